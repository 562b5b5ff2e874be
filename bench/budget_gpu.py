"""A memory budget on a GPU: its predicted device peak against cupy's pools, its time too.

    python -m bench.budget_gpu --device cuda --out profiles/gpu

On the CPU a budget's device peak is checked against tracemalloc (`bench.budgets`). On a GPU
the arrays live in cupy's pools and tracemalloc sees only the engine's Python objects, so this
checks the prediction against what matters there: the most bytes cupy's pools handed out from
the loop's start to the end of the gradient, above what was in use at the start (a memory hook,
exact; `CupyHookProbe`), on a first call (step programs from earlier calls dropped). Each
row: one budget, from keep-all's predicted peak down to the smallest plan's; the chosen plan's
measured peak tape (the profiler's) and device peak over their predictions, and the median of
the loop's seconds (the device synchronised at its end; later calls, after an untimed one)
over the predicted seconds.
With ``--device cpu`` the same rows are read with tracemalloc, to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

SIZES = {  # the budget benchmark's RNN, and the large GPU RNN (bench.gpu) over 128 steps
    "rnn B64 H256": {"model": "rnn", "steps": 256, "batch": 64, "input_size": 256,
                     "hidden": 256},
    "rnn B512 H1024": {"model": "rnn", "steps": 128, "batch": 512, "input_size": 1024,
                       "hidden": 1024},
    "tiny": {"model": "rnn", "steps": 12, "batch": 4, "input_size": 8, "hidden": 16},
}
DEFAULT = ["rnn B64 H256", "rnn B512 H1024"]


def _runner(model: Any, strategy: Any, device: str, at_loop: Any = None) -> Any:
    """`budgets._runner` under `KeepAll`, the device synchronised at each end of the loop
    and of its gradient."""
    import checkpoint_ad as cad
    from checkpoint_ad.profiler.memory import synchronize

    from .budgets import _runner as runner

    return runner(model, strategy, cad.strategies.KeepAll(), at_loop,
                  sync=lambda: synchronize(device))


def _device_peak(model: Any, strategy: Any, device: str) -> tuple[int, str]:
    """(bytes, source): the most the run allocated from the loop's start to the end of its
    gradient above what was in use at the loop's start, on a first call."""
    import checkpoint_ad as cad
    from checkpoint_ad.strategies.loops import program_cache

    if device != "cuda":  # a first call too (`first_call`)
        from .budgets import _device_peak as traced

        return traced(model, strategy, cad.strategies.KeepAll()), "tracemalloc"
    import cupy

    from checkpoint_ad.profiler.memory import CupyHookProbe, synchronize

    program_cache.clear()
    probe = CupyHookProbe(cupy)

    def at_loop() -> None:
        synchronize(device)
        probe.start()

    try:
        _runner(model, strategy, device, at_loop)()
        synchronize(device)
    finally:
        peak = probe.stop()
    return peak, "cupy-pool"


def rows(device: str, count: int, repeats: int, labels: list[str]) -> list[dict[str, Any]]:
    import checkpoint_ad as cad
    from checkpoint_ad.models import build
    from checkpoint_ad.strategies import Budget
    from checkpoint_ad.strategies.budget import forget_dry_runs, format_bytes

    from .budgets import _peak

    out = []
    for label in labels:
        sizes = dict(SIZES[label])
        model = build(sizes.pop("model", label), device=None if device == "cpu" else device,
                      **sizes)
        table = cad.estimate(model.step, model.init_carry(), model.inputs())
        top = next(r for r in table.rows if r.name == "keep-all").peak_tape_bytes
        low = table.minimum_bytes
        limits = sorted({round(low * (top / low) ** (i / (count - 1))) for i in range(count)},
                        reverse=True)
        for limit in limits:
            forget_dry_runs()
            budget = Budget(limit)
            run = _runner(model, budget, device)
            run()  # the dry run and the plan
            chosen = budget.last.chosen
            device_peak, source = _device_peak(model, budget, device)
            tape = _peak(model, budget, cad.strategies.KeepAll())[0]  # the profiler's
            ratios = []
            run()  # untimed: the memory runs dropped the step programs (later calls are timed)
            for _ in range(repeats):
                run()
                ratios.append(run.loop_seconds[0] / max(chosen.seconds, 1e-12))
            row = {"model": label, "limit": format_bytes(limit), "plan": chosen.name,
                   "peak_tape_over_predicted": tape / max(chosen.peak_tape_bytes, 1),
                   "device_peak_bytes": device_peak, "memory_source": source,
                   "predicted_device_peak_bytes": chosen.device_peak_bytes,
                   "device_over_predicted": device_peak / max(chosen.device_peak_bytes, 1),
                   "predicted_seconds": chosen.seconds,
                   "time_over_predicted": statistics.median(ratios),
                   "time_over_predicted_range": [min(ratios), max(ratios)],
                   "fixed_bytes": dict(table.fixed_bytes)}
            out.append(row)
            print(f"{label:>16} {row['limit']:>10} {row['plan']:>24} tape/pred "
                  f"{row['peak_tape_over_predicted']:.3f} device/pred "
                  f"{row['device_over_predicted']:.3f} ({format_bytes(device_peak)} / "
                  f"{format_bytes(chosen.device_peak_bytes)}) time/pred "
                  f"{row['time_over_predicted']:.3f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--budgets", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=DEFAULT, choices=list(SIZES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cpu":  # pinned, as every CPU benchmark here (see bench/README.md)
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    result = rows(args.device, args.budgets, args.repeats, args.models)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"budget-{args.device}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
