"""The profiler logs while the program runs and accounts when the profile is read
(`profiler/accountant.py`). Reading it any number of times, at any point of the block, must
give the profile one read at the end gives; so must a profile measuring device memory, which
accounts for its log as it grows (the allocator would count the log as the program's)."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import nn
from checkpoint_ad.strategies import Binomial, KeepAll, Periodic
from checkpoint_ad.strategies.loops import program_cache
from tests.profile_parity import comparable

# what differs between two runs of the same work beyond their clocks: the device's measured
# peak, where its figure came from, and the explanation, which lists that figure
DEVICE = ("device_peak_bytes", "memory_source", "explain")


def _imperative_rnn(read=None, steps=12):
    """An imperative RNN and its backward, calling `read()` after every op of one step."""
    rng = np.random.default_rng(0)
    W = cad.tensor(rng.standard_normal((6, 6)) / 3, requires_grad=True)
    U = cad.tensor(rng.standard_normal((4, 6)) / 2, requires_grad=True)
    b = cad.tensor(np.zeros(6), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((steps, 3, 4)))

    def run():
        h = cad.zeros(3, 6)
        loss = None
        for t in range(steps):
            h = cad.tanh(h @ W + xs[t] @ U + b)
            if read is not None and t % 3 == 1:
                read()
            loss = h.sum() if loss is None else loss + h.sum()
        if read is not None:
            read()
        loss.backward()
        return [p.grad.numpy().copy() for p in (W, U, b)]

    return run


def _gru(strategy, read=None):
    rng = np.random.default_rng(1)
    model = nn.GRU(4, 5, seed=1, strategy=strategy)
    x = cad.tensor(rng.standard_normal((10, 3, 4)))

    def run():
        out, _ = model(x)
        if read is not None:
            read()
        ((out * out).mean()).backward()
        if read is not None:
            read()
        return [p.grad.numpy().copy() for p in model.parameters()]

    return run


def _without(data, keys):
    return {k: v for k, v in data.items() if k not in keys}


PROGRAMS = {
    "imperative RNN": _imperative_rnn,
    "GRU keep-all": lambda read=None: _gru(KeepAll(), read),
    "GRU periodic": lambda read=None: _gru(Periodic(3), read),
    "GRU binomial": lambda read=None: _gru(Binomial(snapshots=2), read),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_profile_read_during_the_block_is_the_profile_read_once_at_the_end(name):
    with cad.profile() as once:
        grads = PROGRAMS[name]()()
    seen: list[tuple[int, int, int]] = []
    holder: list[object] = []

    def read() -> None:
        prof = holder[0]
        seen.append((prof.primitives, prof.peak_tape_bytes, len(prof.records)))

    with cad.profile() as often:
        holder.append(often)
        grads_read = PROGRAMS[name](read)()
    assert all(np.array_equal(a, b) for a, b in zip(grads, grads_read))
    assert comparable(often) == comparable(once)
    # each read saw the profile so far: counts only grow, and the last read of the forward
    # saw every forward record of the final profile
    assert seen == sorted(seen)
    assert 0 < seen[0][0] < once.primitives


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_measuring_device_memory_leaves_the_tape_accounting_as_it_is(name):
    # each run traces as a first call does (a step program another test left in the cache
    # would make one run trace fewer steps, and record fewer primitives, than the other)
    program_cache.clear()
    with cad.profile() as plain:
        PROGRAMS[name]()()
    program_cache.clear()
    with cad.profile(device_memory=True) as measured:
        PROGRAMS[name]()()
    assert measured.memory_source == "tracemalloc" and measured.device_peak_bytes > 0
    assert _without(comparable(measured), DEVICE) == _without(comparable(plain), DEVICE)


def test_a_long_run_measuring_device_memory_matches_a_plain_profile():
    """Long enough that the measured profile accounts for its log many times over."""
    run = _imperative_rnn(steps=300)
    with cad.profile() as plain:
        run()
    with cad.profile(device_memory=True) as measured:
        run()
    assert plain.primitives > 2000
    assert _without(comparable(measured), DEVICE) == _without(comparable(plain), DEVICE)


def test_entries_that_save_nothing_are_counted_but_add_no_timeline_point():
    x = cad.tensor(np.ones(100), requires_grad=True)
    with cad.profile() as prof:
        y = cad.tanh(x)  # saves its output: a point
        z = y + y + y + y  # three additions saving nothing: counted, no point
    assert prof.primitives == 4
    assert prof.timeline_bytes == [0, 800, 800]  # start, tanh's record, the end
    del y, z


def test_the_profile_of_a_block_left_unread_keeps_no_saved_array_alive():
    """The log names buffers by number and holds weak references only: a profile nobody
    read yet must not keep the arrays the program saved."""
    x = cad.tensor(np.ones(1000), requires_grad=True)
    with cad.profile() as prof:
        y = cad.tanh(x)
        array = y._entry._saved.packed
    ref = weakref.ref(array)
    del y, array
    gc.collect()
    assert ref() is None
    assert prof.timeline_bytes[-1] == 8000  # freed after the block: not this profile's
    assert prof.peak_tape_bytes == 8000


def test_reading_from_another_thread_after_the_block_ends():
    x = cad.tensor(np.ones(10), requires_grad=True)
    with cad.profile() as prof:
        cad.tanh(x).sum().backward()
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(prof.peak_tape_bytes))
    worker.start()
    worker.join()
    assert result == [80]


def test_records_read_from_the_log_are_the_records_their_dataclass_makes():
    """`gathered.settle_raw` sets a record's fields straight into it, in the order of the raw
    items: that order must be the dataclass's."""
    from checkpoint_ad.profiler.gathered import _RECORD_NAMES
    from checkpoint_ad.profiler.records import SavedRecord

    assert _RECORD_NAMES == ("op", "role", "shape", "dtype", "logical_bytes", "stored_bytes",
                             "origin", "buffer", "phase", "owned", "level", "strategy")
    x = cad.tensor(np.ones((2, 3), dtype=np.float32), requires_grad=True)
    with cad.profile() as prof:
        cad.tanh(x)
    record = prof.records[0]
    made = SavedRecord(**{name: getattr(record, name) for name in _RECORD_NAMES})
    assert record == made and hash(record) == hash(made)
    assert (record.op, record.shape, record.dtype, record.stored_bytes) == (
        "tanh", (2, 3), "float32", 24)
    with pytest.raises(AttributeError):
        record.op = "changed"  # still frozen


