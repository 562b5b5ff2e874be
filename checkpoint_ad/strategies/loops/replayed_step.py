"""A taped replayed step: its values, the saved values its backward rules read, and the packed
buffers it shares with the next step.

`step_tape.py` makes one per step it tapes; `step_pull_back.pull_back_steps` reads its saved
values (each buffer unpacked once, even when two steps' rules read it) and frees them as the
rules ran, in the order a recorded entry frees its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from ...saved import KeptBuffer, SavedBuffer

NO_BUFFERS: Mapping[tuple[int, int], Any] = MappingProxyType({})
"""The buffers of a step that shares none with the next: one read-only mapping for all (a
dict of its own per taped step was 64 bytes of every step of a long loop)."""


class ReplayedStep:
    """One replayed step's values and what its backward rules read."""

    __slots__ = ("announced", "as_is", "buffers", "held", "regions", "saved", "values")

    def __init__(self, values: list[Any], saved: list[Any], announced: bool,
                 buffers: Mapping[tuple[int, int], Any], as_is: bool = False,
                 regions: list[Any] | None = None) -> None:
        self.values: Sequence[Any] = values
        self.saved = saved
        # with `as_is`, the buffers a profiler watches of the arrays in `saved`, per
        # instruction (`step_profiled.tape_kept`): freed when its rules ran, as `release`
        # frees (None: none)
        self.held: list[Any] | None = None
        # a profiler heard of its entries: each one's saved values are released one by one in
        # slot order, as a recorded entry's are, so it sees them freed in the same order
        self.announced = announced
        self.buffers = buffers  # (slot, id(packer)) -> packed buffer, shared with the next step
        # every saved value is the array itself (no buffer to unpack) and no entry announced
        self.as_is = as_is
        # per selective region of the program, its inputs' arrays (None: no region, or
        # re-run and let go): what the backward re-runs the region from
        self.regions = regions

    def packed_ids(self) -> set[int]:
        """Ids of the buffers this step keeps that must be unpacked (not kept as is)."""
        return {id(v) for kept in self.saved if kept for v in kept
                if type(v) is not KeptBuffer and isinstance(v, SavedBuffer)}

    def unpack(self, i: int, later: dict[int, tuple[Any, Any]],
               here: dict[int, tuple[Any, Any]], shared: set[int] | None) -> list[Any]:
        """Instruction i's saved values as arrays. A buffer that the step after this one
        unpacked (`later`), or this one already (`here`), gives that array again; one this
        step shares with the step before (its id in `shared`, that step's `packed_ids`) is
        remembered in `here`. Why: a carry kept packed (quantized, offloaded) is read by two
        steps' rules, the one that made it and the one that took it in; unpacking it once
        takes 4.5% off an int8 RNN's instructions."""
        arrays = []
        for v in self.saved[i]:
            if type(v) is KeptBuffer:  # kept as is, in a buffer: its array, without a call
                arrays.append(v.packed)
            elif isinstance(v, SavedBuffer):
                key = id(v)
                found = later.get(key) or here.get(key)
                if found is not None and found[0]() is v:
                    arrays.append(found[1])
                    continue
                array = v.unpack()
                if shared is not None and key in shared:
                    here[key] = (weakref.ref(v), array)
                arrays.append(array)
            else:
                arrays.append(v)
        return arrays

    def release(self, i: int) -> None:
        kept = self.saved[i]
        self.saved[i] = None
        if self.announced and kept:  # (a list dropped at once frees its last item first)
            kept.reverse()
            kept.clear()

    def output(self, slots: tuple[int, ...]) -> list[Any]:
        return [None if s < 0 else self.values[s] for s in slots]

    def drop_values(self, keep: tuple[int, ...]) -> None:
        """Forget every value (the saved ones stay in `saved`): the step's outputs are in the
        caller's hands, and a full-precision copy kept here would undo a compressing strategy.
        Buffers of the `keep` slots (the new carry) stay, for the next step to share."""
        self.values = ()  # (shared: a taped step holds no empty list of its own)
        if self.buffers:
            self.buffers = {k: b for k, b in self.buffers.items() if k[0] in keep} or NO_BUFFERS

def carried_buffers(carry_out: tuple[int, ...],
                    previous: ReplayedStep | None) -> dict[tuple[int, int], Any]:
    """A step's buffers by (slot, id(packer)) as it begins: those of the new carry (slots
    `carry_out` of the step before) that `previous` packed, under its carry slots."""
    buffers: dict[tuple[int, int], Any] = {}
    if previous is not None:
        for k, s in enumerate(carry_out):
            for (slot, pid), buffer in previous.buffers.items():
                if slot == s and s >= 0:
                    buffers[(k, pid)] = buffer
    return buffers
