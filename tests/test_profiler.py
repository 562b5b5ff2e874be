"""The profiler: exact on programs whose saved bytes are known by hand, close to an independent
tracemalloc measurement on a long RNN, and its JSON round-trips."""

from __future__ import annotations

import gc
import itertools
import tracemalloc

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import events
from checkpoint_ad.profiler import Profile, ProfileFormatError
from checkpoint_ad.strategies import Binomial, Quantized


def test_records_and_peak_are_exact_on_a_hand_counted_program():
    x = cad.tensor(np.ones(1000), requires_grad=True)  # float64: 8000 bytes
    w = cad.tensor(np.full(1000, 2.0))
    with cad.profile(model="hand") as prof:
        h = cad.tanh(x)  # saves its output: 8000
        y = h * w  # saves w (for h's gradient): 8000; h needs no saving (w needs no grad)
        z = (y * y).sum()  # saves y once, though both arguments: 8000
        z.backward()
    records = [(r.op, r.role, r.shape, r.logical_bytes, r.stored_bytes) for r in prof.records]
    assert records == [
        ("tanh", "out", (1000,), 8000, 8000),
        ("multiply", "b", (1000,), 8000, 8000),
        ("multiply", "a", (1000,), 8000, 8000),
        ("multiply", "b", (1000,), 8000, 8000),
    ]
    assert prof.records[2].buffer == prof.records[3].buffer  # y saved once
    assert prof.peak_tape_bytes == 24_000
    assert prof.saved_bytes == 24_000
    assert prof.timeline_bytes[-1] == 0  # the sweep freed everything it passed
    assert set(prof.timeline_phase) >= {"forward", "backward"}
    assert prof.meta == {"model": "hand"} and prof.primitives == 4
    assert prof.by_op()["multiply"] == {"count": 3, "logical": 16_000, "stored": 16_000,
                                        "aliased": 0}
    assert "test_profiler.py" in prof.records[0].origin


def test_stored_bytes_follow_the_strategy():
    x = cad.tensor(np.random.default_rng(0).standard_normal(64 * 1024).astype(np.float32),
                   requires_grad=True)
    with cad.profile() as prof, cad.use(Quantized(bits=4)):
        y = cad.tanh(x).sum()
    (record,) = prof.records
    assert record.logical_bytes == 256 * 1024
    assert record.stored_bytes / record.logical_bytes == pytest.approx(0.1406, abs=1e-3)
    assert prof.peak_tape_bytes == record.stored_bytes
    del y


def test_recompute_is_timed_and_counted():
    x = cad.tensor(np.ones(100), requires_grad=True)

    def region(h):
        for _ in range(5):
            h = cad.tanh(h)
        return h

    with cad.profile() as prof:
        cad.checkpoint(region, x).sum().backward()
    assert prof.recomputed_primitives == 5
    assert prof.recompute_seconds > 0
    assert "recompute" in prof.timeline_phase

    w = cad.tensor(0.5, requires_grad=True)
    with cad.profile() as prof:
        _, ys = cad.scan(lambda h, _: (cad.tanh(h * w),) * 2, cad.tensor(np.ones(4)),
                         length=10, strategy=Binomial(2))
        ys.sum().backward()
    # every step re-run in backward (advances and taped re-runs) is counted: 2 ops a step
    assert prof.recomputed_primitives == 2 * (cad.strategies.optimal_evaluations(10, 2) - 10)


def test_profiling_costs_nothing_once_the_block_ends():
    with cad.profile():
        assert events.listeners
    assert not events.listeners


def test_json_round_trip_and_files(tmp_path):
    x = cad.tensor(np.ones(10), requires_grad=True)
    with cad.profile(model="rnn", strategy="keep-all") as prof:
        (cad.exp(x) * x).sum().backward()
    again = Profile.from_json(prof.to_json())
    assert again == prof
    path = prof.save(tmp_path / "sub" / "p.json")
    assert Profile.load(path) == prof
    with pytest.raises(ProfileFormatError, match="malformed"):
        Profile.from_json("{nope")
    with pytest.raises(ProfileFormatError, match="not a checkpoint-ad profile"):
        Profile.from_json('{"schema": "other"}')
    bad = prof.to_dict() | {"version": 99}
    with pytest.raises(ProfileFormatError, match="re-record"):
        Profile.from_dict(bad)
    with pytest.raises(ProfileFormatError, match="unknown profile fields"):
        Profile.from_dict(prof.to_dict() | {"surprise": 1})


