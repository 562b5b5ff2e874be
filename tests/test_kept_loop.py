"""A `scan` that keeps every step records steps 0 and 1 and replays the rest as one entry.

What must hold: its gradients are bitwise those of recording every step (``trace=False``) on
the built-in models, in float32 and float64, under every saved-value form; also where the
loop's inputs get gradients from elsewhere too (a weight used after the loop, a `.grad` left
by an earlier pass, `grad()`, a second backward); a step that cannot be replayed is recorded
like before; the profiler sees the same saved values and peaks.
"""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.profiler import profile
from checkpoint_ad.strategies import (
    Binomial,
    Periodic,
    Quantized,
    Recompute,
    Rematerializing,
    StoreInputs,
    StoreOutputs,
)

MODELS = ["rnn", "lstm", "residual_mlp", "heat", "neural_ode"]
FORMS = [None, StoreInputs(), StoreOutputs(), Quantized(8)]


def _loop_entries(output):
    return [e for e in cad.tape_of(output) if e.mode]


def _model_grads(name, dtype, storage, trace):
    from checkpoint_ad.models import build

    model = build(name, dtype=dtype)

    def run_scan(step, init, xs):  # rows not batched: the replay itself is compared
        return cad.scan(step, init, xs, trace=trace, batch_rows=False)

    if storage is not None:
        with cad.use(storage):
            loss = model.run(run_scan)
    else:
        loss = model.run(run_scan)
    modes = [e.mode for e in _loop_entries(loss)]
    return loss.item(), [g.numpy() for g in cad.grad(loss, model.params)], modes


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("storage", FORMS, ids=["keep", "store-inputs", "store-outputs", "int8"])
def test_keeping_every_step_replays_with_the_recorded_gradients(model, storage, dtype):
    loss, got, modes = _model_grads(model, dtype, storage, trace=True)
    ref_loss, ref, ref_modes = _model_grads(model, dtype, storage, trace=False)
    assert modes == ["replayed"] and ref_modes == []
    assert loss == ref_loss
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype
        np.testing.assert_array_equal(g, r)


def _problem(dtype=np.float64, T=9):
    rng = np.random.default_rng(1)
    w = cad.tensor(rng.standard_normal((5, 5)).astype(dtype) * 0.5, requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((3, 5)).astype(dtype), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((T, 3, 5)).astype(dtype), requires_grad=True)
    return w, h0, xs


def _loss(strategy, trace, how, dtype=np.float64):
    """A loop whose carry, weight and initial state also get gradients outside it: a weight
    used by two operations per step and after the loop, the initial carry used after it."""
    w, h0, xs = _problem(dtype)
    shifted = w * 1.0001  # a captured non-leaf

    def step(h, x):
        a = h @ shifted
        return cad.tanh(a + h * x + a * h), h

    h, ys = cad.scan(step, h0, xs, strategy=strategy, trace=trace)
    loss = (h @ shifted).sum() + (ys**2).sum() + (h0 * shifted[2]).sum() + (h0**3).sum()
    if how == "grad":
        return [g.numpy() for g in cad.grad(loss, [w, h0, xs])]
    if how == "twice":
        loss.backward(retain_graph=True)
        loss.backward()
    else:  # a .grad left by an earlier pass
        w.grad = cad.tensor(np.full((5, 5), 0.1, dtype=dtype))
        h0.grad = cad.tensor(np.full((3, 5), -0.3, dtype=dtype))
        loss.backward()
    return [t.grad.numpy() for t in (w, h0, xs)]


@pytest.mark.parametrize("how", ["backward", "grad", "twice"])
@pytest.mark.parametrize("strategy", [None, Binomial(2), Periodic(9), Periodic(4)],
                         ids=["keep-all", "binomial-2", "periodic-9", "periodic-4"])
@pytest.mark.parametrize("trace", [True, False])
def test_gradients_arriving_from_outside_the_loop_are_summed_as_a_plain_tape_sums(
        strategy, trace, how):
    reference = _loss(None, False, how)
    for got, ref in zip(_loss(strategy, trace, how), reference, strict=True):
        np.testing.assert_array_equal(got, ref)


def test_a_step_that_cannot_be_replayed_is_recorded_as_before():
    w, h0, xs = _problem()

    def step(h, x):
        scale = 0.5 if float((h * h).sum().detach().item()) > 1.0 else 0.25
        h = cad.tanh(h @ w * scale + x)
        return h, h

    carry, ys = cad.scan(step, h0, xs)
    loss = (carry * carry).sum() + ys.sum()
    assert _loop_entries(loss) == []  # every step recorded, no loop entry
    got = cad.grad(loss, [w, h0, xs])
    carry, ys = cad.scan(step, h0, xs, trace=False)
    ref = cad.grad((carry * carry).sum() + ys.sum(), [w, h0, xs])
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g.numpy(), r.numpy())


