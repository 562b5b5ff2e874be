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
2-d tensor captured from outside the loop are batched forward (`find_hoisted`); everything else
runs in the step as before.

The weight gradient of every other product ``a @ C`` whose right operand C is a 2-d captured
tensor that requires grad is batched too, the carry-dependent left operand included (an RNN's
``h @ W``: ``sum_t h_t^T g_t``), and so is the gradient of a captured vector broadcast-added
(a bias: ``sum_t sum_batch g_t``) (`find_summed`): in the backward, each step copies its saved
left operand and the gradient reaching the product into its chunk's stacked buffers (`Stacks`:
made once, reused per chunk; operands handed the same array, an add's gradient passed to both
its inputs, share one), and at the chunk's first step one product (or one sum) over the stacked
rows goes to the tensor's gradient, chunked and ordered as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from ...backend import broadcast_axes, namespace
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


ROWS = 0  # a summed gradient's left operand is a scanned row (a `Hoisted` product's)
SAVED = 1  # ... the product's saved left operand, stacked per chunk
BIAS = 2  # no left operand: a broadcast-added vector's gradient, a sum of the stacked rows


@dataclass(frozen=True, slots=True)
class Summed:
    """The gradient of captured tensor `weight` in instruction `index`, summed per chunk over
    the stacked gradients reaching the instruction (its `output`)."""

    index: int
    weight: int
    output: int
    kind: int  # ROWS, SAVED or BIAS
    left: int  # ROWS: the scanned input k; SAVED: the saved value's index; BIAS: -1
    left_slot: int  # SAVED: the left operand's slot (-1 otherwise)
    axes: tuple[int, ...]  # BIAS: the axes of the stacked gradients summed (kept)
    shape: tuple[int, ...]  # BIAS: the vector's shape


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


def find_summed(instructions: tuple[Any, ...], hoisted: tuple[Hoisted, ...],
                constants: dict[int, Any], dtypes: list[Any], shapes: list[Any],
                region_of: tuple[int, ...], outputs: set[int],
                ) -> tuple[tuple[Summed, ...], int, int]:
    """The captured tensors' gradients a program's backward sums per chunk (`Summed`: the
    `hoisted` products' matrices first), the bytes a step adds to the chunk's stacked
    buffers (operands that share a buffer counted once: `gradient_groups`), and the bytes of
    the largest stacked row (what `choose_chunk` sizes chunks by, with the products')."""
    found = [Summed(h.index, h.weight, h.output, ROWS, h.k, -1, (), ())
             for h in hoisted if h.weight_grad]
    batched = {h.index for h in hoisted}
    for i, ins in enumerate(instructions):
        name = getattr(ins.prim, "name", None)
        if (name not in ("matmul", "add") or i in batched or not ins.taped
                or region_of[i] >= 0 or len(ins.inputs) != 2):
            continue
        a, b = ins.inputs
        if name == "add" and a in constants:
            a, b = b, a
        position = ins.inputs.index(b)
        if b not in constants or a in constants or not ins.mask[position]:
            continue
        a_shape, b_shape, out_shape = shapes[a], shapes[b], shapes[ins.output]
        if a_shape is None or b_shape is None or out_shape is None:
            continue
        if name == "matmul":
            names = [saved.name for saved in ins.saved]
            if len(a_shape) < 2 or len(b_shape) != 2 or position != 1 or "a" not in names:
                continue
            found.append(Summed(i, b, ins.output, SAVED, names.index("a"), a, (), ()))
        elif tuple(b_shape) != tuple(out_shape) and len(b_shape) <= len(out_shape):
            axes = broadcast_axes(tuple(b_shape), tuple(out_shape))
            found.append(Summed(i, b, ins.output, BIAS, -1, -1,
                                (0, *[axis + 1 for axis in axes]), tuple(b_shape)))
    groups = gradient_groups(instructions, shapes, dtypes, outputs)
    stacked: dict[Any, int] = {}
    for s in found:
        stacked[("g", groups[s.output])] = _nbytes(shapes[s.output], dtypes[s.output])
        if s.kind == SAVED:
            stacked[("a", s.left_slot)] = _nbytes(shapes[s.left_slot], dtypes[s.left_slot])
    return tuple(found), sum(stacked.values()), max(stacked.values(), default=0)


