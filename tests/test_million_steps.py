"""The 10**6-step heat demo (bench/million_steps.py) at 10**3 steps: its gradient is bitwise
the keep-all one and agrees with finite differences, it costs the plan's evaluations, and its
command writes the result file the notebook reads."""

from __future__ import annotations

import json

from bench import million_steps
from checkpoint_ad.strategies import Binomial, optimal_evaluations


def test_the_demo_checks_its_gradient_and_counts_its_steps():
    result = million_steps.run(steps=1000, strategy=Binomial(8), check_steps=300, progress=False)
    assert result["evaluations"] == result["planned_evaluations"] == optimal_evaluations(1000, 8)
    assert result["recompute_ratio"] == result["evaluations"] / 1000
    assert result["bitwise_equal_to_keep_all"]
    assert result["fd_rel_error_theta"] < 1e-6 and result["fd_rel_error_u0"] < 1e-6
    assert result["grad_theta_norm"] > 0 and result["grad_u0_norm"] > 0
    # inside a test session the process holds every earlier test's modules: what the run
    # added is what this checks (the demo's own process reports its absolute peak)
    assert 0 <= result["peak_rss_mb"] - result["rss_before_mb"] < 300


def test_the_command_writes_its_result(tmp_path, capsys):
    out = tmp_path / "million.json"
    code = million_steps.main(["--steps", "1000", "--snapshots", "4", "--check-steps", "100",
                               "--no-progress", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["steps"] == 1000 and result["strategy"] == repr(Binomial(4))
    assert "recompute_ratio" in capsys.readouterr().out


def test_the_recorded_results_the_notebook_plots_are_complete():
    from pathlib import Path

    recorded = json.loads((Path(million_steps.__file__).parent / "results"
                           / "million_steps.json").read_text())
    for run in recorded["runs"]:
        assert {"steps", "wall_s", "recompute_ratio", "peak_rss_mb", "strategy"} <= set(run)