def test_to_dict_holds_every_field_as_plain_data_and_is_a_copy():
    """The JSON form is the dataclass's own (every field; records as objects, shapes as
    lists), and changing it leaves the profile alone."""
    import dataclasses

    x = cad.tensor(np.ones((4, 3)), requires_grad=True)
    with cad.profile(model="rnn", sizes={"steps": 2}) as prof:
        cad.tanh(x @ x.T).sum().backward()
    data = prof.to_dict()
    expected = dataclasses.asdict(prof)
    expected["records"] = [{**dataclasses.asdict(r), "shape": list(r.shape)}
                           for r in prof.records]
    assert {k: v for k, v in data.items() if k not in ("schema", "version")} == expected
    assert list(data)[2:] == [f.name for f in dataclasses.fields(Profile)]
    before = Profile.from_dict(prof.to_dict())
    data["records"][0]["shape"].append(7)
    data["timeline_bytes"].append(1)
    data["meta"]["sizes"]["steps"] = 99
    data["peak_buffers"]["999"] = 1
    assert prof == before and prof.meta["sizes"] == {"steps": 2}


def test_summary_lists_ops_and_origins():
    x = cad.tensor(np.ones((8, 8)), requires_grad=True)
    with cad.profile(device_memory=True) as prof:
        (cad.sigmoid(x @ x)).sum().backward()
    text = prof.summary()
    assert "matmul" in text and "sigmoid" in text and "test_profiler.py" in text
    assert "peak tape" in text and "tracemalloc" in text


def test_peak_agrees_with_tracemalloc_on_a_1000_step_rnn():
    rng = np.random.default_rng(0)
    T, B, H = 1000, 64, 256
    W = cad.tensor((rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32),
                   requires_grad=True)
    xs = [cad.tensor(rng.standard_normal((B, H)).astype(np.float32)) for _ in range(T)]

    def forward():
        h = cad.tensor(np.zeros((B, H), dtype=np.float32))
        total = None
        for x in xs:
            h = cad.tanh(h @ W + x)
            total = h.sum() if total is None else total + h.sum()
        return total

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    loss = forward()
    independent = tracemalloc.get_traced_memory()[0] - base  # what the forward left alive
    tracemalloc.stop()
    del loss
    gc.collect()
    with cad.profile() as prof:
        loss = forward()
        loss.backward()
    # the tape's saved values are nearly all of it; the rest is tape entries (about 0.7 kB
    # each) and the small tensors of the loss sum: within 10%
    assert prof.peak_tape_bytes == pytest.approx(independent, rel=0.10)


def _planned_loop(strategy, n=20, hidden=64):
    w = cad.tensor(np.eye(hidden) * 0.5, requires_grad=True)
    h0 = cad.tensor(np.ones((1, hidden)), requires_grad=True)  # float64 carry: hidden*8 bytes
    xs = cad.tensor(np.zeros((n, 1, hidden)))
    with cad.profile(model="loop") as prof:
        carry, _ = cad.scan(lambda h, x: (cad.tanh(h @ w + x), None), h0, xs, strategy=strategy)
        carry.sum().backward()
    return prof


@pytest.mark.parametrize("snapshots", [2, 4])
def test_a_planned_scan_lists_its_snapshots_as_saved_values_of_its_entry(snapshots):
    prof = _planned_loop(Binomial(snapshots))
    carry_bytes = 64 * 8
    snaps = [r for r in prof.records if r.op == "scan[binomial]"]
    assert snaps, "the loop's own entry reached the profiler"
    assert all(r.role.startswith("snapshot") and r.stored_bytes == carry_bytes for r in snaps)
    assert 1 <= len(snaps) <= snapshots
    assert all("test_profiler.py" in r.origin for r in snaps)  # the scan call line
    # snapshots count in the live tape bytes, so the peak is at least what the plan holds
    assert prof.peak_tape_bytes >= len(snaps) * carry_bytes
    assert prof.timeline_bytes[-1] == 0
    assert prof.recomputed_primitives > 0


