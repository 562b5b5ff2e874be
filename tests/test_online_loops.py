"""Loops of unknown length: `scan(..., until=...)` and `while_loop` under an online plan give
gradients bitwise equal to the same loop kept whole, and cost the step evaluations the plan
promises (the offline optimum up to C(s + 2, 2) steps). JAX's `lax.while_loop` semantics."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.errors import ShapeError, StrategyConfigError
from checkpoint_ad.models.heat import HeatConfig, make_heat
from checkpoint_ad.models.rnn import RNNConfig, make_rnn
from checkpoint_ad.strategies import Binomial, Periodic, Recompute, optimal_evaluations

ONLINE = [None, Binomial(1), Binomial(2), Binomial(3), Binomial(5)]
RNG = np.random.default_rng(11)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def _grads(loss_fn, wrt):
    return [g.numpy() for g in cad.grad(loss_fn(), wrt)]


def _threshold(values, after=5):
    """A level first passed after `after` steps (the data decide where the loop stops)."""
    level = float(np.max(values[:after]))
    assert any(v > level for v in values[after:]), "pick other data: the loop would not stop"
    return level


@pytest.mark.parametrize("strategy", ONLINE[1:], ids=repr)
def test_rnn_step_with_xs_stops_on_a_data_dependent_condition(strategy):
    rng = np.random.default_rng(3)
    w = cad.tensor(rng.standard_normal((4, 4)) * 0.6, requires_grad=True)
    h0 = cad.tensor(rng.standard_normal(4), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((30, 4)), requires_grad=True)

    def step(h, x):
        new = cad.tanh(h @ w + x)
        return new, (new, cad.sin(h).sum())

    hs = cad.scan(step, h0, xs)[1][0].numpy()  # the trajectory decides the threshold
    threshold = _threshold(np.sin(hs).sum(axis=1))

    def until(h):
        return float(cad.sin(h).sum()) > threshold

    def run(s):
        carry, (hs, ss) = cad.scan(step, h0, xs, until=until, strategy=s)
        return carry, hs, ss

    carry, hs, ss = run(strategy)
    ref_carry, ref_hs, ref_ss = run(None)
    assert 5 < hs.shape[0] < 30 and hs.shape == ref_hs.shape and ss.shape == ref_ss.shape
    _same([carry.numpy(), hs.numpy()], [ref_carry.numpy(), ref_hs.numpy()])

    def loss(s):
        carry, hs, ss = run(s)
        return (carry * 3.0).sum() + (hs**2).sum() + ss.sum()

    got, want = _grads(lambda: loss(strategy), [w, h0, xs]), _grads(lambda: loss(None), [w, h0, xs])
    _same(got, want)
    assert not want[2][hs.shape[0] :].any()  # rows the loop never reached get zeros


@pytest.mark.parametrize("strategy", ONLINE[1:], ids=repr)
@pytest.mark.parametrize("structure", ["tuple", "dict"])
def test_structured_carries_without_xs_for_every_length(strategy, structure):
    # the step counter in the carry stops the loop: every n from 1 to 24 is a different plan
    a = cad.tensor(RNG.standard_normal((3, 3)) * 0.5, requires_grad=True)
    b = cad.tensor(RNG.standard_normal(3), requires_grad=True)

    def step(carry, _):
        h, c, t = (carry if structure == "tuple" else (carry["h"], carry["c"], carry["t"]))
        h2, c2 = cad.tanh(h @ a + c), c * 0.9 + cad.sin(h) * b
        new = (h2, c2, t + 1.0) if structure == "tuple" else {"h": h2, "c": c2, "t": t + 1.0}
        return new, None

    for n in range(1, 25):

        def stop(carry, n=n):
            t = carry[2] if structure == "tuple" else carry["t"]
            return t.item() >= n

        def loss(s, stop=stop):
            init = (b * 1.0, b * 2.0, cad.tensor(0.0))
            if structure == "dict":
                init = {"h": init[0], "c": init[1], "t": init[2]}
            carry, ys = cad.scan(step, init, until=stop, strategy=s)
            assert ys is None
            h, c = (carry[0], carry[1]) if structure == "tuple" else (carry["h"], carry["c"])
            return (h * c).sum() + (c**2).sum()

        _same(_grads(lambda: loss(strategy), [a, b]), _grads(lambda: loss(None), [a, b]))


@pytest.mark.parametrize("s", [1, 2, 3, 4])
def test_step_evaluations_are_the_offline_optimum_up_to_c_s_plus_2_2(s):
    w = cad.tensor(0.7, requires_grad=True)
    calls = [0]

    def step(carry, _):
        calls[0] += 1
        h, t = carry
        return (cad.sin(h * w) + 0.5, t + 1.0), None

    for n in range(1, comb(s + 2, 2) + 1):
        calls[0] = 0
        (h, _), _ = cad.scan(step, (w * 1.0, cad.tensor(0.0)), strategy=Binomial(s),
                             until=lambda c, n=n: c[1].item() >= n, trace=False)
        cad.grad(h, w)
        assert calls[0] == optimal_evaluations(n, s), (s, n)
        # replayed (steps 0 and 1 traced): the loop still counts every evaluation
        (h, _), _ = cad.scan(step, (w * 1.0, cad.tensor(0.0)), strategy=Binomial(s),
                             until=lambda c, n=n: c[1].item() >= n)
        cad.grad(h, w)
        assert h.grad_fn.op.evaluations == optimal_evaluations(n, s), (s, n)


@pytest.mark.parametrize("strategy", ONLINE[1:4], ids=repr)
def test_built_in_rnn_model_under_until(strategy):
    model = make_rnn(RNNConfig(steps=40, batch=2, hidden=5, dtype="float64", seed=2))
    _, ys = cad.scan(model.step, model.init_carry(), model.inputs())
    threshold = _threshold(np.abs(ys.numpy()))

    def loss(s):
        driver = lambda step, init, xs: cad.scan(
            step, init, xs, strategy=s, until=lambda h: abs(float(h.sum())) > threshold)
        return model.run(loop=driver)

    _same(_grads(lambda: loss(strategy), model.params), _grads(lambda: loss(None), model.params))


@pytest.mark.parametrize("strategy", ONLINE[1:4], ids=repr)
def test_built_in_heat_model_under_until(strategy):
    model = make_heat(HeatConfig(grid=6, steps=60, dtype="float64", seed=1))
    model.run()  # sets the diffusivity the steps capture
    _, ys = cad.scan(model.step, model.init_carry(), model.inputs())
    threshold = float(np.median(ys.numpy()))  # stop once the energy has decayed below it

    def loss(s):
        driver = lambda step, init, xs: cad.scan(
            step, init, xs, strategy=s, until=lambda u: float((u * u).sum()) * model.config.dt
            < threshold)
        return model.run(loop=driver)

    wrt = [*model.params]
    _same(_grads(lambda: loss(strategy), wrt), _grads(lambda: loss(None), wrt))


@pytest.mark.parametrize("strategy", ONLINE, ids=repr)
def test_randomness_and_retain_graph_in_an_online_loop(strategy):
    w = cad.tensor(RNG.standard_normal((4, 4)) * 0.5, requires_grad=True)
    h0 = cad.tensor(RNG.standard_normal(4), requires_grad=True)

    def step(carry, _):
        h, t = carry
        a = cad.nn.functional.dropout(cad.tanh(h @ w), 0.4)
        mask = cad.tensor(np.random.random_sample(a.shape) > 0.3, dtype="float64")
        return (a * mask + 0.1, t + 1.0), a

    def grads(s, seed=5):
        cad.random.manual_seed(seed)
        np.random.seed(seed)
        (h, _), ys = cad.scan(step, (h0, cad.tensor(0.0)), until=lambda c: c[1].item() >= 9,
                              strategy=s)
        loss = (h**2).sum() + (ys * 2.0).sum()
        first = cad.grad(loss, [w, h0], retain_graph=True)
        second = cad.grad(loss, [w, h0])
        _same([g.numpy() for g in first], [g.numpy() for g in second])
        return [g.numpy() for g in first]

    _same(grads(strategy), grads(None))
    assert not np.array_equal(grads(None, seed=6)[0], grads(None)[0])


@pytest.mark.parametrize("strategy", ONLINE, ids=repr)
def test_while_loop_matches_a_python_while_loop(strategy):
    x = cad.tensor(1.3, requires_grad=True)
    v = cad.tensor([0.5, 0.25], requires_grad=True)

    def body(carry):
        a, b = carry
        return a * x + cad.sin(b).sum(), b * 1.5

    y, b = cad.while_loop(lambda c: c[0].item() < 40.0, body, (x * 1.0, v), strategy=strategy)
    ref = (x * 1.0, v)
    while ref[0].item() < 40.0:
        ref = body(ref)
    assert y.item() == ref[0].item()
    _same([g.numpy() for g in cad.grad(y + b.sum(), [x, v])],
          [g.numpy() for g in cad.grad(ref[0] + ref[1].sum(), [x, v])])


def test_while_loop_that_never_runs_returns_its_input():
    init = (cad.tensor(5.0), {"k": cad.tensor(1.0)})
    assert cad.while_loop(lambda c: c[0].item() < 0, lambda c: c, init) is init


def test_until_and_the_end_of_xs_or_length_whichever_comes_first():
    double = lambda h, x: (h * 2.0 + x, h)
    xs = cad.tensor(np.zeros(4), dtype="float32")
    for s in (None, Binomial(2)):
        carry, ys = cad.scan(double, cad.tensor(1.0), xs, until=lambda h: h.item() > 100,
                             strategy=s)
        assert carry.item() == 16.0 and ys.shape == (4,)  # xs ran out first
        carry, ys = cad.scan(double, cad.tensor(1.0), xs, until=lambda h: h.item() > 3,
                             strategy=s)
        assert carry.item() == 4.0 and ys.numpy().tolist() == [1.0, 2.0]
        carry, ys = cad.scan(lambda h, _: (h + 1.0, None), cad.tensor(0.0), length=3,
                             until=lambda h: False, strategy=s)
        assert carry.item() == 3.0
        empty = cad.tensor(np.zeros(0), dtype="float32")
        carry, ys = cad.scan(double, cad.tensor(1.0), empty, until=bool, strategy=s)
        assert carry.item() == 1.0 and ys.shape == (0,)


def test_misuse_is_refused_with_what_to_do():
    step = lambda h, _: (h + 1.0, None)
    h = cad.tensor(0.0, requires_grad=True)
    with pytest.raises(ValueError, match="until="):
        cad.scan(step, h)
    with pytest.raises(TypeError, match="predicate"):
        cad.scan(step, h, length=3, until=3)
    for s in (Periodic(2), Recompute()):
        with pytest.raises(StrategyConfigError, match="Binomial"):
            cad.scan(step, h, until=lambda c: c.item() > 2, strategy=s)
    with pytest.raises(TypeError, match="callables"):
        cad.while_loop(True, lambda c: c, h)
    with pytest.raises(ShapeError):
        cad.scan(lambda c, _: (cad.stack([c, c]), None), h, until=lambda c: True,
                 strategy=Binomial(2), length=5)


@pytest.mark.parametrize("strategy", [Binomial(2, disk=3), Binomial(1, disk=1),
                                      Binomial(3, disk=None)], ids=repr)
def test_online_loops_with_a_disk_level_are_exact_and_keep_their_levels(strategy):
    from checkpoint_ad.strategies import Offload
    from checkpoint_ad.strategies.plans.revolve import simulate_plan

    rng = np.random.default_rng(7)
    w = cad.tensor(rng.standard_normal((5, 5)) * 0.4, requires_grad=True)
    h0 = cad.tensor(rng.standard_normal((3, 5)), requires_grad=True)

    def step(carry, _):
        h, t = carry
        h = cad.tanh(h @ w + 0.1)
        return (h, t + 1.0), h.sum()

    def grads(strategy, n=41):
        kwargs = ({"length": n} if strategy is None
                  else {"until": lambda c: c[1].item() >= n, "strategy": strategy})
        (h, _), ys = cad.scan(step, (h0, cad.tensor(0.0)), **kwargs)
        loop = h.grad_fn.op if strategy is not None else None
        return [g.numpy() for g in cad.grad((h * h).sum() + ys.sum(), [w, h0])], loop

    reference, _ = grads(None)
    got, loop = grads(strategy)
    for g, r in zip(got, reference):
        np.testing.assert_array_equal(g, r)
    stats = simulate_plan(loop.plan)
    assert stats.max_live_snapshots <= strategy.snapshots
    assert 0 < stats.max_live_disk_snapshots <= (strategy.disk or 64)
    assert Offload("disk").folder is None  # disk snapshots gone with the backward
