"""Plots on top of the profiler's query API: a sweep's memory/compute trade-off, live tape bytes
over time, and saved bytes per op.

Every figure is a bare `matplotlib.figure.Figure` (never pyplot), so plotting needs no display,
leaves no global figure state behind, and works under any backend, in threads and in tests; a
notebook with the inline backend shows the returned figure as usual. Pass ``ax=`` to draw into
an axes of your own figure instead.

>>> from checkpoint_ad.plots import pareto_front
>>> pareto_front([(1.0, 5.0), (2.0, 2.0), (3.0, 3.0), (4.0, 1.0)])
[0, 1, 3]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib as mpl
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LinearSegmentedColormap, LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Annotation
from matplotlib.ticker import FuncFormatter, NullFormatter
from matplotlib.transforms import Bbox

from .errors import PlotError
from .profiler import Profile
from .safe_files import child, write_with
from .sweep import SweepResult, SweepRow

__all__ = ["PlotError", "breakdown", "pareto_front", "plot_sweep", "save", "timeline",
           "tradeoff"]

KEEP_ALL = "keep-all"  # the reference preset every sweep measures first
DPI = 150
TIMES = "\N{MULTIPLICATION SIGN}"

# Applied while artists are made: sizes that stay readable in a PNG at DPI and in a slide.
STYLE = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
}

PHASE_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "recompute": "#55a868"}
LOSSLESS_COLOUR = "#4c72b0"
# Gradient error on lossy points: pale orange (small) to dark red (large); the pale yellow end
# of YlOrRd is cut off because it vanishes on white.
ERROR_CMAP = LinearSegmentedColormap.from_list(
    "grad_error", mpl.colormaps["YlOrRd"](np.linspace(0.3, 1.0, 256)))


# ------------------------------------------------------------------ units
_BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _byte_unit(largest: float) -> tuple[str, float]:
    """The largest binary unit in which `largest` bytes is at least 1 (KiB at the least)."""
    for name, size in _BYTE_UNITS:
        if largest >= size:
            return name, size
    return "KiB", 2**10


def _bytes_label(stored: int, logical: int) -> str:
    """'2.61 KiB', or '2.61 of 15.5 KiB (5.9x smaller)' when stored is compressed."""
    whole = max(stored, logical)
    unit, size = _byte_unit(whole) if whole >= 2**10 else ("B", 1)
    if logical > 0 and stored < logical:
        return (f"{stored / size:.3g} of {logical / size:.3g} {unit} "
                f"({logical / max(stored, 1):.1f}{TIMES} smaller)")
    return f"{stored / size:.3g} {unit}"


def _short_sci(value: float) -> str:
    """3.1e-03 -> '3e-3': one significant figure, for labels next to points."""
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


# ------------------------------------------------------------------ trade-off axes
@dataclass(frozen=True)
class _Measure:
    """One column of a sweep row the trade-off plot can put on an axis."""

    title: str
    unit: str  # "bytes": scaled to a unit chosen from the data; otherwise printed as is
    get: Callable[[SweepRow], float | None]


X_MEASURES: dict[str, _Measure] = {
    # what the tape owns: saved references to the caller's parameters and data are left out
    "peak_tape_bytes": _Measure("peak owned tape memory", "bytes",
                                lambda r: r.peak_tape_bytes),
    "device_peak_bytes": _Measure("device peak memory", "bytes", lambda r: r.device_peak_bytes),
    "memory_ratio": _Measure("peak tape memory relative to keep-all", TIMES,
                             lambda r: r.memory_ratio),
}
Y_MEASURES: dict[str, _Measure] = {
    "time_ratio": _Measure("time relative to keep-all", TIMES, lambda r: r.time_ratio),
    "recomputed_primitives": _Measure("recomputed primitives", "count",
                                      lambda r: r.recomputed_primitives),
    "seconds": _Measure("forward + backward time", "s", lambda r: r.seconds),
}


def _measure(table: dict[str, _Measure], name: str, which: str) -> _Measure:
    if name not in table:
        raise PlotError(f"unknown {which} axis {name!r}; choose one of {sorted(table)}")
    return table[name]


def _values(rows: Sequence[SweepRow], measure: _Measure,
            name: str) -> tuple[np.ndarray, str, float]:
    """The column as floats in display units, the axis label, and the display unit's size
    (bytes per unit; 1 for columns shown as they are)."""
    raw = [measure.get(r) for r in rows]
    missing = [r.preset for r, v in zip(rows, raw) if v is None]
    if missing:
        raise PlotError(f"{name} was not measured for {missing}; plot another axis (e.g. "
                        "'peak_tape_bytes') or re-run the sweep where the device can be probed")
    values = np.asarray(raw, dtype=np.float64)
    if measure.unit != "bytes":
        return values, f"{measure.title} ({measure.unit})", 1.0
    unit, size = _byte_unit(float(values.max()))
    return values / size, f"{measure.title} ({unit})", float(size)


WIDE_RANGE = 10.0
"""An axis whose values span more than this factor is drawn on a log scale: on a linear one,
a point far off (revolve's 50x less memory, a slow lossy run) squashes the rest together."""


def _log_scale(values: np.ndarray) -> bool:
    """Whether an axis of these values reads better on a log scale (all positive, wide)."""
    return bool(values.size and (values > 0).all()
                and values.max() / values.min() > WIDE_RANGE)


def _time_spread(rows: Sequence[SweepRow], y: str) -> tuple[np.ndarray, np.ndarray,
                                                             np.ndarray] | None:
    """(which rows, low, high) of the timed runs' min-max in the y axis's units, for rows that
    have a spread; None when y is no time or no row has one."""
    if y not in ("seconds", "time_ratio"):
        return None
    which = np.array([r.seconds_min is not None and r.seconds_max is not None
                      and r.seconds > 0 and r.time_ratio > 0 for r in rows])
    if not which.any():
        return None
    chosen = [r for r, w in zip(rows, which) if w]
    scale = [r.seconds / r.time_ratio if y == "time_ratio" else 1.0 for r in chosen]
    low = np.array([r.seconds_min / k for r, k in zip(chosen, scale)], dtype=np.float64)
    high = np.array([r.seconds_max / k for r, k in zip(chosen, scale)], dtype=np.float64)
    return which, low, high


def _budget_text(row: SweepRow, x: str, scale: float, unit: str) -> str | None:
    """A budget point's limit in the x axis's unit ('limit 4 MiB', 'limit 0.25x'), or None."""
    if row.budget_bytes is None:
        return None
    if x == "memory_ratio":
        keep = row.peak_tape_bytes / row.memory_ratio if row.memory_ratio > 0 else 0.0
        return f"limit {row.budget_bytes / keep:.3g}{TIMES}" if keep else None
    if X_MEASURES[x].unit == "bytes":
        return f"limit {row.budget_bytes / scale:.3g} {unit}"
    return None


# ------------------------------------------------------------------ Pareto front
def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (both minimised).

    A point is dropped when another is at most as large in x and in y and smaller in one.
    Exact duplicates on the front are all kept. The indices come sorted by x (then y), which
    is the order to draw the front as a step line.

    >>> pareto_front([(3, 1), (1, 3), (2, 2), (2, 3), (3, 3)])
    [1, 2, 0]
    >>> pareto_front([])
    []
    """
    pts = [(float(x), float(y)) for x, y in points]
    bad = [i for i, (x, y) in enumerate(pts) if not (math.isfinite(x) and math.isfinite(y))]
    if bad:
        raise PlotError(f"points {bad} are not finite ({[pts[i] for i in bad]}); "
                        "a Pareto front needs numbers")
    order = sorted(range(len(pts)), key=lambda i: (pts[i][0], pts[i][1], i))
    front: list[int] = []
    best: tuple[float, float] | None = None  # the front point with the smallest y so far
    for i in order:
        x, y = pts[i]
        if best is None or y < best[1] or (x, y) == best:
            front.append(i)
            best = (x, y)
    return front


# ------------------------------------------------------------------ shared helpers
def _figure(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


# meta keys that are no model size
_NOT_SIZES = ("model", "strategy", "median_seconds", "blas_threads", "worker")


def _sizes_text(meta: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in meta.items() if k not in _NOT_SIZES)


def _title(head: str, detail: str) -> str:
    """'head: detail' on one line, or two when one would run past a figure's width."""
    return f"{head}: {detail}" if len(head) + len(detail) <= 72 else f"{head}\n{detail}"


def _profile_title(what: str, profile: Profile) -> str:
    meta = profile.meta
    parts = [str(meta["strategy"])] if "strategy" in meta else []
    model = str(meta.get("model", ""))
    sizes = _sizes_text(meta)
    if model or sizes:
        parts.append(f"{model} ({sizes})" if sizes else model)
    parts.append(profile.device)
    return _title(what, " · ".join(parts))


def _overlap(a: Bbox, b: Bbox) -> float:
    both = Bbox.intersection(a, b)
    return 0.0 if both is None else both.width * both.height


def _outside(box: Bbox, frame: Bbox) -> float:
    """Area of `box` that lies outside `frame`."""
    return box.width * box.height - _overlap(box, frame)


def _candidates() -> list[tuple[float, float, str, str, float, float]]:
    """Places tried for a label, cheapest first: (cos, sin, ha, va, gap, cost).

    Eight directions on three rings; `gap` is the distance (points) from the marker's edge.
    Sideways first, as a label beside a point reads best; the outer rings get a leader line.
    """
    out = []
    for ring, gap in enumerate(_GAPS):
        for turn, degrees in enumerate((0, 180, 45, 135, -45, -135, 90, -90)):
            cos, sin = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
            ha = "left" if cos > 0.3 else "right" if cos < -0.3 else "center"
            va = "bottom" if sin > 0.3 else "top" if sin < -0.3 else "center"
            out.append((cos, sin, ha, va, gap, 80.0 * ring + 4.0 * turn))
    return out


_GAPS = (2.5, 16.0, 32.0)
_CANDIDATES = _candidates()
_LABEL_SIZE = 8.5
_HA_SHIFT = {"left": 0.0, "center": 0.5, "right": 1.0}  # of the text's width, leftwards
_VA_SHIFT = {"bottom": 0.0, "center": 0.5, "top": 1.0}  # of its height, downwards


def _segment_boxes(segments: Sequence[np.ndarray], width: float = 1.5) -> list[Bbox]:
    """Thin boxes around axis-parallel segments (display coordinates): lines labels avoid."""
    boxes = []
    for (x0, y0), (x1, y1) in segments:
        boxes.append(Bbox.from_extents(min(x0, x1) - width, min(y0, y1) - width,
                                       max(x0, x1) + width, max(y0, y1) + width))
    return boxes


def _distance(box: Bbox, point: np.ndarray) -> float:
    """From `point` to the nearest part of `box` (0 inside it)."""
    dx = max(box.x0 - point[0], 0.0, point[0] - box.x1)
    dy = max(box.y0 - point[1], 0.0, point[1] - box.y1)
    return math.hypot(dx, dy)


def _nearest_point(box: Bbox, point: np.ndarray) -> np.ndarray:
    """Where a leader line from `point` meets `box`, near enough: its closest point."""
    return np.array([min(max(point[0], box.x0), box.x1), min(max(point[1], box.y0), box.y1)])


def _crosses_box(a: np.ndarray, b: np.ndarray, box: Bbox) -> bool:
    """Whether segment a-b passes through `box` (sampled; the ends themselves excluded)."""
    return any(box.contains(*(a + f * (b - a))) for f in np.linspace(0.1, 0.9, 9))


def _segments_cross(a: np.ndarray, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> bool:
    """Whether segments a-b and c-d properly intersect."""
    def side(p: np.ndarray, q: np.ndarray, r: np.ndarray) -> float:
        return float((q[0] - p[0]) * (r[1] - p[1]) - (q[1] - p[1]) * (r[0] - p[0]))
    return (side(a, b, c) * side(a, b, d) < 0) and (side(c, d, a) * side(c, d, b) < 0)


def _place_labels(ax: Axes, xy: np.ndarray, texts: Sequence[str], radii: Sequence[float],
                  avoid: Sequence[Bbox] = (), lines: Sequence[Bbox] = ()) -> list[Annotation]:
    """Label each point where its text covers the least of other labels, markers and lines.

    Greedy, most crowded point first: each label tries the offsets in `_CANDIDATES` and keeps
    the cheapest, scoring overlapping area with labels already placed, markers (of `radii`
    points) and `avoid` boxes, a share of the length of `lines` it crosses, a leader line
    through anything, other points nearer the label than its own (which would misread), and
    most of all any part outside the axes. Offsets are in points, so the result survives
    saving at another dpi. Call it after a draw (`draw_without_rendering`) has settled the
    layout, so that display coordinates are final.
    """
    fig = ax.figure.figure  # the root figure, also when `ax` sits in a subfigure
    pixels = ax.transData.transform(xy)
    frame = ax.get_window_extent()
    per_point = fig.dpi / 72
    markers = [Bbox.from_extents(px - r * per_point, py - r * per_point,
                                 px + r * per_point, py + r * per_point)
               for (px, py), r in zip(pixels, radii)]
    gaps = np.hypot(*(pixels[:, None, :] - pixels[None, :, :]).transpose(2, 0, 1))
    crowding = (gaps < 40 * per_point).sum(axis=1)
    order = sorted(range(len(texts)), key=lambda i: (-crowding[i], i))
    sizes = []
    for text in texts:  # measured once; each candidate box is then arithmetic
        probe = ax.text(0, 0, text, fontsize=_LABEL_SIZE)
        box = probe.get_window_extent()
        probe.remove()
        sizes.append((box.width, box.height))
    placed: list[Bbox] = list(avoid)
    leaders: list[tuple[np.ndarray, np.ndarray]] = []
    labels: list[Annotation] = []
    for i in order:
        others = [m for j, m in enumerate(markers) if j != i]
        width, height = sizes[i]
        best = (math.inf, 0, Bbox.null())  # (score, index into _CANDIDATES, box)
        for k, (cos, sin, ha, va, gap, cost) in enumerate(_CANDIDATES):
            dx, dy = (radii[i] + gap) * cos, (radii[i] + gap) * sin
            x = pixels[i][0] + dx * per_point - _HA_SHIFT[ha] * width
            y = pixels[i][1] + dy * per_point - _VA_SHIFT[va] * height
            box = Bbox.from_bounds(x, y, width, height).padded(2 * per_point)
            own = _distance(box, pixels[i])
            closer = sum(_distance(box, p) < own for j, p in enumerate(pixels) if j != i)
            score = (cost + 20 * _outside(box, frame) + 100 * closer
                     + 3 * sum(_overlap(box, b) for b in placed)
                     + 4 * sum(_overlap(box, m) for m in others)
                     + 2 * sum(_overlap(box, b) for b in lines)
                     + 150 * sum(_crosses_box(a, b, box) for a, b in leaders))
            if gap > _GAPS[0]:  # a leader line: keep it off labels, markers and other leaders
                start, end = pixels[i], _nearest_point(box, pixels[i])
                score += 150 * sum(_crosses_box(start, end, b) for b in [*placed, *others])
                score += 150 * sum(_segments_cross(start, end, a, b) for a, b in leaders)
            if score < best[0]:
                best = (score, k, box)
        _, k, box = best
        cos, sin, ha, va, gap, _ = _CANDIDATES[k]
        dx, dy = (radii[i] + gap) * cos, (radii[i] + gap) * sin
        far = gap > _GAPS[0]
        label = ax.annotate(
            texts[i], xy[i], xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
            fontsize=_LABEL_SIZE,
            arrowprops={"arrowstyle": "-", "color": "0.45", "lw": 0.6, "shrinkA": 1,
                        "shrinkB": radii[i] * 0.8} if far else None,
        )
        label.set_in_layout(False)  # kept inside the axes by the placement, not by the layout
        placed.append(box)
        if far:
            leaders.append((pixels[i], _nearest_point(box, pixels[i])))
        labels.append(label)
    return labels


# ------------------------------------------------------------------ trade-off
def _rows_with_reference(result: SweepResult) -> list[SweepRow]:
    """The sweep's rows, with keep-all added from its profile when it ran only as reference."""
    rows = list(result.rows)
    if all(r.preset != KEEP_ALL for r in rows) and KEEP_ALL in result.profiles:
        p = result.profiles[KEEP_ALL]
        rows.insert(0, SweepRow(
            preset=KEEP_ALL, label=KEEP_ALL, lossless=True, peak_tape_bytes=p.peak_tape_bytes,
            device_peak_bytes=p.device_peak_bytes, seconds=p.total_seconds,
            recompute_seconds=p.recompute_seconds, recomputed_primitives=p.recomputed_primitives,
            grad_error=0.0, memory_ratio=1.0, time_ratio=1.0, aliased_bytes=p.aliased_bytes,
        ))
    return rows


def _lossy_points(fig: Figure, ax: Axes, xs: np.ndarray, ys: np.ndarray,
                  errors: np.ndarray) -> Line2D:
    """Diamonds coloured by gradient error on a log scale, with a colorbar; the legend entry.

    Errors of exactly zero (a quantizer that left small tensors alone) take the low end of
    the scale; when all are zero there is no scale to show and no colorbar.
    """
    style = {"s": 70, "marker": "D", "edgecolors": "0.2", "linewidths": 0.8, "zorder": 4}
    positive = errors[errors > 0]
    if positive.size == 0:
        ax.scatter(xs, ys, color=ERROR_CMAP(0.0), **style)
        return Line2D([], [], ls="", marker="D", markersize=7, color=ERROR_CMAP(0.0),
                      markeredgecolor="0.2", label="lossy (gradient error 0)")
    # whole decades, so the bar always has labelled ticks at powers of ten
    low = 10.0 ** math.floor(math.log10(float(positive.min())))
    high = max(10.0 ** math.ceil(math.log10(float(positive.max()))), low * 10)
    points = ax.scatter(xs, ys, c=np.maximum(errors, low), cmap=ERROR_CMAP,
                        norm=LogNorm(low, high), **style)
    bar = fig.colorbar(points, ax=ax, label="relative gradient error (lossy)", pad=0.02,
                       fraction=0.05, aspect=30)
    # plain "1e-3" labels: mathtext ones cost a parse per figure, half the time of a plot
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _short_sci(v)))
    bar.ax.yaxis.set_minor_formatter(NullFormatter())
    return Line2D([], [], ls="", marker="D", markersize=7, color=ERROR_CMAP(0.45),
                  markeredgecolor="0.2", label="lossy (colour: gradient error)")


