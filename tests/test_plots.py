"""Plots: every kind renders to PNG and SVG of the expected size, the Pareto front is right on
hand cases and against brute force, labels stay inside the axes and apart, and bad input fails
with a PlotError that says what to do."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from matplotlib.figure import Figure
from matplotlib.image import imread
from matplotlib.text import Annotation, Text

from checkpoint_ad import plots
from checkpoint_ad.plots import PlotError, pareto_front
from checkpoint_ad.profiler import Profile, SavedRecord
from checkpoint_ad.sweep import SweepResult, SweepRow

MiB = 2**20


# ------------------------------------------------------------------ hand-built data
def _row(preset: str, mib: float, time_ratio: float, *, lossless: bool = True,
         error: float = 0.0, device_mib: float | None = 3.0, recomputed: int = 0) -> SweepRow:
    return SweepRow(
        preset=preset, label=preset, lossless=lossless, peak_tape_bytes=int(mib * MiB),
        device_peak_bytes=None if device_mib is None else int(device_mib * MiB),
        seconds=0.2 * time_ratio, recompute_seconds=0.0, recomputed_primitives=recomputed,
        grad_error=error, memory_ratio=mib / 2.0, time_ratio=time_ratio,
    )


def _profile(strategy: str, recompute: bool = False) -> Profile:
    """A forward that grows the tape, a backward that frees it, recompute bursts if asked."""
    bytes_, phases = [0], ["forward"]
    for i in range(1, 21):
        bytes_.append(i * 100_000)
        phases.append("forward")
    for i in range(20, -1, -1):
        if recompute and i % 5 == 0:
            bytes_ += [i * 100_000 + 300_000, i * 100_000]
            phases += ["recompute", "recompute"]
        bytes_.append(i * 100_000)
        phases.append("backward")
    seconds = list(np.linspace(0.0, 0.4, len(bytes_)))
    ops = [("matmul", 600_000, 600_000), ("tanh", 400_000, 100_000), ("add", 50_000, 50_000),
           ("multiply", 30_000, 30_000), ("exp", 2_000, 2_000)]
    records = [SavedRecord(op, "out", (10, 10), "float32", logical, stored, "model.py:1", i,
                           "forward") for i, (op, logical, stored) in enumerate(ops)]
    return Profile(device="cpu", meta={"strategy": strategy, "model": "rnn", "steps": 20},
                   records=records, timeline_seconds=seconds, timeline_bytes=bytes_,
                   timeline_phase=phases, peak_tape_bytes=max(bytes_), forward_seconds=0.2,
                   backward_seconds=0.2, device_peak_bytes=3 * MiB)


def _result() -> SweepResult:
    rows = [
        _row("keep-all", 2.0, 1.0),
        _row("store-outputs", 1.9, 0.97),
        _row("recompute", 0.3, 1.3, recomputed=300),
        _row("revolve-4", 0.3, 1.6, recomputed=900),
        _row("sqrt-segments", 0.6, 1.1, recomputed=300),
        _row("int8", 0.8, 1.2, lossless=False, error=3.1e-3),
        _row("int4", 0.55, 1.25, lossless=False, error=6e-2),
    ]
    profiles = {"keep-all": _profile("keep-all"), "recompute": _profile("recompute", True),
                "revolve-4": _profile("revolve-4", True)}
    return SweepResult("rnn", "cpu", {"model": "rnn", "steps": 20}, rows, profiles)


def _texts(fig: Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


# ------------------------------------------------------------------ Pareto front
@pytest.mark.parametrize(("points", "front"), [
    ([], []),
    ([(1, 1)], [0]),
    ([(1, 5), (2, 2), (3, 3), (4, 1)], [0, 1, 3]),  # (3, 3) is beaten by (2, 2)
    ([(3, 1), (1, 3), (2, 2)], [1, 2, 0]),  # sorted by x, for drawing
    ([(0, 0), (1, 1), (2, 2)], [0]),  # one point beats all
    ([(1, 2), (1, 1)], [1]),  # same x: the lower wins
    ([(1, 1), (2, 1)], [0]),  # same y: the leaner wins
    ([(1, 1), (1, 1), (2, 0)], [0, 1, 2]),  # exact duplicates are both on the front
    ([(1.0, 2.0), (0.5, 3.0), (2.0, 2.0), (0.5, 4.0)], [1, 0]),
])
def test_pareto_front_on_hand_cases(points, front):
    assert pareto_front(points) == front


def _brute_front(points: list[tuple[int, int]]) -> set[int]:
    def beats(p, q):
        return p[0] <= q[0] and p[1] <= q[1] and p != q
    return {i for i, q in enumerate(points) if not any(beats(p, q) for p in points)}


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=25))
def test_pareto_front_matches_brute_force(points):
    front = pareto_front(points)
    assert set(front) == _brute_front(points)
    assert [points[i] for i in front] == sorted(points[i] for i in front)


def test_pareto_front_refuses_non_finite_points():
    with pytest.raises(PlotError, match=r"points \[1\] are not finite"):
        pareto_front([(1.0, 1.0), (float("nan"), 2.0)])


# ------------------------------------------------------------------ rendering to files
@pytest.mark.parametrize("kind", ["tradeoff", "timeline", "breakdown"])
def test_each_plot_renders_png_and_svg_of_the_expected_size(kind, tmp_path):
    result = _result()
    fig = {"tradeoff": lambda: plots.tradeoff(result),
           "timeline": lambda: plots.timeline(result.profiles["recompute"]),
           "breakdown": lambda: plots.breakdown(result.profiles["keep-all"])}[kind]()
    png, svg = plots.save(fig, tmp_path / "nested" / "folder" / kind)
    assert (png.name, svg.name) == (f"{kind}.png", f"{kind}.svg")
    assert png.stat().st_size > 10_000 and svg.stat().st_size > 10_000
    assert svg.read_text().lstrip().startswith("<?xml") and "</svg>" in svg.read_text()
    width, height = fig.get_size_inches() * plots.DPI
    image = imread(png)
    assert image.shape[:2] == (round(height), round(width))
    assert image.std() > 0.05  # not a blank canvas


def test_save_appends_suffixes_to_dotted_stems(tmp_path):
    paths = plots.save(plots.breakdown(_profile("x")), tmp_path / "rnn-revolve-4.0")
    assert [p.name for p in paths] == ["rnn-revolve-4.0.png", "rnn-revolve-4.0.svg"]
    assert all(p.exists() for p in paths)


def test_plot_sweep_writes_tradeoff_and_two_runs(tmp_path):
    written = plots.plot_sweep(_result(), tmp_path / "out")
    names = [p.name for p in written]
    # recompute and revolve-4 tie on memory; the first by name is chosen
    assert names == [f"rnn-{stem}.{ext}" for stem in
                     ["tradeoff", "keep-all-timeline", "keep-all-breakdown",
                      "recompute-timeline", "recompute-breakdown"] for ext in ("png", "svg")]
    assert all(p.exists() and p.stat().st_size > 10_000 for p in written)


def test_which_run_is_plotted_does_not_depend_on_timing(tmp_path):
    result = _result()
    for i, row in enumerate(result.rows):  # revolve-4 now the faster of the two tied
        if row.preset in ("recompute", "revolve-4"):
            result.rows[i] = _row(row.preset, 0.3, 1.6 if row.preset == "recompute" else 1.3)
    names = [p.name for p in plots.plot_sweep(result, tmp_path)]
    assert "rnn-recompute-timeline.png" in names and not any("revolve-4" in n for n in names)


def test_plot_file_names_from_data_stay_in_the_folder(tmp_path):
    result = _result()
    result.model = "../../up/and away"
    result.profiles["../x"] = result.profiles.pop("keep-all")
    result.rows[0] = _row("../x", 0.1, 1.0)
    written = plots.plot_sweep(result, tmp_path / "out")
    assert written and all(p.parent == tmp_path / "out" for p in written)
    assert "up_and_away-_x-timeline.png" in [p.name for p in written]
    assert not any(".." in p.name for p in written)


def test_plot_sweep_skips_runs_without_profiles(tmp_path):
    result = _result()
    result.profiles.clear()
    assert [p.name for p in plots.plot_sweep(result, tmp_path)] == ["rnn-tradeoff.png",
                                                                    "rnn-tradeoff.svg"]


def test_plot_sweep_on_a_real_sweep(tmp_path):
    from checkpoint_ad.sweep import sweep

    result = sweep("rnn", ["keep-all", "recompute", "int8"],
                   sizes={"steps": 8, "batch": 2, "hidden": 4, "input_size": 3}, progress=False)
    written = plots.plot_sweep(result, tmp_path)
    assert {p.name for p in written} >= {"rnn-tradeoff.png", "rnn-keep-all-timeline.svg",
                                         "rnn-recompute-breakdown.png"}
    assert imread(written[0]).shape[2] == 4


# ------------------------------------------------------------------ what the plots show
def test_tradeoff_labels_every_strategy_and_lossy_errors():
    fig = plots.tradeoff(_result())
    ax, colorbar = fig.axes
    assert ax.get_xlabel() == "peak owned tape memory (MiB)"
    assert ax.get_ylabel() == "time relative to keep-all (\N{MULTIPLICATION SIGN})"
    assert colorbar.get_ylabel() == "relative gradient error (lossy)"
    assert ax.get_title() == "memory/compute trade-off: rnn (steps=20) on cpu"
    texts = _texts(fig)
    for name in ["keep-all", "store-outputs", "recompute", "revolve-4", "sqrt-segments"]:
        assert name in texts
    assert "int8\nerr 3e-3" in texts and "int4\nerr 6e-2" in texts
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["keep-all (reference)", "Pareto front (lossless)", "lossless",
                      "lossy (colour: gradient error)"]


def test_tradeoff_labels_stay_inside_the_axes_and_apart():
    rows = [_row(f"s{i}", 1.0 + 0.01 * (i % 3), 1.0 + 0.01 * (i // 3)) for i in range(6)]
    rows += [_row("keep-all", 3.0, 1.0), _row("far", 0.2, 2.0)]
    fig = plots.tradeoff(SweepResult("rnn", "cpu", {"model": "rnn"}, rows))
    fig.draw_without_rendering()
    ax = fig.axes[0]
    frame = ax.get_window_extent()
    # the text alone: Annotation's own extent would include its leader line
    boxes = [Text.get_window_extent(t) for t in ax.texts if isinstance(t, Annotation)]
    assert len(boxes) == len(rows)
    for box in boxes:
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1
        assert frame.y0 <= box.y0 and box.y1 <= frame.y1
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), (a, b)
    assert not any(box.overlaps(ax.get_legend().get_window_extent()) for box in boxes)


def test_tradeoff_other_axes_and_reference_only_keep_all():
    result = _result()
    result.rows = [r for r in result.rows if r.preset != "keep-all"]  # measured as reference
    fig = plots.tradeoff(result, x="device_peak_bytes", y="recomputed_primitives")
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("device peak memory (MiB)",
                                                  "recomputed primitives (count)")
    assert "keep-all" in _texts(fig)
    fig = plots.tradeoff(result, x="memory_ratio", y="seconds")
    assert fig.axes[0].get_ylabel() == "forward + backward time (s)"


def test_tradeoff_small_bytes_use_kib_and_zero_errors_need_no_colorbar():
    rows = [_row("keep-all", 0.004, 1.0), _row("int8", 0.004, 1.1, lossless=False)]
    fig = plots.tradeoff(SweepResult("rnn", "cpu", {}, rows))
    assert len(fig.axes) == 1  # no colorbar: every error is zero
    assert fig.axes[0].get_xlabel() == "peak owned tape memory (KiB)"
    assert "int8\nerr 0" in _texts(fig)


def test_plots_draw_into_a_given_axes():
    fig = Figure(figsize=(14, 6), layout="constrained")
    left, right = fig.subfigures(1, 2)
    ax = left.add_subplot()
    assert plots.tradeoff(_result(), ax=ax) is left
    ax2, ax3 = right.subplots(2, 1)
    assert plots.timeline(_profile("keep-all"), ax=ax2) is right
    assert plots.breakdown(_profile("keep-all"), ax=ax3) is right
    fig.draw_without_rendering()


def test_timeline_shades_phases_and_marks_the_peak():
    fig = plots.timeline(_profile("recompute", recompute=True))
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time since the profile began (ms)"
    assert ax.get_ylabel() == "live saved bytes (MiB)"
    assert ax.get_title() == "saved-value timeline: recompute · rnn (steps=20) · cpu"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["live saved bytes", "forward", "backward", "recompute"]
    assert _texts(fig) == [f"peak {2_300_000 / MiB:.3g} MiB"]
    assert len(ax.collections) == 3  # one shaded collection per phase
    lo, hi = ax.get_ylim()
    assert lo == 0 and hi > 2_300_000 / MiB  # headroom for the legend above the peak


def test_timeline_runs_of_phases():
    assert plots._runs(["f", "f", "b", "r", "r", "b"]) == [("f", 0, 2), ("b", 2, 3),
                                                          ("r", 3, 5), ("b", 5, 6)]
    assert plots._runs([]) == []


def test_breakdown_sorts_folds_and_shows_compression():
    fig = plots.breakdown(_profile("int8"), top=2)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["matmul (1 saved)", "tanh (1 saved)", "3 other ops (3 saved)"]
    assert "97.7 of 391 KiB (4.0\N{MULTIPLICATION SIGN} smaller)" in _texts(fig)
    assert ax.get_legend() is not None
    labels = [t.get_text() for t in plots.breakdown(_profile("x"), top=4).axes[0]
              .get_yticklabels()]
    assert labels[-1] == "exp (1 saved)"  # one op left over keeps its own name


def test_breakdown_without_compression_has_no_legend():
    prof = _profile("keep-all")
    prof.records = [r for r in prof.records if r.op != "tanh"]
    fig = plots.breakdown(prof)
    assert fig.axes[0].get_legend() is None
    assert "586 KiB" in _texts(fig)


def _front_points(fig: Figure) -> set[tuple[float, float]]:
    """The ringed points (the Pareto front's), as (x, y) in data units."""
    ax = fig.axes[0]
    rings = [c for c in ax.collections if c.get_sizes().size and c.get_sizes()[0] == 190]
    assert len(rings) == 1
    return {(round(float(x), 3), round(float(y), 3)) for x, y in rings[0].get_offsets()}


def test_the_pareto_front_is_drawn_over_lossless_points_only():
    """int4 (0.55 MiB, 1.25x) would beat sqrt-segments on memory; its gradients differ, so it
    is shown with its error beside the front, not on it."""
    rows = [_row("keep-all", 2.0, 1.0), _row("sqrt-segments", 0.6, 1.1),
            _row("int4", 0.4, 1.05, lossless=False, error=6e-2)]
    fig = plots.tradeoff(SweepResult("rnn", "cpu", {}, rows))
    assert _front_points(fig) == {(0.6, 1.1), (2.0, 1.0)}
    assert "int4\nerr 6e-2" in _texts(fig)
    # over every point, int4 (0.4, 1.05) would have pushed sqrt-segments off the front
    assert plots.pareto_front([(2.0, 1.0), (0.6, 1.1), (0.4, 1.05)]) == [2, 0]


def test_an_axis_spanning_more_than_ten_times_is_logarithmic():
    narrow = [_row("keep-all", 2.0, 1.0), _row("sqrt-segments", 0.6, 1.1)]
    fig = plots.tradeoff(SweepResult("rnn", "cpu", {}, narrow))
    assert (fig.axes[0].get_xscale(), fig.axes[0].get_yscale()) == ("linear", "linear")
    wide = [*narrow, _row("revolve-4", 0.02, 30.0, recomputed=900)]  # 100x less, 30x slower
    fig = plots.tradeoff(SweepResult("rnn", "cpu", {}, wide))
    assert (fig.axes[0].get_xscale(), fig.axes[0].get_yscale()) == ("log", "log")


def _timed(row: SweepRow, low: float, high: float, noise: bool | None) -> SweepRow:
    return dataclasses.replace(row, seconds_min=low, seconds_max=high, timed_runs=5,
                               within_noise=noise)


def test_time_points_carry_their_spread_and_a_noise_flag():
    rows = [_timed(_row("keep-all", 2.0, 1.0), 0.18, 0.25, None),
            _timed(_row("store-outputs", 1.9, 1.05), 0.19, 0.26, True),
            _timed(_row("revolve-4", 0.3, 2.0), 0.39, 0.42, False)]
    fig = plots.tradeoff(SweepResult("rnn", "cpu", {}, rows))
    ax = fig.axes[0]
    bars = [c for c in ax.collections if type(c).__name__ == "LineCollection"]
    assert len(bars) == 1
    segments = sorted(tuple(np.round(seg[:, 1], 6)) for seg in bars[0].get_segments())
    # y is time relative to keep-all's median (0.2 s): min-max / 0.2
    assert segments == [(0.9, 1.25), (0.95, 1.3), (1.95, 2.1)]
    texts = _texts(fig)
    assert "store-outputs\n(time within noise)" in texts and "revolve-4" in texts
    assert "min-max of the timed runs" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_budget_point_names_its_limit_in_the_axis_unit():
    budget = dataclasses.replace(_row("budget-512KiB", 0.45, 1.3), budget_bytes=512 * 2**10)
    rows = [_row("keep-all", 2.0, 1.0), budget]
    assert "budget-512KiB\nlimit 0.5 MiB" in _texts(plots.tradeoff(
        SweepResult("rnn", "cpu", {}, rows)))
    assert "budget-512KiB\nlimit 0.25\N{MULTIPLICATION SIGN}" in _texts(plots.tradeoff(
        SweepResult("rnn", "cpu", {}, rows), x="memory_ratio"))


def test_the_breakdown_shows_the_bytes_alive_at_the_peak_not_all_ever_saved():
    """matmul saved 600 kB and tanh 100 kB, but only tanh's buffer (1) and an unrecorded
    snapshot (9) were alive at the peak: the bars are what the peak is made of."""
    prof = _profile("revolve-4")
    prof.peak_buffers = {"1": 100_000, "9": 40_000}
    prof.peak_tape_bytes = 140_000
    fig = plots.breakdown(prof)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "bytes alive at the tape's peak (KiB)"
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["tanh (1 saved)", "(no entry: loop snapshots, region inputs) (1 saved)"]
    table = prof.by_op_at_peak()
    assert sum(row["stored"] for row in table.values()) == prof.peak_tape_bytes
    assert table["tanh"]["logical"] == 400_000  # quantized 4x: its logical size beside it


# ------------------------------------------------------------------ errors
def test_plot_error_is_a_value_error():
    assert issubclass(PlotError, ValueError)


@pytest.mark.parametrize(("call", "words"), [
    (lambda: plots.tradeoff(SweepResult("rnn", "cpu", {})), "no rows to plot"),
    (lambda: plots.tradeoff(_result(), x="speed"), "unknown x axis 'speed'; choose one of"),
    (lambda: plots.tradeoff(_result(), y="peak_tape_bytes"), "unknown y axis"),
    (lambda: plots.tradeoff(SweepResult("rnn", "cpu", {}, [_row("a", 1, 1, device_mib=None)]),
                            x="device_peak_bytes"), r"not measured for \['a'\]"),
    (lambda: plots.timeline(Profile()), "no timeline points"),
    (lambda: plots.timeline(Profile(timeline_seconds=[0.0], timeline_bytes=[1, 2],
                                    timeline_phase=["forward"])), "differ in length"),
    (lambda: plots.breakdown(Profile()), "saved no values"),
    (lambda: plots.breakdown(_profile("x"), top=0), "top must be at least 1"),
    (lambda: plots.plot_sweep(SweepResult("rnn", "cpu", {}), "/tmp/never"), "no rows"),
])
def test_bad_input_raises_plot_error(call, words):
    with pytest.raises(PlotError, match=words):
        call()