def gradient_groups(instructions: tuple[Any, ...], shapes: list[Any], dtypes: list[Any],
                    outputs: set[int]) -> dict[int, int]:
    """Per slot, the slot whose gradient array reaches it as it is (itself, or for a value
    read once, by an add of its own shape and dtype, the add's output's group): operands in
    one group are handed the same array each step, and share a stacked buffer."""
    uses: dict[int, list[int]] = {}
    for i, ins in enumerate(instructions):
        for s in ins.inputs:
            uses.setdefault(s, []).append(i)
    groups: dict[int, int] = {}
    for i in range(len(instructions) - 1, -1, -1):  # consumers before producers
        out = instructions[i].output
        group = out
        readers = uses.get(out, [])
        if out not in outputs and len(readers) == 1:
            user = instructions[readers[0]]
            if (getattr(user.prim, "name", None) == "add" and user.taped
                    and user.inputs.count(out) == 1 and shapes[out] is not None
                    and shapes[out] == shapes[user.output] and dtypes[out] == dtypes[user.output]):
                group = groups.get(user.output, user.output)
        groups[out] = group
    return groups


def _nbytes(shape: Any, dtype: Any) -> int:
    return prod(shape) * np.dtype(dtype).itemsize


class Stacks:
    """Per-chunk stacked buffers, one row a step, written from the chunk's last step down
    (a backward's order). Operands handed the same array at every step of the chunk share
    one buffer (checked per step; one handed another array, or none, at some step gets its
    own, its rows so far copied); rows a step gave nothing are zeros. Buffers are kept
    between chunks and reused."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.rows = 0  # rows of the current chunk
        self.free: dict[tuple[Any, ...], list[Any]] = {}
        self.of: dict[Any, list[Any]] = {}  # operand -> [buffer, last row, its array, first
        # row written, users]
        self.expected: dict[Any, int] = {}  # operand -> the row it writes next

    def begin(self, rows: int) -> None:
        """A new chunk of `rows` rows (what the last is let go)."""
        self.end()
        self.rows = rows

    def end(self) -> None:
        """Return the chunk's buffers for the next."""
        seen = set()
        for stack in self.of.values():
            if id(stack) not in seen:
                seen.add(id(stack))
                buffer = stack[0]
                self.free.setdefault((buffer.shape, buffer.dtype), []).append(buffer)
        self.of, self.expected = {}, {}

    def _new(self, like: Any, first: int) -> list[Any]:
        key = ((self.chunk, *like.shape), like.dtype)
        kept = self.free.get(key)
        buffer = kept.pop() if kept else namespace(like).empty(key[0], dtype=like.dtype)
        return [buffer, -1, None, first, 1]

    def _split(self, operand: Any, stack: list[Any], expected: int) -> list[Any]:
        """`operand`'s own buffer, with the rows it shared so far (those above `expected`)."""
        own = self._new(stack[0][0], stack[3])
        own[0][expected + 1:self.rows] = stack[0][expected + 1:self.rows]
        stack[4] -= 1
        self.of[operand] = own
        return own

    def put(self, operand: Any, row: int, value: Any) -> None:
        """`value` as `operand`'s row `row` (rows put in descending order)."""
        stack = self.of.get(operand)
        if stack is None:
            for other in self.of.values():
                if other[1] == row and other[2] is value and other[3] == row:
                    other[4] += 1
                    self.of[operand] = other
                    self.expected[operand] = row - 1
                    return
            stack = self.of[operand] = self._new(value, row)
            if row + 1 < self.rows:
                stack[0][row + 1:self.rows] = 0
            expected = row
        else:
            expected = self.expected[operand]
            if stack[1] == row:  # another operand of the buffer wrote this step
                if stack[2] is value and expected == row:
                    self.expected[operand] = row - 1
                    return
                stack = self._split(operand, stack, expected)
            elif expected != row and stack[4] > 1:
                stack = self._split(operand, stack, expected)
        buffer = stack[0]
        if expected > row:  # steps that gave nothing
            buffer[row + 1:expected + 1] = 0
        buffer[row] = value
        stack[1], stack[2] = row, value
        self.expected[operand] = row - 1

    def stacked(self, operand: Any) -> Any:
        """`operand`'s rows of the chunk (those it was given nothing for: zeros), or None."""
        stack = self.of.get(operand)
        if stack is None:
            return None
        expected = self.expected[operand]
        if expected >= 0:
            if stack[4] > 1:
                stack = self._split(operand, stack, expected)
            stack[0][:expected + 1] = 0
            self.expected[operand] = -1
        stack[2] = None  # (let go of the last array written)
        return stack[0][:self.rows]

    def release(self) -> None:
        self.of, self.expected, self.free = {}, {}, {}