def _grad_in_step(trace, create_graph, strategy=None):
    """(loop mode, ys, w.grad) of a scan whose step takes a gradient, as JAX's
    `scan(lambda h, x: ... jax.grad(f)(w, x) ...)` does: the gradient (x, here) repeats on
    steps 0 and 1 and changes after, so a replay freezing it would show."""
    w = cad.tensor(np.array([0.5, -0.3]), requires_grad=True)

    def step(h, x):
        (g,) = cad.grad((w * x).sum(), [w], create_graph=create_graph)
        h = cad.tanh(h * w + g)
        return h, h

    xs = cad.tensor(np.array([[1.0, 2.0], [1.0, 2.0], [3.0, -1.0], [0.5, 0.2]]))
    with cad.inspect.loops() as ran:
        _, ys = cad.scan(step, cad.ones(2, dtype="float64"), xs, trace=trace,
                         strategy=strategy)
        ys.sum().backward()
    return ran[0].mode, ys.detach().numpy(), w.grad.numpy()


@pytest.mark.parametrize(("create_graph", "strategy"), [
    (False, None), (True, None), (False, Binomial(2)), (False, Recompute())], ids=repr)
def test_a_step_taking_a_gradient_is_recorded_and_says_so_like_jax_grad_inside_scan(
        create_graph, strategy):
    mode, ys, grad = _grad_in_step(True, create_graph, strategy)
    want_mode, want_ys, want_grad = _grad_in_step(False, create_graph, strategy)
    assert mode.startswith("recorded: the step computes a gradient (grad(), backward()")
    assert want_mode == "recorded: trace=False"
    np.testing.assert_array_equal(ys, want_ys)  # not the first steps' gradient, frozen
    np.testing.assert_array_equal(grad, want_grad)


def test_values_kept_by_a_rematerializing_pool_are_recorded():
    w, h0, xs = _problem()
    with cad.use(Rematerializing(10**9)):
        carry, _ = cad.scan(lambda h, x: (cad.tanh(h @ w + x), None), h0, xs)
    (mode,) = [e.mode for e in _loop_entries(carry.sum())] or ["no loop entry"]
    assert mode == "no loop entry"  # recorded step by step: the pool learns each entry


def test_short_loops_and_no_grad_record_and_nested_loops_replay_the_outer_only():
    w, h0, xs = _problem(T=2)
    carry, _ = cad.scan(lambda h, x: (cad.tanh(h @ w + x), None), h0, xs)
    assert _loop_entries(carry.sum()) == []
    w, h0, xs = _problem(T=6)
    inner_xs = cad.tensor(np.linspace(-1.0, 1.0, 60).reshape(4, 3, 5))

    def outer(h, x):  # the inner loop runs while the outer traces: recorded, into its program
        inner, _ = cad.scan(lambda g, y: (cad.tanh(g @ w + y), None), h, inner_xs)
        return inner * x, None

    carry, _ = cad.scan(outer, h0, xs)
    assert [e.mode for e in _loop_entries(carry.sum())] == ["replayed"]
    got = cad.grad(carry.sum(), [w, h0, xs])
    carry, _ = cad.scan(outer, h0, xs, trace=False)
    ref = cad.grad(carry.sum(), [w, h0, xs])
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g.numpy(), r.numpy())


def test_the_profiler_sees_a_replayed_loop_keeping_every_step_as_a_recorded_one():
    def run(trace, storage):
        w, h0, xs = _problem(np.float32, T=12)
        with profile() as prof:
            with cad.use(storage):
                carry, ys = cad.scan(lambda h, x: (cad.tanh(h @ w + x),) * 2, h0, xs,
                                     trace=trace)
            ((carry * carry).sum() + ys.sum()).backward()
        return prof

    for storage in (cad.strategies.KeepAll(), Quantized(8)):
        replayed, recorded = run(True, storage), run(False, storage)
        rows = [sorted((r.op, r.role, r.shape, r.stored_bytes, r.origin, r.owned)
                       for r in p.records if r.phase == "forward")
                for p in (replayed, recorded)]
        assert rows[0] == rows[1]
        assert replayed.peak_tape_bytes == recorded.peak_tape_bytes
        assert replayed.aliased_bytes == recorded.aliased_bytes


