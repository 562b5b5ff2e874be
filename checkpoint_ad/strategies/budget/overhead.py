"""The plan executor's own time per segment, measured once per process: what a plan's price
adds to the measured costs of its steps.

Why: a plan's steps are priced from a dry run of the user's step, but the executor also spends
time between them (taking a snapshot, restoring one, setting up each reverse action's tape and
its pull-back), about the same for any loop on one machine, and far from negligible next to a
replayed step when a plan has many reverse actions (`Binomial` reverses every step on its own).
So a tiny loop runs under two periodic plans that differ only in how many segments they have,
and what each took beyond its priced steps, divided by the difference in segments, is the
time per segment: per snapshot taken in the forward, and per reverse action in the backward;
then under `Binomial(2)`, whose backward re-runs from a restored snapshot before most reverse
actions: what is left over, per restore, is the time per re-run. What Periodic(16) took beyond
its snapshots and reverse actions is each call's fixed part; keep-all's, a loop keeping every
step. The same loops stopping on `until` (never true: they end with their xs) give what each
step of such a loop adds (at least what asking `until` alone takes, timed on its own), and
the online planner is timed on its own (`_planner_model`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ... import random
from ...autograd import grad
from ...grad_mode import enable_grad
from ...ops import multiply, tanh
from ...pytree import flatten
from ...saved import KEEP, use_packer
from ...tensor import tensor
from ..loops.loop import StepLoop
from ..loops.plan_executor import stops
from ..loops.scan import scan
from ..plans.online import OnlinePlanner
from .candidates import (
    backward_snapshots,
    binomial,
    binomial_online,
    keep_every_step,
    periodic,
    planner_seconds,
)
from .pricing import StepCost, measure

STEPS = 64
"""Steps of the tiny loop; it runs under Periodic(1) (64 segments), Periodic(16) (4) and
Binomial(2)."""
RUNS = 9  # each plan's time is the least of these


@dataclass(frozen=True)
class Overhead:
    """Seconds the executor adds per segment beyond its steps."""

    snapshot_seconds: float
    """Per snapshot taken in the forward (the step loop broken up, the carry packed)."""
    reverse_seconds: float
    """Per reverse action in the backward (its restore, tape set-up and pull-back)."""
    advance_seconds: float = 0.0
    """Per re-run (an `Advance` after a restore) in the backward, beyond its steps."""
    call_seconds: float = 0.0
    """Per call of a planned loop, forward and backward, beyond its steps and segments
    (setting up and recording the loop's entry, its guards, its outputs)."""
    kept_call_seconds: float = 0.0
    """Per call of a replayed loop keeping every step (`kept_loop.py`), beyond its steps:
    the executor's fixed part, and joining the recorded first steps to the replayed rest."""
    until_step_seconds: float = 0.0
    """Per step of a loop keeping every step that stops on `until`, beyond one of known
    length: asking `until` (a carry wrapped as tensors; the user's own test costs more)."""
    online_step_seconds: float = 0.0
    """Per step of a binomial plan placed online, beyond its taped step and its planner's
    decisions: the step taped on its own, `until` asked, the plan's actions run."""
    planner_step_seconds: float = 0.0
    """The online planner's time per step (`OnlinePlanner.advance`, and its reversal at the
    end), beside `planner_snapshot_seconds` per step and snapshot held once they are s."""
    planner_snapshot_seconds: float = 0.0


def with_overhead(cost: StepCost) -> StepCost:
    """`cost` with the executor's time per snapshot and per reverse action filled in."""
    overhead = executor_overhead()
    return replace(cost, snapshot_overhead_seconds=overhead.snapshot_seconds,
                   reverse_overhead_seconds=overhead.reverse_seconds,
                   advance_overhead_seconds=overhead.advance_seconds,
                   call_seconds=overhead.call_seconds,
                   kept_call_seconds=overhead.kept_call_seconds,
                   until_step_seconds=overhead.until_step_seconds,
                   online_step_seconds=overhead.online_step_seconds,
                   planner_step_seconds=overhead.planner_step_seconds,
                   planner_snapshot_seconds=overhead.planner_snapshot_seconds)


@functools.cache
def executor_overhead() -> Overhead:
    """The executor's time per segment on this machine (measured on the first call, within
    the first dry run, which no profile hears: `budget.dry_run`)."""
    per_step, per_snapshot = _planner_model()
    numpy_state = np.random.get_state()
    try:
        with random.replaying(random.get_state()), enable_grad(), use_packer(KEEP):
            excess = _excess()
    finally:
        np.random.set_state(numpy_state)
    segments = STEPS - STEPS // 16  # Periodic(1) has this many more segments than Periodic(16)
    fine, coarse, revolve = excess["periodic k=1"], excess["periodic k=16"], excess["binomial"]
    snapshot = max(0.0, (fine[0] - coarse[0]) / segments)
    reverse = max(0.0, (fine[1] - coarse[1]) / segments)
    # the loop's fixed part: Periodic(16) beyond its 3 snapshots and 4 reverse actions
    fixed_forward = coarse[0] - (STEPS // 16 - 1) * snapshot
    fixed = coarse[1] - (STEPS // 16) * reverse
    # Binomial(2) re-runs from a restored snapshot before most reverse actions: what its
    # backward took beyond its steps, its reverse actions and the loop's fixed part
    packs, restores = backward_snapshots(STEPS, 2)
    advance = (revolve[1] - fixed - STEPS * reverse - packs * snapshot) / max(restores, 1)
    # a loop stopping on `until` (which never says so here) beside its known-length twin; at
    # least what asking it alone takes, which a busy machine's noise in the difference of two
    # loops' times can hide (the difference read 0 in one CI run)
    until = max((excess["keep-all until"][0] - excess["keep-all"][0]) / STEPS, _asking_until())
    planner = planner_seconds(STEPS, 2, per_step, per_snapshot)  # "binomial online" is s=2
    online = (excess["binomial online"][0] - planner) / STEPS
    return Overhead(snapshot, reverse, max(0.0, advance),
                    call_seconds=max(0.0, fixed_forward) + max(0.0, fixed),
                    kept_call_seconds=max(0.0, sum(excess["keep-all"])),
                    until_step_seconds=max(0.0, until), online_step_seconds=max(0.0, online),
                    planner_step_seconds=per_step, planner_snapshot_seconds=per_snapshot)


PLANNER_STEPS = 512
"""Steps of the loops whose online plans `_planner_model` times."""
PLANNER_RUNS = 3  # each planner's time is the least of these


def _planner_model() -> tuple[float, float]:
    """(a, b) of the online planner's time for s snapshots over n steps, about
    ``n * a + b * s * (n - s)``: each step's decision costs a little, and once s snapshots
    are held, most steps choose one to drop among them (O(s) each). Fitted to its time at
    s = 8 and s = 128 over `PLANNER_STEPS` steps (the least of `PLANNER_RUNS` runs each); at
    s = 1,024 a decision took 160 us, for a step that may take 10."""
    n = PLANNER_STEPS
    seconds = {}
    for s in (8, 128):
        best = float("inf")
        for _ in range(PLANNER_RUNS):
            planner = OnlinePlanner(s)
            began = time.perf_counter()
            for _ in range(n):
                planner.advance()
            planner.finish_plan(n)
            best = min(best, time.perf_counter() - began)
        seconds[s] = best
    # seconds[s] = n a + b s (n - s), for both s
    low, high = 8 * (n - 8), 128 * (n - 128)
    b = max(0.0, (seconds[128] - seconds[8]) / (high - low))
    a = max(0.0, (seconds[8] - b * low) / n)
    return a, b


def _never(carry: Any) -> bool:
    return False


def _asking_until() -> float:
    """Seconds to ask `until` once (`plan_executor.stops`: the carry's leaves unflattened
    and passed without recording) at the tiny loop's carry (`_excess`'s `init`), the least
    per call of `RUNS` runs of `STEPS` calls."""
    leaves, spec = flatten(tensor(np.zeros(4)))
    best = float("inf")
    for _ in range(RUNS):
        began = time.perf_counter()
        for _ in range(STEPS):
            stops(_never, spec, leaves)
        best = min(best, (time.perf_counter() - began) / STEPS)
    return best


def _excess() -> dict[str, tuple[float, float]]:
    """Per plan: (forward, backward) seconds beyond the priced steps."""
    w = tensor(0.5, requires_grad=True)
    xs = tensor(np.linspace(0.0, 1.0, STEPS * 4).reshape(STEPS, 4))
    init = tensor(np.zeros(4))

    def step(h, x):
        h = tanh(multiply(h, w) + x)
        return h, h

    carry_leaves, carry_spec = flatten(init)
    xs_leaves, xs_spec = flatten(xs)
    loop = StepLoop(step, carry_spec, xs_leaves, xs_spec, STEPS)
    cost = measure(loop, carry_leaves, {"keep": KEEP}, {"keep": None})
    priced = {c.name: c for c in periodic(cost) if c.loop.every in (1, 16)}
    priced["binomial"] = next(c for c in binomial(cost) if c.name == "binomial s=2")
    priced["keep-all"] = next(keep_every_step(cost))  # a loop strategy of None
    priced["keep-all until"] = priced["keep-all"]
    priced["binomial online"] = next(c for c in binomial_online(cost) if c.name == "binomial s=2")
    forward = dict.fromkeys(priced, float("inf"))
    backward = dict.fromkeys(priced, float("inf"))
    for _ in range(RUNS):  # the plans take turns: a machine getting busier slows them alike
        for name, row in priced.items():
            began = time.perf_counter()
            # keep-all given as KEEP: no strategy would take the ambient one (a budget)
            _, ys = scan(step, init, xs, strategy=KEEP if row.loop is None else row.loop,
                         until=_never if name.endswith(("until", "online")) else None)
            total = ys.sum()
            ran = time.perf_counter()
            grad(total, [w])
            forward[name] = min(forward[name], ran - began)
            backward[name] = min(backward[name], time.perf_counter() - ran)
    excess = {name: (forward[name] - row.forward_seconds, backward[name] - row.backward_seconds)
              for name, row in priced.items()}
    return excess
