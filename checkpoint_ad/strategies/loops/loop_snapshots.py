"""A planned loop's snapshots, their storage and the random states they carry.

A snapshot is the carry at one step of the plan, packed through the one saving path with the
loop's `storage` (or the disk level for a plan's disk snapshots), with the engine's random
state at that step and numpy's global one when the steps draw from it (`tracks_numpy`): a
restore hands the carry back and rewinds both, so the steps re-run from it draw what they
drew the first time. Owns the executor's `storage`, `disk_storage`, `last_engine_state`,
`quiet` and `restore_at`; also what a disk snapshot costs (`measure_costs`, asked by a plan
that has a disk level) and what a snapshot's objects cost (`snapshot_object_bytes`, asked by
a budget's dry run).
"""

from __future__ import annotations

import time
import tracemalloc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import random
from ...backend import namespace
from ...pytree import flatten, unflatten
from ...saved import SavedBuffer, SavedSlot, pack_value, stores_as_is
from ...tensor import Tensor
from ..plans.revolve import _DISK_RESTORE, _KIND_MASK, _RESTORE, plan_codes
from ..storage.offload import Offload

if TYPE_CHECKING:
    from .plan_executor import PlannedLoop


READ_AHEAD = 2
"""Restores whose snapshots the executor announces to their storage ahead (`prefetch`)."""


@dataclass(slots=True)
class CarrySnapshot:
    """A stored carry, and the random states (the engine's and numpy's) at that step (one
    per snapshot, so no instance dictionary)."""

    buffers: list[SavedBuffer | None]
    engine_state: random.GeneratorState
    numpy_state: Any  # None unless the loop draws from numpy's global state


def snapshot_object_bytes(arrays: list[Any], storage: Any) -> int:
    """Bytes a snapshot of `arrays` holds beyond its stored values, as a loop keeps it (its
    buffers, the snapshot, its place in the loop's table and the loop entry's slot for each
    buffer), traced by tracemalloc; 0 under a caller's tracing (starting it would spoil the
    caller's peak). About 500 bytes: an eighth of a small carry's 4 KiB, which a plan with
    many snapshots of it holds many times."""
    if tracemalloc.is_tracing():
        return 0
    state = random.get_state()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        snapshots = {0: CarrySnapshot([None if a is None else pack_value(a, storage)
                                       for a in arrays], state, None)}
        slots = [SavedSlot(f"snapshot{0}.{k}", b, None, None)
                 for k, b in enumerate(snapshots[0].buffers) if b is not None]
        held = tracemalloc.get_traced_memory()[0] - before
        # a buffer kept by reference (`KeptBuffer`) allocated none of its stored bytes here
        stored = sum(b.stored_nbytes for a, b in zip(arrays, snapshots[0].buffers)
                     if b is not None and getattr(b, "packed", None) is not a)
        del slots
    finally:
        tracemalloc.stop()
    return max(0, held - stored)


def disk_storage_for(storage: Any) -> Offload:
    """Where a plan's disk snapshots go: the loop's storage when it is a disk level already,
    else the disk level with a lossy storage (quantization) inside it."""
    if isinstance(storage, Offload):
        return storage if storage.level == "disk" else Offload("disk", planned=True)
    inner = None if storage.lossless else storage
    return Offload("disk", inner=inner, planned=True)


def same_numpy_state(a: Any, b: Any) -> bool:
    """Whether two states of numpy's global generator are the same (nothing drawn between)."""
    return bool(a[0] == b[0] and a[2:] == b[2:] and np.array_equal(a[1], b[1]))


def take_snapshot(
    executor: PlannedLoop,
    arrays: list[Any],
    storage: Any = None,
    engine_state: random.GeneratorState | None = None,
) -> CarrySnapshot:
    """A snapshot of `arrays` kept with `storage` (the loop's, by default), with the random
    states its steps start from (the engine's is `engine_state` when those steps already
    ran, else the current one)."""
    storage = executor.storage if storage is None else storage
    buffers = [None if a is None else pack_value(a, storage) for a in arrays]
    last = executor.last_engine_state
    if engine_state is None and last is not None and draws_nothing(executor):
        return CarrySnapshot(buffers, last, numpy_state(executor))
    state = random.get_state() if engine_state is None else engine_state
    if last is not None and state is not last and state[0] is last[0] and (
            state[1] == last[1]):
        # the steps since drew nothing (most loops draw nothing): one state object for
        # every such snapshot, not one per snapshot (a few hundred bytes each, about a
        # tenth of a small carry)
        state = last
    executor.last_engine_state = state
    return CarrySnapshot(buffers, state, numpy_state(executor))