@pytest.mark.parametrize("strategy", [None, Binomial(2)], ids=["keep-all", "binomial-2"])
def test_higher_order_gradients_through_a_replayed_loop(strategy):
    """create_graph re-runs the loop with a tape: the first-order gradient (a weight also used
    after the loop) is bitwise the recorded one; the second order equals it to rounding."""
    def run(trace):
        w, h0, xs = _problem(T=7)
        h, ys = cad.scan(lambda h, x: (cad.tanh(h @ w + x),) * 2, h0, xs, strategy=strategy,
                         trace=trace)
        loss = (ys**2).sum() + (h @ w).sum()
        (g,) = cad.grad(loss, [w], create_graph=True)
        (hv,) = cad.grad((g * g).sum(), [w])
        return g.numpy(), hv.numpy()

    (g, hv), (g_ref, hv_ref) = run(True), run(False)
    np.testing.assert_array_equal(g, g_ref)
    np.testing.assert_allclose(hv, hv_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", [None, Periodic(16)], ids=["keep-all", "periodic-16"])
def test_a_replayed_loop_holds_no_full_precision_copy_of_what_it_compresses(strategy):
    """Under int8 storage the values a replayed loop keeps are its codes: it holds no more
    memory after its forward than recording every step does (measured by tracemalloc)."""
    import gc
    import tracemalloc

    def held(trace):
        rng = np.random.default_rng(0)
        w = cad.tensor(rng.standard_normal((128, 128)).astype(np.float32) * 0.1,
                       requires_grad=True)
        xs = cad.tensor(rng.standard_normal((32, 64, 128)).astype(np.float32))
        h0 = cad.zeros((64, 128), dtype="float32")
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            with cad.use(Quantized(8)):
                carry, ys = cad.scan(lambda h, x: (cad.tanh(h @ w + x), cad.sum(h)), h0, xs,
                                     strategy=strategy, trace=trace)
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        cad.grad(carry.sum() + ys.sum(), [w])
        return kept

    full_precision = 32 * 64 * 128 * 4  # every hidden state as float32
    one_carry = 64 * 128 * 4
    replayed, recorded = held(True), held(False)
    # the loop entry keeps its carry-in (for a create_graph re-run): for a replayed keep-all
    # that is the carry recorded step 1 made, which a recorded loop drops once it is packed
    assert replayed <= recorded * 1.05 + one_carry
    assert replayed < 0.6 * full_precision


@pytest.mark.parametrize("strategy", [None, Binomial(2), Binomial(3)],
                         ids=["keep-all", "binomial-2", "binomial-3"])
@pytest.mark.parametrize("steps", [1, 2, 7])
def test_hooks_and_retain_grad_on_the_final_carry_see_its_whole_gradient(strategy, steps):
    """A step returning its carry as an output: the final carry is also the last row of the
    outputs, so its hook and `.grad` see both uses, as with a plain recorded loop."""
    def run(trace):
        w, h0, xs = _problem(T=steps)
        h, ys = cad.scan(lambda h, x: (cad.tanh(h @ w + x),) * 2, h0, xs, strategy=strategy,
                         trace=trace)
        seen = []
        h.register_hook(lambda g: seen.append(g.numpy().copy()))
        h.retain_grad()
        ys.retain_grad()
        (ys.sum() * 2.0 + (h * h).sum()).backward()
        return [seen[0], h.grad.numpy(), ys.grad.numpy(), w.grad.numpy(), xs.grad.numpy()]

    reference = run(False) if strategy is None else None
    if reference is None:
        w, h0, xs = _problem(T=steps)  # the recorded keep-all loop is the reference
        h, ys = cad.scan(lambda h, x: (cad.tanh(h @ w + x),) * 2, h0, xs, trace=False)
        seen = []
        h.register_hook(lambda g: seen.append(g.numpy().copy()))
        h.retain_grad()
        ys.retain_grad()
        (ys.sum() * 2.0 + (h * h).sum()).backward()
        reference = [seen[0], h.grad.numpy(), ys.grad.numpy(), w.grad.numpy(), xs.grad.numpy()]
    for trace in (True, False):
        for got, ref in zip(run(trace), reference, strict=True):
            np.testing.assert_array_equal(got, ref)


class _CountingCopy(cad.strategies.Strategy):
    """A lossless packer (a copy) that counts what the backward sweep unpacks."""

    def __init__(self):
        self.unpacks = 0

    def for_leaf(self):
        return cad.strategies.KeepAll()  # as `Quantized`: the caller holds its parameters

    def pack(self, array):
        return array.copy()

    def unpack(self, stored):
        self.unpacks += 1
        return stored


@pytest.mark.parametrize("strategy", [None, Periodic(4), Binomial(3)],
                         ids=["keep", "periodic-4", "binomial-3"])
def test_a_carry_stored_packed_is_unpacked_once_by_the_two_steps_that_read_it(strategy):
    """h_t is saved by step t-1's tanh (its output) and step t's matmul (its input), in one
    buffer: each further step costs one unpack, not two, and the gradients stay keep-all's."""
    rng = np.random.default_rng(0)
    W = cad.tensor(rng.standard_normal((8, 8)) / 3, requires_grad=True)

    def run(storage, steps):
        xs = cad.tensor(np.random.default_rng(steps).standard_normal((steps, 4, 8)))

        def step(h, x):
            h = cad.tanh(h @ W + x)
            return h, h

        with cad.use(storage):
            _, ys = cad.scan(step, cad.zeros(4, 8, dtype="float64"), xs, strategy=strategy)
            return cad.grad(cad.sum(ys * ys), [W])[0].numpy()

    counts = []
    for steps in (16, 32):
        packer = _CountingCopy()
        np.testing.assert_array_equal(run(packer, steps), run(cad.strategies.KeepAll(), steps))
        counts.append(packer.unpacks)
    assert counts[1] - counts[0] == 16