def test_snapshot_storage_shows_in_stored_bytes():
    plain = _planned_loop(Binomial(4), hidden=512)
    packed = _planned_loop(Binomial(4, storage=Quantized(bits=8)), hidden=512)
    plain_bytes = sum(r.stored_bytes for r in plain.records if r.op == "scan[binomial]")
    packed_bytes = sum(r.stored_bytes for r in packed.records if r.op == "scan[binomial]")
    assert 0 < packed_bytes < 0.5 * plain_bytes


# ------------------------------------------------------------- owned and aliased bytes
def test_parameters_and_input_slices_are_aliases_not_tape_memory():
    rng = np.random.default_rng(0)
    w = cad.tensor(rng.standard_normal((64, 64)), requires_grad=True)  # 32 KiB parameter
    xs = cad.tensor(rng.standard_normal((10, 4, 64)))  # input data: each xs[t] is a view
    with cad.profile() as prof:
        h = cad.tensor(np.zeros((4, 64)))
        for t in range(10):
            h = cad.tanh(h @ w + xs[t] * 1.0)
        h.sum().backward()
    owned = {(r.op, r.role) for r in prof.records if r.owned}
    aliased = {(r.op, r.role) for r in prof.records if not r.owned}
    assert ("tanh", "out") in owned and ("matmul", "b") in aliased  # w is the caller's
    assert ("matmul", "a") in owned  # h: made by the tape (the zeros too: nobody else has them)
    # owned: 10 tanh outputs (shared with the next matmul) and the initial zeros, 2 KiB each
    assert prof.peak_tape_bytes == 11 * 4 * 64 * 8
    assert prof.aliased_bytes == 64 * 64 * 8  # the parameter, once
    assert prof.saved_bytes == prof.peak_tape_bytes
    assert prof.by_op()["matmul"]["aliased"] == 64 * 64 * 8
    assert "the caller's" in prof.summary()


def test_a_packed_copy_of_a_parameter_is_owned_and_quantize_leaves_parameters_alone():
    w = cad.tensor(np.random.default_rng(0).standard_normal(4096).astype(np.float32),
                   requires_grad=True)
    with cad.profile() as prof, cad.saved_values_hooks(lambda a: a.copy(), lambda a: a):
        y = (w * w).sum()
    assert [r.owned for r in prof.records] == [True, True]  # the packed form is new memory
    assert prof.peak_tape_bytes == 4096 * 4 and prof.aliased_bytes == 0
    with cad.profile() as prof, cad.use(Quantized(bits=8)):
        y = (w * w).sum()
    assert [r.owned for r in prof.records] == [False, False]  # by reference: costs nothing
    assert prof.peak_tape_bytes == 0 and prof.aliased_bytes == 4096 * 4
    del y


def test_a_version_1_profile_still_loads_with_everything_owned():
    x = cad.tensor(np.ones(10), requires_grad=True)
    with cad.profile() as prof:
        cad.tanh(x).sum().backward()
    old = prof.to_dict() | {"version": 1}
    del old["aliased_bytes"]
    for record in old["records"]:
        del record["owned"]
    loaded = Profile.from_dict(old)
    assert loaded.aliased_bytes is None and all(r.owned for r in loaded.records)
    assert loaded.peak_tape_bytes == prof.peak_tape_bytes