def restore_snapshot(executor: PlannedLoop, snapshot: CarrySnapshot,
                     stream: np.random.Generator) -> list[Any]:
    """The snapshot's carry; `stream` (and numpy's state) rewound to draw what its steps
    drew."""
    if snapshot.numpy_state is not None:
        np.random.set_state(snapshot.numpy_state)
    if not draws_nothing(executor):
        random.rewind(stream, snapshot.engine_state)
    return [None if b is None else b.unpack() for b in snapshot.buffers]


def read_ahead(executor: PlannedLoop, snapshots: dict[int, CarrySnapshot], index: int) -> None:
    """Announce to their storage the snapshots the next restores after action `index`
    read, in plan order, so a disk level reads them while the steps run."""
    restore_at = executor.restore_at
    if restore_at is None:
        if not (executor.storage.reads_ahead or executor.disk_storage.reads_ahead):
            return
        kinds = np.frombuffer(plan_codes(executor.plan), dtype=np.int64) & _KIND_MASK
        restore_at = executor.restore_at = np.flatnonzero(
            (kinds == _RESTORE) | (kinds == _DISK_RESTORE))
        if not executor.storage.reads_ahead and not (kinds == _DISK_RESTORE).any():
            # only the disk level reads ahead, and no snapshot goes there: the hints
            # would all go to storages that ignore them (a cost at every restore)
            restore_at = executor.restore_at = restore_at[:0]
    if not restore_at.size:
        return
    first = int(np.searchsorted(restore_at, index, side="right"))
    by_storage: dict[int, tuple[Any, list[Any]]] = {}
    for at in restore_at[first:first + READ_AHEAD]:
        snapshot = snapshots.get(executor.plan[int(at)].step)
        if snapshot is None:  # taken later: announced once it exists
            break
        for b in snapshot.buffers:
            if b is not None:
                by_storage.setdefault(id(b.packer), (b.packer, []))[1].append(b.packed)
    for storage, stored in by_storage.values():
        storage.prefetch(stored)


def numpy_state(executor: PlannedLoop) -> Any:
    return np.random.get_state() if executor.tracks_numpy else None


def draws_nothing(executor: PlannedLoop) -> bool:
    """Whether nothing in this loop draws from the engine's generator: its steps are
    replayed from a program that draws nothing (a trace sees every draw), and its storages
    keep arrays as they are. The generator's state is then the same before every step,
    so a snapshot need not read it (about 6 µs) nor a restore set it back."""
    quiet = executor.quiet
    if quiet is None:
        program = executor.program
        if program is None:
            return False
        quiet = executor.quiet = not program.draws and all(  # a program never changes
            packer is None or stores_as_is(packer)
            for packer in (executor.storage, executor.step_packer))
    return quiet


def measure_costs(executor: PlannedLoop) -> tuple[float, float]:
    """(write, read) cost of one disk snapshot of the initial carry, in forward steps:
    step 0 is timed (twice, the faster counts: the first call warms caches) without a
    tape, its randomness not kept, and the carry written and read once. The step runs on
    copies of the carry and of row 0 of xs (a step changing them in place changes
    nothing of the caller's)."""
    loop = executor.loop
    evaluations, numpy_state = loop.evaluations, np.random.get_state()
    step = float("inf")
    try:
        for _ in range(2):
            tensors = [None if a is None else Tensor._wrap(_copy(a)) for a in executor.initial]
            x = loop.x_at(0)
            if x is not None:
                x = unflatten(loop.xs_spec, iter(
                    None if p is None else Tensor._wrap(_copy(p._data))
                    for p in flatten(x)[0]))
            with random.replaying(random.get_state()):
                started = time.perf_counter()
                loop.call_for_values(0, tensors, x)
                step = min(step, time.perf_counter() - started)
    finally:
        np.random.set_state(numpy_state)
        loop.evaluations = evaluations
    write = read = 0.0
    for a in executor.initial:
        if a is not None:
            w, r = executor.disk_storage.time_io(a)
            write, read = write + w, read + r
    step = max(step, 1e-9)
    return write / step, read / step


def _copy(array: Any) -> Any:
    return namespace(array).array(array, copy=True)
