"""Online checkpointing against the offline optimum: step evaluations of `OnlinePlanner(s)`
over every loop length up to ``--steps``, divided by `optimal_evaluations(n, s)`.

Planner only (no model runs): the ratio is exact bookkeeping, not a timing, so the figures do
not depend on the machine. ``python -m bench.online [--steps 100000] [--snapshots 8,16,32,64]``
prints a Markdown table: the worst ratio over all n and where it occurs, the ratio at a few n,
and the longest prefix of lengths where the planner is exactly optimal (it should reach
C(s + 2, 2), the limit of Stumm & Walther's optimality).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from math import comb
from typing import Any

from checkpoint_ad.strategies.plans.online import OnlinePlanner
from checkpoint_ad.strategies.plans.revolve import optimal_evaluations


def measure(snapshots: int, steps: int, marks: Sequence[int]) -> dict[str, Any]:
    """One planner advanced to `steps` steps, its cost compared with the optimum at every n."""
    planner = OnlinePlanner(snapshots)
    worst, worst_at, optimal_until = 1.0, 1, 0
    at_marks: dict[int, float] = {}
    started = time.perf_counter()
    for n in range(1, steps + 1):
        planner.advance()
        ratio = planner.evaluations(n) / optimal_evaluations(n, snapshots)
        if ratio == 1.0 and optimal_until == n - 1:
            optimal_until = n
        if ratio > worst:
            worst, worst_at = ratio, n
        if n in marks:
            at_marks[n] = ratio
    return {
        "snapshots": snapshots,
        "steps": steps,
        "worst_ratio": worst,
        "worst_at": worst_at,
        "optimal_up_to": optimal_until,
        "c_s_plus_2_2": comb(snapshots + 2, 2),
        "ratio_at": at_marks,
        "planner_us_per_step": (time.perf_counter() - started) / steps * 1e6,
    }


def table(rows: list[dict[str, Any]]) -> str:
    marks = sorted({n for row in rows for n in row["ratio_at"]})
    head = ["s", "worst ratio", "at n", "optimal for n <=", "C(s+2,2)"]
    head += [f"n={n:,}" for n in marks] + ["planner µs/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = [str(row["snapshots"]), f"{row['worst_ratio']:.4f}", f"{row['worst_at']:,}",
                 f"{row['optimal_up_to']:,}", f"{row['c_s_plus_2_2']:,}"]
        cells += [f"{row['ratio_at'][n]:.4f}" if n in row["ratio_at"] else "" for n in marks]
        cells.append(f"{row['planner_us_per_step']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.online", description=__doc__)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--snapshots", default="8,16,32,64")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    marks = [n for n in (100, 1_000, 10_000, 100_000) if n <= args.steps]
    rows = [measure(int(s), args.steps, marks) for s in args.snapshots.split(",")]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
