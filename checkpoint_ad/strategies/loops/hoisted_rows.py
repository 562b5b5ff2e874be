"""Carry-independent work of a step program batched over the rows of a chunk of steps.

Why: a step's ``x @ U`` (a scanned row times a captured matrix) does not depend on the carry,
yet a replay runs it as one small product per step, and its backward adds one small weight
gradient per step. Here such products are made for a chunk of steps at once, as one product
over the chunk's stacked rows (`RowSource`: each step then reads its row of the result), and
the weight's gradient is summed over the chunk as one product too, when the backward reaches
the chunk's first step (`RowSource.keep`, `RowSource.step_done`).

The chunks are fixed by the absolute step index alone (steps 2.., in chunks aligned on
multiples of a chunk's steps, chosen from the product's row size and the loop's length:
`choose_chunk`), never by a plan: a re-run from a snapshot makes the same chunk again,
and every plan's backward reaches each chunk's first step after its other steps, so every
lossless strategy gives bitwise the gradients of keeping every step. A product over stacked
rows rounds differently from the per-step ones, so a scan's results then equal a recorded
Python loop's to rounding, not bitwise; it is opt-in, ``scan(..., batch_rows=True)``. Steps 0
and 1 (recorded while they are traced) always take the per-step products.

Only products whose left operand is a scanned row (2-d or more) and whose right operand is a
2-d tensor captured from outside the loop are batched (`find_hoisted`); everything else runs
in the step as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from ...backend import namespace
from ...ops import astype

HOIST_FROM = 2  # the first step whose rows come from a chunk (steps 0 and 1 are traced)
MOST_CHUNK = 32  # steps per chunk at most
CHUNK_BYTES = 2 << 20  # a chunk's products (each hoisted output) at most this size, about
LEAST_CHUNK = 8  # fewer steps per chunk: not batched (a product over 8 rows or fewer gained
# nothing measured over per-row ones: RNN batch 64, hidden 256, OpenBLAS, one thread)
STEPS_PER_CHUNK_STEP = 16  # a chunk is at most a 16th of the loop's steps: a plan that
# re-runs steps holds a chunk of products and one of their gradients beside its snapshots


def choose_chunk(row_bytes: int, steps: int) -> int:
    """Steps per chunk for products of `row_bytes` per step in a loop of `steps` (the whole
    scan's): 0 where batching is not worth its memory."""
    if row_bytes <= 0:
        return 0
    chunk = min(MOST_CHUNK, CHUNK_BYTES // row_bytes, steps // STEPS_PER_CHUNK_STEP)
    return chunk if chunk >= LEAST_CHUNK else 0


@dataclass(frozen=True, slots=True)
class Hoisted:
    """One batched product: instruction `index` computes ``x[k] @ constant[weight]`` into
    slot `output`."""

    index: int
    k: int  # the scanned input (its position among the step's xs leaves)
    weight: int  # the captured matrix's slot
    output: int
    weight_grad: bool  # whether the matrix takes a gradient (its backward is batched)


def find_hoisted(instructions: tuple[Any, ...], x_in: tuple[int, ...],
                 constants: dict[int, Any], dtypes: list[Any], shapes: list[Any],
                 ) -> tuple[tuple[Hoisted, ...], int]:
    """The products of a program that may be batched over a chunk's rows, and the bytes of
    the largest one's row (what `choose_chunk` sizes chunks by; 0 where none qualifies).
    `shapes`: each slot's shape as traced (None where unknown)."""
    found = []
    most_bytes = 0
    first_x = x_in[0] if x_in else 0
    for i, ins in enumerate(instructions):
        if ins.prim is None or getattr(ins.prim, "name", None) != "matmul":
            continue
        if len(ins.inputs) != 2:
            continue
        a, b = ins.inputs
        if a not in x_in or b not in constants or a == b:
            continue
        a_shape, b_shape = shapes[a], shapes[b]
        if a_shape is None or b_shape is None or len(a_shape) < 2 or len(b_shape) != 2:
            continue
        row_bytes = prod(a_shape[:-1]) * b_shape[1] * np.dtype(dtypes[ins.output]).itemsize
        most_bytes = max(most_bytes, row_bytes)
        found.append(Hoisted(i, a - first_x, b, ins.output, ins.taped and ins.mask[1]))
    return tuple(found), most_bytes


class RowSource:
    """The rows a loop's replayed steps take: step t's scanned rows and, from step
    `HOIST_FROM` on, its rows of the chunk's batched products (`at`); in the backward, the
    gradients of those products, summed into each matrix's gradient per chunk. Holds one
    chunk of products (made when a step in it is first asked for) and one chunk of
    gradients at a time. `offset`: the loop's first step's index in the whole scan (a loop
    keeping every step replays its steps from 1 or 2)."""

    def __init__(self, program: Any, xs: list[Any], offset: int, chunk: int) -> None:
        self.hoisted: tuple[Hoisted, ...] = program.hoisted
        self.chunk = chunk
        self.weights = [program.constants[h.weight] for h in self.hoisted]
        self.weight_dtypes = [program.dtype[h.weight] for h in self.hoisted]
        self.xs = xs  # the scanned arrays (None where a leaf is None)
        # no row of a product outlives its step (none saved, returned or viewed): each chunk
        # is made into the same buffers, which stay warm in cache (`StepProgram.rows_private`)
        self.private = program.rows_private
        self.buffers: list[Any] = [None] * len(self.hoisted)
        self.grad_buffers: list[Any] = [None] * len(self.hoisted)
        self.offset = offset
        self.length = min((x.shape[0] for x in xs if x is not None), default=0)
        self.at_chunk = -1  # the chunk whose products `products` holds
        self.products: list[Any] = []
        self.grad_chunk = -1  # the chunk whose gradients `grads` holds
        self.grads: list[Any] = []
        self.grad_stop = 0  # one past the last step a gradient row was kept for

    def chunk_bytes(self) -> int:
        """Bytes of the largest chunk of products (a chunk of their gradients is as large)."""
        rows = min(self.chunk, max(0, self.length + self.offset - HOIST_FROM))
        return chunk_bytes(self.hoisted, rows, self.xs, self.weights)

    def core(self, t: int) -> bool:
        """Whether step t takes its products from a chunk (and gives their gradients back)."""
        return t + self.offset >= HOIST_FROM

    def _bounds(self, t: int) -> tuple[int, int, int]:
        """(chunk index, first step, one past the last step) of step t's chunk, in the
        loop's own step numbers: chunks are aligned on multiples of `chunk` in the whole
        scan (as a periodic plan's segments are), the first begins at `HOIST_FROM`."""
        c = (t + self.offset) // self.chunk
        start = max(c * self.chunk, HOIST_FROM) - self.offset
        return c, start, min(c * self.chunk + self.chunk - self.offset, self.length)

    def at(self, t: int) -> list[Any]:
        """Step t's inputs: its scanned rows, then (from `HOIST_FROM` on) its rows of the
        batched products, in `hoisted` order."""
        rows = [None if x is None else _row(x, t) for x in self.xs]
        if t + self.offset < HOIST_FROM:
            return rows
        c, start, stop = self._bounds(t)
        if c != self.at_chunk:
            self.products = []  # (let go of the chunk before the next one is made)
            self.products = [self._product(j, h, w, start, stop)
                             for j, (h, w) in enumerate(zip(self.hoisted, self.weights))]
            self.at_chunk = c
        i = t - start
        rows.extend(p[i] for p in self.products)
        return rows

    def _product(self, j: int, h: Hoisted, weight: Any, start: int, stop: int) -> Any:
        x = self.xs[h.k][start:stop]
        xp = namespace(x)
        rows = x.reshape(-1, x.shape[-1])
        if not self.private:
            flat = xp.matmul(rows, weight)
        else:
            buffer = self.buffers[j]
            if buffer is None:
                size = self.chunk * rows.shape[0] // max(stop - start, 1)
                dtype = xp.result_type(rows.dtype, weight.dtype)
                buffer = self.buffers[j] = xp.empty((size, weight.shape[1]), dtype=dtype)
            flat = xp.matmul(rows, weight, out=buffer[: rows.shape[0]])
        return flat.reshape(*x.shape[:-1], weight.shape[1])

    def keep(self, t: int, j: int, grad: Any) -> None:
        """The gradient of step t's row of product `j`, kept for its chunk's weight
        gradient."""
        c, start, stop = self._bounds(t)
        if c != self.grad_chunk:  # a new chunk (a sweep broken off drops its old one)
            self.grads = [None] * len(self.hoisted)
            self.grad_chunk, self.grad_stop = c, t + 1
        buffer = self.grads[j]
        if buffer is None:  # one buffer per product, made once, zeroed per chunk
            whole = self.grad_buffers[j]
            if whole is None or whole.dtype != grad.dtype:
                xp = namespace(grad)
                whole = self.grad_buffers[j] = xp.empty((self.chunk, *grad.shape),
                                                        dtype=grad.dtype)
            buffer = self.grads[j] = whole[: stop - start]
            buffer.fill(0)
        buffer[t - start] = grad

    def step_done(self, t: int, add: Any, positions: dict[int, Any]) -> None:
        """The backward finished step t: at its chunk's first step, each matrix's gradient
        over the chunk (one product of the stacked rows and gradients) goes to the sink
        (`add(position, grad)`, `positions`: the captured slots' places)."""
        c, start, _ = self._bounds(t)
        if t != start or c != self.grad_chunk:
            return
        stop = self.grad_stop
        grads, self.grads, self.grad_chunk = self.grads, [], -1
        for h, buffer, dtype in zip(self.hoisted, grads, self.weight_dtypes):
            if buffer is None:
                continue
            position = positions.get(h.weight)
            if position is None:
                continue
            x = self.xs[h.k][start:stop]
            g = buffer[: stop - start]
            grad = x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])
            if grad.dtype != dtype:
                grad = astype(grad, dtype)
            add(position, grad)

    def release(self) -> None:
        """Let go of the chunk held (the loop's run or backward ended)."""
        self.products, self.at_chunk = [], -1
        self.grads, self.grad_chunk = [], -1
        self.buffers = [None] * len(self.hoisted)
        self.grad_buffers = [None] * len(self.hoisted)


def chunk_bytes(hoisted: tuple[Hoisted, ...], chunk: int, xs: list[Any],
                weights: list[Any]) -> int:
    """Bytes of one chunk of the `hoisted` products over the scanned arrays `xs`."""
    return sum(chunk * prod(xs[h.k].shape[1:-1]) * w.shape[1] * w.itemsize
               for h, w in zip(hoisted, weights))


def program_chunk_bytes(program: Any, xs: list[Any]) -> int:
    """What a loop of `program` over the scanned arrays `xs` holds of batched rows in a
    chunk, of products (a chunk of their gradients is as large; 0 where it batches none)."""
    length = min((x.shape[0] for x in xs if x is not None), default=0)
    chunk = choose_chunk(program.row_bytes, length) if program.hoisted else 0
    if not chunk:
        return 0
    weights = [program.constants[h.weight] for h in program.hoisted]
    return chunk_bytes(program.hoisted, chunk, xs, weights)


def _row(array: Any, t: int) -> Any:
    value = array[t]
    return np.asarray(value) if isinstance(value, np.generic) else value
