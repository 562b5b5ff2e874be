"""A planned loop's per-step outputs, written into one array per output as the steps run.

Why: a loop that kept each step's output rows until its end, then stacked them, held every
row's array object (about 220 bytes each beyond its data: a 10**6-step loop returning a loss
per step held over 200 MB of them) and, while stacking, the rows and the stack at once: twice
the outputs' bytes at the forward's end, where most plans' tapes peak too. Writing each row
into its place as it arrives holds the outputs once. Loops of unknown length (`until`), and
outputs whose rows change shape, dtype or array type, keep their rows and stack them.

An output that is the carry itself (RNNs return ``h, h``) leaves the loop's entry without its
last row, which is joined on after the entry (see `PlannedLoop._last_rows_from_carry`); here
the entry's part is a view of the array that also holds that row, so `join_rows` records the
join without copying the output again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..backend import namespace
from ..grad_mode import is_grad_enabled
from ..ops import getitem
from ..tape import add_entry, edge_of
from ..tensor_base import make_tensor
from .loop import columns


class OutputRows:
    """Each step's outputs (a list of arrays, None for an absent output) in step order."""

    def __init__(self, n: int | None, keep: bool = True) -> None:
        self.n = n
        self.keep = keep  # False: only count (a rebuild of a forward whose rows are had)
        self.count = 0
        self.arrays: list[Any] | None = None  # one array of n rows per output (None: absent)
        self.rows: list[list[Any]] | None = None if n is not None else []  # rows kept instead

    def __len__(self) -> int:
        return self.count

    def append(self, ys: list[Any]) -> None:
        """Step `len(self)`'s outputs."""
        t = self.count
        self.count += 1
        if not self.keep:
            return
        if self.rows is not None:
            self.rows.append(ys)
            return
        arrays = self.arrays
        if arrays is None:
            arrays = self.arrays = [
                None if y is None else namespace(y).empty((self.n, *y.shape), dtype=y.dtype)
                for y in ys]
        if _fits(arrays, ys):
            for array, y in zip(arrays, ys):
                if array is not None:
                    array[t] = y
            return
        # a row unlike the first (shape, dtype or array type): keep rows, as stacking sorts
        # such rows out (or says what is wrong with them)
        self.rows = [[None if a is None else a[s] for a in arrays] for s in range(t)]
        self.arrays = None
        self.rows.append(ys)

    def extend(self, per_step: Iterable[list[Any]]) -> None:
        for ys in per_step:
            self.append(ys)

    def stacked(self, same: dict[int, int]) -> list[Any]:
        """Per output: its rows as one array (None: absent, or no rows); an output in `same`
        (the carry itself) without its last row. With rows written in place, such an output
        is a view of `whole(k)`, whose last row is the last step's (the final carry)."""
        if self.rows is not None:
            out: list[Any] = []
            for k, column in enumerate(columns(self.rows)):
                rows = column[:-1] if k in same else column
                out.append(None if column[0] is None or not rows
                           else namespace(rows[0]).stack(rows, axis=0))
            return out
        assert self.arrays is not None and self.count == self.n
        return [None if a is None else (a if k not in same else a[:-1] if self.n > 1 else None)
                for k, a in enumerate(self.arrays)]

    def whole(self, k: int) -> Any:
        """Output `k`'s array of every row, when rows were written in place (else None)."""
        return None if self.arrays is None else self.arrays[k]


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
    """The op of an entry that joins a block of rows and one last row into `whole`, an array
    already holding both (the block is a view of it): the same gradients as concatenating
    them, without the copy."""

    name = "concatenate"

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def backward(
        self, entry: Any, grads: list[Any], create_graph: bool, retain_graph: bool = False
    ) -> list[Any]:
        g = grads[0]
        if g is None:
            return [None, None]
        return [getitem(g, slice(0, self.rows)), getitem(g, self.rows)]


def join_rows(block: Any, row: Any, whole: Any) -> Any:
    """``concatenate([block, expand_dims(row, 0)])`` as a tensor over `whole`, whose leading
    rows `block`'s data is a view of and whose last row holds `row`'s values."""
    rows = block.shape[0]
    assert whole.shape[0] == rows + 1
    edges = (edge_of(block), edge_of(row))
    if edges == (None, None) or not is_grad_enabled():
        return make_tensor(whole)
    return add_entry(_JoinRows(rows), edges, [whole])[0]
