"""One budget over loops run one after another (the layers of a stacked RNN): each loop is
planned in what the earlier loops, still holding their tape, left; the next pass plans them
together (see `checkpoint_ad/strategies/shared_budget.py`)."""

from __future__ import annotations

import gc
import itertools
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import checkpoint_ad as cad
from checkpoint_ad.errors import BudgetError, BudgetWarning
from checkpoint_ad.strategies import Budget, scan
from checkpoint_ad.strategies.budget import forget_dry_runs
from checkpoint_ad.strategies.budget.shared_budget import fastest_together, least_together

T, B, H = 60, 16, 192


def _stack(depth: int = 2):
    """`depth` tanh-RNN layers, each a loop over the one below's outputs."""
    rng = np.random.default_rng(0)
    weights = [cad.tensor(rng.standard_normal((H, H)) / (2 * np.sqrt(H)), requires_grad=True)
               for _ in range(depth)]
    xs = cad.tensor(rng.standard_normal((T, B, H)))

    def layer(w):
        def step(h, x):
            h = cad.tanh(h @ w + x)
            return h, h
        return step

    def forward(strategy):
        out = xs
        for w in weights:
            _, out = scan(layer(w), cad.zeros(B, H, dtype="float64"), out, strategy=strategy)
        return cad.sum(out)

    return weights, forward


def _pass(forward, weights, strategy):
    """(profile, gradients, warnings) of one forward and backward."""
    for w in weights:
        w.grad = None
    with warnings.catch_warnings(record=True) as heard, cad.profile() as prof:
        warnings.simplefilter("always")
        forward(strategy).backward()
    return prof, [w.grad.numpy().copy() for w in weights], [
        w.message for w in heard if isinstance(w.message, BudgetWarning)]


def test_loops_run_one_after_another_share_the_budget():
    """Two layers, each of whose keep-all fits the budget alone but not both: the second is
    planned in what the first left, the pass's tape stays within the budget (it peaked at
    the sum before), and the gradients are keep-all's bitwise."""
    weights, forward = _stack()
    kept, reference, _ = _pass(forward, weights, None)
    forget_dry_runs()
    budget = Budget(int(kept.peak_tape_bytes * 0.75))  # one layer kept whole fits
    for _ in range(3):
        prof, grads, heard = _pass(forward, weights, budget)
        assert not heard
        assert prof.peak_tape_bytes <= budget.limit_bytes
        assert all(np.array_equal(g, r) for g, r in zip(grads, reference))
        second = budget.last
        assert second.held_bytes > 0 and "held by earlier loops" in second.table()
        assert budget.held_bytes() == 0  # the backward let go of both
    # the pair kept whole would not fit: planned alone, each took keep-all, and it peaked
    assert kept.peak_tape_bytes > budget.limit_bytes


