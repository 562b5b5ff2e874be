"""Workload 5, schedule planning: the time `binomial_plan` takes to produce a Revolve plan
(and `multilevel_plan` a RAM + disk plan).

The plan is made once per loop length, before the forward runs, so its cost adds to every
first call. `build` is the call itself (the plan is then complete: every action packed, its
step counts known); `walk` decodes every action once, as the scan executor does over a whole
forward and backward. Each plan is checked against the binomial optimum as it is timed.
"""

from __future__ import annotations

from typing import Any

from .measure import time_median


def plans(params: dict, threads: int) -> dict[str, Any]:
    """One row per (n_steps, snapshots) in ``params["cases"]``."""
    from checkpoint_ad.strategies import binomial_plan, optimal_evaluations

    rows = []
    for n, s in params["cases"]:
        build = time_median(lambda n=n, s=s: binomial_plan(n, s), params["repeats"])
        plan = binomial_plan(n, s)
        if plan.evaluations != optimal_evaluations(n, s):
            raise RuntimeError(f"binomial_plan({n}, {s}) costs {plan.evaluations} evaluations, "
                               f"the optimum is {optimal_evaluations(n, s)}")
        extras: dict[str, Any] = {"n_steps": n, "snapshots": s, "actions": len(plan),
                                  "evaluations": plan.evaluations}
        if n <= params.get("walk_up_to", 0):
            walk = time_median(lambda plan=plan: sum(1 for _ in plan), 1, warmup=0)
            extras["walk_seconds"] = walk.median
        rows.append({
            "name": f"n={n:.0e} s={s}".replace("e+0", "e"),
            "seconds": build.median,
            "spread": [build.low, build.high],
            "repeats": build.repeats,
            "rate": len(plan) / build.median / 1e6,
            "rate_unit": "M actions/s",
            "extras": extras,
        })
    rows += _multilevel_rows(params)
    return {"rows": rows}


MULTILEVEL_CASES = [(10**6, 4, 3, 2.0, 2.0), (10**6, 16, None, 1.0, 1.0), (10**6, 8, 20, 1.0, 1.0)]
"""(n, RAM snapshots, disk slots, write cost, read cost): two-level plans the issue asks to
build in under a second for a million steps."""


def _multilevel_rows(params: dict) -> list[dict[str, Any]]:
    from checkpoint_ad.strategies import multilevel_plan

    rows = []
    for case in MULTILEVEL_CASES:
        build = time_median(lambda case=case: multilevel_plan(*case), params["repeats"])
        plan = multilevel_plan(*case)
        n, s, d, _, _ = case
        rows.append({
            "name": f"multilevel n={n:.0e} s={s} disk={d}".replace("e+0", "e"),
            "seconds": build.median,
            "spread": [build.low, build.high],
            "repeats": build.repeats,
            "rate": len(plan) / build.median / 1e6,
            "rate_unit": "M actions/s",
            "extras": {"n_steps": n, "snapshots": s, "actions": len(plan),
                       "evaluations": plan.evaluations, "cost": plan.cost},
        })
    return rows
