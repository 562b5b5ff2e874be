"""A `scan`'s tape entry guards the values its backward reads as recording every step does
(issue 38): a value changed in place after the loop either leaves the gradient right (the
backward does not read it) or raises the error recording raises, in every mode: keep-all
(replayed or recorded), `Binomial`, `Periodic`, `Recompute`, a `Budget`, reversed, stopped by
`until`. Each test names the PyTorch behaviour it matches; the reference is the loop recorded
step by step (keep-all, ``trace=False``) on values left alone."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import Binomial, Budget, Periodic, Recompute

STRATEGIES = {
    "keep-all": lambda: None,
    "binomial": lambda: Binomial(2),
    "periodic": lambda: Periodic(2),
    "recompute": lambda: Recompute(),
    "budget": lambda: Budget(600),
}
OPEN_ENDED = {"keep-all", "binomial", "budget"}  # plans that take loops stopped by `until`
MODES = [
    (name, trace, reverse, until)
    for name in STRATEGIES
    for trace in ((True,) if name == "budget" else (True, False))
    for reverse in (False, True)
    for until in ((False, True) if name in OPEN_ENDED else (False,))
]
KEEP_ALL = [m for m in MODES if m[0] == "keep-all"]


def _mode_id(mode):
    name, trace, reverse, until = mode
    return "-".join([name, "traced" if trace else "recorded"]
                    + (["reverse"] if reverse else []) + (["until"] if until else []))


_BUDGETS: list[Budget] = []
"""The budgets `_scan` ran under, latest last: what plan each chose is timing-dependent."""


def _scan(step, init, xs, mode):
    name, trace, reverse, until = mode
    kwargs = {"strategy": STRATEGIES[name](), "trace": trace, "reverse": reverse}
    if isinstance(kwargs["strategy"], Budget):
        _BUDGETS.append(kwargs["strategy"])
    if until:
        kwargs["until"] = lambda carry: False  # asked after every step; xs ends the loop
    return cad.scan(step, init, xs, **kwargs)


def _reference(program, mode):
    """The gradient of the loop recorded step by step, nothing changed in place."""
    return program(("keep-all", False, mode[2], False), change=False)


def _raises_or_right(program, mode, error=cad.SavedValueModifiedError):
    """Run `program` (which changes a value in place after the loop): it raises `error` or
    gives the reference gradient. Returns whether it raised."""
    try:
        got = program(mode, change=True)
    except error as exc:
        assert "modified in place" in str(exc) or "in place" in str(exc)
        return True
    np.testing.assert_array_equal(got, _reference(program, mode))
    return False


# ----------------------------------------------------------------- the final carry
def _tanh_carry(mode, change):
    w = cad.tensor(0.5, requires_grad=True)
    h, ys = _scan(lambda h, x: (cad.tanh(h * w + x),) * 2, cad.tensor(0.1), cad.ones(5), mode)
    if change:
        h.mul_(2.0)
    ys.sum().backward()
    return w.grad.numpy()


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_inplace_on_scan_carry_after_scan_raises_like_pytorch_saved_tensor_check(mode):
    """PyTorch: ``h = tanh(...)`` saved for backward, then ``h.mul_(2)``, raises "one of the
    variables needed for gradient computation has been modified by an inplace operation"."""
    raised = _raises_or_right(_tanh_carry, mode)
    if mode[0] != "budget":  # (a budget may pick tanh's store-inputs form: nothing to catch)
        assert raised


@pytest.mark.parametrize("mode", KEEP_ALL, ids=_mode_id)
def test_scan_carry_error_names_the_loop_entry_and_the_value(mode):
    """The error says which entry saved which value, as a tape's does."""
    with pytest.raises(cad.SavedValueModifiedError) as caught:
        _tanh_carry(mode, change=True)
    message = str(caught.value)
    assert ("scan[keep-all]" in message and "final carry" in message) or "'tanh'" in message


