"""Planned loops (`scan` under `Binomial`, `Periodic`, `Recompute`) give the gradients of the
same loop kept whole, in the corners where they used to be silently wrong: outputs that alias
the carry, randomness in a step, inputs changed in place, second backwards, retries after an
error, and second derivatives. Each test names the behaviour of JAX or PyTorch it matches."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import Binomial, Periodic, Recompute

PLANNED = [Binomial(1), Binomial(2), Binomial(3), Periodic(2), Periodic(3), Recompute()]
RNG = np.random.default_rng(7)


def _inputs(n=6, hidden=4):
    w = cad.tensor(RNG.standard_normal((hidden, hidden)) * 0.5, requires_grad=True)
    h0 = cad.tensor(RNG.standard_normal(hidden), requires_grad=True)
    xs = cad.tensor(RNG.standard_normal((n, hidden)), requires_grad=True)
    return w, h0, xs


def _grads(step, w, h0, xs, strategy, seed=0, weights=None):
    cad.random.manual_seed(seed)
    np.random.seed(seed)
    carry, ys = cad.scan(step, h0, xs, strategy=strategy)
    leaves = [carry] + [y for y in (ys if isinstance(ys, tuple) else (ys,)) if y is not None]
    loss = sum(((leaf * (k + 1.0)) ** 2).sum() for k, leaf in enumerate(leaves))
    return [g.numpy() for g in cad.grad(loss, [w, h0, xs])]


def _assert_same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("strategy", PLANNED, ids=repr)
def test_an_output_that_is_the_new_carry_twice_adds_both_adjoints(strategy):
    """JAX: `lax.scan` with `return h, (h, h)` under `jax.checkpoint` equals the plain loop."""
    w, h0, xs = _inputs()

    def step(h, x):
        new = cad.tanh(h @ w + x)
        return new, (new, new)

    _assert_same(_grads(step, w, h0, xs, strategy), _grads(step, w, h0, xs, None))


@pytest.mark.parametrize("strategy", PLANNED, ids=repr)
def test_outputs_that_alias_each_other_or_the_old_carry_add_up(strategy):
    """PyTorch autograd: a tensor used twice receives the sum of both gradients."""
    w, h0, xs = _inputs()

    def step(h, x):
        y = cad.sin(h) * x
        return cad.tanh(h @ w + x), (y, y, h)

    _assert_same(_grads(step, w, h0, xs, strategy), _grads(step, w, h0, xs, None))


@pytest.mark.parametrize("strategy", PLANNED, ids=repr)
def test_randomness_in_a_step_is_replayed(strategy):
    """PyTorch `checkpoint(preserve_rng_state=True)`: a dropout mask drawn in a re-run step
    is the one the first run drew, from the engine's generator and from numpy's state."""
    w, h0, xs = _inputs(n=7)

    def step(h, x):
        a = cad.nn.functional.dropout(cad.tanh(h @ w + x), 0.4)
        mask = cad.tensor(np.random.random_sample(a.shape) > 0.3, dtype="float64")
        return a * mask, a

    plain = _grads(step, w, h0, xs, None, seed=3)
    _assert_same(_grads(step, w, h0, xs, strategy, seed=3), plain)
    # the masks really are random: another seed gives another gradient
    assert not np.array_equal(_grads(step, w, h0, xs, None, seed=4)[0], plain[0])


def test_a_scan_draws_what_the_same_python_loop_draws():
    """PyTorch: checkpointing does not change what the program computes."""
    w, h0, xs = _inputs(n=5)

    def step(h, x):
        return cad.nn.functional.dropout(cad.tanh(h @ w + x), 0.5), None

    cad.random.manual_seed(11)
    h = h0
    for t in range(5):
        h, _ = step(h, xs[t])
    cad.random.manual_seed(11)
    carry, _ = cad.scan(step, h0, xs, strategy=Binomial(2))
    np.testing.assert_array_equal(carry.numpy(), h.numpy())


@pytest.mark.parametrize("strategy", [Binomial(2), Periodic(2), Recompute()], ids=repr)
@pytest.mark.parametrize("what", ["captured weight", "initial carry", "xs"])
def test_an_input_changed_in_place_after_the_loop_is_caught(strategy, what):
    """PyTorch: modifying a tensor saved for backward raises at backward (keep-all does)."""
    w, h0, xs = _inputs()
    h0_nonleaf = h0 * 1.0
    carry, _ = cad.scan(lambda h, x: (cad.tanh(h @ w + x), None), h0_nonleaf, xs,
                        strategy=strategy)
    loss = carry.sum()
    with cad.no_grad():
        {"captured weight": w, "initial carry": h0_nonleaf, "xs": xs}[what].mul_(2.0)
    with pytest.raises(cad.SavedValueModifiedError, match="modified in place"):
        loss.backward()


@pytest.mark.parametrize("strategy", PLANNED, ids=repr)
def test_retain_graph_and_a_persistent_tape_answer_twice(strategy):
    """PyTorch `backward(retain_graph=True)`; TensorFlow persistent `GradientTape`."""
    w, h0, xs = _inputs()

    def step(h, x):
        new = cad.tanh(h @ w + x)
        return new, new

    reference = _grads(step, w, h0, xs, None)
    carry, ys = cad.scan(step, h0, xs, strategy=strategy)
    loss = (carry ** 2).sum() + ((ys * 2.0) ** 2).sum()
    first = [g.numpy() for g in cad.grad(loss, [w, h0, xs], retain_graph=True)]
    second = [g.numpy() for g in cad.grad(loss, [w, h0, xs])]
    _assert_same(first, reference)
    _assert_same(second, reference)
    with pytest.raises(cad.BackwardError, match="retain_graph=True"):
        cad.grad(loss, [w])
    with cad.GradientTape(persistent=True) as tape:
        carry, _ = cad.scan(lambda h, x: (cad.tanh(h @ w + x), None), h0, xs, strategy=strategy)
        total = carry.sum()
    g1, g2 = tape.gradient(total, w).numpy(), tape.gradient(total, w).numpy()
    np.testing.assert_array_equal(g1, g2)


@pytest.mark.parametrize("strategy", PLANNED, ids=repr)
def test_a_step_that_raises_in_the_backward_leaves_the_loop_retryable(strategy):
    """PyTorch: an exception in backward leaves the graph usable for another attempt."""
    w, h0, xs = _inputs()
    calls = {"n": 0, "fail_at": None}

    def step(h, x):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("transient failure")
        return cad.tanh(h @ w + x), None

    reference = _grads(step, w, h0, xs, None)
    # recorded (trace=False): a replayed loop does not call the step again in backward
    carry, _ = cad.scan(step, h0, xs, strategy=strategy, trace=False)
    loss = ((carry * 1.0) ** 2).sum()
    if calls["n"] == len(xs) and isinstance(strategy, Binomial) and strategy.snapshots >= 6:
        pytest.skip("nothing is re-run")
    calls["fail_at"] = calls["n"] + 1  # the backward's first re-run
    with pytest.raises(RuntimeError, match="transient"):
        cad.grad(loss, [w, h0, xs], retain_graph=True)
    _assert_same([g.numpy() for g in cad.grad(loss, [w, h0, xs])], reference)


@pytest.mark.parametrize("strategy", [Binomial(2), Periodic(3), Recompute()], ids=repr)
def test_second_derivatives_through_a_planned_loop_equal_keep_all(strategy):
    """PyTorch `create_graph=True` through `checkpoint`; JAX `grad(grad(...))` of a remat."""
    w, h0, xs = _inputs(n=5)

    def hessian_vector(strat):
        carry, ys = cad.scan(lambda h, x: (cad.tanh(h @ w + x), cad.sin(h)), h0, xs,
                             strategy=strat)
        loss = (carry ** 2).sum() + ys.sum()
        (gw,) = cad.grad(loss, [w], create_graph=True)
        return [g.numpy() for g in cad.grad((gw * gw).sum(), [w, h0, xs])]

    for a, b in zip(hessian_vector(strategy), hessian_vector(None)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_reverse_scans_from_the_last_row_and_keeps_ys_aligned():
    """JAX `lax.scan(..., reverse=True)`: ys[t] belongs to xs[t]."""
    w, h0, xs = _inputs(n=5)

    def step(h, x):
        new = cad.tanh(h @ w + x)
        return new, new * 2.0

    h, rows = h0, {}
    for t in reversed(range(5)):
        h, rows[t] = step(h, xs[t])
    expected = cad.stack([rows[t] for t in range(5)])
    for strategy in (None, Binomial(2)):
        carry, ys = cad.scan(step, h0, xs, strategy=strategy, reverse=True)
        np.testing.assert_array_equal(ys.numpy(), expected.numpy())
        np.testing.assert_array_equal(carry.numpy(), h.numpy())
        got = cad.grad((ys ** 2).sum() + carry.sum(), [w, xs])
        want = cad.grad((expected ** 2).sum() + h.sum(), [w, xs], retain_graph=True)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12)


def test_a_loop_of_no_steps_returns_empty_stacked_outputs():
    """JAX: `lax.scan` over a length-0 axis gives ys with a leading axis of 0."""
    carry, (ys, none) = cad.scan(lambda h, x: (h + x.sum(), (h * x, None)),
                                 cad.tensor(0.0, dtype="float64"), cad.zeros(0, 3))
    assert ys.shape == (0, 3) and ys.dtype == np.float64 and none is None
    assert carry.item() == 0.0
    _, ys = cad.scan(lambda c, x: (c, c), cad.tensor(1.0), length=0)
    assert ys.shape == (0,)


def test_a_carry_that_changes_shape_or_dtype_is_refused():
    """JAX: the carry must keep its type across steps."""
    with pytest.raises(cad.ShapeError, match="changed carry leaf 0 from float32"):
        cad.scan(lambda c, x: (c.astype("float64"), None), cad.tensor(1.0), length=2)
    with pytest.raises(cad.ShapeError, match="keep its shape"):
        cad.scan(lambda c, x: (cad.stack([c, c]), None), cad.tensor(1.0), length=2)


def test_planned_loops_in_threads_replay_each_threads_own_randomness():
    """PyTorch: each thread's generator is its own; checkpointing in threads stays exact."""
    w, h0, xs = _inputs(n=6)

    def step(h, x):
        return cad.nn.functional.dropout(cad.tanh(h @ w + x), 0.5), None

    def run(seed, strategy):
        cad.random.manual_seed(seed)
        carry, _ = cad.scan(step, h0, xs, strategy=strategy)
        return cad.grad(carry.sum(), [w])[0].numpy()

    expected = {seed: run(seed, None) for seed in range(4)}
    results: dict[int, list[np.ndarray]] = {}

    def worker(seed):
        results[seed] = [run(seed, Binomial(2)) for _ in range(10)]

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed, grads in results.items():
        for g in grads:
            np.testing.assert_array_equal(g, expected[seed])