def test_the_pareto_front_agrees_with_measured_device_peaks_on_the_rnn():
    """The trade-off plot's memory axis must rank strategies as the allocator does: for the
    presets on the front, ordered by peak tape bytes, the tracemalloc peak of the same run
    rises too (within 5% of keep-all's peak: tape entries and gradients are not tape bytes)."""
    from checkpoint_ad.plots import pareto_front
    from checkpoint_ad.sweep import sweep

    presets = ["keep-all", "store-outputs", "sqrt-segments", "recompute", "revolve-4",
               "revolve-16"]
    result = sweep("rnn", presets, sizes={"steps": 128, "batch": 16, "input_size": 16,
                                          "hidden": 64}, progress=False, repeats=1)
    rows = {r.preset: r for r in result.rows}
    assert all(r.device_peak_bytes for r in rows.values())  # tracemalloc measured each run
    tolerance = 0.05 * rows["keep-all"].device_peak_bytes
    front = [result.rows[i] for i in pareto_front(
        [(r.peak_tape_bytes, r.time_ratio) for r in result.rows])]
    for smaller, larger in itertools.pairwise(front):
        assert smaller.device_peak_bytes <= larger.device_peak_bytes + tolerance, (
            smaller.preset, larger.preset)
    # and across every pair, not only the front: less tape never means clearly more memory
    for a in rows.values():
        for b in rows.values():
            if a.peak_tape_bytes < b.peak_tape_bytes:
                assert a.device_peak_bytes <= b.device_peak_bytes + tolerance, (a.preset, b.preset)
    revolve = min(rows["revolve-4"].peak_tape_bytes, rows["revolve-16"].peak_tape_bytes)
    if rows["recompute"].peak_tape_bytes < revolve:  # only if the allocator agrees
        assert rows["recompute"].device_peak_bytes < min(
            rows["revolve-4"].device_peak_bytes, rows["revolve-16"].device_peak_bytes)
    assert rows["recompute"].peak_tape_bytes > revolve  # it keeps every step's carry


@pytest.mark.slow
@pytest.mark.parametrize("model", ["lstm", "residual_mlp", "heat", "neural_ode"])
def test_less_tape_means_no_more_measured_memory_on_every_built_in_model(model):
    """The memory axis ranks the loop strategies as the allocator does on each built-in model
    at its main-job sizes: a preset with less peak tape than another has no larger
    tracemalloc peak (within 5% of keep-all's: gradients and parameters are not tape)."""
    from checkpoint_ad.models import SWEEP_SIZES
    from checkpoint_ad.sweep import sweep

    result = sweep(model, ["keep-all", "recompute", "revolve-4"], sizes=SWEEP_SIZES[model],
                   progress=False, repeats=1)
    rows = {r.preset: r for r in result.rows}
    tolerance = 0.05 * rows["keep-all"].device_peak_bytes
    for a in rows.values():
        for b in rows.values():
            if a.peak_tape_bytes < b.peak_tape_bytes:
                assert a.device_peak_bytes <= b.device_peak_bytes + tolerance, (a.preset, b.preset)
    assert rows["revolve-4"].device_peak_bytes < rows["keep-all"].device_peak_bytes


def test_device_memory_is_measured_when_asked_and_the_profile_says_how():
    """tracemalloc slows numpy code several times over: on the CPU it runs only on request."""
    import tracemalloc

    x = cad.tensor(np.ones(4096), requires_grad=True)
    with cad.profile() as plain:
        assert not tracemalloc.is_tracing()
        cad.tanh(x).sum().backward()
    assert plain.memory_source == "none" and plain.device_peak_bytes is None
    assert plain.peak_tape_bytes == 4096 * 8  # the tape is accounted either way
    with cad.profile(device_memory=True) as measured:
        cad.tanh(x).sum().backward()
    assert measured.memory_source == "tracemalloc"
    assert measured.device_peak_bytes >= 4096 * 8
    assert not tracemalloc.is_tracing()


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_device_peak_counts_a_temporary_made_and_freed_inside_one_rule():
    """cupy's pool is read through a memory hook: a buffer that lives only inside one rule,
    between two engine events, is in the peak (sampling the pool at events misses it)."""
    from checkpoint_ad.backend import cupy_or_none

    cupy = cupy_or_none()
    if cupy is None:
        pytest.skip("needs cupy and a CUDA device")
    temporary = 64 * 2**20

    class Spiky(cad.Function):
        @staticmethod
        def forward(ctx, x):
            scratch = cupy.ones(temporary, dtype=cupy.uint8)
            del scratch
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            return g

    x = cad.tensor(np.ones(256, dtype=np.float32), device="cuda", requires_grad=True)
    with cad.profile(device="cuda") as prof:
        cad.sum(Spiky.apply(x)).backward()
    assert prof.memory_source == "cupy-pool"
    assert temporary <= prof.device_peak_bytes < temporary + 2**20
