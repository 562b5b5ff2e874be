"""One run of a sweep: what it needs (`SweepRun`), how it is measured (`measure`), and what it
gives back (`RunOutcome`). Kept apart from the table so that every way of running a sweep (one
process, or a Dask cluster in `sweep_cluster`) measures a run with the very same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .profiler import Profile, profile


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
    repeats: int = 3
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
    """A run's profile, its parameter gradients (float64) and its median time."""

    profile: Profile
    grads: list[np.ndarray]
    seconds: float


def _forward_backward(model: Any, preset: Any) -> list[Any]:
    from . import autograd
    from .strategies import scan, use

    loop_strategy = preset.loop_strategy(model.n_steps)

    def loop(step: Callable, init: Any, xs: Any) -> Any:
        return scan(step, init, xs, strategy=loop_strategy)

    with use(preset.storage_strategy):
        loss = model.run(loop)
    return autograd.grad(loss, model.params)


def run_one(model: Any, preset: Any, device: str, meta: dict[str, Any]) -> tuple[Profile, list]:
    """Run `model` forward and backward under `preset`, profiled; return profile and grads."""
    with profile(device=device, device_memory=True, strategy=preset.name, **meta) as prof:
        grads = _forward_backward(model, preset)
    return prof, [np.asarray(g.numpy(), dtype=np.float64) for g in grads]


def time_one(model: Any, preset: Any, device: str, repeats: int) -> float:
    """Median wall time of `repeats` unprofiled forward+backward runs (tracemalloc, which the
    profile's memory measurement needs, slows allocation-heavy code, so time is taken apart)."""
    from .profiler.memory import synchronize

    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        _forward_backward(model, preset)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure(run: SweepRun) -> RunOutcome:
    """Build the run's model, run it once profiled and `run.repeats` times for its median time."""
    instance = run.build()
    prof, grads = run_one(instance, run.preset, run.device, run.meta)
    seconds = time_one(instance, run.preset, run.device, run.repeats)
    prof.meta["median_seconds"] = seconds
    return RunOutcome(prof, grads, seconds)


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
