"""The profiler on replayed loop steps: a step replayed from its step program is announced as one
event per step (no entry, saved slot or leaf tensor made per instruction), yet the profile is the
one recording every step gives (``trace=False``): the same records, timeline, peaks, counts and
explanation. And values packed into a new stored form are still counted at their 'pack', before
the entry that saved them, though the recorder counts them when the next event arrives."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import events
from checkpoint_ad.profiler import profile
from checkpoint_ad.strategies import Binomial, KeepAll, Periodic, Quantized, StoreInputs
from tests.profile_parity import comparable


def _params(seed=0, T=10, B=3, H=5):
    rng = np.random.default_rng(seed)
    w = cad.tensor(rng.standard_normal((H, H)).astype(np.float32) * 0.4, requires_grad=True)
    u = cad.tensor(rng.standard_normal((H, H)).astype(np.float32) * 0.4, requires_grad=True)
    b = cad.tensor(rng.standard_normal(H).astype(np.float32) * 0.1, requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((B, H)).astype(np.float32), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((T, B, H)).astype(np.float32))
    return w, u, b, h0, xs


def _gated_step(w, u, b):
    """A GRU-like step: parameters captured (constants of the program), a gate, a broadcast
    bias, an input row that needs no gradient, a value used twice."""
    def step(h, x):
        z = cad.sigmoid(h @ u + b)
        c = cad.tanh(h @ w + x)
        h = z * h + (1 - z) * c
        return h, h * h
    return step


def _profiled(loop, storage, trace):
    w, u, b, h0, xs = _params()
    with profile() as prof, cad.use(storage):
        carry, ys = cad.scan(_gated_step(w, u, b), h0, xs, strategy=loop, trace=trace)
        ((carry * carry).sum() + ys.sum()).backward()
    # a kept loop recorded step by step leaves no loop entry behind
    mode = carry.grad_fn.op.mode if trace or loop is not None else "recorded"
    grads = [t.grad.numpy() for t in (w, u, b, h0)]
    return prof, mode, grads


@pytest.mark.parametrize(("loop", "storage"), [
    (Binomial(3), KeepAll()),
    (Binomial(3), Quantized(8)),
    (Binomial(4), StoreInputs()),
    (Binomial(3, storage=Quantized(8)), KeepAll()),
    (Periodic(4), Quantized(8)),
], ids=["binomial-keep", "binomial-int8", "binomial-store-inputs", "int8-snapshots",
        "periodic-int8"])
def test_a_replayed_planned_loop_profiles_as_its_recording(loop, storage):
    replayed, mode, grads = _profiled(loop, storage, trace=True)
    recorded, ref_mode, ref_grads = _profiled(loop, storage, trace=False)
    assert mode == "replayed" and ref_mode == "recorded: trace=False"
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_array_equal(g, r)
    assert replayed.recomputed_primitives > 0 and len(replayed.records) > 0
    assert comparable(replayed) == comparable(recorded)


@pytest.mark.parametrize("storage", [
    KeepAll(),
    Quantized(8),
], ids=["keep", "int8"])
def test_a_replayed_loop_keeping_every_step_lists_what_recording_lists(storage):
    """A kept loop is one tape entry (its order of buffers differs from per-step recording):
    the same forward records, peak and aliased bytes."""
    replayed, mode, _ = _profiled(None, storage, trace=True)
    recorded, _, _ = _profiled(None, storage, trace=False)
    assert mode == "replayed"
    rows = [sorted((r.op, r.role, r.shape, r.stored_bytes, r.origin, r.owned, r.strategy)
                   for r in p.records if r.phase == "forward") for p in (replayed, recorded)]
    assert rows[0] == rows[1]
    assert replayed.peak_tape_bytes == recorded.peak_tape_bytes
    assert replayed.aliased_bytes == recorded.aliased_bytes
    assert max(replayed.timeline_bytes) == max(recorded.timeline_bytes)


@pytest.mark.parametrize("loop", [None, Binomial(3), Periodic(4)],
                         ids=["kept", "binomial", "periodic"])
@pytest.mark.parametrize("trace", [True, False], ids=["replayed", "recorded"])
def test_a_loss_on_the_final_carry_shares_the_buffer_its_last_step_packed(loop, trace):
    """The final carry is the value the last step saved (``h * h``): a loss that saves it
    again shares that quantized buffer, as on a plain tape, rather than packing it twice."""
    prof, _, _ = _profiled(loop, Quantized(8), trace=trace)
    forward = [r for r in prof.records if r.phase == "forward"]
    *inside, outer_a, outer_b = forward  # the loss's `carry * carry` is the last entry
    assert outer_a.op == outer_b.op == "multiply" and outer_a.buffer == outer_b.buffer
    assert outer_a.buffer in {r.buffer for r in inside}



def _profiled_with_a_value_from_before_the_loop(loop, trace):
    """A step that captures a value computed before the loop (a graph value, not a leaf: as
    heat's diffusivity is) and saves it at every step."""
    w, u, b, h0, xs = _params()
    with profile() as prof:
        gate = cad.sigmoid(b) * 2.0  # saves nothing itself; each step saves it

        def step(h, x):
            h = cad.tanh(gate * (h @ w) + x @ u)
            return h, h.sum()

        # rows not batched (`hoisted_rows.py`): the replay is compared with recording,
        # bitwise, and its profile too (a batched one also counts its chunk)
        carry, ys = cad.scan(step, h0, xs, strategy=loop, trace=trace, batch_rows=False)
        (carry.sum() + ys.sum()).backward()
    return prof, [t.grad.numpy() for t in (w, u, b, h0)]


@pytest.mark.parametrize("loop", [None, Binomial(1), Binomial(3), Periodic(3)],
                         ids=["kept", "binomial-1", "binomial-3", "periodic"])
def test_a_captured_graph_value_is_the_tapes_in_a_replayed_loop_as_when_recorded(loop):
    """Replayed steps once learned the captured value as one of the caller's leaves, so
    every later record of it read the caller's memory and the loop's peak tape one value
    short of recording's."""
    replayed, grads = _profiled_with_a_value_from_before_the_loop(loop, trace=True)
    recorded, ref_grads = _profiled_with_a_value_from_before_the_loop(loop, trace=False)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_array_equal(g, r)
    gate_records = [r for p in (replayed, recorded) for r in p.records
                    if r.op == "multiply" and r.role == "a" and r.shape == (5,)]
    assert gate_records and all(r.owned for r in gate_records)
    assert replayed.peak_tape_bytes == recorded.peak_tape_bytes
    assert replayed.leaf_bytes == recorded.leaf_bytes
    assert replayed.aliased_bytes == recorded.aliased_bytes
    if loop is not None:  # a kept loop is one entry: its order of buffers is its own
        assert comparable(replayed) == comparable(recorded)

def _heard(T):
    w, u, b, h0, xs = _params(T=T)
    heard = []
    stop = events.subscribe(lambda kind, payload: heard.append((kind, payload)),
                            kinds=["record", "replaying", "replayed"])
    try:
        with profile():
            carry, _ = cad.scan(_gated_step(w, u, b), h0, xs)
    finally:
        stop()
    assert carry.grad_fn.op.mode == "replayed"
    return [kind for kind, _ in heard], [p for kind, p in heard if kind == "replayed"]


def test_a_replayed_step_is_one_event_and_makes_no_entries():
    short, long = _heard(T=9), _heard(T=20)
    for (kinds, payloads), steps in ((short, 9), (long, 20)):
        replayed = steps - 2  # steps 0 and 1 are recorded (traced)
        assert kinds.count("replaying") == kinds.count("replayed") == replayed
        assert len({id(step) for step, *_ in payloads}) == 1  # described once per program
        step, saved, values, _, _ = payloads[0]
        assert all(len(d.saved) == len(kept) for d, kept in zip(step.instructions, saved)
                   if d is not None)
        assert not any(isinstance(v, cad.Tensor) for v in values)
    assert short[0].count("record") == long[0].count("record")  # none per replayed step


def test_values_packed_into_a_new_form_are_counted_before_the_entry_that_saved_them():
    x = cad.tensor(np.linspace(-1, 1, 256), requires_grad=True)
    with profile() as prof, cad.use(Quantized(8)):
        y = cad.tanh(x)  # saves its output, quantized: one 'pack', then its 'record'
        snapshot = cad.strategies.Quantized(8)  # no event between: nothing counted here
        assert snapshot == Quantized(8)
        y.sum().backward()
    (record,) = [r for r in prof.records if r.op == "tanh"]
    stored = record.stored_bytes
    assert 0 < stored < record.logical_bytes
    # start, the pack, the record, then the backward frees it
    assert prof.timeline_bytes[:3] == [0, stored, stored]
    assert prof.timeline_bytes[-1] == 0 and prof.peak_tape_bytes == stored


def test_a_step_that_raises_while_profiled_leaves_nothing_uncounted():
    """Values packed before a failure are counted at the next event, as at their 'pack'."""
    x = cad.tensor(np.ones(64), requires_grad=True)
    with profile() as prof, cad.use(Quantized(8)):
        y = cad.tanh(x)
        with pytest.raises(cad.ShapeError):
            y @ cad.tensor(np.ones(3))
        del y
    assert prof.peak_tape_bytes == prof.records[0].stored_bytes > 0
    assert prof.timeline_bytes[-1] == 0


def _profiled_views(trace):
    """A step that saves two views of an array it made (a gate split in halves), under a
    plan that re-runs steps: each re-run makes new bases while earlier ones have died."""
    rng = np.random.default_rng(0)
    H, B, T = 8, 4, 12
    w = cad.tensor(rng.standard_normal((H, 2 * H)) * 0.3, requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((B, H)))
    xs = cad.tensor(rng.standard_normal((T, B, 2 * H)))

    def step(h, x):
        g = h @ w + x
        h = cad.tanh(g[:, :H] * g[:, H:])
        return h, h.sum()

    with profile() as prof:
        carry, ys = cad.scan(step, h0, xs, strategy=Binomial(2), trace=trace)
        (carry.sum() + ys.sum()).backward()
    return prof


@pytest.mark.parametrize("trace", [True, False], ids=["replayed", "recorded"])
def test_every_base_a_saved_view_keeps_alive_is_noted_once(trace):
    """A base made after another died may take its id: it is a base of its own. (Known by id
    alone, such bases went unnoted, and which did depended on where numpy put them.)"""
    prof = _profiled_views(trace)
    views = [r for r in prof.records if r.op == "multiply"]
    bases = {r.buffer for r in views if r.role == "a"}  # one base per 'a' view: its step's
    assert {r.phase for r in views} == {"forward", "recompute"}
    assert len(prof.view_base_bytes) == len(bases)
    assert set(prof.view_base_bytes.values()) == {views[0].stored_bytes}  # the other half


def test_a_replayed_step_saving_views_profiles_as_its_recording():
    assert comparable(_profiled_views(True)) == comparable(_profiled_views(False))
