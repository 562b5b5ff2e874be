"""Workload 6, memory budgets: how well `Budget` predicts, and whether its plans are fast.

For each model, budgets from keep-all's predicted peak down to the smallest plan's (spaced
geometrically): the loop runs under ``Budget(limit)``, planned in a warm-up run (so the timed
runs time the plan, not the dry run), and its measured peak tape (the profiler's, less what the
model's own code saved before the loop, reported apart) and median time are compared with what
the budget predicted for the plan it chose, and with the fastest shipped preset whose measured
peak fits the same budget.
"""

from __future__ import annotations

from typing import Any

from .measure import time_median

PRESETS = ("keep-all", "store-inputs", "store-outputs", "sqrt-segments", "recompute",
           "revolve-4", "revolve-8", "revolve-16", "revolve-32")


def _runner(model: Any, strategy: Any, storage: Any,
            at_loop: Any = None) -> Any:
    """One run of `model` (its loop under `strategy`, saved values under `storage`) and its
    gradient; `at_loop()` is called as the loop starts."""
    import checkpoint_ad as cad

    def scan(step: Any, init: Any, xs: Any) -> Any:
        if at_loop is not None:
            at_loop()
        return cad.scan(step, init, xs, strategy=strategy)

    def run() -> None:
        with cad.use(storage):
            loss = model.run(scan)
            cad.grad(loss, model.params)

    return run


def _peak(model: Any, strategy: Any, storage: Any) -> tuple[int, int]:
    """(peak tape bytes of the loop, tape bytes the model saved before it): the budget
    limits the loop's tape; what the caller's code saved before the loop (heat saves its
    diffusivity field) is reported apart, as it is in no plan's power."""
    import checkpoint_ad as cad

    before = 0

    def at_loop() -> None:
        nonlocal before
        before = prof.peak_tape_bytes

    with cad.profile() as prof:
        _runner(model, strategy, storage, at_loop)()
    return prof.peak_tape_bytes - before, before


def _presets(model: Any, repeats: int) -> list[tuple[str, int, float]]:
    """(name, measured peak tape, median seconds) of every shipped preset in `PRESETS`."""
    from checkpoint_ad.presets import load_preset

    out = []
    for name in PRESETS:
        preset = load_preset(name)
        strategy, storage = preset.loop_strategy(model.n_steps), preset.storage_strategy
        run = _runner(model, strategy, storage)
        out.append((name, _peak(model, strategy, storage)[0], time_median(run, repeats).median))
    return out


def budgets(params: dict, threads: int) -> dict[str, Any]:
    """One row per (model, budget)."""
    import checkpoint_ad as cad
    from checkpoint_ad.models import build
    from checkpoint_ad.strategies import Budget
    from checkpoint_ad.strategies.budget import forget_dry_runs, format_bytes

    rows = []
    for model_name, sizes in params["models"].items():
        model = build(model_name, **sizes)
        if model_name == "heat":  # the step reads the diffusivity run() computes first
            model._kappa = cad.sigmoid(model.theta) * model.config.kappa_max
        table = cad.estimate(model.step, model.init_carry(), model.inputs())
        top = next(r for r in table.rows if r.name == "keep-all").peak_tape_bytes
        low = table.minimum_bytes
        count = params["budgets"]
        limits = sorted({round(low * (top / low) ** (i / (count - 1))) for i in range(count)},
                        reverse=True)
        presets = _presets(model, params["repeats"])
        for limit in limits:
            budget = Budget(limit)
            run = _runner(model, budget, cad.strategies.KeepAll())
            # each budget plans from a dry run of its own, just before its runs are timed: the
            # prediction and the measurement then see the machine in the same state (budgets
            # share one dry run by default, which would date every prediction to the first)
            forget_dry_runs()
            run()  # plans (the dry run); the runs below reuse it
            chosen = budget.last.chosen
            peak, before_loop = _peak(model, budget, cad.strategies.KeepAll())
            timing = time_median(run, params["repeats"], warmup=0)
            fitting = [(name, seconds) for name, p, seconds in presets if p <= limit]
            best = min(fitting, key=lambda item: item[1]) if fitting else None
            rows.append({
                "name": f"{model_name} {format_bytes(limit)}",
                "seconds": timing.median,
                "spread": [timing.low, timing.high],
                "repeats": timing.repeats,
                "extras": {
                    "model": model_name, "limit_bytes": limit, "plan": chosen.name,
                    "peak_tape_bytes": peak, "predicted_peak_bytes": chosen.peak_tape_bytes,
                    "saved_before_loop_bytes": before_loop,
                    "predicted_seconds": chosen.seconds,
                    "peak_over_predicted": peak / max(chosen.peak_tape_bytes, 1),
                    "time_over_predicted": timing.median / max(chosen.seconds, 1e-12),
                    "best_preset": best[0] if best else None,
                    "over_best_preset": timing.median / best[1] if best else None,
                    "fixed_bytes": dict(table.fixed_bytes),
                },
            })
    return {"rows": rows}
