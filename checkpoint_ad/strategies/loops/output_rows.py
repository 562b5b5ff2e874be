"""A planned loop's per-step outputs, written into one array per output as the steps run.

Why: a loop that kept each step's output rows until its end, then stacked them, held every
row's array object (about 220 bytes each beyond its data: a 10**6-step loop returning a loss
per step held over 200 MB of them) and, while stacking, the rows and the stack at once: twice
the outputs' bytes at the forward's end, where most plans' tapes peak too. Writing each row
into its place as it arrives holds the outputs once. Loops of unknown length (`until`) write
rows into chunks (doubling, up to a MiB each), joined once the length is known (no row objects; the
join holds the outputs twice for a moment, as stacking did). Outputs whose rows change shape,
dtype or array type keep their rows and stack them.

An output that is the carry itself (RNNs return ``h, h``) leaves the loop's entry without its
last row, which is joined on after the entry (see `PlannedLoop._last_rows_from_carry`); and a
`scan` keeping every step records its first two steps before the loop's entry (`kept_loop`).
Both join pieces onto the loop's rows; here the pieces are views of (or rows already written
into) one array that holds every row, so `join_rows` records each join without a copy.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from ...backend import namespace
from ...grad_mode import is_grad_enabled
from ...ops import getitem
from ...tape import add_entry, edge_of
from ...tensor_base import TensorBase, make_tensor
from .loop import columns, stack_outputs


class OutputRows:
    """Each step's outputs (a list of arrays, None for an absent output) in step order; with
    `lead`, the rows of steps recorded before the loop first, in arrays that hold both."""

    def __init__(self, n: int | None, keep: bool = True,
                 lead: Sequence[list[Any]] = ()) -> None:
        self.n = n
        self.keep = keep  # False: only count (a rebuild of a forward whose rows are had)
        self.count = 0
        self.lead = len(lead)
        self.arrays: list[Any] | None = None  # lead + n rows per output (None: absent)
        self.rows: list[list[Any]] | None = None  # rows kept instead (unlike rows)
        self.chunks: list[list[Any]] = []  # unknown length: per chunk, arrays per output
        self.filled = 0  # rows written into the last chunk
        self.none_row: list[Any] | None = None  # see `_kept_row`
        if lead and n is not None and keep:
            self._allocate(lead[0])
            if all(_fits(self.arrays, ys) for ys in lead):
                for s, ys in enumerate(lead):
                    self._write(s, ys)
            else:  # unlike rows: the joins fall back to copying
                self.lead, self.arrays = 0, None

    def _allocate(self, ys: list[Any]) -> None:
        total = self.lead + (self.n or 0)
        self.arrays = [None if y is None else namespace(y).empty((total, *y.shape), dtype=y.dtype)
                       for y in ys]

    def _write(self, row: int, ys: list[Any]) -> None:
        assert self.arrays is not None
        for array, y in zip(self.arrays, ys):
            if array is not None:
                array[row] = y

    def __len__(self) -> int:
        return self.count

    def append(self, ys: list[Any]) -> None:
        """Step `len(self)`'s outputs."""
        t = self.count
        self.count += 1
        if not self.keep:
            return
        if self.rows is not None:
            self.rows.append(self._kept_row(ys))
            return
        if self.n is None:
            self._append_growing(ys)
            return
        if self.arrays is None:
            self._allocate(ys)
        arrays = self.arrays
        assert arrays is not None
        if _fits(arrays, ys):
            self._write(self.lead + t, ys)
            return
        # a row unlike the first (shape, dtype or array type): keep rows, as stacking sorts
        # such rows out (or says what is wrong with them)
        lead = self.lead
        self.rows = [[None if a is None else a[lead + s] for a in arrays] for s in range(t)]
        self.arrays, self.lead = None, 0
        self.rows.append(self._kept_row(ys))

    def _append_growing(self, ys: list[Any]) -> None:
        chunk = self.chunks[-1] if self.chunks else None
        if chunk is None or self.filled == _capacity(chunk):
            rows = self.count - 1  # written so far: chunks double up to about a MiB
            chunk = [None if y is None else namespace(y).empty((_chunk_rows(y, rows), *y.shape),
                                                                 dtype=y.dtype) for y in ys]
            self.chunks.append(chunk)
            self.filled = 0
        if not _fits(chunk, ys):
            self.rows = self._growing_rows()
            self.chunks, self.filled = [], 0
            self.rows.append(self._kept_row(ys))
            return
        for array, y in zip(chunk, ys):
            if array is not None:
                array[self.filled] = y
        self.filled += 1

    def _kept_row(self, ys: list[Any]) -> list[Any]:
        """`ys` as a kept row: a row of absent outputs only is one list shared by every such
        row (a loop of 10**6 steps that output nothing keeps no 10**6 lists). Rows written
        into arrays keep no list at all."""
        if any(y is not None for y in ys):
            return ys
        if self.none_row is None:
            self.none_row = ys
        return self.none_row

    def _growing_rows(self) -> list[list[Any]]:
        rows = []
        for i, chunk in enumerate(self.chunks):
            used = self.filled if i == len(self.chunks) - 1 else _capacity(chunk)
            rows.extend([[None if a is None else a[s] for a in chunk] for s in range(used)])
        return rows

    def _join_chunks(self) -> None:
        """Once a loop of unknown length ends: its chunks as one array per output."""
        self.n = self.count
        if not self.chunks:
            self.rows = []
            return
        last = len(self.chunks) - 1
        arrays = []
        for k, first in enumerate(self.chunks[0]):
            if first is None:
                arrays.append(None)
                continue
            parts = [chunk[k] if i < last else chunk[k][:self.filled]
                     for i, chunk in enumerate(self.chunks)]
            arrays.append(namespace(first).concat(parts, axis=0))
        self.arrays, self.chunks, self.filled = arrays, [], 0

    def ended_at(self, count: int) -> None:
        """A loop made at its most steps (`n`) ended after `count` of them (`until`): its
        arrays are cut to the rows written (views: the rest stays unused)."""
        assert count == self.count <= (self.n or 0)
        if self.arrays is not None:
            rows = self.lead + count
            self.arrays = [None if a is None else a[:rows] for a in self.arrays]
        self.n = count

    def extend(self, per_step: Iterable[list[Any]]) -> None:
        for ys in per_step:
            self.append(ys)

    def stacked(self, same: dict[int, int]) -> list[Any]:
        """Per output: its rows as one array (None: absent, or no rows); an output in `same`
        (the carry itself) without its last row. With rows written in place, such an output
        is a view of `whole(k)`, whose last row is the last step's (the final carry)."""
        if self.n is None and self.rows is None:
            self._join_chunks()
        if self.rows is not None:
            out: list[Any] = []
            for k, column in enumerate(columns(self.rows)):
                rows = column[:-1] if k in same else column
                out.append(None if column[0] is None or not rows
                           else namespace(rows[0]).stack(rows, axis=0))
            return out
        assert self.arrays is not None and self.count == self.n
        lead = self.lead
        return [None if a is None else (a[lead:] if k not in same
                                        else a[lead:-1] if self.n > 1 else None)
                for k, a in enumerate(self.arrays)]

    def whole(self, k: int) -> Any:
        """Output `k`'s array of the loop's own rows, when rows were written in place (else
        None)."""
        return None if self.arrays is None else self.arrays[k][self.lead:]

    def full(self) -> list[Any] | None:
        """Per output, the array of every row, the lead rows first (None when rows were not
        written in place)."""
        return None if self.arrays is None else list(self.arrays)


