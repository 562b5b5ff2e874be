"""Issue 42: the time-memory trade-off of this engine and its peers, point by point, measured
side by side: the RNN ``h = tanh(h @ W + x_t @ U + b)`` (loss = sum of every h) and the
built-in residual MLP, under this engine's plans (keep-all, `Periodic`, `Binomial`, `Budget`,
int8 storage), PyTorch eager (keep-all, and `torch.utils.checkpoint` every k steps) and jitted
JAX (`lax.scan`, of `remat(step)`, two-level √T and three-level nested remat scans).

Each point is one job (`point`), run in a fresh worker process per point and per round, so its
peak resident set above the process's own baseline is a measure every library shares; the
rounds run every point of every case once, in an order rotated per round, and a point's time
relative to the numpy floor is the median over rounds of its time over the floor's time in the
same round (the machine's speed drifts by tens of percent over minutes; within a round it
drifts less). `merge_rounds` folds the rounds' rows into one row per point; `plot` draws the
curves, memory on x and time over the floor on y.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import rnn
from .measure import (
    _high_water_mark,
    _malloc_trim,
    _reset_high_water_mark,
    _rss,
    measure,
    pin_threads,
)
from .peers import require
from .table import MB, Row

BENCH = "pareto"


# ------------------------------------------------------------------------------ the points
def levels(steps: int, depth: int) -> list[int]:
    """`depth` loop lengths, outermost first, whose product is `steps`, each as near
    ``steps ** (1 / depth)`` as the divisors of what is left allow (√T segments of √T steps
    for two levels)."""
    sizes, rest = [], steps
    for left in range(depth, 1, -1):
        target = rest ** (1 / left)
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        d = min(divisors, key=lambda d: (abs(math.log(d / target)), -d))
        sizes.append(d)
        rest //= d
    return [*sizes, rest]


def points(steps: int, sizes: dict[str, Any], kind: str = "rnn") -> list[dict[str, Any]]:
    """The points of one case of `steps` steps: who runs it, the scheme, its parameter, its
    curve (``family``), its row name, and the peer it needs."""
    root = max(2, round(math.sqrt(steps)))
    every = sorted({max(1, round(root * f)) for f in sizes["every"]} - {steps})
    out = [{"who": "floor", "name": "numpy floor (by hand)", "family": "numpy floor"},
           {"who": "ours", "scheme": "keep-all", "name": "ours scan keep-all",
            "family": "ours keep-all"}]
    if kind == "rnn":  # products of a captured matrix to batch (the MLP's weights are rows)
        out.append({"who": "ours", "scheme": "keep-all", "batch_rows": True,
                    "name": "ours scan keep-all, batch_rows", "family": "ours keep-all"})
    out += [{"who": "ours", "scheme": f"every-{k}", "name": f"ours scan Periodic({k})",
             "family": "ours Periodic"} for k in every]
    out += [{"who": "ours", "scheme": f"revolve-{s}", "name": f"ours scan Binomial({s})",
             "family": "ours Binomial"} for s in sizes["snapshots"] if s < steps // 2]
    out += [{"who": "ours", "scheme": "budget", "fraction": f,
             "name": f"ours scan Budget({f:.0%} of keep-all's tape)", "family": "ours Budget"}
            for f in sizes["budget_fractions"]]
    out += [{"who": "ours", "scheme": "int8", "name": "ours scan int8 (Quantized)",
             "family": "ours int8"}]
    out += [{"who": "torch", "scheme": "eager", "name": "torch eager keep-all",
             "family": "torch eager", "peer": "torch"}]
    out += [{"who": "torch", "scheme": "every", "every": k,
             "name": f"torch checkpoint every {k}", "family": "torch checkpoint every k",
             "peer": "torch"} for k in every]
    jax_schemes = [("scan", [steps], False, "jax scan keep-all"),
                   ("remat", [steps], True, "jax scan(remat(step))"),
                   ("two-level", levels(steps, 2), False, "jax two-level"),
                   ("three-level", levels(steps, 3), False, "jax three-level")]
    out += [{"who": "jax", "scheme": scheme, "levels": lv, "remat_step": remat,
             "name": f"{name} {'x'.join(map(str, lv))}" if len(lv) > 1 else name,
             "family": name, "peer": "jax"}
            for scheme, lv, remat, name in jax_schemes]
    return out


def cases(sizes: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(case label, model params) of every case: the RNN at each T, then the residual MLP."""
    r = sizes["rnn"]
    out = [(f"rnn T={t}, B={r['batch']}, H={r['hidden']}, float32",
            {"model": "rnn", "steps": t, "batch": r["batch"], "hidden": r["hidden"],
             "input": r["input"]}) for t in r["steps"]]
    m = sizes["mlp"]
    out.append((f"residual MLP layers={m['layers']}, width={m['width']}, batch={m['batch']}",
                {"model": "residual_mlp", "sizes": dict(m)}))
    return out


