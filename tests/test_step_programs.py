"""Step programs: a planned loop traces steps 0 and 1 and replays the rest on arrays.

What must hold: a replayed loop's gradients are bitwise those of the same loop recorded step by
step (``trace=False``), for every loop strategy and storage, on the built-in models, in float32
and float64; a step that a replay could not repeat exactly is recorded instead, with the reason
in the loop's ``mode``; the profiler sees the same saved values, peaks and re-run counts.
"""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.function import Function
from checkpoint_ad.profiler import profile
from checkpoint_ad.strategies import (
    Binomial,
    Periodic,
    Quantized,
    Recompute,
    StoreInputs,
    StoreOutputs,
)
from checkpoint_ad.strategies.loops import program_cache

MODELS = ["rnn", "lstm", "residual_mlp", "heat", "neural_ode"]
PLANS = [
    ("binomial-2", Binomial(2), None),
    ("binomial-5", Binomial(5), None),
    ("periodic-3", Periodic(3), None),
    ("recompute", Recompute(), None),
    ("binomial-3-int8-snapshots", Binomial(3, storage=Quantized(8)), None),
    ("binomial-3-store-inputs", Binomial(3), StoreInputs()),
    ("periodic-4-store-outputs", Periodic(4), StoreOutputs()),
    ("binomial-4-int8-steps", Binomial(4), Quantized(8)),
]


def _model_run(name, dtype, loop, storage, trace):
    from checkpoint_ad.models import build

    # a first call: an earlier test's program for the same step code may fit this one (a
    # built-in model's step, its constants equal by value while the earlier ones live), and
    # would be reused rather than traced, depending on when the collector ran
    program_cache.clear()
    model = build(name, dtype=dtype)
    loops = []

    def run_scan(step, init, xs):
        # rows not batched (`hoisted_rows.py`): the replay itself is what is compared
        carry, ys = cad.scan(step, init, xs, strategy=loop, trace=trace, batch_rows=False)
        loops.append(carry)
        return carry, ys

    if storage is not None:
        with cad.use(storage):
            loss = model.run(run_scan)
    else:
        loss = model.run(run_scan)
    modes = [_loop_of(c).mode for c in loops]
    grads = cad.grad(loss, model.params)
    return loss.item(), [g.numpy() for g in grads], modes


def _loop_of(carry):
    leaf = carry if isinstance(carry, cad.Tensor) else next(
        t for t in (carry.values() if isinstance(carry, dict) else carry)
        if isinstance(t, cad.Tensor)
    )
    return leaf.grad_fn.op


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("name", "loop", "storage"), PLANS, ids=[p[0] for p in PLANS])
def test_replayed_models_match_recorded_bitwise(model, name, loop, storage, dtype):
    loss, got, modes = _model_run(model, dtype, loop, storage, trace=True)
    ref_loss, ref, ref_modes = _model_run(model, dtype, loop, storage, trace=False)
    assert modes and all(m == "replayed" for m in modes), modes
    assert all(m == "recorded: trace=False" for m in ref_modes)
    assert loss == ref_loss
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype
        np.testing.assert_array_equal(g, r)


# ----------------------------------------------------------------- refusals
def _rnn(seed=0, T=9, B=3, H=4):
    rng = np.random.default_rng(seed)
    w = cad.tensor(rng.standard_normal((H, H)) * 0.4, requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((B, H)), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((T, B, H)), requires_grad=True)
    return w, h0, xs


def _grads(step, strategy, trace=True):
    w, h0, xs = _rnn()
    carry, ys = cad.scan(lambda h, x: step(h, x, w), h0, xs, strategy=strategy, trace=trace)
    loss = (carry * carry).sum() + ys.sum()
    mode = _loop_of(carry).mode if strategy is not None else None
    return [g.numpy() for g in cad.grad(loss, [w, h0, xs])], mode