def test_the_timeline_marks_where_each_phase_begins():
    """Entries that save nothing add no point, so a phase change is marked by a point of its
    own: the sweep's first point holds the bytes the forward ended with."""
    x = cad.tensor(np.ones(100), requires_grad=True)
    with cad.profile() as prof:
        y = cad.tanh(cad.tanh(x))
        (y + y).sum().backward()
    phases, bytes_ = prof.timeline_phase, prof.timeline_bytes
    first_backward = phases.index("backward")
    assert phases[:first_backward] == ["forward"] * first_backward
    assert bytes_[first_backward] == bytes_[first_backward - 1] == 1600  # two saved outputs
    assert bytes_[-1] == 0


def test_a_profile_read_from_another_thread_while_its_block_runs():
    """Reads race the recording thread's log: each read accounts for what was logged so far
    under a lock, and the profile at the end is the one read once."""
    run = _imperative_rnn(steps=60)
    with cad.profile() as once:
        run()
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []
    holder: list[object] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                if holder:
                    seen.append(len(holder[0].records))
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=reader)
    worker.start()
    try:
        with cad.profile() as often:
            holder.append(often)
            run()
    finally:
        stop.set()
        worker.join()
    assert not errors
    assert seen == sorted(seen)
    assert comparable(often) == comparable(once)