# ------------------------------------------------------------------------------ the models
class _Model:
    """One case's arrays, its reference gradients, and its step in numpy terms."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.kind = params["model"]
        if self.kind == "rnn":
            self.arrays = rnn.data(params)
            self.steps = params["steps"]
            self.reference = rnn._reference(self.arrays)
        else:
            from checkpoint_ad.models import build

            self.built = build("residual_mlp", **params["sizes"])
            self.steps = self.built.n_steps
            cfg = self.built.config
            self.arrays = {"W": self.built.W.numpy(), "b": self.built.b.numpy(),
                           "data": self.built.data.numpy(),
                           "target": self.built.target.numpy(),
                           "reg": cfg.reg, "batch": cfg.batch}
            self.reference = [g.astype(np.float64)
                              for g in self.built.numpy_reference_loss_and_grads()[1]]


class _MLPFloor:
    def __init__(self, model: _Model) -> None:
        self.model = model.built
        self.grads: list[np.ndarray] | None = None

    def run(self) -> None:
        self.grads = self.model.numpy_reference_loss_and_grads()[1]

    def clear(self) -> None:
        self.grads = None


def _floor(model: _Model) -> Any:
    return rnn._Floor(model.arrays) if model.kind == "rnn" else _MLPFloor(model)


# ------------------------------------------------------------------------------ ours
def _keep_all_tape(model: _Model) -> int:
    """Keep-all's peak tape bytes, the profiler's, for the Budget points' limits."""
    import checkpoint_ad as cad

    work = _ours(model, None, cad.strategies.KeepAll())
    with cad.profile() as prof:
        work.run()
    work.clear()
    return int(prof.peak_tape_bytes)


def _ours(model: _Model, strategy: Any, storage: Any, batch_rows: bool = False) -> Any:
    if model.kind == "rnn":
        return rnn._Engine(model.arrays, strategy, storage, batch_rows=batch_rows)
    from .models import _Engine

    return _Engine(model.built, strategy, storage)


def _ours_grads(model: _Model, work: Any) -> list[np.ndarray]:
    if model.kind == "rnn":
        return work.grads()
    return [p.grad.numpy() for p in model.built.params]