def _predicted_points(rows: Sequence[SweepRow], x: str, y: str, xs: np.ndarray,
                      ys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(which rows, predicted x, predicted y) in the axes' units, for rows a budget ran; None
    when there are none or the axes are not tape bytes and time."""
    if x != "peak_tape_bytes" or y not in ("seconds", "time_ratio"):
        return None
    which = np.array([r.predicted_peak_bytes is not None and r.predicted_seconds is not None
                      for r in rows])
    if not which.any():
        return None
    raw = np.array([r.peak_tape_bytes for r in rows], dtype=np.float64)
    scale = float(xs.max() / raw.max()) if raw.max() > 0 else 1.0
    px = np.array([r.predicted_peak_bytes for r in rows if r.predicted_peak_bytes is not None
                   and r.predicted_seconds is not None], dtype=np.float64) * scale
    seconds = np.array([r.predicted_seconds for r, w in zip(rows, which) if w], dtype=np.float64)
    if y == "time_ratio":
        keep = [r.seconds / r.time_ratio for r, w in zip(rows, which) if w and r.time_ratio > 0]
        seconds = seconds / (keep[0] if keep else 1.0)
    return which, px, seconds


def _prediction_marks(ax: Axes, xs: np.ndarray, ys: np.ndarray, which: np.ndarray,
                      px: np.ndarray, py: np.ndarray) -> Line2D:
    """Hollow squares at the predictions, dotted to the measured points; the legend entry."""
    for mx_, my_, qx, qy in zip(xs[which], ys[which], px, py):
        ax.plot([qx, mx_], [qy, my_], color="0.45", ls=":", lw=1.0, zorder=3)
    ax.scatter(px, py, s=60, marker="s", facecolors="none", edgecolors=LOSSLESS_COLOUR,
               linewidths=1.2, zorder=4)
    return Line2D([], [], ls="", marker="s", markersize=8, markerfacecolor="none",
                  color=LOSSLESS_COLOUR, label="budget: predicted (dotted to measured)")


def tradeoff(result: SweepResult, x: str = "peak_tape_bytes", y: str = "time_ratio",
             ax: Axes | None = None) -> Figure:
    """The memory/compute trade-off of a sweep: one labelled point per strategy.

    Circles are lossless strategies, diamonds lossy ones, coloured by their gradient error
    (also written under the name). The step line is the Pareto front of the lossless points
    (least memory for the time, both minimised; a lossy point trades accuracy too, so it is
    shown beside the front, never on it) and its points are ringed; dashed lines cross at
    keep-all, the reference. On a time axis each point's bar spans the min-max of its timed
    runs, and a point whose time cannot be told from keep-all's says "within noise". An axis
    whose values span more than `WIDE_RANGE` is logarithmic. A budget's run
    (`sweep(budgets=...)`) names its limit in the x axis's unit and also shows, as a hollow
    square joined to its measured point, what its plan was predicted to cost (on tape-bytes
    and time axes).
    `x` is one of `X_MEASURES` (bytes are shown in KiB/MiB/GiB, whichever reads
    best), `y` one of `Y_MEASURES`.

    >>> from checkpoint_ad.sweep import SweepResult, SweepRow
    >>> row = SweepRow("keep-all", "keep-all", True, 2**20, None, 0.1, 0.0, 0, 0.0, 1.0, 1.0)
    >>> fig = tradeoff(SweepResult("rnn", "cpu", {"model": "rnn", "steps": 8}, [row]))
    >>> fig.axes[0].get_xlabel()
    'peak owned tape memory (MiB)'
    """
    mx = _measure(X_MEASURES, x, "x")
    my = _measure(Y_MEASURES, y, "y")
    rows = _rows_with_reference(result)
    if not rows:
        raise PlotError(f"sweep of {result.model!r} has no rows to plot; run sweep() with at "
                        "least one preset")
    xs, xlabel, xscale = _values(rows, mx, x)
    ys, ylabel, _ = _values(rows, my, y)
    names = [r.preset for r in rows]
    lossless = np.array([r.lossless for r in rows])
    errors = np.array([r.grad_error for r in rows], dtype=np.float64)
    exact = [i for i in range(len(rows)) if lossless[i]]  # the front: lossless points only
    front = [exact[k] for k in pareto_front([(xs[i], ys[i]) for i in exact])]
    log_x, log_y = _log_scale(xs), _log_scale(ys)

    with mpl.rc_context(STYLE):
        fig, ax = _figure(ax, (8.0, 5.5))
        handles: list[Any] = []
        if KEEP_ALL in names:
            ref = names.index(KEEP_ALL)
            for line in (ax.axvline(xs[ref], color="0.6", ls="--", lw=0.8, zorder=1),
                         ax.axhline(ys[ref], color="0.6", ls="--", lw=0.8, zorder=1)):
                line.set_label("_")
            handles.append(Line2D([], [], color="0.6", ls="--", lw=0.8,
                                  label="keep-all (reference)"))

        if log_x:
            ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        step_x = step_y = np.empty(0)
        if front:
            fx, fy = xs[front], ys[front]
            if xs.max() > fx[-1]:  # the last front point is also the best beyond it
                fx, fy = np.append(fx, xs.max()), np.append(fy, fy[-1])
            # the steps drawn as plain vertices, so the labels can avoid the very same segments
            step_x = np.repeat(fx, 2)[1:]
            step_y = np.repeat(fy, 2)[:-1]
            ax.plot(step_x, step_y, color="0.25", lw=1.4, zorder=2)
            ax.scatter(xs[front], ys[front], s=190, facecolors="none", edgecolors="0.15",
                       linewidths=1.4, zorder=3)
            handles.append(Line2D([], [], color="0.25", lw=1.4, marker="o", markersize=11,
                                  markerfacecolor="none", label="Pareto front (lossless)"))

        spread = _time_spread(rows, y)
        if spread is not None:
            which, low, high = spread
            ax.errorbar(xs[which], ys[which], yerr=[ys[which] - low, high - ys[which]],
                        fmt="none", ecolor="0.35", elinewidth=1.0, capsize=3, zorder=3)
            handles.append(Line2D([], [], color="0.35", lw=1.0, marker="_", markersize=7,
                                  label="min-max of the timed runs"))

        if lossless.any():
            ax.scatter(xs[lossless], ys[lossless], s=60, marker="o", color=LOSSLESS_COLOUR,
                       edgecolors="white", linewidths=0.8, zorder=4)
            handles.append(Line2D([], [], ls="", marker="o", markersize=8,
                                  color=LOSSLESS_COLOUR, label="lossless"))
        lossy = ~lossless
        if lossy.any():
            handles.append(_lossy_points(fig, ax, xs[lossy], ys[lossy], errors[lossy]))

        predicted = _predicted_points(rows, x, y, xs, ys)
        if predicted is not None:
            handles.append(_prediction_marks(ax, xs, ys, *predicted))

        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.margins(x=0.12, y=0.14)
        if x != "memory_ratio" and xs.min() >= 0 and not log_x:
            ax.set_xlim(left=0)  # memory from zero, so distances read as ratios
        sizes = _sizes_text(result.meta)
        threads = result.meta.get("blas_threads")  # what the times were measured with
        ax.set_title(_title("memory/compute trade-off", f"{result.model}"
                            + (f" ({sizes})" if sizes else "") + f" on {result.device}"
                            + ("" if threads is None else f", {threads} BLAS thread"
                               + ("" if threads == 1 else "s"))))
        legend = ax.legend(handles=handles, loc="best", framealpha=0.9)
        fig.figure.draw_without_rendering()
        # pin the legend where "best" put it, clear of the points, before the labels go in
        corner = ax.transAxes.inverted().transform(legend.get_window_extent().p0)
        legend = ax.legend(handles=handles, loc=tuple(corner), framealpha=0.9)

        unit = xlabel.rsplit("(", 1)[-1].rstrip(")")
        texts = []
        for r, ok, e in zip(rows, lossless, errors):
            lines = [r.preset] if ok else [r.preset, f"err {_short_sci(e)}"]
            budget = _budget_text(r, x, xscale, unit)
            if budget is not None:
                lines.append(budget)
            if r.within_noise and y in ("seconds", "time_ratio"):
                lines.append("(time within noise)")
            texts.append("\n".join(lines))
        on_front = set(front)
        radii = [7.5 if i in on_front else 5.0 for i in range(len(rows))]
        frame = ax.get_window_extent()
        step = ax.transData.transform(np.column_stack([step_x, step_y]))
        segments = list(itertools.pairwise(step))
        if KEEP_ALL in names:
            kx, ky = ax.transData.transform((xs[ref], ys[ref]))
            segments += [np.array([(kx, frame.y0), (kx, frame.y1)]),
                         np.array([(frame.x0, ky), (frame.x1, ky)])]
        _place_labels(ax, np.column_stack([xs, ys]), texts, radii,
                      avoid=[legend.get_window_extent().padded(3)],
                      lines=_segment_boxes(segments))
    return fig


# ------------------------------------------------------------------ timeline
def _runs(phases: Sequence[str]) -> list[tuple[str, int, int]]:
    """Contiguous runs of one phase as (phase, first index, index after the last)."""
    runs: list[tuple[str, int, int]] = []
    start = 0
    for i in range(1, len(phases) + 1):
        if i == len(phases) or phases[i] != phases[start]:
            runs.append((phases[start], start, i))
            start = i
    return runs


def timeline(profile: Profile, ax: Axes | None = None) -> Figure:
    """Live saved bytes over time as a step line, with the phases shaded behind it.

    Forward, backward and recompute stretches each get a colour, so a checkpointing schedule
    reads off the plot: the tape grows in the forward sweep, shrinks in the backward sweep,
    and refills in short recompute bursts. The peak is marked and labelled.

    >>> from checkpoint_ad.profiler import Profile
    >>> prof = Profile(timeline_seconds=[0.0, 0.5, 1.0], timeline_bytes=[0, 4096, 0],
    ...                timeline_phase=["forward", "forward", "backward"])
    >>> timeline(prof).axes[0].get_ylabel()
    'live saved bytes (KiB)'
    """
    t = np.asarray(profile.timeline_seconds, dtype=np.float64)
    b = np.asarray(profile.timeline_bytes, dtype=np.float64)
    phases = list(profile.timeline_phase)
    if t.size == 0:
        raise PlotError("profile has no timeline points; record it with "
                        "`with checkpoint_ad.profile() as prof:` around forward and backward")
    if not (t.size == b.size == len(phases)):
        raise PlotError(f"timeline lists differ in length (seconds {t.size}, bytes {b.size}, "
                        f"phase {len(phases)}); the profile is corrupt")
    unit, size = _byte_unit(float(b.max()))
    b = b / size
    if t[-1] - t[0] < 1.0:
        t, t_unit = t * 1e3, "ms"
    else:
        t_unit = "s"
    end = t[-1] if t[-1] > t[0] else t[0] + 1.0

    with mpl.rc_context(STYLE):
        fig, ax = _figure(ax, (9.0, 4.5))
        present: list[str] = []
        spans: dict[str, list[tuple[float, float]]] = {}
        for phase, first, stop in _runs(phases):
            right = t[stop] if stop < t.size else end
            spans.setdefault(phase, []).append((t[first], right - t[first]))
        for phase, ranges in spans.items():
            # one artist per phase: a recompute schedule can alternate thousands of times
            ax.broken_barh(ranges, (0, 1), transform=ax.get_xaxis_transform(),
                           color=PHASE_COLOURS.get(phase, "0.7"), alpha=0.18, lw=0, zorder=0)
            present.append(phase)
        ax.step(t, b, where="post", color="0.15", lw=1.3, zorder=2)

        peak = int(np.argmax(b))
        top = b[peak] if b[peak] > 0 else 1.0
        ax.plot(t[peak], b[peak], "o", color="#c44e52", ms=6, zorder=3)
        on_left = (t[peak] - t[0]) < 0.6 * (end - t[0])
        ax.annotate(f"peak {b[peak]:.3g} {unit}", (t[peak], b[peak]),
                    xytext=(8 if on_left else -8, 4), textcoords="offset points",
                    ha="left" if on_left else "right", va="bottom", fontsize=9,
                    color="#c44e52", fontweight="bold")

        ax.set_xlim(t[0], end)
        ax.set_ylim(0, top * 1.32)  # headroom above the peak holds the legend
        ax.set_xlabel(f"time since the profile began ({t_unit})")
        ax.set_ylabel(f"live saved bytes ({unit})")
        ax.set_title(_profile_title("saved-value timeline", profile))
        order = [p for p in PHASE_COLOURS if p in present] + \
                [p for p in present if p not in PHASE_COLOURS]
        handles: list[Any] = [Line2D([], [], color="0.15", lw=1.3, label="live saved bytes")]
        handles += [Patch(color=PHASE_COLOURS.get(p, "0.7"), alpha=0.35, label=p) for p in order]
        ax.legend(handles=handles, loc="upper right", ncol=len(handles), framealpha=0.9)
    return fig


# ------------------------------------------------------------------ breakdown
def breakdown(profile: Profile, ax: Axes | None = None, top: int = 10) -> Figure:
    """Stored bytes per op alive at the tape's peak as horizontal bars, largest first, logical
    bytes pale behind them: what the peak is made of (`Profile.by_op_at_peak()`), which is
    what a strategy has to cut; bytes saved and freed long before the peak do not count. A
    profile without the peak's buffers (a version 1 or 2 file) shows every byte ever saved
    (`Profile.by_op()`), and its axis says so.

    Where a strategy compresses (quantized storage), the pale logical bar sticks out past the
    stored one and the label gives the ratio. Ops beyond the `top` largest share one "other"
    bar. Each buffer counts once.

    >>> from checkpoint_ad.profiler import Profile, SavedRecord
    >>> rec = SavedRecord("tanh", "output", (4, 8), "float32", 128, 32, "demo.py:1", 0, "forward")
    >>> breakdown(Profile(records=[rec], peak_buffers={"0": 32})).axes[0].get_xlabel()
    "bytes alive at the tape's peak (KiB)"
    """
    if top < 1:
        raise PlotError(f"top must be at least 1; got {top!r}")
    table = profile.by_op_at_peak()
    at_peak = bool(table)
    if not at_peak:
        table = profile.by_op()
    if not table:
        raise PlotError("profile saved no values, so there is nothing to break down; profile "
                        "a run that records operations on tensors requiring grad")
    ops = sorted(table.items(), key=lambda kv: (-kv[1]["stored"], -kv[1]["logical"], kv[0]))
    rows = [(f"{op} ({row['count']} saved)", row["stored"], row["logical"])
            for op, row in ops[:top]]
    rest = ops[top:]
    if len(rest) == 1:  # an "other" bar for one op would hide its name for nothing
        rows.append((f"{rest[0][0]} ({rest[0][1]['count']} saved)", rest[0][1]["stored"],
                     rest[0][1]["logical"]))
    elif rest:
        rows.append((f"{len(rest)} other ops ({sum(r['count'] for _, r in rest)} saved)",
                     sum(r["stored"] for _, r in rest), sum(r["logical"] for _, r in rest)))
    labels = [r[0] for r in rows]
    unit, size = _byte_unit(max(max(r[1], r[2]) for r in rows))
    stored = np.array([r[1] for r in rows], dtype=np.float64) / size
    logical = np.array([r[2] for r in rows], dtype=np.float64) / size
    pos = np.arange(len(rows))

    with mpl.rc_context(STYLE):
        fig, ax = _figure(ax, (8.0, max(3.0, 1.6 + 0.42 * len(rows))))
        ax.barh(pos, logical, height=0.66, color=LOSSLESS_COLOUR, alpha=0.25,
                label="logical (uncompressed)")
        ax.barh(pos, stored, height=0.66, color=LOSSLESS_COLOUR, label="stored")
        for y, (_, s, lg) in zip(pos, rows):
            ax.annotate(_bytes_label(s, lg), (max(s, lg) / size, y), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize=8.5)
        ax.set_yticks(pos, labels)
        ax.invert_yaxis()  # largest at the top
        ax.grid(axis="y", visible=False)
        widest = float(max(stored.max(), logical.max())) or 1.0
        ax.set_xlim(0, widest * 1.45)  # room for the value labels
        if at_peak:
            ax.set_xlabel(f"bytes alive at the tape's peak ({unit})")
            ax.set_title(_profile_title("saved bytes per op at the peak", profile))
        else:
            ax.set_xlabel(f"bytes saved over the whole run ({unit})")
            ax.set_title(_profile_title("saved bytes per op", profile))
        if (logical > stored).any():  # otherwise the pale bars are hidden: nothing to explain
            ax.legend(loc="best", framealpha=0.9)
    return fig


# ------------------------------------------------------------------ files
def save(fig: Figure, stem: str | Path) -> list[Path]:
    """Write `stem.png` (at DPI) and `stem.svg`, creating folders; return both paths.

    The suffixes are appended, never substituted, so a stem like ``rnn-revolve-4.0`` is safe.
    Each file is written atomically and never through a symlink (`checkpoint_ad.safe_files`).
    """
    png, svg = Path(f"{stem}.png"), Path(f"{stem}.svg")
    write_with(png, lambda f: fig.savefig(f, format="png", dpi=DPI, facecolor="white"))
    write_with(svg, lambda f: fig.savefig(f, format="svg", facecolor="white"))
    return [png, svg]


def plot_sweep(result: SweepResult, folder: str | Path) -> list[Path]:
    """Write a sweep's trade-off plot, and the timeline and breakdown of two runs, to `folder`.

    The two runs are keep-all (the reference) and the lossless run with the least peak tape
    memory (ties go to the first name in sort order, so the choice never depends on timing);
    a run is skipped when its profile is not in the result. Files are named
    ``<model>-tradeoff.*`` and ``<model>-<preset>-{timeline,breakdown}.*``, each name reduced
    to one safe path component (model and preset names come from data).
    """
    folder = Path(folder)
    written = save(tradeoff(result), child(folder, f"{result.model}-tradeoff"))
    lossless = [r for r in result.rows if r.lossless and r.preset in result.profiles]
    chosen = [KEEP_ALL] if KEEP_ALL in result.profiles else []
    if lossless:
        leanest = min(lossless, key=lambda r: (r.peak_tape_bytes, r.preset))
        if leanest.preset not in chosen:
            chosen.append(leanest.preset)
    for name in chosen:
        prof = result.profiles[name]
        if prof.timeline_seconds:
            written += save(timeline(prof), child(folder, f"{result.model}-{name}-timeline"))
        if prof.records:
            written += save(breakdown(prof), child(folder, f"{result.model}-{name}-breakdown"))
    return written