def _affine_carry(mode, change):
    w = cad.tensor(0.5, requires_grad=True)
    h, ys = _scan(lambda h, x: (h * w + x, h * w), cad.tensor(0.1), cad.ones(5), mode)
    if change:
        h.mul_(2.0)
    ys.sum().backward()
    return w.grad.numpy()


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_scan_carry_changed_in_place_that_no_backward_reads_keeps_the_gradient(mode):
    """PyTorch: changing a tensor no backward saved is allowed and changes no gradient."""
    assert not _raises_or_right(_affine_carry, mode)


# ----------------------------------------------------------------- xs
def _xs_program(step):
    def program(mode, change):
        w = cad.tensor(0.5, requires_grad=True)
        xs = cad.tensor(np.linspace(0.1, 1.0, 10).reshape(5, 2).astype(np.float32))
        _, ys = _scan(lambda h, x: (step(h, w, x),) * 2, cad.ones(2), xs, mode)
        if change:
            xs.mul_(3.0)
        ys.sum().backward()
        return w.grad.numpy()
    return program


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_inplace_on_xs_after_scan_raises_like_pytorch_view_version_check(mode):
    """PyTorch: ``for x in xs`` gives views sharing xs's version counter; a row saved by
    ``tanh(h*w) * x`` is caught when xs changes in place before the backward."""
    assert _raises_or_right(_xs_program(lambda h, w, x: cad.tanh(h * w) * x), mode)


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_xs_changed_after_scan_that_saved_no_row_keeps_the_gradient_or_raises(mode):
    """PyTorch: rows only added (nothing saved) may change; a plan that re-runs steps reads
    them again, so it must raise rather than differentiate other values."""
    _BUDGETS.clear()
    raised = _raises_or_right(_xs_program(lambda h, w, x: cad.tanh(h * w) + x), mode)
    if mode[0] == "keep-all" or (mode[0] == "budget" and not _budget_reran(_BUDGETS[-1])):
        assert not raised  # nothing re-run: as recording, no error


def _budget_reran(budget: Budget) -> bool:
    """Whether the plan `budget` chose for its last loop re-runs steps: it picks the fastest
    plan that fits, and on a tiny loop which is fastest is the machine's noise."""
    chosen = budget.last.chosen
    return chosen.evaluations > budget.last.n_steps


# ----------------------------------------------------------------- captured tensors
def _captured_program(make, step):
    def program(mode, change):
        w = cad.tensor(0.5, requires_grad=True)
        c = make(w)
        _, ys = _scan(lambda h, x: (step(h, w, c, x),) * 2, cad.tensor(0.1), cad.ones(5), mode)
        if change:
            with cad.no_grad():
                c.mul_(3.0)
        ys.sum().backward()
        return w.grad.numpy()
    return program


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_inplace_on_captured_non_leaf_after_scan_raises_like_pytorch(mode):
    """PyTorch: ``w2 = w * 2`` saved by ``h * w2``, then changed in place, raises."""
    program = _captured_program(lambda w: w * 2, lambda h, w, c, x: cad.tanh(h * c + x))
    assert _raises_or_right(program, mode)


@pytest.mark.parametrize("make", [lambda w: w * 2, lambda w: cad.tensor(0.3)],
                         ids=["non-leaf", "constant"])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_captured_tensor_only_added_may_change_unless_steps_are_rerun(make, mode):
    """PyTorch: a tensor only added is not saved and may change; a plan that re-runs the
    steps reads it again and raises instead of differentiating another loop."""
    program = _captured_program(make, lambda h, w, c, x: cad.tanh(h * w + c))
    _BUDGETS.clear()
    raised = _raises_or_right(program, mode)
    if mode[0] == "keep-all" or (mode[0] == "budget" and not _budget_reran(_BUDGETS[-1])):
        assert not raised  # nothing re-run: as recording, no error