CHUNK_BYTES = 1 << 20
"""The most bytes of one chunk of an output's rows in a loop of unknown length: chunks hold
as many rows as were written before them (at least 16), up to this (at least 16 rows)."""


def _chunk_rows(y: Any, written: int) -> int:
    return max(16, min(written, CHUNK_BYTES // max(int(y.nbytes), 1)))


def _capacity(chunk: list[Any]) -> int:
    """Rows a chunk holds (a chunk of absent outputs only: no bound, nothing is written)."""
    return next((a.shape[0] for a in chunk if a is not None), sys.maxsize)


def _fits(arrays: list[Any], ys: list[Any]) -> bool:
    if len(arrays) != len(ys):
        return False
    for array, y in zip(arrays, ys):
        if array is None or y is None:
            if array is not y:
                return False
        elif type(y) is not type(array) or y.shape != array.shape[1:] or y.dtype != array.dtype:
            return False
    return True


class _JoinRows:
    """The op of an entry that joins rows and blocks of rows into `whole`, an array already
    holding each piece's values in its place: the same gradients as stacking and
    concatenating them, without the copy."""

    name = "concatenate"

    def __init__(self, spans: list[Any]) -> None:
        self.spans = spans  # per piece: its row (an int) or its block (a slice) of `whole`

    def backward(
        self, entry: Any, grads: list[Any], create_graph: bool, retain_graph: bool = False
    ) -> list[Any]:
        g = grads[0]
        if g is None:
            return [None] * len(self.spans)
        return [getitem(g, span) for span in self.spans]


def join_rows(pieces: Sequence[Any], whole: Any) -> Any:
    """The pieces (tensors: a row, of `whole`'s shape less its first axis, or a block of
    rows) stacked and concatenated in order, as a tensor over `whole`: the caller has put
    each piece's values in its place there already (written, or the piece is a view)."""
    spans: list[Any] = []
    at = 0
    for piece in pieces:
        if piece.ndim == whole.ndim:
            spans.append(slice(at, at + piece.shape[0]))
            at += piece.shape[0]
        else:
            spans.append(at)
            at += 1
    assert at == whole.shape[0]
    return join_edges([edge_of(p) for p in pieces], spans, whole)


def join_edges(edges: list[Any], spans: list[Any], whole: Any) -> Any:
    """`join_rows` of pieces given by their graph edges (None: no gradient) and their
    spans of `whole` (a row, or a slice of rows): the pieces' tensors need not be alive."""
    if not is_grad_enabled() or all(e is None for e in edges):
        return make_tensor(whole)
    return add_entry(_JoinRows(spans), edges, [whole])[0]


class RecordedRows:
    """The outputs of a loop that records its steps, written into one array per output as
    each step ends; what is kept of a step's output tensors is their graph edges.

    Why: holding every step's output tensors until the loop ends, then stacking them, holds
    the outputs twice at the forward's end, and under a strategy that stores saved values
    packed (`Quantized`) the full-precision rows live only for that stack: writing each row
    into its place lets the step's array go with its tensor. Rows unlike the first (shape,
    dtype, array type) fall back to stacking tensors remade from the kept rows and edges,
    as stacking the tensors did."""

    def __init__(self, n: int | None) -> None:
        self.rows = OutputRows(n)
        self.edges: list[list[Any]] = []  # per step, each output's edge (None: no gradient)

    def append(self, ys: list[Any]) -> None:
        """Step `len(self.edges)`'s output leaves (tensors, or None)."""
        self.rows.append([None if y is None else y._data for y in ys])
        self.edges.append([None if y is None else edge_of(y) for y in ys])

    def stacked(self) -> list[Any]:
        """Each output leaf stacked over the steps (None leaves stay None), as `stack`
        would give it."""
        rows = self.rows
        arrays = rows.stacked({}) if rows.rows is None else None  # (may find unlike rows)
        if rows.rows is not None:  # unlike rows: stack tensors remade over them
            return stack_outputs([[None if a is None else _tensor_over(a, e)
                                   for a, e in zip(r, es)]
                                  for r, es in zip(rows.rows, self.edges)])
        spans = list(range(len(self.edges)))
        return [None if a is None else join_edges([es[k] for es in self.edges], spans, a)
                for k, a in enumerate(arrays)]


def _tensor_over(array: Any, edge: Any) -> Any:
    """A tensor over `array` whose gradient goes to `edge`: a leaf edge's own tensor, or a
    new one on the entry's output."""
    if edge is None:
        return make_tensor(array)
    if isinstance(edge[0], TensorBase):
        return edge[0]  # a leaf: the tensor itself
    return make_tensor(array, edge[0], edge[1])
