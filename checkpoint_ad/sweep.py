"""Sweeps: one model under many strategies, each run profiled, with gradient errors measured
against keeping everything in the same run. The command line's main job is a thin face on this.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SweepConfigError, SweepFormatError
from .profiler import Profile
from .profiler.records import from_plain
from .safe_files import child, write_text
from .strategies.budget import parse_bytes
from .sweep_cluster import check_cluster_options, run_on_cluster
from .sweep_runs import (
    BudgetRun,
    RunOutcome,
    SweepRun,
    measure_interleaved,
    pinned_threads,
    run_one,
    time_one,
    warm_up,
)

__all__ = ["SCHEMA", "SweepResult", "SweepRow", "run_one", "sweep", "time_one", "within_noise"]

SCHEMA = "checkpoint-ad/sweep"


@dataclass(frozen=True)
class SweepRow:
    """One strategy's figures; ratios are to the keep-everything run of the same sweep.

    `peak_tape_bytes` is the profile's: the most bytes of saved values the tape *owns* alive
    at once, which is what a strategy can save; saved references to the caller's own arrays
    are in `aliased_bytes`.

    `seconds` is the median of `timed_runs` timed runs, `seconds_min`/`seconds_max` their
    spread; `within_noise` is True when that spread (or keep-all's) is at least the row's
    distance from keep-all's median, so the time difference cannot be told from noise (None
    for keep-all itself, for a single timed run, and in older tables).
    """

    preset: str
    label: str
    lossless: bool
    peak_tape_bytes: int
    device_peak_bytes: int | None
    seconds: float
    recompute_seconds: float
    recomputed_primitives: int
    grad_error: float  # max over parameters of |g - g_keep| / |g_keep|
    memory_ratio: float  # peak tape bytes / keep-everything's
    time_ratio: float  # seconds / keep-everything's
    # most bytes of the caller's own memory (parameters, input data) the tape held by
    # reference at once: not in peak_tape_bytes, which counts what the tape owns; None in a
    # table written before the two were told apart (its peak_tape_bytes includes them)
    aliased_bytes: int | None = None
    # a budget's run (`sweep(budgets=...)`): the plan it chose and what it predicted for it;
    # None for presets
    plan: str | None = None
    predicted_peak_bytes: int | None = None
    predicted_seconds: float | None = None
    seconds_min: float | None = None
    seconds_max: float | None = None
    timed_runs: int | None = None
    within_noise: bool | None = None
    budget_bytes: int | None = None  # a budget's limit (bytes); None for presets


# fields added to the table after its first release: absent from older tables, None there
_ADDED_FIELDS = ("aliased_bytes", "plan", "predicted_peak_bytes", "predicted_seconds",
                 "seconds_min", "seconds_max", "timed_runs", "within_noise", "budget_bytes")


@dataclass
class SweepResult:
    """A sweep's table and the profile of every run."""

    model: str
    device: str
    meta: dict[str, Any]
    rows: list[SweepRow] = field(default_factory=list)
    profiles: dict[str, Profile] = field(default_factory=dict)

    def table(self) -> str:
        """The table as text, one row per strategy."""
        head = (f"{'strategy':<22}{'peak tape MiB':>14}{'x keep':>8}{'aliased MiB':>12}"
                f"{'device MiB':>12}{'median s':>9}{'min-max s':>14}{'x keep':>8}"
                f"{'noise':>8}{'re-run ops':>11}{'grad error':>12}")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            device = "-" if r.device_peak_bytes is None else f"{r.device_peak_bytes / 2**20:.2f}"
            aliased = "-" if r.aliased_bytes is None else f"{r.aliased_bytes / 2**20:.3f}"
            spread = ("-" if r.seconds_min is None or r.seconds_max is None
                      else f"{r.seconds_min:.3f}-{r.seconds_max:.3f}")
            noise = "within" if r.within_noise else ""
            lines.append(
                f"{r.preset:<22}{r.peak_tape_bytes / 2**20:>14.3f}{r.memory_ratio:>8.2f}"
                f"{aliased:>12}{device:>12}{r.seconds:>9.3f}{spread:>14}{r.time_ratio:>8.2f}"
                f"{noise:>8}{r.recomputed_primitives:>11}{r.grad_error:>12.2e}"
            )
        if any(r.timed_runs for r in self.rows):
            runs = max(r.timed_runs or 0 for r in self.rows)
            lines.append(f"median and min-max of {runs} timed runs per strategy; "
                         "noise 'within': the spread is at least the difference from keep-all")
        threads = self.meta.get("blas_threads")
        if threads is not None:  # absent from tables written before sweeps pinned threads
            lines.append(f"BLAS threads per run: {threads}")
        for r in self.rows:
            if r.plan is not None and r.predicted_peak_bytes is not None:
                lines.append(
                    f"{r.preset}: ran {r.plan}; predicted {r.predicted_peak_bytes / 2**20:.3f} "
                    f"MiB tape and {r.predicted_seconds or 0.0:.3f} s, measured "
                    f"{r.peak_tape_bytes / 2**20:.3f} MiB and {r.seconds:.3f} s")
        return "\n".join(lines)

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(SweepRow.__dataclass_fields__))
        writer.writeheader()
        for r in self.rows:
            writer.writerow(asdict(r))
        return out.getvalue()

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "device": self.device, "meta": self.meta,
                "rows": [asdict(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, data: Any) -> SweepResult:
        """The table from its `to_dict` form (profiles are separate files), every key and type
        checked; `SweepFormatError` names the first wrong key and what was expected."""
        if not isinstance(data, dict) or "profiles" in data:
            raise SweepFormatError("a sweep table must be a JSON object with keys model, "
                                   f"device, meta, rows; got {type(data).__name__}"
                                   + (" with a 'profiles' key" if isinstance(data, dict) else ""))
        rows = data.get("rows")
        if isinstance(rows, list):  # tables from before owned and aliased bytes were apart,
            # before budgets ran in sweeps, and before times had a spread
            added = dict.fromkeys(_ADDED_FIELDS)
            data = {**data, "rows": [{**added, **r} if isinstance(r, dict) else r
                                     for r in rows]}
        return from_plain(cls, {**data, "profiles": {}}, "sweep table", SweepFormatError)

    @classmethod
    def load(cls, path: str | Path) -> SweepResult:
        """Read a ``sweep-<model>.json`` written by `save` (the table only, no profiles)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SweepFormatError(f"cannot read sweep table {str(path)!r}: {exc}") from exc
        except RecursionError:  # a table nests a few levels; this is not one
            raise SweepFormatError(f"cannot read sweep table {str(path)!r}: nested too deeply; "
                                   "was the file made by another tool?") from None
        try:
            return cls.from_dict(data)
        except SweepFormatError as exc:
            raise SweepFormatError(f"{path}: {exc}") from exc

    def file_names(self) -> dict[str, str]:
        """The file name `save` gives each preset's profile: ``<model>-<preset>.json``, made
        safe as one path component (names come from data, so they must not steer the path)."""
        return {name: child(".", f"{self.model}-{name}.json").name
                for name in [r.preset for r in self.rows] + list(self.profiles)}

    def save(self, folder: str | Path) -> Path:
        """Write the table (CSV, JSON, text) and each run's profile JSON under `folder`, each
        file atomically and never through a symlink (`checkpoint_ad.safe_files`)."""
        folder = Path(folder)
        stem = f"sweep-{self.model}"
        write_text(child(folder, f"{stem}.csv"), self.to_csv())
        write_text(child(folder, f"{stem}.json"), json.dumps(self.to_dict(), indent=1))
        write_text(child(folder, f"{stem}.txt"), self.table() + "\n")
        names = self.file_names()
        for name, prof in self.profiles.items():
            prof.save(folder / names[name])
        return folder


def _relative_error(grads: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    worst = 0.0
    for g, r in zip(grads, reference, strict=True):
        scale = float(np.linalg.norm(r)) or 1.0
        worst = max(worst, float(np.linalg.norm(g.astype(np.float64) - r)) / scale)
    return worst


def sweep(
    model: str = "rnn",
    presets: Sequence[Any] | None = None,
    device: str = "cpu",
    sizes: dict[str, Any] | None = None,
    progress: bool = True,
    repeats: int = 5,
    *,
    dirs: Sequence[str | Path] = (),
    allow_python: bool = False,
    workers: int | None = None,
    client: Any = None,
    budgets: Sequence[int | str] = (),
    threads: int = 1,
) -> SweepResult:
    """Run `model` under each preset (keep-all first, as the reference) and collect a table.

    Each preset runs once profiled (memory, saved values, recompute counts) and `repeats`
    times unprofiled for its median time and spread; here the timed runs are interleaved
    (every preset once, then every preset again, ...), so a slow spell of the machine falls
    on all presets alike. Presets named by string are looked up with
    `load_preset` (`dirs` and `allow_python` are passed on). Each of `budgets` (bytes, or sizes
    such as ``"16MiB"``) is one more column, every loop run under ``Budget(limit)``; its row
    names the plan the budget chose and what it predicted (`SweepRow.plan`,
    `predicted_peak_bytes`, `predicted_seconds`).

    Every run uses `threads` BLAS threads (threadpoolctl; one by default, as the bench): on a
    machine with idle cores a multi-threaded BLAS makes times depend on what else runs, and
    sweeps stop comparing. The table's `meta` records the count as ``blas_threads``.

    By default every run happens here, one after another. `workers=N` fans the runs out over
    a local Dask cluster of N single-threaded worker processes; `client=` a
    ``distributed.Client`` or a scheduler address (``"tcp://host:port"``) uses that cluster
    instead (see `checkpoint_ad.sweep_cluster`; needs the ``dask`` extra). Either way the rows,
    their order and the gradient errors are those of the serial sweep; only measured times and
    memory peaks can differ.

    >>> from checkpoint_ad.sweep import sweep
    >>> result = sweep("rnn", ["keep-all", "revolve-4"], sizes={"steps": 8}, progress=False,
    ...                repeats=1)
    >>> [r.preset for r in result.rows]
    ['keep-all', 'revolve-4']
    """
    from .models import build, check_memory, sizes_of
    from .presets import DEFAULT_SWEEP, load_preset

    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise SweepConfigError(f"sweep: repeats must be a positive int, got {repeats!r}")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise SweepConfigError(f"sweep: threads must be a positive int, got {threads!r}")
    check_cluster_options(workers, client)
    sizes = dict(sizes or {})
    chosen = [load_preset(p, dirs=dirs, allow_python=allow_python)
              if isinstance(p, (str, Path)) else p
              for p in (presets or ([] if budgets else DEFAULT_SWEEP))]
    chosen += [BudgetRun(limit) for limit in budgets]
    reference = load_preset("keep-all")
    order = [reference] + [p for p in chosen if p.name != reference.name]
    if client is None:  # keep-all runs as the reference: refuse what cannot fit here
        check_memory(model, **sizes)
    # built here also when the runs happen elsewhere: bad sizes fail before any run starts
    first = build(model, device=None if device == "cpu" else device, **sizes)
    # every size, the defaults included, and the BLAS threads each run had
    meta = {"model": model, **sizes_of(first), **sizes, "blas_threads": threads}
    in_table = {p.name for p in chosen}
    runs = [SweepRun(model, preset, device, sizes, meta, repeats, preset.name in in_table)
            for preset in order]
    if workers is None and client is None:
        with pinned_threads(threads):
            warm_up(runs[0])
            outcomes = measure_interleaved(runs, progress)
    else:
        outcomes = run_on_cluster(runs, workers=workers, client=client,
                                  progress_bar=progress, threads=threads)
    return _merge(SweepResult(model, device, meta), runs, outcomes)


def _merge(result: SweepResult, runs: list[SweepRun], outcomes: list[RunOutcome]) -> SweepResult:
    """Fill `result` with one row per run in `runs` order, compared with the first (keep-all).

    How the outcomes were made (here or on workers) does not matter: the gradient errors come
    from the returned gradients, so they equal the serial sweep's."""
    base = outcomes[0]
    for run, outcome in zip(runs, outcomes, strict=True):
        prof, preset = outcome.profile, run.preset
        result.profiles[preset.name] = prof
        if not run.in_table:
            continue  # measured as the reference only
        result.rows.append(SweepRow(
            preset=preset.name,
            label=preset.label,
            lossless=preset.lossless,
            peak_tape_bytes=prof.peak_tape_bytes,
            device_peak_bytes=prof.device_peak_bytes,
            seconds=outcome.seconds,
            recompute_seconds=prof.recompute_seconds,
            recomputed_primitives=prof.recomputed_primitives,
            grad_error=_relative_error(outcome.grads, base.grads),
            memory_ratio=prof.peak_tape_bytes / max(base.profile.peak_tape_bytes, 1),
            time_ratio=outcome.seconds / max(base.seconds, 1e-12),
            aliased_bytes=prof.aliased_bytes,
            **outcome.prediction,
            seconds_min=min(outcome.times) if outcome.times else None,
            seconds_max=max(outcome.times) if outcome.times else None,
            timed_runs=len(outcome.times) or None,
            within_noise=None if run is runs[0] else within_noise(outcome.times, base.times),
            budget_bytes=(parse_bytes(preset.limit) if isinstance(preset, BudgetRun)
                          else None),
        ))
    return result


def within_noise(times: Sequence[float], reference: Sequence[float]) -> bool | None:
    """Whether a row's time cannot be told from the reference's: the spread (max - min) of
    either set of timed runs is at least the distance between their medians. None when a set
    has fewer than two runs (no spread to judge by).

    >>> within_noise([1.0, 1.2, 1.1], [1.05, 1.0, 1.1])
    True
    >>> within_noise([2.0, 2.1, 2.05], [1.0, 1.02, 1.01])
    False
    """
    if len(times) < 2 or len(reference) < 2:
        return None
    spread = max(max(times) - min(times), max(reference) - min(reference))
    return bool(spread >= abs(float(np.median(times)) - float(np.median(reference))))