# ----------------------------------------------------------------- in place inside a step
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_inplace_on_step_row_of_leaf_xs_requiring_grad_raises_like_pytorch_view_of_leaf(mode):
    """PyTorch: an in-place op on a view of a leaf that requires grad raises; the caller's
    xs is left as it was."""
    xs = cad.tensor(np.ones((5, 2), np.float32), requires_grad=True)

    def step(h, x):
        x.mul_(2.0)
        return h + x, h

    with pytest.raises(cad.InplaceError):
        _scan(step, cad.zeros(2), xs, mode)
    np.testing.assert_array_equal(xs.detach().numpy(), np.ones((5, 2), np.float32))


def test_budget_dry_run_leaves_the_callers_xs_as_it_was():
    """The dry run runs steps on copies of the rows it reads: xs ends as keep-all leaves it."""
    xs = cad.tensor(np.ones((5, 2), np.float32))

    def step(h, x):
        x.mul_(2.0)
        return h + x, h

    cad.scan(step, cad.zeros(2), xs)
    expected = xs.numpy().copy()
    budgeted = cad.tensor(np.ones((5, 2), np.float32))
    cad.scan(step, cad.zeros(2), budgeted, strategy=Budget(600))
    np.testing.assert_array_equal(budgeted.numpy(), expected)


def test_inplace_on_a_step_row_changes_only_that_row_version():
    """A step changing its own row in place leaves the rows other steps saved valid (their
    versions are their own), while xs changed after the loop reaches them all."""
    xs = cad.tensor(np.full((4, 2), 0.5, np.float32))
    w = cad.tensor(0.7, requires_grad=True)

    def step(h, x):
        x.mul_(2.0)  # before use: what the step saves is the doubled row
        return cad.tanh(h * w) * x, h

    h, _ = cad.scan(step, cad.ones(2), xs, trace=False)
    h.sum().backward()
    expected = w.grad.numpy()
    np.testing.assert_array_equal(xs.numpy(), np.ones((4, 2), np.float32))
    w.grad = None
    xs2 = cad.tensor(np.full((4, 2), 0.5, np.float32))
    h, _ = cad.scan(step, cad.ones(2), xs2, trace=False)
    xs2.add_(1.0)
    with pytest.raises(cad.SavedValueModifiedError):
        h.sum().backward()
    assert np.isfinite(expected).all()


# ----------------------------------------------------------------- requires_grad of outputs
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_carry_that_needs_no_grad_comes_back_without_history_like_pytorch(mode):
    """PyTorch: a result computed from tensors that need no gradient has
    ``requires_grad=False`` (and converts to numpy) whatever loop computed it."""
    w = cad.tensor(0.5, requires_grad=True)
    k, ys = _scan(lambda h, x: (h * 2, h * w), cad.tensor(1.0), cad.ones(5), mode)
    assert not k.requires_grad and k.grad_fn is None
    assert ys.requires_grad
    assert float(np.asarray(k)) == 32.0
    ys.sum().backward()
    ref_w = cad.tensor(0.5, requires_grad=True)
    _, ref = cad.scan(lambda h, x: (h * 2, h * ref_w), cad.tensor(1.0), cad.ones(5), trace=False)
    ref.sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), ref_w.grad.numpy())


@pytest.mark.parametrize("n", [5, 6])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_carry_leaves_that_swap_need_grad_as_recording_says(mode, n):
    """A carry whose leaves swap each step: which one needs grad at the end depends on the
    parity of the steps run, as recording each step finds."""
    def step(carry, x):
        a, b = carry
        return (b * 1.0, a * x), a

    def run(m):
        a0 = cad.tensor(1.0, requires_grad=True)
        (a, b), ys = _scan(step, (a0, cad.tensor(2.0)), cad.ones(n), m)
        return a.requires_grad, b.requires_grad, ys.requires_grad

    assert run(mode) == run(("keep-all", False, False, False))


# ----------------------------------------------------------------- what a budget's dry run touches
def _counting_step(counter, w):
    def step(h, x):
        counter.add_(1.0)
        return cad.tanh(h * w + x), h
    return step


