"""Hooks, `retain_grad()` and gradients taken inside a step of a checkpointed loop (`Binomial`,
`Periodic`, `Recompute`, `Budget`) behave as in the loop kept whole, as under PyTorch's
non-reentrant `torch.utils.checkpoint` and JAX's `grad` inside `lax.scan`; and a backward that
fails leaves every `.grad` as it was, so a retry gives exactly one pass's gradients."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.errors import BackwardError, StepNeedsTapeError
from checkpoint_ad.strategies import Binomial, Budget, Periodic, Recompute

N, HIDDEN = 6, 3
RNG = np.random.default_rng(11)
W0 = RNG.standard_normal((HIDDEN, HIDDEN)) * 0.5
H0 = RNG.standard_normal(HIDDEN)
X0 = RNG.standard_normal((N, HIDDEN))


def _leaves():
    w = cad.tensor(W0.copy(), requires_grad=True)
    h0 = cad.tensor(H0.copy(), requires_grad=True)
    return w, h0, cad.tensor(X0.copy())


def _leanest_budget(step, h0, xs):
    """A budget that only the leanest plan fits: one that re-runs steps in the backward."""
    table = cad.estimate(step, h0, xs, budget=Budget(1 << 40))
    return Budget(table.minimum_bytes)


def _strategies():
    return [Binomial(2), Periodic(2), Recompute(), "budget"]


def _resolve(strategy, step, h0, xs):
    return _leanest_budget(step, h0, xs) if strategy == "budget" else strategy


def _hooked_run(strategy, trace, backwards=1):
    """(W.grad, h0.grad, the gradients the step's hook saw, in firing order)."""
    w, h0, xs = _leaves()
    seen = []

    def step(h, x):
        z = h @ w + x
        z.register_hook(lambda g: seen.append(g.numpy().copy()))
        new = cad.tanh(z)
        return new, new * 2.0

    strategy = _resolve(strategy, step, h0, xs)
    seen.clear()  # (a budget's estimate ran the step: its hooks were dropped, but be sure)
    carry, ys = cad.scan(step, h0, xs, strategy=strategy, trace=trace)
    loss = (ys * ys).sum() + carry.sum()
    for _ in range(backwards):
        loss.backward(retain_graph=True)
    return w.grad.numpy(), h0.grad.numpy(), seen


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", _strategies(), ids=repr)
def test_hook_in_a_checkpointed_step_fires_once_per_step_like_torch_nonreentrant_checkpoint(
        strategy, trace):
    """PyTorch: a hook registered inside a non-reentrant `checkpoint` fires once per backward
    with the gradient of keeping the region; here, once per step, in the same order and with
    the same gradients (bitwise) as the loop kept whole, and the parameters' gradients too."""
    ref_w, ref_h0, ref_seen = _hooked_run(None, trace=False)
    w_grad, h0_grad, seen = _hooked_run(strategy, trace)
    assert len(ref_seen) == N
    assert len(seen) == N
    for got, want in zip(seen, ref_seen):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(w_grad, ref_w)
    np.testing.assert_array_equal(h0_grad, ref_h0)


def _input_hooked_run(strategy, on, trace, reverse):
    """(W.grad, h0.grad, xs.grad, what the hook on the step's carry or row saw): keeping
    every step, the carry is the previous step's output and the row a view of xs, so the
    hook sees (and halves) each one's whole gradient."""
    w, h0, _ = _leaves()
    xs = cad.tensor(X0.copy(), requires_grad=True)
    seen = []

    def step(h, x):
        (h if on == "carry" else x).register_hook(
            lambda g: seen.append(g.numpy().copy()) or g * 0.5)
        new = cad.tanh(h @ w + x * h)
        return new, new * 2.0

    strategy = _resolve(strategy, step, h0, xs)
    seen.clear()
    carry, ys = cad.scan(step, h0, xs, strategy=strategy, trace=trace, reverse=reverse)
    ((ys * ys).sum() + carry.sum()).backward()
    return w.grad.numpy(), h0.grad.numpy(), xs.grad.numpy(), seen


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("on", ["carry", "row"])
@pytest.mark.parametrize("strategy", _strategies(), ids=repr)
def test_hook_on_a_steps_carry_or_row_changes_the_gradient_like_a_python_loop(
        strategy, on, trace, reverse):
    """PyTorch: a hook registered on a tensor inside a non-reentrant checkpoint sees its
    gradient and its result flows on. A plan's re-run makes the step's carry and row leaves
    of their own; their hooks still fire once per step, on the same gradients, and what
    they return reaches the earlier steps, xs and the weights bitwise as keeping every step
    (they were silently dropped)."""
    want = _input_hooked_run(None, on, False, reverse)
    got = _input_hooked_run(strategy, on, trace, reverse)
    assert len(want[3]) == N and len(got[3]) == N
    # the same gradients (the order rows' hooks fire in, between steps, is the sweep's)
    for g, r in zip(sorted(got[3], key=tuple), sorted(want[3], key=tuple)):
        np.testing.assert_array_equal(g, r)
    for g, r in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("strategy", [Binomial(2), Periodic(3)], ids=repr)
def test_hook_in_a_checkpointed_step_fires_once_per_step_in_each_backward_with_retain_graph(
        strategy):
    """PyTorch: with retain_graph, each backward fires a tensor's hook again, once."""
    ref_w, _, ref_seen = _hooked_run(None, trace=False, backwards=2)
    w_grad, _, seen = _hooked_run(strategy, trace=True, backwards=2)
    assert len(seen) == len(ref_seen) == 2 * N
    for got, want in zip(seen, ref_seen):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(w_grad, ref_w)


@pytest.mark.parametrize("strategy", [Binomial(2), Periodic(2)], ids=repr)
def test_hook_in_a_checkpointed_step_fires_once_under_create_graph(strategy):
    """PyTorch: a hook fires once per backward also when the backward makes a graph."""
    counts = []
    for chosen in (None, strategy):
        w, h0, xs = _leaves()
        fired = []

        def step(h, x, fired=fired, w=w):
            z = h @ w + x
            z.register_hook(lambda g: fired.append(1))
            return cad.tanh(z), None

        carry, _ = cad.scan(step, h0, xs, strategy=chosen)
        (gw,) = cad.grad(carry.sum(), [w], create_graph=True)
        counts.append(len(fired))
        assert gw.requires_grad
    assert counts == [N, N]


def test_a_hook_on_a_captured_leaf_fires_once_on_its_total_like_torch_accumulate_grad():
    """PyTorch: a leaf's hook fires once per backward, on the gradient summed over every
    use; a checkpointed loop's pull-backs of its segments do not fire it each."""
    totals = []
    for strategy in (None, Binomial(2), Periodic(2)):
        w, h0, xs = _leaves()
        seen = []
        w.register_hook(lambda g, seen=seen: seen.append(g.numpy().copy()))

        def step(h, x, w=w):
            new = cad.tanh(h @ w + x)
            return new, new

        _, ys = cad.scan(step, h0, xs, strategy=strategy)
        ys.sum().backward()
        assert len(seen) == 1
        np.testing.assert_array_equal(seen[0], w.grad.numpy())
        totals.append(seen[0])
    np.testing.assert_array_equal(totals[1], totals[0])
    np.testing.assert_array_equal(totals[2], totals[0])


def _retained_run(strategy, trace):
    w, h0, xs = _leaves()
    kept = []

    def step(h, x):
        z = h @ w + x
        z.retain_grad()
        kept.append(z)
        new = cad.tanh(z)
        return new, new

    strategy = _resolve(strategy, step, h0, xs)
    kept.clear()
    carry, ys = cad.scan(step, h0, xs, strategy=strategy, trace=trace)
    first = list(kept)  # the loop's forward: the tensors the caller holds
    assert len(first) == N
    ((ys * ys).sum() + carry.sum()).backward()
    return first, w.grad.numpy()


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", _strategies(), ids=repr)
def test_retain_grad_in_a_checkpointed_step_fills_the_tensor_the_forward_made(strategy, trace):
    """PyTorch: `retain_grad()` inside a non-reentrant `checkpoint` fills `.grad` of the
    tensor the forward returned to the caller, though the backward recomputes it; here the
    tensors the loop's forward made get the gradients of the loop kept whole, bitwise."""
    ref, ref_w = _retained_run(None, trace=False)
    got, w_grad = _retained_run(strategy, trace)
    for mine, want in zip(got, ref):
        assert mine.grad is not None
        np.testing.assert_array_equal(mine.grad.numpy(), want.grad.numpy())
    np.testing.assert_array_equal(w_grad, ref_w)


def _captured_retained_run(strategy, trace, nested):
    """`.grad` of a non-leaf the step captures, retained before the loop, and of its leaf."""
    w, h0, xs = _leaves()
    c = cad.tanh(w[0]) * 0.5
    c.retain_grad()

    def step(h, x):
        if nested:  # reached through a loop inside the step
            g, _ = cad.scan(lambda a, r: (a * c, None), h, cad.stack([x]))
        else:
            g = h * c
        return cad.tanh(g + x), None

    strategy = _resolve(strategy, step, h0, xs)
    carry, _ = cad.scan(step, h0, xs, strategy=strategy, trace=trace)
    carry.sum().backward()
    return c.grad.numpy(), w.grad.numpy()


@pytest.mark.parametrize("nested", [False, True], ids=["direct", "nested-loop"])
@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", _strategies(), ids=repr)
def test_retain_grad_on_a_captured_non_leaf_gives_its_total_like_torch(strategy, trace, nested):
    """PyTorch: ``c.retain_grad()`` before a loop fills c's `.grad` with its total gradient,
    once. A plan's backward pulls the loop back segment by segment; each segment's sweep
    reached c with the sum so far and filled `.grad` with it too (Recompute over 6 steps:
    several times the total), while c's leaf got the right gradient."""
    want = _captured_retained_run(None, False, nested)
    got = _captured_retained_run(strategy, trace, nested)
    for mine, ref in zip(got, want):
        np.testing.assert_array_equal(mine, ref)


def test_retain_grad_in_a_checkpointed_step_is_not_filled_by_grad_like_torch_autograd_grad():
    """PyTorch: `torch.autograd.grad` fills no `.grad`, retained tensors' included."""
    w, h0, xs = _leaves()
    kept = []

    def step(h, x):
        z = h @ w + x
        z.retain_grad()
        kept.append(z)
        return cad.tanh(z), None

    carry, _ = cad.scan(step, h0, xs, strategy=Binomial(2))
    cad.grad(carry.sum(), [w])
    assert all(z.grad is None for z in kept)


def _descending_run(strategy, trace, lr=0.3):
    """A step that descends an energy: h - lr * dE/dh, dE/dh taken with a graph."""
    w, h0, xs = _leaves()

    def step(h, x):
        energy = (cad.tanh(h @ w) ** 2).sum()
        (g,) = cad.grad(energy, [h], create_graph=True)
        new = cad.tanh(h - lr * g + x)
        return new, new

    strategy = _resolve(strategy, step, h0, xs)
    carry, ys = cad.scan(step, h0, xs, strategy=strategy, trace=trace)
    ((ys * ys).sum() + carry.sum()).backward()
    return w.grad.numpy(), h0.grad.numpy(), carry.numpy()


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", _strategies(), ids=repr)
def test_gradient_inside_a_checkpointed_step_matches_keep_all_like_jax_grad_in_scan(
        strategy, trace):
    """JAX: `jax.grad` inside the body of a `lax.scan` under `jax.checkpoint` differentiates
    like the plain scan; here bitwise the gradients (and carry) of keeping every step."""
    ref = _descending_run(None, trace=False)
    got = _descending_run(strategy, trace)
    for mine, want in zip(got, ref):
        np.testing.assert_array_equal(mine, want)


def test_gradient_inside_a_checkpointed_step_with_until_matches_keep_all():
    """JAX: a `while_loop`-like loop of descent steps; placed online, the same gradients."""
    results = []
    for strategy in (None, Binomial(2)):
        w, h0, _ = _leaves()

        def step(h, _, w=w):
            (g,) = cad.grad((cad.tanh(h @ w) ** 2).sum(), [h], create_graph=True)
            return h - 0.3 * g, None

        carry, _ = cad.scan(step, h0, length=N, strategy=strategy,
                            until=lambda h: False)
        carry.sum().backward()
        results.append((w.grad.numpy(), h0.grad.numpy()))
    for mine, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(mine, want)


def test_gradient_taken_by_a_later_step_only_says_what_to_do():
    """A step that takes a gradient only from its third call on runs without a tape there:
    the error says so and how to go on (keep-all runs it). (Recorded: a replay would repeat
    the traced steps 0 and 1, which take none.)"""
    w, h0, xs = _leaves()
    calls = [0]

    def step(h, x):
        calls[0] += 1
        if calls[0] >= 3:
            (g,) = cad.grad((h * h).sum(), [h], create_graph=True)
            h = h - 0.1 * g
        return cad.tanh(h @ w + x), None

    with pytest.raises(StepNeedsTapeError, match="take it in every step"):
        cad.scan(step, h0, xs, strategy=Binomial(2), trace=False)
    assert issubclass(StepNeedsTapeError, BackwardError)
    calls[0] = 0
    carry, _ = cad.scan(step, h0, xs)  # keeping every step: every step has its tape
    carry.sum().backward()


def test_hook_on_a_tensor_that_needs_no_grad_in_a_checkpointed_step_still_fails():
    """PyTorch: `register_hook` on a tensor that does not require grad raises; a planned
    loop raises too (from the step's first run with a tape)."""
    w, h0, xs = _leaves()

    def step(h, x):
        x.register_hook(lambda g: g)  # a row of xs, which needs no gradient
        return cad.tanh(h @ w + x), None

    with pytest.raises(BackwardError, match="does not require grad"):
        carry, _ = cad.scan(step, h0, xs, strategy=Binomial(2))
        carry.sum().backward()


# ----------------------------------------------------------------- transactional .grad
class _FailsOnce(cad.Function):
    """x * 3 whose backward raises on its first call (a flaky custom rule)."""

    failures = 0

    @staticmethod
    def forward(ctx, x):
        return x * 3.0

    @staticmethod
    def backward(ctx, g):
        if _FailsOnce.failures > 0:
            _FailsOnce.failures -= 1
            raise RuntimeError("a custom backward failed")
        return g * 3.0


@pytest.mark.parametrize("earlier", [None, 1.5])
def test_failed_backward_leaves_grad_untouched_and_retry_gives_one_pass(earlier):
    """Unlike PyTorch (which keeps what reached `.grad` before the error), a failed backward
    leaves every `.grad` as it was: W's term from (W*W).sum(), delivered before the failing
    rule is reached, is not in `.grad`, and a retry with retain_graph gives exactly the
    reference (not 2·ref + 2W)."""
    w = cad.tensor(W0.copy(), requires_grad=True)
    v = cad.tensor(H0.copy(), requires_grad=True)
    if earlier is not None:
        w.grad = cad.tensor(np.full_like(W0, earlier))
    before = None if w.grad is None else w.grad.numpy().copy()
    # recorded first, so the sweep reaches it after (W*W).sum() and v's term
    loss = _FailsOnce.apply(w).sum() + (w * w).sum() + (v * v).sum()
    _FailsOnce.failures = 1
    with pytest.raises(RuntimeError, match="custom backward failed"):
        loss.backward(retain_graph=True)
    assert v.grad is None
    if before is None:
        assert w.grad is None
    else:
        np.testing.assert_array_equal(w.grad.numpy(), before)
    loss.backward(retain_graph=True)
    reference = cad.tensor(W0.copy(), requires_grad=True)
    if earlier is not None:
        reference.grad = cad.tensor(np.full_like(W0, earlier))
    (_FailsOnce.apply(reference).sum() + (reference * reference).sum()).backward()
    np.testing.assert_array_equal(w.grad.numpy(), reference.grad.numpy())
    np.testing.assert_array_equal(v.grad.numpy(), 2 * H0)


def test_failed_leaf_hook_leaves_every_grad_untouched():
    """A leaf's hook that raises: no `.grad` is written, retained non-leaves' included."""
    w = cad.tensor(W0.copy(), requires_grad=True)
    v = cad.tensor(H0.copy(), requires_grad=True)
    z = v * 2.0
    z.retain_grad()

    def refuse(g):
        raise ValueError("hook refused")

    w.register_hook(refuse)
    with pytest.raises(ValueError, match="hook refused"):
        ((w * w).sum() + (z * z).sum()).backward()
    assert w.grad is None and v.grad is None and z.grad is None


@pytest.mark.parametrize("strategy", [None, Binomial(2), Periodic(2)], ids=repr)
def test_failure_inside_a_checkpointed_loops_backward_leaves_grad_untouched(strategy):
    """A rule failing while the backward re-runs a loop's steps (after W got its term from
    after the loop): no `.grad` changes, and the retry with retain_graph gives the loop's
    gradients exactly, as keeping every step without a failure does."""

    def run(failures):
        w, h0, xs = _leaves()
        kept = []

        def step(h, x):
            z = _FailsOnce.apply(h @ w) + x
            z.retain_grad()
            kept.append(z)
            new = cad.tanh(z)
            return new, new

        carry, ys = cad.scan(step, h0, xs, strategy=strategy)
        first = list(kept)
        loss = ys.sum() + (w * w).sum() + (carry * carry).sum()
        _FailsOnce.failures = failures
        if failures:
            with pytest.raises(RuntimeError, match="custom backward failed"):
                loss.backward(retain_graph=True)
            assert w.grad is None and h0.grad is None
            assert all(z.grad is None for z in first)
        loss.backward(retain_graph=True)
        return [w.grad.numpy(), h0.grad.numpy()] + [z.grad.numpy() for z in first]

    _FailsOnce.failures = 0
    reference = run(0)
    for got, want in zip(run(1), reference):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("strategy", _strategies(), ids=repr)
def test_hook_on_step_0s_carry_is_a_hook_on_the_callers_tensor_like_a_python_loop(
        strategy, trace):
    """A Python loop hands step 0 the caller's tensor itself: a hook registered on it there
    is that tensor's hook, which sees its whole gradient (its uses outside the loop too)
    once per backward. A plan's step 0 runs on a copy; its hook goes to the caller's."""
    def run(strategy):
        w, _, xs = _leaves()
        h0 = cad.tensor(H0.copy(), requires_grad=True)
        a = h0 * 2.0
        seen, first = [], [True]

        def step(h, x):
            if first[0]:
                first[0] = False
                h.register_hook(lambda g: seen.append(g.numpy().copy()) or g * 0.5)
            new = cad.tanh(h @ w + x)
            return new, None

        strategy = _resolve(strategy, step, a, xs)
        seen.clear()
        first[0] = True
        carry, _ = cad.scan(step, a, xs, strategy=strategy, trace=trace)
        (carry.sum() + (a * a).sum()).backward()
        return seen, h0.grad.numpy(), w.grad.numpy()

    want, got = run(None), run(strategy)
    assert len(want[0]) == len(got[0]) == 1
    np.testing.assert_array_equal(got[0][0], want[0][0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("inner", [Periodic(2), Binomial(1), None], ids=repr)
@pytest.mark.parametrize("outer", [Binomial(2), Recompute(), None], ids=repr)
def test_hook_on_a_nested_loops_step_0_carry_fires_as_in_nested_python_loops(outer, inner):
    """The inner loop's step 0 hooks the outer step's tensor it was given: once per outer
    step and backward, however often either plan runs its steps again."""
    def run(outer, inner):
        w, h0, xs = _leaves()
        seen, first = [], [False]

        def inner_step(h, x):
            if first[0]:  # the inner loop's step 0, in whichever run of the outer step
                first[0] = False
                h.register_hook(lambda g: seen.append(g.numpy().copy()))
            return cad.tanh(h @ w + x), None

        def outer_step(h, x):
            first[0] = True
            f, _ = cad.scan(inner_step, h * 1.0, cad.stack([x, x * 0.5]), strategy=inner,
                            trace=False)
            return f, None

        carry, _ = cad.scan(outer_step, h0, xs, strategy=outer, trace=False)
        carry.sum().backward()
        return seen, w.grad.numpy(), h0.grad.numpy()

    want, got = run(None, None), run(outer, inner)
    assert len(want[0]) == N and len(got[0]) == N
    for g, r in zip(sorted(got[0], key=tuple), sorted(want[0], key=tuple)):
        np.testing.assert_array_equal(g, r)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("inner", [False, True], ids=["direct", "inner loop"])
@pytest.mark.parametrize("strategy", [Binomial(1), Binomial(2)], ids=repr)
def test_hook_on_a_captured_leaf_in_a_loop_stopped_by_until_fires_once_per_step(
        strategy, inner):
    """A loop stopped by `until` tapes each step as it runs and lets all but the last tape
    go; the backward runs those steps again. A hook such a run registered on a captured
    leaf is taken back with its tape, so it fires once per step, as in a Python loop (it
    fired twice per re-run step, changing the gradient when it returns one)."""
    def run(strategy):
        c0 = cad.tensor(np.array([0.3, -0.2, 0.5]), requires_grad=True)
        h0 = cad.tensor(np.array([0.1, 0.2, 0.3]), requires_grad=True)
        seen = []

        def hooked(c, x):
            c.register_hook(lambda g: seen.append(1) or g * 0.5)
            return c * x, None

        def step(h, x):
            if inner:
                f, _ = cad.scan(hooked, c0, cad.stack([x]), strategy=Periodic(2), trace=False)
            else:
                f = hooked(c0, x)[0]
            return h * x + f, None

        f, _ = cad.scan(step, h0, cad.tensor(np.full((5, 3), 1.1)), strategy=strategy,
                        trace=False, until=lambda c: False)
        f.sum().backward()
        return len(seen), c0.grad.numpy(), h0.grad.numpy()

    want, got = run(None), run(strategy)
    assert want[0] == got[0] == 5
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("until", [False, True], ids=["known length", "until"])
@pytest.mark.parametrize("strategy", [Binomial(2), Periodic(2)], ids=repr)
def test_hook_on_a_captured_leaf_in_steps_drawing_from_numpy_fires_once_per_step(
        strategy, until):
    """Steps that draw from numpy's global random state make a plan take its forward's
    last tape again (to keep the state): the first take's hooks are taken back, so a hook
    on a captured leaf fires once per step, as in a Python loop."""
    if until and isinstance(strategy, Periodic):
        pytest.skip("Periodic plans loops of known length")

    def run(strategy):
        np.random.seed(3)
        c0 = cad.tensor(np.array([0.3, -0.2, 0.5]), requires_grad=True)
        h0 = cad.tensor(np.array([0.1, 0.2, 0.3]), requires_grad=True)
        seen = []

        def step(h, x):
            c0.register_hook(lambda g: seen.append(1) or g * 0.5)
            noise = cad.tensor(np.random.standard_normal(3) * 0.01)
            return h * x + c0 + noise, None

        kwargs = {"until": lambda c: False} if until else {}
        f, _ = cad.scan(step, h0, cad.tensor(np.full((5, 3), 1.1)), strategy=strategy,
                        trace=False, **kwargs)
        f.sum().backward()
        return len(seen), c0.grad.numpy(), h0.grad.numpy()

    want, got = run(None), run(strategy)
    assert want[0] == got[0] == 5
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
