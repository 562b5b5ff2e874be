"""The three kinds of strategy: the engine dispatches on their types, each kind accepts a
user-written strategy, and bad arguments fail when a strategy is built."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import (
    Binomial,
    KeepAll,
    LoopStrategy,
    Periodic,
    Quantized,
    Recompute,
    RegionStrategy,
    Strategy,
)
from checkpoint_ad.strategies.plans import revolve

RNG = np.random.default_rng(3)


@dataclass(frozen=True)
class StoreEveryCarry(LoopStrategy):
    storage: Strategy | None = None

    def plan(self, n_steps):
        return revolve.store_all_plan(n_steps)


INT8 = Quantized(bits=8)


@dataclass(frozen=True)
class RecomputeFromInt8(RegionStrategy):
    storage: Strategy = INT8


def _loop_grads(strategy):
    w = cad.tensor(RNG.standard_normal((4, 4)) * 0.5, requires_grad=True)
    xs = cad.tensor(RNG.standard_normal((6, 4)))
    grads = []
    for strat in (None, strategy):
        carry, _ = cad.scan(lambda h, x: (cad.tanh(h @ w + x), None),
                            cad.tensor(np.ones(4)), xs, strategy=strat)
        grads.append(cad.grad((carry ** 2).sum(), [w])[0].numpy())
    return grads


def test_a_user_written_loop_strategy_runs_its_plan_and_is_exact():
    plain, planned = _loop_grads(StoreEveryCarry())
    np.testing.assert_array_equal(planned, plain)


@dataclass(frozen=True)
class ActionsAsAList(LoopStrategy):
    """A plan given as a plain list of actions (not a packed `Plan`)."""

    def plan(self, n_steps):
        return list(revolve.binomial_plan(n_steps, 2))


def test_a_loop_strategy_may_give_its_plan_as_a_list_of_actions():
    plain, planned = _loop_grads(ActionsAsAList())
    np.testing.assert_array_equal(planned, plain)


def test_a_user_written_region_strategy_stores_the_region_inputs_its_way():
    x = cad.tensor(RNG.standard_normal(2048), requires_grad=True)
    w = cad.tensor(0.5, requires_grad=True)
    results = {}
    for name, strategy in (("recompute", Recompute()), ("int8", RecomputeFromInt8())):
        with cad.profile() as prof:  # the forward: what the region holds until backward
            h = x * 2.0  # a non-leaf region input nothing else saves
            y = cad.checkpoint(lambda v: cad.sin(v) * w, h, strategy=strategy)
        gx, gw = cad.grad(y.sum(), [x, w])
        results[name] = (prof.timeline_bytes[-1], gx.numpy(), gw.numpy())
    assert results["recompute"][0] >= 2048 * 8  # h itself
    assert results["int8"][0] < 0.3 * results["recompute"][0]
    # d/dx of sin(2x) * w is 2 w cos(2x): an error of half a quantization step in 2x (a range
    # of at most 14 over 255 steps here) moves it by at most 2 w * 0.5 * 14 / 255
    np.testing.assert_allclose(results["int8"][1], results["recompute"][1], atol=14 / 255)
    assert not np.array_equal(results["int8"][1], results["recompute"][1])  # it is lossy


def test_use_dispatches_on_the_kind_and_refuses_other_objects():
    with cad.use(Binomial(2)):
        assert cad.strategies.current_loop_strategy() == Binomial(2)
    with cad.use(KeepAll()):
        assert cad.strategies.current_loop_strategy() is None
    with pytest.raises(TypeError, match="takes a strategy"), cad.use(object()):
        pass
    with pytest.raises(TypeError, match="region strategy"):
        cad.checkpoint(lambda v: v, cad.tensor(1.0, requires_grad=True), strategy=Binomial(2))
    with pytest.raises(TypeError, match="loop strategy"):
        cad.scan(lambda c, x: (c, None), cad.tensor(1.0), length=1, strategy="binomial")


@pytest.mark.parametrize("build", [
    lambda: Binomial(0),
    lambda: Binomial(True),
    lambda: Binomial(2.0),
    lambda: Binomial(2, storage="int8"),
    lambda: Periodic(0),
    lambda: Periodic(3, storage=8),
])
def test_loop_strategies_refuse_bad_arguments_when_built(build):
    with pytest.raises(cad.StrategyConfigError, match=r"Binomial|Periodic"):
        build()


def test_the_keep_all_preset_takes_the_engines_fast_path():
    from checkpoint_ad.presets import load_preset

    built = load_preset("keep-all").storage_strategy
    assert type(built) is KeepAll and built == cad.strategies.KeepAll()
    x = cad.tensor(np.ones(8), requires_grad=True)
    with cad.use(built):
        y = cad.tanh(x)
    (slot,) = y.grad_fn.slots
    assert slot.buffer.packed is y.data  # kept as is: no packing at all