def test_budget_dry_run_leaves_a_captured_tensor_as_it_was_and_says_why_it_refuses():
    """A plain PyTorch loop changes a captured ``counter.add_(1)`` once a step; a budget cannot
    price such a step by re-running it, so it refuses, with the counter as it was."""
    counter = cad.tensor(0.0)
    w = cad.tensor(0.5, requires_grad=True)
    with pytest.raises(cad.InplaceError, match="captures in place") as caught:
        cad.scan(_counting_step(counter, w), cad.tensor(0.1), cad.ones(5), strategy=Budget(600))
    assert "float32[]" in str(caught.value) and "strategy=None" in str(caught.value)
    assert float(counter.numpy()) == 0.0 and counter.version == 0


def test_budget_dry_run_leaves_the_callers_initial_carry_as_it_was():
    """A step changing its carry in place changes the caller's initial carry once, as a plain
    loop does; the dry run runs it on a copy."""
    def step(h, x):
        h.add_(x)
        return h * 1.0, h * 2.0

    init = cad.ones(2)
    h, ys = cad.scan(step, init, cad.ones((5, 2)))
    expected = init.numpy(), h.numpy(), ys.numpy()
    init = cad.ones(2)
    try:  # (a plan tapes the step with a carry that requires grad: in place on it raises)
        h, ys = cad.scan(step, init, cad.ones((5, 2)), strategy=Budget(600))
    except cad.InplaceError:
        np.testing.assert_array_equal(init.numpy(), np.ones(2, np.float32))
        return
    for got, want in zip((init.numpy(), h.numpy(), ys.numpy()), expected):
        np.testing.assert_array_equal(got, want)


def test_a_disk_plans_timing_run_leaves_the_callers_xs_as_it_was():
    """``Binomial(disk=...)`` times step 0 to price its disk snapshots: on copies."""
    def step(h, x):
        x.mul_(2.0)
        return h + x, h

    def run(strategy):
        xs = cad.ones((5, 2))
        cad.scan(step, cad.zeros(2), xs, strategy=strategy, trace=False)
        return xs.numpy()

    np.testing.assert_array_equal(run(Binomial(1, disk=1)), run(None))


# ----------------------------------------------------------------- in place inside a step, re-run
def _raises_inplace_or_matches(program, mode):
    """`program(mode)` gives keep-all's result recorded step by step (``trace=False``), or
    raises `InplaceError` before a wrong gradient is handed out; True when it raised."""
    expected = program(("keep-all", False, mode[2], False))
    try:
        got = program(mode)
    except cad.InplaceError as exc:
        assert "in place" in str(exc)
        return True
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
    return False


def _row_changing(mode):
    w = cad.tensor(0.5, requires_grad=True)
    xs = cad.tensor(np.linspace(0.1, 1.0, 10).reshape(5, 2).astype(np.float32))

    def step(h, x):
        x.mul_(2.0)  # xs needs no grad: allowed, as on PyTorch's rows of such an xs
        return cad.tanh(h * w) * x, h

    h, ys = _scan(step, cad.ones(2), xs, mode)
    (h.sum() + ys.sum()).backward()
    return w.grad.numpy(), xs.numpy()


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_step_changing_its_row_in_place_gives_pytorchs_gradient_or_raises_where_steps_rerun(mode):
    """PyTorch: ``for x in xs: x.mul_(2)`` (xs needing no grad) changes each row once and
    differentiates the changed rows. A plan re-running a step would change its row again:
    it raises instead, naming the loop; keep-all gives PyTorch's gradient and xs."""
    raised = _raises_inplace_or_matches(_row_changing, mode)
    if mode[0] == "keep-all":
        assert not raised
    elif mode[0] in ("binomial", "periodic", "recompute"):
        assert raised