def test_a_first_pass_warns_where_a_loop_no_longer_fits_and_the_next_plans_them_together():
    """Three layers, a budget a third of keep-all's: the first pass cannot know the later
    loops, so a loop left too little runs its leanest plan and the budget warns (saying by
    how much the tape passes it); the next pass plans each loop together with those that
    followed it last time, fits, and warns no more."""
    weights, forward = _stack(3)
    kept, reference, _ = _pass(forward, weights, None)
    forget_dry_runs()
    budget = Budget(kept.peak_tape_bytes // 3)
    _, grads, heard = _pass(forward, weights, budget)
    assert heard and "this once" in str(heard[0]) and "plans these loops together" in str(
        heard[0])
    assert all(np.array_equal(g, r) for g, r in zip(grads, reference))
    # the loop left too little ran the fastest plan within a tenth of the budget of its
    # leanest (the leanest alone, binomial s=1, re-runs n**2 / 2 steps)
    squeezed = budget.last_pass[-1]
    near = min(r.peak_tape_bytes for r in squeezed.rows) + budget.limit_bytes // 10
    assert squeezed.chosen.peak_tape_bytes <= near
    assert squeezed.chosen.seconds == min(r.seconds for r in squeezed.rows
                                          if r.peak_tape_bytes <= near)
    for _ in range(2):
        prof, grads, heard = _pass(forward, weights, budget)
        assert not heard and prof.peak_tape_bytes <= budget.limit_bytes
        assert all(np.array_equal(g, r) for g, r in zip(grads, reference))


def test_the_first_of_loops_planned_together_leaves_room_for_the_later_ones():
    weights, forward = _stack(2)
    forget_dry_runs()
    kept, _, _ = _pass(forward, weights, None)
    budget = Budget(int(kept.peak_tape_bytes * 0.6))
    _pass(forward, weights, budget)  # the first pass: learns the two loops
    tables = []

    def forward_noting_plans(strategy):
        out = cad.ones(T, B, H)
        for w in weights:
            _, out = scan(lambda h, x, w=w: (cad.tanh(h @ w + x),) * 2,
                          cad.zeros(B, H, dtype="float64"), out, strategy=strategy)
            tables.append(strategy.last)
        return cad.sum(out)

    _pass(forward_noting_plans, weights, budget)  # other steps: a pass of its own to learn
    tables.clear()
    prof, _, heard = _pass(forward_noting_plans, weights, budget)
    first, second = tables
    assert first.later_loops == 1 and "loop(s) that followed it" in first.table()
    assert first.chosen.peak_tape_bytes + first.later_bytes <= budget.limit_bytes
    assert second.held_bytes == first.chosen.peak_tape_bytes
    assert prof.peak_tape_bytes <= budget.limit_bytes and not heard


def test_loops_that_cannot_fit_together_raise_with_the_least_budget_that_would():
    weights, forward = _stack(2)
    forget_dry_runs()
    table = cad.estimate(lambda h, x: (cad.tanh(h @ weights[0] + x),) * 2,
                         cad.zeros(B, H, dtype="float64"), cad.ones(T, B, H))
    alone = table.minimum_bytes  # each layer's leanest plan
    budget = Budget(int(alone * 1.5))  # fits one leanest plan, not two
    _, _, heard = _pass(forward, weights, budget)
    assert heard  # the first pass: the second loop ran its leanest plan, over the budget
    with pytest.raises(BudgetError, match="cannot fit in") as caught:
        _pass(forward, weights, budget)
    assert caught.value.minimum_bytes == 2 * alone
    forget_dry_runs()
    enough = Budget(caught.value.minimum_bytes)
    _pass(forward, weights, enough)
    prof, _, heard = _pass(forward, weights, enough)
    assert not heard and prof.peak_tape_bytes <= enough.limit_bytes


def test_a_loop_whose_graph_is_dropped_no_longer_counts():
    weights, _ = _stack(1)
    budget = Budget("1MiB")
    h, ys = scan(lambda h, x: (cad.tanh(h @ weights[0] + x),) * 2,
                 cad.zeros(B, H, dtype="float64"), cad.ones(T, B, H), strategy=budget)
    assert budget.held_bytes() == budget.last.chosen.peak_tape_bytes > 0
    del h, ys
    gc.collect()
    assert budget.held_bytes() == 0


def test_each_thread_counts_its_own_loops():
    import threading

    weights, _ = _stack(1)
    budget = Budget("1MiB")
    kept = scan(lambda h, x: (cad.tanh(h @ weights[0] + x),) * 2,
                cad.zeros(B, H, dtype="float64"), cad.ones(T, B, H), strategy=budget)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(budget.held_bytes()))
    worker.start()
    worker.join()
    assert seen == [0] and budget.held_bytes() > 0
    del kept


def _rows(sizes):
    return [SimpleNamespace(peak_tape_bytes=b, seconds=s) for b, s in sizes]


row_lists = st.lists(st.tuples(st.integers(1, 50), st.floats(0.0, 10.0)), min_size=1,
                     max_size=5)


