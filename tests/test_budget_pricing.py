"""What a budget prices: the steps as the loop runs them (replayed from a step program, or
recorded where the step refuses tracing), and, when the user allows it, plans with disk
snapshots. Times are never asserted against a clock here (the bench compares predictions with
measurements); the tests check which measured costs each plan is priced from."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import models
from checkpoint_ad.errors import StrategyConfigError
from checkpoint_ad.strategies import Binomial, Budget, Offload, Periodic, scan
from checkpoint_ad.strategies.budget import plan_table
from checkpoint_ad.strategies.budget.candidates import (
    binomial,
    binomial_disk,
    binomial_online,
    keep_every_step,
    keep_every_step_until,
    periodic,
)
from checkpoint_ad.strategies.budget.pricing import FormCost, SnapshotCost, StepCost

SIZES = {"steps": 60, "batch": 4, "input_size": 8, "hidden": 16}


def _cost(mode: str, n: int = 50, disk: SnapshotCost | None = None) -> StepCost:
    """A hand-made measurement whose recorded and replayed times differ by powers of ten, so
    a price says which it was made from."""
    form = FormCost(first_bytes=800, step_bytes=800, carry_saved_bytes=0, taped_seconds=10.0,
                    backward_seconds=100.0, replayed_taped_seconds=0.01,
                    replayed_backward_seconds=0.1)
    return StepCost(
        n_steps=n, carry_bytes=64, untaped_seconds=1.0, forms={"keep": form},
        snapshots={"keep": SnapshotCost(64, 0.0, 0.0)}, gradient_bytes=0, output_bytes=0,
        mode=mode, replayed_untaped_seconds=0.001 if mode == "replayed" else None,
        replayed_forward_seconds=0.003 if mode == "replayed" else None, disk=disk)


def _rnn_loop():
    model = models.build("rnn", **SIZES)
    return model, (model.step, model.init_carry(), model.inputs())


def _item_step():
    """A step that reads a value into Python: the loop records it step by step."""
    w = cad.tensor(np.linspace(-0.5, 0.5, 16).reshape(4, 4), requires_grad=True)
    xs = cad.tensor(np.random.default_rng(0).standard_normal((30, 4)))

    def step(h, x):
        h = cad.tanh(h @ w + x) * (1.0 if cad.sum(h).item() < 1e9 else 0.5)
        return h, cad.sum(h)

    return w, (step, cad.zeros(4, dtype="float64"), xs)


# ------------------------------------------------------------------ what is measured
def test_the_dry_run_traces_the_step_and_times_its_replays():
    _, loop = _rnn_loop()
    cost = cad.estimate(*loop).cost
    assert cost.mode == "replayed" and cost.replays
    assert cost.replayed_untaped_seconds > 0
    for form in cost.forms.values():
        assert form.replayed_taped_seconds > 0 and form.replayed_backward_seconds > 0


def test_a_step_that_refuses_tracing_is_measured_as_recorded_and_says_why():
    _, loop = _item_step()
    cost = cad.estimate(*loop).cost
    assert not cost.replays and cost.mode.startswith("recorded: the step reads")
    assert cost.replayed_untaped_seconds is None
    assert all(f.replayed_taped_seconds is None for f in cost.forms.values())


@pytest.mark.parametrize("make", [_rnn_loop, _item_step])
def test_the_dry_run_predicts_the_mode_the_loop_then_runs_in(make):
    _, (step, init, xs) = make()
    cost = cad.estimate(step, init, xs).cost
    carry, _ = scan(step, init, xs, strategy=Periodic(8))
    assert carry.grad_fn.op.mode == cost.mode


# ------------------------------------------------------------------ what each plan costs
def test_planned_loops_that_replay_are_priced_at_replayed_costs():
    """Replayed steps of a plan's forward at their forward cost f (outputs written into
    rows), its backward's re-runs at the bare replay's u, which write none."""
    cost = _cost("replayed")
    n, u, f, tau, beta = cost.n_steps, 0.001, 0.003, 0.01, 0.1
    T, U = 10.0, 1.0  # step 0 taped and step 1 untaped are recorded (and traced)
    rows = {c.name: c for c in periodic(cost)}
    k = 10
    row = rows[f"periodic k={k}"]
    advanced = n - k
    assert row.forward_seconds == pytest.approx(T + U + (advanced - 2) * f + k * tau)
    assert row.backward_seconds == pytest.approx(n * beta + advanced * tau)
    s = 4
    row = next(c for c in binomial(cost) if c.name == f"binomial s={s}")
    reruns = cad.strategies.optimal_evaluations(n, s) - n - (n - 1)
    assert row.forward_seconds == pytest.approx(T + U + (n - 3) * f + tau)
    assert row.backward_seconds == pytest.approx(n * beta + (n - 1) * tau + reruns * u)


def test_the_dry_run_times_the_forwards_steps_with_their_rows():
    _, loop = _rnn_loop()
    cost = cad.estimate(*loop).cost
    assert cost.replayed_forward_seconds is not None and cost.replayed_forward_seconds > 0
    _, loop = _item_step()
    assert cad.estimate(*loop).cost.replayed_forward_seconds is None  # recorded: not traced


def test_planned_loops_that_record_are_priced_at_recorded_costs():
    cost = _cost("recorded: the step reads a value into Python")
    n, T, U, B = cost.n_steps, 10.0, 1.0, 100.0
    row = next(c for c in periodic(cost) if c.name == "periodic k=10")
    assert row.forward_seconds == pytest.approx((n - 10) * U + 10 * T + (T - U))
    assert row.backward_seconds == pytest.approx(n * B + (n - 10) * T)


def test_a_kept_segment_taped_before_the_program_is_known_is_priced_as_recorded():
    """In a loop of two steps, Periodic(1) tapes step 1 in its forward before steps 0 and 1
    are both traced, so that step records; the re-run of step 0 replays."""
    cost = _cost("replayed", n=2)
    row = next(c for c in periodic(cost) if c.name == "periodic k=1")
    assert row.forward_seconds == pytest.approx(10.0 + 10.0)
    assert row.backward_seconds == pytest.approx(100.0 + 0.1 + 0.01)


def test_keep_all_is_priced_as_a_plain_scan_runs_it():
    """A plain scan records steps 0 and 1 and replays the rest (kept_loop.py)."""
    n = 50
    row = next(c for c in keep_every_step(_cost("replayed", n)) if c.name == "keep-all")
    assert row.forward_seconds == pytest.approx(2 * 10.0 + (n - 2) * 0.01)
    assert row.backward_seconds == pytest.approx(2 * 100.0 + (n - 2) * 0.1)
    recorded = _cost("recorded: the step reads a value into Python", n)
    row = next(c for c in keep_every_step(recorded) if c.name == "keep-all")
    assert row.forward_seconds == pytest.approx(n * 10.0)  # a step that refuses: recorded



def test_a_step_that_captures_a_value_made_anew_each_call_is_priced_with_its_tracing():
    """Heat's step reads a diffusivity made from a parameter before the loop: a new tensor on
    every call, so no call reuses an earlier call's program; each traces steps 0 and 1 and
    compiles again, which its price now includes. A step that captures only leaves (the
    RNN's weights) reuses the program from its second call on: nothing added."""
    heat = models.build("heat", grid=16, steps=40)
    heat._kappa = cad.sigmoid(heat.theta) * heat.config.kappa_max
    anew = cad.estimate(heat.step, heat.init_carry(), heat.inputs())
    assert anew.cost.replays and anew.cost.call_overhead_seconds > 0
    kept = next(r for r in anew.rows if r.name == "keep-all")
    alone = next(c for c in keep_every_step(anew.cost) if c.name == "keep-all")
    assert kept.forward_seconds == pytest.approx(
        alone.forward_seconds + anew.cost.call_overhead_seconds + anew.cost.kept_call_seconds)
    _, (step, init, xs) = _rnn_loop()
    assert cad.estimate(step, init, xs).cost.call_overhead_seconds == 0.0
    with cad.inspect.loops() as ran:  # the premise: heat's loop never reuses its program
        for _ in range(2):
            heat._kappa = cad.sigmoid(heat.theta) * heat.config.kappa_max
            scan(heat.step, heat.init_carry(), heat.inputs())
    assert [r.mode for r in ran] == ["replayed", "replayed"]

def test_every_forward_step_writes_its_rows_and_each_call_pays_the_executors_part():
    """Rows are written by every step of a forward (a replayed advance's price has its
    own); each call pays the executor's fixed part, a kept loop's where it replays."""
    r = 1e-4
    cost = replace(_cost("replayed"), row_seconds=r, call_seconds=0.5, kept_call_seconds=0.7)
    plain = _cost("replayed")
    n, k = cost.n_steps, 10

    def row(c, name, family):
        return next(x for x in family(c) if x.name == name)

    assert row(cost, "keep-all", keep_every_step).forward_seconds == pytest.approx(
        row(plain, "keep-all", keep_every_step).forward_seconds + n * r)
    name = f"periodic k={k}"
    assert row(cost, name, periodic).forward_seconds == pytest.approx(
        row(plain, name, periodic).forward_seconds + (2 + k) * r)  # steps 0, 1 and the kept
    recorded = replace(cost, mode="recorded: the step reads a value into Python")
    assert row(recorded, name, periodic).forward_seconds == pytest.approx(
        row(replace(recorded, row_seconds=0.0), name, periodic).forward_seconds + n * r)
    table = {x.name: x for x in plan_table(cost, None).rows}
    bare = {x.name: x for x in plan_table(replace(cost, call_seconds=0.0,
                                                  kept_call_seconds=0.0), None).rows}
    assert table["keep-all"].forward_seconds == pytest.approx(
        bare["keep-all"].forward_seconds + 0.7)
    assert table[name].forward_seconds == pytest.approx(bare[name].forward_seconds + 0.5)
    # a loop that records keeps every step on the tape, with no executor
    table = {x.name: x for x in plan_table(recorded, None).rows}
    assert table["keep-all"].forward_seconds == pytest.approx(
        row(recorded, "keep-all", keep_every_step).forward_seconds)


def test_a_loop_stopping_on_until_is_priced_with_its_checks_and_its_online_planner():
    """Keep-all asks `until` after every step; an online binomial plan also tapes each step
    on its own and runs its planner, whose decisions cost more the more snapshots it
    holds (`candidates.planner_seconds`)."""
    cost = replace(_cost("replayed"), until_step_seconds=0.25, online_step_seconds=0.5,
                   planner_step_seconds=0.125, planner_snapshot_seconds=0.0625)
    plain = _cost("replayed")
    n = cost.n_steps
    kept = next(c for c in keep_every_step_until(cost) if c.name == "keep-all")
    assert kept.forward_seconds == pytest.approx(
        next(keep_every_step(plain)).forward_seconds + n * 0.25)
    for s in (2, 8, 41):  # (values of s priced for 50 steps)
        name = f"binomial s={s}"
        priced = next(c for c in binomial_online(cost) if c.name == name)
        bare = next(c for c in binomial_online(plain) if c.name == name)
        assert priced.forward_seconds == pytest.approx(
            bare.forward_seconds + n * 0.5 + n * 0.125 + 0.0625 * s * (n - s))
        assert priced.backward_seconds == bare.backward_seconds
    # a budget prices an `until` loop's keep-all with its checks
    _, (step, init, xs) = _rnn_loop()
    table = cad.estimate(step, init, xs, until=lambda carry: False)
    kept = next(r for r in table.rows if r.name == "keep-all")
    alone = next(c for c in keep_every_step(table.cost) if c.name == "keep-all")
    assert table.cost.until_step_seconds > 0
    assert kept.forward_seconds == pytest.approx(
        alone.forward_seconds + SIZES["steps"] * table.cost.until_step_seconds
        + table.cost.kept_call_seconds)


def test_the_dry_run_times_writing_rows_only_for_a_loop_with_outputs():
    _, loop = _rnn_loop()
    assert cad.estimate(*loop).cost.row_seconds > 0
    step, init, xs = loop
    assert cad.estimate(lambda h, x: (step(h, x)[0], None), init, xs).cost.row_seconds == 0


# ------------------------------------------------------------------ disk snapshots
def test_disk_plans_are_priced_only_when_the_disk_was_timed():
    assert list(binomial_disk(_cost("replayed"))) == []
    rows = list(binomial_disk(_cost("replayed", disk=SnapshotCost(64, 0.002, 0.002))))
    assert rows and all(r.name.endswith(" + disk") and r.lossless for r in rows)
    for r in rows:
        plan = r.loop.plan(50)
        assert r.loop.disk is None and plan.disk_writes > 0
        assert r.peak_tape_bytes == plan.max_live_snapshots * 64 + 800
        assert r.evaluations == 50 + plan.advanced_steps


def test_disk_plans_are_opt_in():
    _, loop = _rnn_loop()
    names = [r.name for r in cad.estimate(*loop).rows]
    assert not any("disk" in name for name in names)
    table = cad.estimate(*loop, disk=True)
    assert table.cost.disk is not None and table.cost.disk.pack_seconds > 0
    assert any(r.name.endswith(" + disk") for r in table.rows)
    with pytest.raises(StrategyConfigError, match="disk"):
        Budget("1MiB", disk="yes")
    with pytest.raises(StrategyConfigError, match="disk"):
        cad.estimate(*loop, disk=1)


def test_a_small_budget_with_disk_runs_a_disk_plan_bitwise_equal_to_keep_all():
    model, loop = _rnn_loop()
    loss = model.run(scan)  # keeping every step (a scan: its x @ U is batched as the plan's)
    reference = [g.numpy() for g in cad.grad(loss, model.params)]
    ram_only = cad.estimate(*loop)
    limit = ram_only.minimum_bytes  # only binomial s=1 fits: n(n+1)/2 step evaluations
    assert [r.name for r in ram_only.rows if r.peak_tape_bytes <= limit] == ["binomial s=1"]
    budget = Budget(limit, disk=True)
    with cad.profile() as prof:
        loss = model.run(lambda step, init, xs: scan(step, init, xs, strategy=budget))
        grads = cad.grad(loss, model.params)
    chosen = budget.last.chosen
    assert chosen.name.endswith(" + disk") and isinstance(chosen.strategy, Binomial)
    assert chosen.peak_tape_bytes <= limit
    assert all(np.array_equal(g.numpy(), r) for g, r in zip(grads, reference))
    assert prof.io_bytes_written > 0 and prof.level_peak_bytes["disk"] > 0
    assert Offload("disk").folder is None  # the disk snapshots' files are gone