def _capture_changing(saved):
    def program(mode):
        w = cad.tensor(0.5, requires_grad=True)
        c = cad.tensor(1.0)

        def step(h, x):
            c.add_(1.0)  # once a step: what a plain loop leaves in c is 1 + steps
            y = h * w * c if saved else h * w + c
            return cad.tanh(y + x), h

        h, ys = _scan(step, cad.tensor(0.1), cad.ones(5), mode)
        (h.sum() + ys.sum()).backward()
        return w.grad.numpy(), c.numpy()
    return program


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_step_changing_a_captured_tensor_it_only_adds_is_pytorchs_loop_or_raises(mode):
    """PyTorch: a captured ``c.add_(1)`` each step, c only added (not saved): allowed. A plan
    re-running steps would add to c again and read it changed: it raises (a budget's dry run
    before running anything, leaving c as it was); keep-all runs each step once."""
    try:
        raised = _raises_inplace_or_matches(_capture_changing(saved=False), mode)
    except cad.InplaceError:
        raised = True
    if mode[0] == "keep-all":
        assert not raised
    else:
        assert raised


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_step_changing_a_captured_tensor_it_saves_raises_in_every_mode(mode):
    """PyTorch: ``h * c`` saves c, and the next step's ``c.add_(1)`` changes it: the backward
    raises. Here every mode raises, none hands out a gradient."""
    with pytest.raises((cad.SavedValueModifiedError, cad.InplaceError)):
        _capture_changing(saved=True)(mode)


def _first_step_changing(n, saved):
    def program(mode):
        w = cad.tensor(0.5, requires_grad=True)
        c = cad.tensor(np.float32(1.0))
        rows = np.ones(n, dtype=np.float32)
        rows[-1 if mode[2] else 0] = 5.0  # the row the loop's first step runs on

        def step(h, x):
            if float(x.numpy()) > 2.0:  # the first step only (a loop of one: every step)
                c.add_(1.0)
            y = h * w * c if saved else h * w + c
            return cad.tanh(y + x), h

        h, ys = _scan(step, cad.tensor(np.float32(0.1)), cad.tensor(rows), mode)
        (h.sum() + ys.sum()).backward()
        return w.grad.numpy(), c.numpy()
    return program


@pytest.mark.parametrize("saved", [False, True], ids=["added", "saved"])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_step_changing_a_captured_tensor_only_at_step_0_is_pytorchs_loop_or_raises(mode, n,
                                                                                  saved):
    """PyTorch: a loop whose first step alone does ``c.add_(1)`` (a branch on its row, or a
    loop of one step) changes c once, before any step reads it. A plan re-running step 0
    would change c again and read it changed (silently: 3 or 5 in c, and another gradient,
    before step 0's own change was seen): it raises; keep-all runs each step once, and a
    loop of one step re-runs nothing."""
    raised = _raises_inplace_or_matches(_first_step_changing(n, saved), mode)
    if mode[0] == "keep-all":
        assert not raised
    elif n > 1:
        assert raised


def _scratch(mode):
    w = cad.tensor(0.5, requires_grad=True)

    def step(h, x):
        z = cad.zeros(2)  # made by the step: changing it in place is the step's own business
        z.add_(x)
        z.mul_(3.0)
        return cad.tanh(h * w + z), h

    h, ys = _scan(step, cad.ones(2), cad.ones((5, 2)), mode)
    (h.sum() + ys.sum()).backward()
    return (w.grad.numpy(),)


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_step_changing_its_own_tensors_in_place_is_allowed_in_every_mode(mode):
    """PyTorch: in place on a tensor the step made (not saved before) is allowed; re-running
    such a step makes it anew, so every strategy gives keep-all's gradient bitwise."""
    assert not _raises_inplace_or_matches(_scratch, mode)


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf-xs", "non-leaf-xs"])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_inplace_on_step_row_requiring_grad_raises_like_pytorch_unbind_views(mode, leaf):
    """PyTorch: ``for x in xs`` gives unbind's views, which may not be changed in place while
    a gradient is recorded through them (leaf or not): "a view ... of a function that
    returns multiple views". One InplaceError in every mode, and xs left as it was."""
    a = cad.tensor(np.ones((5, 2), np.float32), requires_grad=True)
    xs = a if leaf else a * 1.0
    before = xs.detach().numpy().copy()

    def step(h, x):
        x.mul_(2.0)
        return h + x, h

    with pytest.raises(cad.InplaceError, match=r"in place|row"):
        _scan(step, cad.zeros(2), xs, mode)
    np.testing.assert_array_equal(xs.detach().numpy(), before)


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_inplace_on_step_row_with_an_operand_requiring_grad_raises_like_pytorch(mode):
    """PyTorch: ``x.mul_(w)`` on unbind's view with w requiring grad raises too, though xs
    needs none (the row would need history its base cannot take)."""
    w = cad.tensor(2.0, requires_grad=True)
    xs = cad.ones((5, 2))

    def step(h, x):
        x.mul_(w)
        return h + x, h

    with pytest.raises(cad.InplaceError):
        _scan(step, cad.zeros(2), xs, mode)
    np.testing.assert_array_equal(xs.numpy(), np.ones((5, 2), np.float32))