def _fits(combo, extras, room):
    """Whether loops 0..j together, beside extras[j], fit `room` for every j."""
    held = 0
    for j, row in enumerate(combo):
        held += row.peak_tape_bytes
        if held + extras[j] > room:
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(first=row_lists, later=st.lists(row_lists, max_size=3), room=st.integers(0, 160),
       extras=st.lists(st.integers(0, 40), min_size=4, max_size=4))
def test_fastest_together_is_the_fastest_combination_that_fits(first, later, room, extras):
    """Against every combination: each prefix of the loops (held together while the last of
    them runs) fits beside what else was held then."""
    first_rows, later_rows = _rows(first), [_rows(r) for r in later]
    extras = extras[:len(later) + 1]
    combos = [c for c in itertools.product(first_rows, *later_rows) if _fits(c, extras, room)]
    found = fastest_together(first_rows, later_rows, room, extras)
    if not combos:
        assert found is None
        assert least_together(first_rows, later_rows, extras) > room
        return
    assert found is not None and least_together(first_rows, later_rows, extras) <= room
    row, later_bytes = found
    best = min(sum(r.seconds for r in c) for c in combos)
    # a fitting combination with `row` first, its later rows taking `later_bytes`, is that fast
    with_row = [c for c in combos if c[0] is row
                and sum(r.peak_tape_bytes for r in c[1:]) == later_bytes]
    assert with_row and min(sum(r.seconds for r in c) for c in with_row) == pytest.approx(
        best, abs=1e-9)


def test_values_saved_beside_a_loop_are_left_room_from_the_next_pass():
    """Under `use(Budget)`, a loss saves a value after the loop, through the budget's pool. In
    a first pass the loop took the budget (keep-all fits it alone), so the pool goes over and
    warns; the next pass plans the loop to leave that room, and the tape stays within."""
    weights, _ = _stack(1)
    xs = cad.ones(T, B, H)

    def forward(strategy):
        _, ys = scan(lambda h, x: (cad.tanh(h @ weights[0] + x),) * 2,
                     cad.zeros(B, H, dtype="float64"), xs)
        return cad.sum(cad.tanh(ys))  # saves one (T, B, H) array beside the loop's tape

    def under(budget):
        def run(_):
            with cad.use(budget):
                return forward(None)
        return run

    forget_dry_runs()
    loop_alone = cad.estimate(lambda h, x: (cad.tanh(h @ weights[0] + x),) * 2,
                              cad.zeros(B, H, dtype="float64"), xs)
    kept = next(r for r in loop_alone.rows if r.name == "keep-all").peak_tape_bytes
    budget = Budget(int(kept * 1.5))  # the loop kept whole fits; beside the loss, not
    _, reference, _ = _pass(forward, weights, None)
    first, grads, heard = _pass(under(budget), weights, budget)
    assert heard and "passes the budget" in str(heard[0])
    assert first.peak_tape_bytes > budget.limit_bytes
    for _ in range(2):
        prof, grads, heard = _pass(under(budget), weights, budget)
        assert not heard and prof.peak_tape_bytes <= budget.limit_bytes
        assert budget.last.later_bytes >= T * B * H * 8 and "leave" in budget.last.table()
        assert all(np.array_equal(g, r) for g, r in zip(grads, reference))


def test_the_last_pass_lists_each_loops_plan_in_order():
    weights, forward = _stack(3)
    forget_dry_runs()
    kept, _, _ = _pass(forward, weights, None)
    budget = Budget(kept.peak_tape_bytes // 2)
    assert budget.last_pass == ()
    for _ in range(2):
        _pass(forward, weights, budget)
    tables = budget.last_pass
    assert len(tables) == 3 and tables[-1] is budget.last
    assert [t.held_bytes for t in tables] == [
        0, tables[0].chosen.peak_tape_bytes,
        tables[0].chosen.peak_tape_bytes + tables[1].chosen.peak_tape_bytes]
    assert sum(t.chosen.peak_tape_bytes for t in tables) <= budget.limit_bytes
