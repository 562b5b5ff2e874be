"""Workload 6, memory budgets: how well `Budget` predicts, and whether its plans are fast.

For each model, budgets from keep-all's predicted peak down to the smallest plan's (spaced
geometrically). Each budget is run `repeats` times over: a new ``Budget(limit)`` plans from its
own dry run, its plan is timed at once, then the two fastest shipped presets whose measured
peak fits the budget. Reported: the plan's measured peak tape (the profiler's, under a loss that
saves nothing, less what the model's own code saved before the loop; both that and what the
model's own loss saves are reported apart) over its predicted peak and over the budget; the median
over repeats of the loop's measured time (its `scan` call and the gradient, not the model's
work around the loop, which no plan prices) over that repeat's prediction; and the median of
the whole run's time over each rival's in the same repeat, against the rival it is slowest
beside (the faster one: the larger median ratio; a rival whose plan the budget chose, the
same strategy and storage, is that repeat's own run, not timed twice).
Ratios of runs a moment apart: this machine's speed drifts by tens of percent over a minute,
which a median over a minute would measure instead.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from .measure import time_median

RIVALS = 2  # presets timed beside each budget: the fastest two that fit, by their own timing
PRESETS = ("keep-all", "store-inputs", "store-outputs", "sqrt-segments", "recompute",
           "revolve-4", "revolve-8", "revolve-16", "revolve-32")


def _runner(model: Any, strategy: Any, storage: Any,
            at_loop: Any = None, sync: Any = None) -> Any:
    """One run of `model` (its loop under `strategy`, saved values under `storage`) and its
    gradient; `at_loop()` is called as the loop starts. The run's `loop_seconds` (a
    one-item list) holds the last run's seconds in its `scan` call and in the gradient:
    what a prediction prices, without the model's work around the loop (its loss).
    `sync()`, where given, waits for the device at each end of both (a GPU's queued work)."""
    import checkpoint_ad as cad

    loop_seconds = [0.0]
    wait = sync if sync is not None else (lambda: None)
    until = getattr(model, "bench_until", None)  # see `budgets`

    def scan(step: Any, init: Any, xs: Any) -> Any:
        if at_loop is not None:
            at_loop()
        wait()
        began = time.perf_counter()
        out = cad.scan(step, init, xs, strategy=strategy, until=until)
        wait()
        loop_seconds[0] = time.perf_counter() - began
        return out

    def run() -> None:
        with cad.use(storage):
            loss = model.run(scan)
            began = time.perf_counter()
            cad.grad(loss, model.params)
            wait()
            loop_seconds[0] += time.perf_counter() - began

    run.loop_seconds = loop_seconds  # type: ignore[attr-defined]
    return run


def _peak(model: Any, strategy: Any, storage: Any) -> tuple[int, int]:
    """(peak tape bytes of the loop, tape bytes the model saved before it): the budget limits
    the loop's tape, not the caller's code around it (heat saves its diffusivity field before
    the loop, and its loss saves the final misfit), so the loop's peak is measured under a
    loss that saves nothing (sums of the outputs); what the model's own loss saves is
    measured apart (`_loss_saved_bytes`)."""
    import checkpoint_ad as cad

    before = 0

    def at_loop() -> None:
        nonlocal before
        before = prof.peak_tape_bytes

    with _quiet(model), cad.profile() as prof:
        _runner(model, strategy, storage, at_loop)()
    return prof.peak_tape_bytes - before, before


@contextlib.contextmanager
def _quiet(model: Any, quiet: bool = True) -> Iterator[None]:
    """`model` runs under `_quiet_loss` in this block (an attribute of this instance, for
    this block only); with `quiet` False, under its own loss."""
    if not quiet:
        yield
        return
    model.loss = _quiet_loss
    try:
        yield
    finally:
        del model.loss


def _quiet_loss(carry: Any, ys: Any) -> Any:
    """The sum of every output tensor: a loss whose tape saves nothing (a sum saves no value)."""
    import checkpoint_ad as cad
    from checkpoint_ad.pytree import flatten

    leaves = [leaf for leaf in flatten((carry, ys))[0] if isinstance(leaf, cad.Tensor)]
    loss = cad.sum(leaves[0])
    for leaf in leaves[1:]:
        loss = loss + cad.sum(leaf)
    return loss


def _loss_saved_bytes(model: Any, loss: Any) -> int:
    """Peak tape bytes of the model's own `loss` alone, on the outputs of its loop made leaves
    that require grad (as they would be graph values: what the loss saves is its own)."""
    import checkpoint_ad as cad
    from checkpoint_ad.pytree import flatten, unflatten

    with cad.no_grad():
        outputs = cad.scan(model.step, model.init_carry(), model.inputs())
    leaves, spec = flatten(outputs)
    carry, ys = unflatten(spec, [
        cad.tensor(leaf.numpy(), requires_grad=True) if isinstance(leaf, cad.Tensor) else leaf
        for leaf in leaves])
    with cad.profile() as prof:
        value = loss(carry, ys)
    del value
    return prof.peak_tape_bytes


def _device_peak(model: Any, strategy: Any, storage: Any, first_call: bool = True,
                 quiet: bool = True) -> int:
    """Peak bytes tracemalloc traced from the loop's start to the end of the gradient, above
    what was allocated when the loop started: every array and Python object the run made,
    the tape's and the engine's own alike, which the budget's device peak predicts. With
    `first_call`, the step programs kept from earlier calls are dropped first, so the loop
    runs as its first call does (the call the prediction is for); else as a later call.
    `quiet`: under a loss that saves nothing and makes no temporaries of its own, as `_peak`
    measures the tape (the model's loss is the caller's code after the loop, which no plan
    prices: heat's misfit holds two grids, 14% of the prediction at grid 32); else under the
    model's own loss."""
    import gc
    import tracemalloc

    base = 0

    def at_loop() -> None:
        nonlocal base
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()

    from checkpoint_ad.strategies.loops import program_cache

    if first_call:  # as the loop's first call runs: tracing two steps, compiling a program
        program_cache.clear()
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        with _quiet(model, quiet):
            _runner(model, strategy, storage, at_loop)()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        if not tracing:
            tracemalloc.stop()


def _presets(model: Any, repeats: int) -> list[tuple[str, int, float]]:
    """(name, measured peak tape, median seconds) of every shipped preset in `PRESETS`."""
    from checkpoint_ad.presets import load_preset
    from checkpoint_ad.strategies import Binomial

    out = []
    for name in PRESETS:
        preset = load_preset(name)
        strategy, storage = preset.loop_strategy(model.n_steps), preset.storage_strategy
        if getattr(model, "bench_until", None) is not None and not (
                strategy is None or isinstance(strategy, Binomial)):
            continue  # plans loops of known length only
        run = _runner(model, strategy, storage)
        out.append((name, _peak(model, strategy, storage)[0], time_median(run, repeats).median))
    return out


def _budget_row(model_name: str, model: Any, limit: int, rivals: list[str], repeats: int,
                fixed_bytes: dict[str, int], loss_saved: int) -> dict[str, Any]:
    """One budget, `repeats` times over: a new `Budget(limit)` plans from a dry run of its own,
    its plan is timed at once, then each rival preset, so every ratio compares runs a moment
    apart (this machine's speed drifts by tens of percent over seconds: a prediction dated
    to one moment and a median taken over a minute measure the drift, not the model)."""
    import checkpoint_ad as cad
    from checkpoint_ad.presets import load_preset
    from checkpoint_ad.strategies import Budget
    from checkpoint_ad.strategies.budget import forget_dry_runs, format_bytes

    rival_runs, rival_plans = [], []
    for name in rivals:
        preset = load_preset(name)
        rival_plans.append((preset.loop_strategy(model.n_steps), preset.storage_strategy))
        rival_runs.append(_runner(model, *rival_plans[-1]))
    times, over_predicted, plans = [], [], Counter()
    over_rival: list[list[float]] = [[] for _ in rivals]  # per rival, per repeat
    same_plan: set[str] = set()
    first = None
    for _ in range(repeats):
        forget_dry_runs()
        budget = Budget(limit)
        run = _runner(model, budget, cad.strategies.KeepAll())
        run()  # plans (the dry run); the timed run below reuses the plan
        chosen = budget.last.chosen
        if first is None:
            first = chosen
            peak, before_loop = _peak(model, budget, cad.strategies.KeepAll())
            device = _device_peak(model, budget, cad.strategies.KeepAll())
            later = _device_peak(model, budget, cad.strategies.KeepAll(), first_call=False)
            with_loss = _device_peak(model, budget, cad.strategies.KeepAll(), quiet=False)
        seconds = _once(run)
        loop_seconds = run.loop_seconds[0]  # type: ignore[attr-defined]
        # a rival whose plan the budget chose is this very run: timing it again would
        # compare two draws of the machine's noise, not two plans
        rival_seconds = []
        for name, plan, rival in zip(rivals, rival_plans, rival_runs):
            if plan == (chosen.strategy, chosen.storage):
                same_plan.add(name)
                rival_seconds.append(seconds)
            else:
                rival_seconds.append(_once(rival))
        times.append(seconds)
        over_predicted.append(loop_seconds / max(chosen.seconds, 1e-12))
        for ratios, rival_time in zip(over_rival, rival_seconds):
            ratios.append(seconds / rival_time)
        plans[chosen.name] += 1
    plan = plans.most_common(1)[0][0]
    # the faster rival is the one the budget's run reads slowest beside, by median ratio
    # (the least of two timings per repeat would pick each repeat's luckier draw)
    ratios = [statistics.median(r) for r in over_rival]
    faster = max(range(len(rivals)), key=ratios.__getitem__, default=0)
    return {
        "name": f"{model_name} {format_bytes(limit)}",
        "seconds": statistics.median(times),
        "spread": [min(times), max(times)],
        "repeats": repeats,
        "extras": {
            "model": model_name, "limit_bytes": limit, "plan": plan,
            "plans": dict(plans),
            "peak_tape_bytes": peak, "predicted_peak_bytes": first.peak_tape_bytes,
            "saved_before_loop_bytes": before_loop, "loss_saved_bytes": loss_saved,
            "peak_over_limit": peak / limit,
            "device_peak_bytes": device, "predicted_device_peak_bytes": first.device_peak_bytes,
            "device_over_predicted": device / max(first.device_peak_bytes, 1),
            "later_call_device_over_predicted": later / max(first.device_peak_bytes, 1),
            "with_model_loss_device_over_predicted": with_loss / max(first.device_peak_bytes, 1),
            "predicted_seconds": first.seconds,
            "peak_over_predicted": peak / max(first.peak_tape_bytes, 1),
            "time_over_predicted": statistics.median(over_predicted),
            "time_over_predicted_range": [min(over_predicted), max(over_predicted)],
            "best_preset": rivals[faster] if rivals else None,
            "rivals": rivals,
            "over_best_preset": ratios[faster] if rivals else None,
            "rivals_with_the_chosen_plan": sorted(same_plan),
            "fixed_bytes": fixed_bytes,
        },
    }


def _never(carry: Any) -> bool:
    return False


def _once(run: Any) -> float:
    """Seconds of one call of `run`."""
    return time_median(run, 1, warmup=0).median


def budgets(params: dict, threads: int) -> dict[str, Any]:
    """One row per (model, budget). A model's sizes may name the built-in model (``"model":
    "rnn"``): its key is then a label (one model at two sizes)."""
    import checkpoint_ad as cad
    from checkpoint_ad.models import build

    rows = []
    for model_name, sizes in params["models"].items():
        sizes = dict(sizes)
        kind = sizes.pop("model", model_name)
        until = _never if sizes.pop("until", False) else None
        model = build(kind, **sizes)
        # `until`: the loop stops when `until` says so (never, here: at the end of its xs),
        # so only keep-all and binomial plans placed online run it (an instance attribute,
        # which `_runner` hands every `scan` of this model)
        model.bench_until = until
        if kind == "heat":  # the step reads the diffusivity run() computes first
            model._kappa = cad.sigmoid(model.theta) * model.config.kappa_max
        table = cad.estimate(model.step, model.init_carry(), model.inputs(), until=until)
        top = next(r for r in table.rows if r.name == "keep-all").peak_tape_bytes
        low = table.minimum_bytes
        count = params["budgets"]
        limits = sorted({round(low * (top / low) ** (i / (count - 1))) for i in range(count)},
                        reverse=True)
        presets = _presets(model, params["repeats"])
        loss_saved = _loss_saved_bytes(model, model.loss)
        for limit in limits:
            fitting = sorted((seconds, name) for name, p, seconds in presets if p <= limit)
            rivals = [name for _, name in fitting[:RIVALS]]
            rows.append(_budget_row(model_name, model, limit, rivals, params["repeats"],
                                    dict(table.fixed_bytes), loss_saved))
    return {"rows": rows}
