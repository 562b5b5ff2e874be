"""One run of a sweep: what it needs (`SweepRun`), how it is measured (`measure`), and what it
gives back (`RunOutcome`). Kept apart from the table so that every way of running a sweep (one
process, or a Dask cluster in `sweep_cluster`) measures a run with the very same code.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .origins import as_user_code
from .profiler import Profile, profile
from .strategies import Budget, KeepAll, Strategy


@dataclass(frozen=True)
class SweepRun:
    """Everything one run needs, small and picklable so that it can travel to a worker.

    A sweep is a list of these, keep-all first; a new column of runs (e.g. a memory budget)
    is a new field here and more entries in the list.
    """

    model: str
    preset: Any  # a presets.Preset (or an object with its interface)
    device: str = "cpu"
    sizes: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # written into the run's profile
    repeats: int = 5
    in_table: bool = True  # False: measured only as the reference the other rows are compared to

    def build(self) -> Any:
        """A fresh instance of the run's model (models are seeded, so every build is the same)."""
        from .models import build

        return build(self.model, device=None if self.device == "cpu" else self.device,
                     **self.sizes)

    def describe(self) -> str:
        """How error messages name the run."""
        return f"preset {self.preset.name!r} on model {self.model!r}"


@dataclass
class RunOutcome:
    """A run's profile, its parameter gradients (float64), its median time and every timed
    run's seconds (in the order they ran) and, for a budget column, the plan its budget chose
    and what it predicted (made where the run ran)."""

    profile: Profile
    grads: list[np.ndarray]
    seconds: float
    prediction: dict[str, Any] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class BudgetRun:
    """A memory budget run as a sweep's column, like a preset: every loop under
    ``Budget(limit)``. One `Budget` serves all the column's runs: it plans in an unprofiled
    warm-up run, and the profiled and timed runs reuse that dry run, so they measure the plan
    alone."""

    limit: int | str
    lossy: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", Budget(self.limit, lossy=self.lossy))

    @property
    def name(self) -> str:
        text = str(self.limit).replace(" ", "")
        return f"budget-{text}" + ("-lossy" if self.lossy else "")

    @property
    def label(self) -> str:
        return self.name

    @property
    def lossless(self) -> bool:
        return not self.lossy

    @property
    def storage_strategy(self) -> Strategy:
        return KeepAll()

    def loop_strategy(self, n_steps: int) -> Budget:
        return self.budget  # type: ignore[attr-defined]


def _prediction(preset: Any) -> dict[str, Any]:
    """A budget column's chosen plan and its predicted figures (nothing for a preset)."""
    if not isinstance(preset, BudgetRun):
        return {}
    last = preset.budget.last  # type: ignore[attr-defined]
    if last is None or last.chosen is None:
        return {}
    row = last.chosen
    return {"plan": row.name, "predicted_peak_bytes": row.peak_tape_bytes,
            "predicted_seconds": row.seconds}


def _forward_backward(model: Any, preset: Any) -> list[Any]:
    from . import autograd
    from .strategies import scan, use

    loop_strategy = preset.loop_strategy(model.n_steps)

    def loop(step: Callable, init: Any, xs: Any) -> Any:
        return scan(step, init, xs, strategy=loop_strategy)

    with use(preset.storage_strategy):
        loss = model.run(loop)
    return list(autograd.grad(loss, model.params))


def run_one(model: Any, preset: Any, device: str, meta: dict[str, Any]) -> tuple[Profile, list]:
    """Run `model` forward and backward under `preset`, profiled; return profile and grads.
    Saved values name the lines of the model that saved them (`origins.as_user_code`)."""
    folder = os.path.dirname(inspect.getfile(type(model)))
    with as_user_code(folder), profile(device=device, device_memory=True,
                                       strategy=preset.name, **meta) as prof:
        grads = _forward_backward(model, preset)
    return prof, [np.asarray(g.numpy(), dtype=np.float64) for g in grads]


def time_once(model: Any, preset: Any, device: str) -> float:
    """Wall time of one unprofiled forward+backward run (tracemalloc, which the profile's
    memory measurement needs, slows allocation-heavy code, so time is taken apart)."""
    from .profiler.memory import synchronize

    synchronize(device)
    start = time.perf_counter()
    _forward_backward(model, preset)
    synchronize(device)
    return time.perf_counter() - start


def time_one(model: Any, preset: Any, device: str, repeats: int) -> float:
    """Median wall time of `repeats` unprofiled forward+backward runs, one after another."""
    return float(np.median([time_once(model, preset, device) for _ in range(repeats)]))


def profiled(run: SweepRun) -> tuple[Any, RunOutcome]:
    """Build the run's model and run it once profiled; the outcome's times are still to take
    (`timed`), with the model returned for them."""
    instance = run.build()
    if isinstance(run.preset, BudgetRun):  # plan in a warm-up run: the timed runs then
        _forward_backward(instance, run.preset)  # time the plan alone, not its dry run
    prof, grads = run_one(instance, run.preset, run.device, run.meta)
    return instance, RunOutcome(prof, grads, 0.0, _prediction(run.preset))


def timed(outcome: RunOutcome) -> RunOutcome:
    """`outcome` with its median time set from its `times`."""
    outcome.seconds = float(np.median(outcome.times))
    outcome.profile.meta["median_seconds"] = outcome.seconds
    return outcome


def measure(run: SweepRun) -> RunOutcome:
    """Build the run's model, run it once profiled and `run.repeats` times for its median time
    (one run alone, as on a cluster's worker; `measure_interleaved` times a serial sweep)."""
    instance, outcome = profiled(run)
    outcome.times = [time_once(instance, run.preset, run.device) for _ in range(run.repeats)]
    return timed(outcome)


def measure_interleaved(runs: list[SweepRun], show: bool = False) -> list[RunOutcome]:
    """Every run profiled once, then timed in rounds: A, B, C, ..., then A, B, C again, each
    run `repeats` times. A slow spell of the machine (another program, a clock change) then
    falls on every preset alike rather than on the one that happened to run during it, and
    each row's spread shows how far its time can be trusted."""
    prepared = [profiled(run) for run in progress(runs, show)]
    schedule = [k for round_ in range(max(run.repeats for run in runs))
                for k, run in enumerate(runs) if round_ < run.repeats]
    for k in progress(schedule, show, total=len(schedule)):
        instance, outcome = prepared[k]
        outcome.times.append(time_once(instance, runs[k].preset, runs[k].device))
    return [timed(outcome) for _, outcome in prepared]


@contextmanager
def pinned_threads(threads: int) -> Iterator[int | None]:
    """BLAS/OpenMP pools limited to `threads` threads for the block (threadpoolctl), as the
    bench and a cluster's workers run: a run's time then does not depend on how many cores
    happen to be idle, and sweeps compare. Yields the count in effect (`blas_threads`)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=threads):
        yield blas_threads()


def blas_threads() -> int | None:
    """The most threads any loaded BLAS/OpenMP pool may use now (None: no pool loaded)."""
    from threadpoolctl import threadpool_info

    counts = [pool["num_threads"] for pool in threadpool_info()]
    return max(counts) if counts else None


def warm_up(run: SweepRun) -> None:
    """One unmeasured run: imports, caches and allocator pools settle before measuring."""
    run_one(run.build(), run.preset, run.device, run.meta)


def progress(items: Iterable[Any], show: bool, total: int | None = None) -> Iterable[Any]:
    """`items`, behind a progress bar when `show` and tqdm is there (a TTY only)."""
    if not show:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience; the sweep runs without it
        return items
    return tqdm(items, total=total, desc="strategies", unit="run", leave=False, disable=None)