class _Double(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _reads_item(h, x, w):
    scale = 0.5 if float((h * h).sum().detach().item()) > 1.0 else 0.25
    h = cad.tanh(h @ w * scale + x)
    return h, h


def _python_control_flow(h, x, w):
    h = cad.tanh(h @ w + x)
    if bool((h.sum() > 0).detach()):
        h = h * 1.5
    return h, h


def _fresh_outside_data(h, x, w):
    noise = cad.tensor(np.random.default_rng().standard_normal(h.shape[-1]))
    h = cad.tanh(h @ w + x + noise * 0.0)
    return h, h


def _hook_inside(h, x, w):
    h = cad.tanh(h @ w + x)
    if h.requires_grad:  # steps a plan runs without a tape have no graph to hook
        h.register_hook(lambda g: g)
    return h, h


def _in_place(h, x, w):
    h = cad.tanh(h @ w + x) * 1.0
    h.mul_(0.5)
    return h, h


def _custom_function(h, x, w):
    h = _Double.apply(cad.tanh(h @ w + x))
    return h, h


def _nested_loop(h, x, w):
    inner, _ = cad.scan(lambda c, _x: (cad.tanh(c @ w), None), h, length=3,
                        strategy=Binomial(1))
    h = inner + x
    return h, h


REFUSED = [
    (_reads_item, "reads a tensor's values"),
    (_python_control_flow, "reads a tensor's values"),
    (_fresh_outside_data, "values change from step to step"),
    (_hook_inside, "hook"),
    (_in_place, "in place"),
    (_custom_function, "not a primitive"),
    (_nested_loop, "not a primitive"),
]


@pytest.mark.parametrize(("step", "why"), REFUSED, ids=[s.__name__ for s, _ in REFUSED])
def test_steps_a_replay_cannot_repeat_are_recorded_and_still_exact(step, why):
    np.random.seed(0)
    reference, _ = _grads(step, None)
    np.random.seed(0)
    got, mode = _grads(step, Binomial(2))
    assert mode.startswith("recorded: the step") and why in mode, mode
    if step is not _fresh_outside_data:  # its values differ from run to run by design
        for g, r in zip(got, reference):
            np.testing.assert_array_equal(g, r)


def test_trace_false_records_and_says_so():
    def step(h, x, w):
        h = cad.tanh(h @ w + x)
        return h, h

    got, mode = _grads(step, Binomial(2), trace=False)
    replayed, replay_mode = _grads(step, Binomial(2))
    assert mode == "recorded: trace=False" and replay_mode == "replayed"
    for g, r in zip(got, replayed):
        np.testing.assert_array_equal(g, r)


def test_constants_made_inside_the_step_replay_when_they_do_not_change():
    def step(h, x, w):
        bias = cad.tensor(np.linspace(-1.0, 1.0, h.shape[-1]))
        h = cad.tanh(h @ w + x + bias * 0.5)
        return h, h

    reference, _ = _grads(step, None)
    got, mode = _grads(step, Periodic(3))
    assert mode == "replayed"
    for g, r in zip(got, reference):
        np.testing.assert_array_equal(g, r)


def test_detach_inside_the_step_replays_without_a_gradient_path():
    def step(h, x, w):
        h = cad.tanh(h @ w + x) + h.detach() * 0.1
        return h, h

    reference, _ = _grads(step, None)
    got, mode = _grads(step, Binomial(3))
    assert mode == "replayed"
    for g, r in zip(got, reference):
        np.testing.assert_array_equal(g, r)


# ----------------------------------------------------------------- the backward's corners
def test_retain_graph_and_anomaly_mode_and_leaf_hooks_stay_exact():
    def step(h, x, w):
        h = cad.tanh(h @ w + x)
        return h, h

    reference, _ = _grads(step, None)
    w, h0, xs = _rnn()
    carry, ys = cad.scan(lambda h, x: step(h, x, w), h0, xs, strategy=Binomial(2))
    loss = (carry * carry).sum() + ys.sum()
    first = [g.numpy() for g in cad.grad(loss, [w, h0, xs], retain_graph=True)]
    with cad.detect_anomaly():
        second = [g.numpy() for g in cad.grad(loss, [w, h0, xs], retain_graph=True)]
    seen = []
    w.register_hook(lambda g: seen.append(1))
    third = [g.numpy() for g in cad.grad(loss, [w, h0, xs])]
    assert _loop_of(carry).mode == "replayed" and seen
    for got in (first, second, third):
        for g, r in zip(got, reference):
            np.testing.assert_array_equal(g, r)


def test_the_profiler_sees_a_replayed_loop_as_a_recorded_one():
    def run(trace, storage):
        w, h0, xs = _rnn(T=12)
        with profile() as prof:
            with cad.use(storage):
                carry, ys = cad.scan(lambda h, x: (cad.tanh(h @ w + x),) * 2, h0, xs,
                                     strategy=Binomial(3), trace=trace)
            ((carry * carry).sum() + ys.sum()).backward()
        assert _loop_of(carry).mode == ("replayed" if trace else "recorded: trace=False")
        return prof

    for storage in (cad.strategies.KeepAll(), Quantized(8)):
        replayed, recorded = run(True, storage), run(False, storage)
        rows = [[(r.op, r.role, r.shape, r.stored_bytes, r.origin, r.phase, r.owned)
                 for r in p.records] for p in (replayed, recorded)]
        assert rows[0] == rows[1]
        assert replayed.peak_tape_bytes == recorded.peak_tape_bytes
        assert replayed.aliased_bytes == recorded.aliased_bytes
        assert replayed.primitives == recorded.primitives
        assert replayed.recomputed_primitives == recorded.recomputed_primitives > 0


def test_engine_randomness_is_drawn_again_by_replays():
    from checkpoint_ad.nn import functional as F

    def run(strategy, trace=True):
        cad.random.manual_seed(3)
        w, h0, xs = _rnn(T=11)

        def step(h, x):
            h = cad.tanh(F.dropout(h @ w, 0.3) + x + cad.randn(h.shape[-1]) * 0.1)
            return h, h

        carry, ys = cad.scan(step, h0, xs, strategy=strategy, trace=trace)
        grads = cad.grad((carry * carry).sum() + ys.sum(), [w, h0, xs])
        mode = _loop_of(carry).mode if strategy is not None else None
        return [carry.numpy()] + [g.numpy() for g in grads], mode

    reference, _ = run(None)
    for strategy in (Binomial(3), Periodic(4), Recompute()):
        got, mode = run(strategy)
        recorded, _ = run(strategy, trace=False)
        assert mode == "replayed"
        for g, r, k in zip(got, reference, recorded):
            np.testing.assert_array_equal(g, r)
            np.testing.assert_array_equal(g, k)


def test_a_caller_generator_inside_the_step_is_not_frozen():
    gen = np.random.default_rng(5)

    def step(h, x, w):
        noise = cad.randn(h.shape[-1], generator=gen)
        h = cad.tanh(h @ w + x + noise * 0.0)
        return h, h

    _, mode = _grads(step, Binomial(2))
    assert mode.startswith("recorded: the step") and "change from step to step" in mode


def test_the_tape_table_says_how_each_loop_ran():
    w, h0, xs = _rnn()
    carry, _ = cad.scan(lambda h, x: (cad.tanh(h @ w + x), None), h0, xs, strategy=Binomial(2))
    recorded, _ = cad.scan(lambda h, x: (cad.tanh(h @ w + x), None), carry, xs,
                           strategy=Binomial(2), trace=False)
    table = cad.tape_of(recorded.sum()).table()
    assert "(replayed)" in table and "(recorded: trace=False)" in table
    assert [e.mode for e in cad.tape_of(recorded.sum()) if e.mode] == [
        "replayed", "recorded: trace=False"]