def _ours_point(model: _Model, point: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import checkpoint_ad as cad

    extras: dict[str, Any] = {}
    if point["scheme"] == "budget":
        keep = _keep_all_tape(model)
        limit = max(1, int(keep * point["fraction"]))
        strategy, storage = cad.strategies.Budget(limit), cad.strategies.KeepAll()
        extras |= {"limit_bytes": limit, "keep_all_tape_bytes": keep}
    else:
        strategy, storage = rnn.preset_strategies(point["scheme"], model.steps)
    return _ours(model, strategy, storage, point.get("batch_rows", False)), extras


# ------------------------------------------------------------------------------ torch
class _Torch:
    """The case's loss in PyTorch eager, optionally with every `every` steps one
    `torch.utils.checkpoint` region (non-reentrant: what it saves is its input carry)."""

    def __init__(self, model: _Model, every: int | None) -> None:
        import torch
        import torch.utils.checkpoint as ckpt

        self.torch, self.ckpt, self.model, self.every = torch, ckpt, model, every
        a = model.arrays
        if model.kind == "rnn":
            self.params = [torch.from_numpy(a[k]).requires_grad_() for k in ("W", "U", "b")]
            self.h0 = torch.from_numpy(a["h0"])
            self.xs = torch.from_numpy(a["xs"]).unbind(0)
        else:
            self.params = [torch.from_numpy(a[k]).requires_grad_() for k in ("W", "b")]
            self.h0 = torch.from_numpy(a["data"])
            self.target = torch.from_numpy(a["target"])
        self.grads: list[np.ndarray] | None = None

    def _steps(self, h: Any, start: int, stop: int, rows: Sequence[Any]) -> tuple[Any, Any]:
        """Steps start..stop-1 from carry `h`: the carry and the sum of their outputs."""
        torch, total = self.torch, None
        for t in range(start, stop):
            if self.model.kind == "rnn":
                W, U, b = self.params
                h = torch.tanh(h @ W + self.xs[t] @ U + b)
                y = h.sum()
            else:
                W, b = rows
                h = h + torch.tanh(h @ W[t] + b[t])
                y = (h * h).sum()
            total = y if total is None else total + y
        return h, total

    def run(self) -> None:
        self.clear()
        # per-layer weights as views made once: W[t] inside the loop would scatter each
        # layer's gradient into a zero array of the whole stack
        rows = [p.unbind(0) for p in self.params] if self.model.kind != "rnn" else ()
        h, total, n = self.h0, None, self.model.steps
        k = self.every or n
        for start in range(0, n, k):
            stop = min(start + k, n)
            if self.every is None:
                h, part = self._steps(h, start, stop, rows)
            else:
                h, part = self.ckpt.checkpoint(self._steps, h, start, stop, rows,
                                               use_reentrant=False)
            total = part if total is None else total + part
        if self.model.kind == "rnn":
            loss = total
        else:
            a = self.model.arrays
            miss = h - self.target
            loss = (0.5 * (miss * miss).sum() + a["reg"] * total) / a["batch"]
        loss.backward()
        self.grads = [p.grad.numpy() for p in self.params]

    def clear(self) -> None:
        self.grads = None
        for p in self.params:
            p.grad = None


# ------------------------------------------------------------------------------ jax
class _Jax:
    """The case's loss as nested jitted `lax.scan`s: `levels` loop lengths, outermost first,
    every level below the outermost a `jax.checkpoint` of its scan (one level: a plain scan,
    of `remat(step)` when `remat_step`). Compiled before any measurement."""

    def __init__(self, model: _Model, levels_: list[int], remat_step: bool) -> None:
        import jax
        import jax.numpy as jnp

        self.jax, self.model = jax, model
        a = model.arrays
        if model.kind == "rnn":
            self.params = tuple(jnp.asarray(a[k]) for k in ("W", "U", "b"))
            xs, h0 = jnp.asarray(a["xs"]), jnp.asarray(a["h0"])
        else:
            self.params = (jnp.asarray(a["W"]), jnp.asarray(a["b"]))
            h0, target = jnp.asarray(a["data"]), jnp.asarray(a["target"])

        def loss(p: tuple[Any, ...]) -> Any:
            if model.kind == "rnn":
                W, U, b = p

                def step(h: Any, x: Any) -> tuple[Any, Any]:
                    h = jnp.tanh(h @ W + x @ U + b)
                    return h, jnp.sum(h)
                inputs: Any = xs
            else:
                def step(h: Any, x: Any) -> tuple[Any, Any]:
                    h = h + jnp.tanh(h @ x[0] + x[1])
                    return h, jnp.sum(h * h)
                inputs = p

            body = jax.checkpoint(step) if remat_step else step
            for _ in levels_[1:]:
                def body(h: Any, x: Any, inner: Any = body) -> tuple[Any, Any]:
                    return jax.lax.scan(inner, h, x)
                body = jax.checkpoint(body)
            nested = jax.tree_util.tree_map(
                lambda v: v.reshape(*levels_, *v.shape[1:]), inputs)
            h, ys = jax.lax.scan(body, h0, nested)
            if model.kind == "rnn":
                return jnp.sum(ys)
            miss = h - target
            return (0.5 * jnp.sum(miss * miss) + a["reg"] * jnp.sum(ys)) / a["batch"]

        self.compiled = jax.jit(jax.grad(loss)).lower(self.params).compile()
        self.out: Any = None

    def run(self) -> None:
        self.out = self.jax.block_until_ready(self.compiled(self.params))

    def clear(self) -> None:
        self.out = None

    def grads(self) -> list[np.ndarray]:
        return [np.asarray(g) for g in self.out]


# ------------------------------------------------------------------------------ one point
def _tiny(params: dict[str, Any]) -> dict[str, Any]:
    """The same case with every array tiny and the same number of steps: the same code runs
    (the same plan's shape, the same library paths), on almost no data."""
    if params["model"] == "rnn":
        return params | {"batch": 2, "hidden": 2, "input": 2}
    return params | {"sizes": params["sizes"] | {"width": 2, "batch": 2}}


def _work(params: dict[str, Any]) -> tuple[Any, Callable[[], list[np.ndarray]], dict, _Model]:
    """The point's workload, a function reading its gradients, its extras, and its model."""
    who = params["who"]
    model = _Model(params)
    extras: dict[str, Any] = {}
    if who == "floor":
        work: Any = _floor(model)
        return work, lambda: work.grads, extras, model
    if who == "ours":
        work, extras = _ours_point(model, params)
        return work, lambda: _ours_grads(model, work), extras, model
    if who == "torch":
        work = _Torch(model, params.get("every"))
        return work, lambda: work.grads, extras, model
    work = _Jax(model, params["levels"], params["remat_step"])
    stats = work.compiled.memory_analysis()
    if stats is not None:  # XLA's own count of the buffers one run allocates beyond its inputs
        extras["xla_temp_mib"] = (stats.temp_size_in_bytes + stats.output_size_in_bytes) / MB
    return work, work.grads, extras, model


def warm_up_tiny(params: dict[str, Any]) -> bool:
    """Run the point's program twice on tiny arrays (`_tiny`), so that the library's code
    pages, thread pools and lazy state are resident before `first_run_rss` takes its
    baseline; False where the tiny program could not run (a `Budget` fraction below the
    least plan of tiny arrays), and the baseline is then taken without it."""
    try:
        warm = _work(_tiny(params))[0]
        for _ in range(2):
            warm.run()
            warm.clear()
    except Exception:  # a best effort: the point itself still runs
        return False
    return True


def _file_pages() -> int | None:
    """Resident bytes backed by files (code and mapped libraries), `RssFile` in
    /proc/self/status; None where the kernel does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def first_run_rss(work: Any) -> int | None:
    """Peak resident bytes of the first `work.run()` above the resident set just before it,
    less the file-backed pages the run brought in (library code paged in on first use, which
    a run on large arrays reaches and one on tiny arrays does not: 4 MiB of XLA's here), so
    that it is the run's data. Taken after the imports, the data, JAX's compilation and
    `warm_up_tiny`. Not a run after a warm-up of `work` itself: XLA keeps its buffers from one
    run to the next (`malloc_trim` does not return them), so a second run's peak above its
    start undercounts JAX."""
    gc.collect()
    _malloc_trim()
    with contextlib.suppress(ImportError):
        base, files = _rss(), _file_pages()
        if _reset_high_water_mark():
            work.run()
            peak, files_after = _high_water_mark(), _file_pages()
            work.clear()
            if peak is None:
                return None
            paged_in = files_after - files if files is not None and files_after else 0
            return max(peak - base - max(paged_in, 0), 0)
    return None


def point(params: dict[str, Any], threads: int) -> dict[str, Any]:
    """One point of one case, in this fresh worker: peak RSS of its first run above the
    worker's baseline (`first_run_rss`), then time (median of `repeats` after a warm-up),
    the peak RSS of a run after that (``rss_steady_mib``), the tracemalloc peak for the
    numpy-only columns, and the gradients' error against the floor's."""
    who = params["who"]
    if who in ("torch", "jax"):
        require(who)
        if who == "torch":
            import torch  # noqa: F401  (its pool, pinned below)
        else:
            import jax  # noqa: F401
        pin_threads(threads)  # after the import: torch brings its own thread pool
    warmed = warm_up_tiny(params)
    work, grads, extras, model = _work(params)
    first = first_run_rss(work)
    result = measure(work, params["repeats"], warmup=1, traced=who in ("floor", "ours"),
                     check=lambda: {"grad_error": max(
                         float(np.max(np.abs(np.asarray(g, np.float64) - r))
                               / max(float(np.max(np.abs(r))), 1e-30))
                         for g, r in zip(grads(), model.reference))})
    if who == "ours" and params["scheme"] == "budget":
        chosen = work.strategy.last.chosen if work.strategy.last is not None else None
        extras["plan"] = None if chosen is None else chosen.name
    steady = result.pop("rss_bytes", None)
    result["rss_bytes"] = first
    result["extras"] = extras | {"family": params["family"], "round": params["round"],
                                 "steps": model.steps, "rss_steady_bytes": steady,
                                 "warmed_on_tiny_arrays": warmed}
    return result


# ------------------------------------------------------------------------------ the rounds
def merge_rounds(rows: Sequence[Row]) -> list[Row]:
    """One row per point of the pareto blocks (others untouched, in place): medians over
    rounds of time and memory, and ``/floor``, the median over rounds of the point's time
    over the floor's in the same round (its range in extras ``over_floor_range``)."""
    out: list[Row] = []
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if row.bench != BENCH:
            out.append(row)
            continue
        key = (row.case, row.name)
        if key not in groups:
            groups[key] = []
            out.append(row)  # a placeholder, replaced below, keeps the order
        groups[key].append(row)
    floors = {(r.case, r.extras.get("round")): r.seconds for r in rows
              if r.bench == BENCH and r.role == "floor" and r.seconds is not None}
    floor_mem = {}
    merged = {key: _merge(group, floors) for key, group in groups.items()}
    for (case, _), row in merged.items():
        if row.role == "floor":
            floor_mem[case] = row.rss_bytes
    for row in merged.values():
        ref = floor_mem.get(row.case)
        row.ratios["rss/floor"] = (row.rss_bytes / ref if row.rss_bytes is not None and ref
                                   else None)
    return [merged[(r.case, r.name)] if r.bench == BENCH else r for r in out]


def _median(values: Sequence[float | int | None]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _merge(group: list[Row], floors: dict[tuple[str, Any], float]) -> Row:
    measured = [r for r in group if r.seconds is not None]
    if not measured:  # skipped or failed in every round: its first note
        return group[0]
    first = measured[0]
    ratios = [r.seconds / floors[(r.case, r.extras.get("round"))] for r in measured
              if floors.get((r.case, r.extras.get("round")))]
    seconds = [r.seconds for r in measured]
    extras = dict(first.extras)
    extras.pop("round", None)
    extras["rounds"] = len(measured)
    steady = _median([r.extras.get("rss_steady_bytes") for r in measured])
    extras.pop("rss_steady_bytes", None)
    extras["warmed_on_tiny_arrays"] = all(r.extras.get("warmed_on_tiny_arrays", True)
                                          for r in measured)
    extras["rss_steady_mib"] = None if steady is None else steady / MB
    if ratios:
        extras["over_floor_range"] = f"{min(ratios):.2f}-{max(ratios):.2f}"
    failed = [r.note for r in group if r.seconds is None and r.note]
    return Row(first.bench, first.case, first.name, first.role,
               seconds=statistics.median(seconds), spread=[min(seconds), max(seconds)],
               repeats=sum(r.repeats for r in measured),
               tracemalloc_bytes=_median([r.tracemalloc_bytes for r in measured]),
               rss_bytes=_median([r.rss_bytes for r in measured]),
               grad_error=max((r.grad_error for r in measured if r.grad_error is not None),
                              default=None),
               ratios={"/floor": statistics.median(ratios) if ratios else None},
               extras=extras, note=failed[0] if failed else "")


# ------------------------------------------------------------------------------ the plot
def plot(rows: Sequence[Row], path: Path) -> Path | None:
    """One figure, a panel per case: each curve's points at (peak RSS above baseline, time
    over the numpy floor), written to `path`; None when matplotlib is not installed or no
    pareto row was measured."""
    measured = [r for r in rows if r.bench == BENCH and r.seconds is not None
                and r.ratios.get("/floor") is not None and r.rss_bytes is not None]
    if not measured:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    case_names = list(dict.fromkeys(r.case for r in measured))
    fig, axes = plt.subplots(1, len(case_names), figsize=(6.5 * len(case_names), 5.5),
                             squeeze=False)
    markers = {"ours": "o", "torch": "s", "jax": "^", "numpy": "*"}
    for ax, case in zip(axes[0], case_names):
        families: dict[str, list[Row]] = {}
        for r in measured:
            if r.case == case:
                families.setdefault(r.extras.get("family", r.name), []).append(r)
        for family, members in families.items():
            members.sort(key=lambda r: r.rss_bytes)
            xs = [max(r.rss_bytes, 1) / MB for r in members]
            ys = [r.ratios["/floor"] for r in members]
            ax.plot(xs, ys, marker=markers.get(family.split()[0], "x"),
                    linestyle="-" if len(members) > 1 else "none", label=family)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("peak RSS of a first run above the worker's baseline, MiB (log)")
        ax.set_ylabel("time / numpy floor (median over rounds)")
        ax.set_title(case, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