class RowSource:
    """The rows a loop's replayed steps take: step t's scanned rows and, from step
    `HOIST_FROM` on, its rows of the chunk's batched products (`at`); in the backward, the
    gradients reaching the instructions of `summed` (and their left operands), stacked and
    summed into each captured tensor's gradient per chunk. Holds one chunk of products
    (made when a step in it is first asked for) and one chunk of stacked rows at a time.
    `offset`: the loop's first step's index in the whole scan (a loop keeping every step
    replays its steps from 1 or 2)."""

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
        self.summed: tuple[Summed, ...] = program.summed
        self.summed_dtypes = [program.dtype[s.weight] for s in self.summed]
        self.stack_row_bytes = program.stack_row_bytes
        self.stacks = Stacks(chunk)
        self.offset = offset
        self.length = min((x.shape[0] for x in xs if x is not None), default=0)
        self.at_chunk = -1  # the chunk whose products `products` holds
        self.products: list[Any] = []
        self.grad_chunk = -1  # the chunk whose gradients `stacks` holds
        self.grad_stop = 0  # one past the last step a gradient row was kept for

    def chunk_bytes(self) -> int:
        """Bytes of the largest chunk of products (the forward's)."""
        return chunk_bytes(self.hoisted, self._rows(), self.xs, self.weights)

    def stack_bytes(self) -> int:
        """Bytes of the largest chunk of stacked rows (the backward's: gradients, left
        operands)."""
        return self._rows() * self.stack_row_bytes

    def _rows(self) -> int:
        return min(self.chunk, max(0, self.length + self.offset - HOIST_FROM))

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

    def keep(self, t: int, j: int, grad: Any, saved: Any) -> None:
        """The gradient of step t's output of summed gradient `j`'s instruction (and its
        saved values, `saved`, the left operand among them), stacked for the chunk's sum."""
        c, start, _ = self._bounds(t)
        if c != self.grad_chunk:  # a new chunk (a sweep broken off drops its old one)
            self.grad_chunk, self.grad_stop = c, t + 1
            self.stacks.begin(t + 1 - start)
        row = t - start
        summed = self.summed[j]
        self.stacks.put(("g", j), row, grad)
        if summed.kind == SAVED:
            self.stacks.put(("a", j), row, saved[summed.left])

    def step_done(self, t: int, add: Any, positions: dict[int, Any]) -> None:
        """The backward finished step t: at its chunk's first step, each captured tensor's
        gradient over the chunk (one product of the stacked rows and gradients, or one sum
        of the gradients) goes to the sink (`add(position, grad)`, `positions`: the
        captured slots' places)."""
        c, start, _ = self._bounds(t)
        if t == start and c == self.grad_chunk:
            self._sum(start, add, positions)

    def flush(self, add: Any, positions: dict[int, Any]) -> None:
        """The chunk held summed now, before the sweep reaches its first step: a backward
        that records the steps below it (anomaly detection) would never finish it."""
        if self.grad_chunk >= 0:
            start = max(self.grad_chunk * self.chunk, HOIST_FROM) - self.offset
            self._sum(start, add, positions)

    def _sum(self, start: int, add: Any, positions: dict[int, Any]) -> None:
        stop = self.grad_stop
        stacks = self.stacks
        for j, (summed, dtype) in enumerate(zip(self.summed, self.summed_dtypes)):
            g = stacks.stacked(("g", j))
            if g is None:
                continue
            position = positions.get(summed.weight)
            if position is None:
                continue
            if summed.kind == BIAS:
                grad = g.sum(axis=summed.axes, keepdims=True).reshape(summed.shape)
            else:
                a = (self.xs[summed.left][start:stop] if summed.kind == ROWS
                     else stacks.stacked(("a", j)))
                grad = a.reshape(-1, a.shape[-1]).T @ g.reshape(-1, g.shape[-1])
            if grad.dtype != dtype:
                grad = astype(grad, dtype)
            add(position, grad)
            grad = None
        stacks.end()
        self.grad_chunk = -1

    def release(self) -> None:
        """Let go of the chunk held (the loop's run or backward ended)."""
        self.products, self.at_chunk = [], -1
        self.grad_chunk = -1
        self.stacks.release()
        self.buffers = [None] * len(self.hoisted)


def chunk_bytes(hoisted: tuple[Hoisted, ...], chunk: int, xs: list[Any],
                weights: list[Any]) -> int:
    """Bytes of one chunk of the `hoisted` products over the scanned arrays `xs`."""
    return sum(chunk * prod(xs[h.k].shape[1:-1]) * w.shape[1] * w.itemsize
               for h, w in zip(hoisted, weights))


def program_chunk_bytes(program: Any, xs: list[Any]) -> int:
    """What a loop of `program` over the scanned arrays `xs` holds of batched rows in a
    chunk: of products (the forward's) or of stacked rows (the backward's), the larger (0
    where it batches none)."""
    length = min((x.shape[0] for x in xs if x is not None), default=0)
    batches = program.hoisted or program.summed
    chunk = choose_chunk(program.row_bytes, length) if batches else 0
    if not chunk:
        return 0
    weights = [program.constants[h.weight] for h in program.hoisted]
    return max(chunk_bytes(program.hoisted, chunk, xs, weights),
               chunk * program.stack_row_bytes)


def _row(array: Any, t: int) -> Any:
    value = array[t]
    return np.asarray(value) if isinstance(value, np.generic) else value
