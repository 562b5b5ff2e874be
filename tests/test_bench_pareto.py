"""The pareto benchmark (issue 42): its jobs, its rounds folded into one row per point, and a
tiny run end to end with the peers absent (skipped with a note). No timing is asserted."""

from __future__ import annotations

import json
import math

import pytest

from bench import pareto, runner, suite
from bench.table import Row

TINY = {"rnn": {"steps": (8,), "batch": 3, "hidden": 5, "input": 4},
        "mlp": {"layers": 8, "width": 6, "batch": 3},
        "every": (0.5,), "snapshots": (2,), "budget_fractions": (0.5,),
        "rounds": 2, "repeats": 1}


@pytest.mark.parametrize("steps", [8, 64, 256, 1024, 30, 7])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_nested_levels_multiply_to_the_loop_length(steps, depth):
    sizes = pareto.levels(steps, depth)
    assert len(sizes) == depth and math.prod(sizes) == steps
    if steps in (256, 1024) and depth == 2:
        assert sizes == [round(math.sqrt(steps))] * 2  # two-level √T: √T segments of √T


def test_select_keeps_the_named_columns_of_the_named_cases_and_their_floors():
    jobs = suite.jobs(quick=False, only={"pareto"})
    picked = runner.select_jobs(jobs, ["T=1024", "scan keep-all,eager keep-all"])
    assert picked and {j.case for j in picked} == {c for c in {j.case for j in jobs}
                                                  if "T=1024" in c}
    names = {j.name for j in picked}
    assert names == {"numpy floor (by hand)", "ours scan keep-all",
                     "ours scan keep-all, batch_rows", "jax scan keep-all",
                     "torch eager keep-all"}
    rounds = suite.SIZES["default"]["pareto"]["rounds"]
    assert len(picked) == 5 * rounds  # every round of each, floors included
    assert runner.select_jobs(jobs, []) == jobs
    assert runner.select_jobs(jobs, ["no such column"]) == []


def test_every_point_runs_once_per_round_in_a_rotated_order():
    jobs = suite.jobs(quick=True, only={"pareto"})
    sizes = suite.SIZES["quick"]["pareto"]
    assert {j.bench for j in jobs} == {"pareto"} and {j.task for j in jobs} == {"pareto:point"}
    per_round = [[j.name for j in jobs if j.params["round"] == r]
                 for r in range(sizes["rounds"])]
    assert sorted(per_round[0]) == sorted(per_round[1]) and per_round[0] != per_round[1]
    for case in {j.case for j in jobs}:
        floors = [j for j in jobs if j.case == case and j.role == "floor"]
        assert len(floors) == sizes["rounds"]
    peers = {j.peer for j in jobs if j.name.startswith(("torch", "jax"))}
    assert peers == {"torch", "jax"}
    assert not any(j.bench == "pareto" for j in suite.jobs(quick=True))  # opt-in only
    names = {j.name for j in suite.jobs(quick=False, only={"pareto"})}
    assert {"jax two-level 16x16", "jax two-level 32x32", "jax scan(remat(step))",
            "torch checkpoint every 16", "ours scan Periodic(16)"} <= names


def _row(name, round_, seconds, role="", rss=None, family="f"):
    return Row("pareto", "c", name, role, seconds=seconds, repeats=1, rss_bytes=rss,
               extras={"round": round_, "family": family, "rss_steady_bytes": rss})


def test_over_floor_is_the_median_of_each_rounds_ratio_not_a_ratio_of_medians():
    rows = [_row("floor", 0, 1.0, "floor", rss=100), _row("p", 0, 2.0, rss=50),
            _row("floor", 1, 2.0, "floor", rss=100), _row("p", 1, 2.0, rss=50),
            _row("floor", 2, 4.0, "floor", rss=100), _row("p", 2, 6.0, rss=50),
            Row("pareto", "c", "torch", note="skipped: torch not installed"),
            Row("pareto", "c", "torch", note="skipped: torch not installed"),
            Row("rnn", "T=8", "other", seconds=1.0)]
    merged = pareto.merge_rounds(rows)
    assert [r.name for r in merged] == ["floor", "p", "torch", "other"]
    p = merged[1]
    assert p.ratios["/floor"] == pytest.approx(1.5)  # per round 2.0, 1.0, 1.5
    assert p.seconds == 2.0 and p.spread == [2.0, 6.0] and p.extras["rounds"] == 3
    assert p.ratios["rss/floor"] == pytest.approx(0.5) and "round" not in p.extras
    assert merged[0].ratios["/floor"] == 1.0
    assert merged[2].seconds is None and merged[2].note.startswith("skipped")


@pytest.mark.parametrize("scheme", [{"scheme": "keep-all"}, {"scheme": "revolve-2"},
                                    {"scheme": "budget", "fraction": 0.5}])
def test_our_mlp_points_match_the_models_reference_gradients(scheme):
    params = {"model": "residual_mlp", "sizes": TINY["mlp"], "round": 0, "repeats": 1,
              "who": "ours", "family": "ours"} | scheme
    result = pareto.point(params, 1)
    assert result["grad_error"] < 1e-5 and result["tracemalloc_bytes"] > 0
    assert result["rss_bytes"] is not None
    if scheme["scheme"] == "budget":
        assert result["extras"]["plan"] and result["extras"]["limit_bytes"] > 0


@pytest.mark.parametrize("who", ["torch", "jax"])
@pytest.mark.parametrize("model", ["rnn", "residual_mlp"])
def test_peer_points_compute_the_floors_gradients(who, model):
    pytest.importorskip(who)
    steps = 8
    case = ({"model": "rnn", "steps": steps} | {k: v for k, v in TINY["rnn"].items()
                                                if k != "steps"}
            if model == "rnn" else {"model": model, "sizes": TINY["mlp"]})
    for point in pareto.points(steps, TINY):
        if point["who"] == who:
            params = case | point | {"round": 0, "repeats": 1}
            assert pareto.point(params, 1)["grad_error"] < 1e-5, point["name"]


def test_a_tiny_run_with_the_peers_absent_has_one_row_per_point(tmp_path, monkeypatch):
    monkeypatch.setitem(suite.SIZES["quick"], "pareto", TINY)
    monkeypatch.setattr(pareto, "cases", lambda sizes: [("rnn tiny", {
        "model": "rnn", "steps": 8, "batch": 3, "hidden": 5, "input": 4})])
    monkeypatch.setattr(runner, "missing", lambda peer: peer and f"skipped: {peer} absent")
    assert runner.main(["--quick", "--only", "pareto", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench-quick-pareto.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    expected = {p["name"] for p in pareto.points(8, TINY)}
    assert set(rows) == expected and len(data["rows"]) == len(expected)
    for name, row in rows.items():
        if name.startswith(("torch", "jax")):
            assert row["seconds"] is None and row["note"].startswith("skipped")
        else:
            assert row["seconds"] > 0 and row["extras"]["rounds"] == 2, (name, row["note"])
            assert row["ratios"]["/floor"] > 0 and row["rss_bytes"] is not None
            assert row["tracemalloc_bytes"] > 0 and row["grad_error"] < 1e-5
    assert rows["numpy floor (by hand)"]["ratios"]["/floor"] == 1.0
    markdown = (tmp_path / "bench-quick-pareto.md").read_text()
    assert "## pareto · rnn tiny" in markdown and "skipped: jax absent" in markdown
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench-quick-pareto.png").stat().st_size > 0
