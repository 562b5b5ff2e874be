"""Large arrays that a long taped segment moves its kept values into, a row per step.

Why: a segment that keeps every step (a keep-all `scan`, a long `Periodic` segment) makes
each step's kept values (the new carry, a saved activation) as new small arrays. Once a run
keeps more than the allocator reuses, every one of them is fresh memory the kernel must map
page by page on first touch: on the RNN of issue 42 at T = 1,024 (64 KiB a step) about 16
page faults a step, 3-4% of the run. The hand-written floor writes its hidden states into
one array, which numpy asks the kernel to back with huge pages (allocations of 4 MiB or
more). Here a value is copied into its row of such an array as soon as it is made, and the
small array is freed at once, so the next step's is made in the same memory. Values, saved
values and gradients are the same arrays' contents; only where they live changes.

Only numpy arrays, only segments whose kept values reach `LEAST_SLAB_BYTES`, and only
while each new value has the row's shape and dtype (the program's trace says what to
expect; anything else is kept as made). A slab of `steps` rows holds its memory until its
last row is let go (the backward frees a chunk at a time, not a step at a time), so slabs
are cut into chunks of `CHUNK_BYTES` at most.
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

# kept bytes over a segment from which slabs pay: below, glibc's malloc keeps the memory of
# a run's small arrays mapped for the next run (its trim threshold grows to 2x the largest
# freed mapping, at most 64 MiB), so there is nothing to save and a slab's copy and first
# touch cost 3% (RNN T = 256: 16 MiB kept); at T = 1,024 (64 MiB) they gain 3-4%
LEAST_SLAB_BYTES = 32 << 20
# a chunk's bytes: the kernel maps about the first 2 MiB of each in small pages (numpy's
# advice covers whole huge pages inside the allocation only; measured here: 515 faults for a
# 4 MiB array, 544 for 64 MiB), so larger chunks amortize that; the backward lets go of a
# chunk at a time
CHUNK_BYTES = 16 << 20


class KeptSlabs:
    """Rows for the kept values of a segment's steps before `stop` (`place`)."""

    __slots__ = ("_open", "_stop", "slots")

    def __init__(self, slots: dict[int, tuple[tuple[int, ...], Any, int]], stop: int) -> None:
        self.slots = slots  # slot -> (shape, dtype, steps per chunk)
        self._stop = stop  # the segment's end: no chunk reaches past it
        self._open: dict[int, tuple[int, Any]] = {}  # slot -> (first step, chunk array)

    @classmethod
    def for_segment(cls, program: Any, start: int, stop: int | None) -> KeptSlabs | None:
        """Slabs for a segment of `program`'s steps, or None where none would pay: an open
        segment, or no kept value large enough over it."""
        if stop is None or stop - start < 2:
            return None
        slots = program.slab_slots
        if slots is None:
            slots = program.slab_slots = kept_value_slots(program)
        rows = [(slot, shape, dtype, prod(shape) * dtype.itemsize)
                for slot, shape, dtype in slots]
        if sum(row for *_, row in rows) * (stop - start) < LEAST_SLAB_BYTES:
            return None
        return cls({slot: (shape, dtype, -(-CHUNK_BYTES // row))
                    for slot, shape, dtype, row in rows if row}, stop)

    def place(self, slot: int, t: int, value: Any) -> Any:
        """`value` (step t's at `slot`) copied into its row, and the row; `value` itself
        where it is not a numpy array of the expected shape and dtype."""
        shape, dtype, per_chunk = self.slots[slot]
        if type(value) is not np.ndarray or value.shape != shape or value.dtype != dtype:
            return value
        first, chunk = self._open.get(slot, (t + 1, None))
        if chunk is None or not first <= t < first + len(chunk):
            steps = min(per_chunk, self._stop - t)
            if steps < 1:
                return value
            first, chunk = t, np.empty((steps, *shape), dtype=dtype)
            self._open[slot] = (first, chunk)
        row = chunk[t - first, ...]  # (a 0-d row is a view too)
        np.copyto(row, value)
        return row


def kept_value_slots(program: Any) -> tuple[tuple[int, tuple[int, ...], Any], ...]:
    """(slot, shape, dtype) of each value a taped step keeps past its end that the step
    makes as a new array: the outputs of its taped, non-view primitives that some
    instruction saves or that carry on (a view shares its input's memory: not moved)."""
    shapes = program.slot_shapes
    if shapes is None:
        return ()
    out = []
    keep = program.saved_slots | set(program.carry_out)
    for ins in program.instructions:
        prim = ins.prim
        slot = ins.output
        if slot not in keep or prim is None or getattr(prim, "view", True):
            continue
        shape, dtype = shapes[slot], program.dtype[slot]
        if shape is None or dtype is None:
            continue
        out.append((slot, tuple(shape), np.dtype(dtype)))
    return tuple(out)