def _nested_row_changing(mode):
    w = cad.tensor(0.5, requires_grad=True)
    xs = cad.tensor(np.linspace(0.1, 1.2, 24).reshape(4, 3, 2).astype(np.float32))

    def inner(h, x):
        x.mul_(2.0)  # a row of the outer step's row: the outer row changes
        return cad.tanh(h * w) * x, h

    def outer(h, row):
        h2, _ = cad.scan(inner, h, row, trace=mode[1])
        return h2, h2

    h, ys = _scan(outer, cad.ones(2), xs, mode)
    (h.sum() + ys.sum()).backward()
    return w.grad.numpy(), xs.numpy()


@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_nested_scan_changing_the_outer_row_in_place_gives_pytorchs_gradient_or_raises(mode):
    """PyTorch: nested ``for`` loops over views of views, the inner one doubling its rows:
    each element doubled once. An outer plan re-running its steps would double them again:
    it raises (the inner loop's change reaches the outer row's counter)."""
    raised = _raises_inplace_or_matches(_nested_row_changing, mode)
    if mode[0] == "keep-all":
        assert not raised
    elif mode[0] in ("binomial", "periodic", "recompute"):
        assert raised


def _counting_while(strategy):
    w = cad.tensor(0.5, requires_grad=True)

    def step(carry):
        h, k = carry
        k.add_(1)  # the carry's own counter, changed in place
        return cad.tanh(h * w) * k.astype("float32"), k * 1

    k0 = cad.tensor(np.array(0, np.int64))
    h, k = cad.while_loop(lambda carry: carry[1] < 5, step, (cad.tensor(0.1), k0),
                          strategy=strategy)
    h.backward()
    return w.grad.numpy(), k.numpy(), k0.numpy()


@pytest.mark.parametrize("strategy", ["keep-all", "binomial", "budget"])
def test_while_loop_step_changing_its_carry_in_place_is_pytorchs_loop_or_raises(strategy):
    """PyTorch: ``while``, the step doing ``k.add_(1)`` on its carry: the caller's k0 changes
    once (step 0's carry is k0), the loop runs as written. A plan re-running steps from
    stored carries would change them again: it raises rather than differentiate it."""
    expected = _counting_while(None)
    try:
        got = _counting_while(STRATEGIES[strategy]())
    except cad.InplaceError as exc:
        assert strategy != "keep-all" and "in place" in str(exc)
        return
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
    assert strategy != "binomial"


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("mode", MODES, ids=_mode_id)
def test_rows_of_the_carry_are_a_new_array_like_torch_stack(mode, n):
    """PyTorch: ``torch.stack`` of the carries a loop returned is a new tensor, so changing
    it in place leaves the final carry as it was. A plan's one-step loop returning its carry
    as its output handed out a view of the final carry: ``ys.mul_(1.5)`` changed it too, and
    the loss read from it (found by the loop composition property)."""
    def step(h, x):
        new = cad.tanh(h * x)
        return new, new  # an RNN's (h, h)

    h0 = cad.tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    final, ys = _scan(step, h0, cad.ones((n, 3)), mode)
    before = final.numpy().copy()
    ys.mul_(1.5)
    np.testing.assert_array_equal(final.numpy(), before)
