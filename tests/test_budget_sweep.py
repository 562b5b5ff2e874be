"""Budgets as sweep columns: Python, the command line, the saved table and the trade-off plot."""

from __future__ import annotations

import json

import pytest

from checkpoint_ad import cli
from checkpoint_ad.plots import tradeoff
from checkpoint_ad.sweep import BudgetRun, SweepResult, sweep

SIZES = {"steps": 24, "batch": 4, "input_size": 8, "hidden": 16}


@pytest.fixture(scope="module")
def result():
    return sweep("rnn", ["revolve-4"], sizes=SIZES, progress=False, repeats=1,
                 budgets=["3KiB", "1MiB"])


def test_each_budget_is_a_column_naming_its_plan_and_prediction(result):
    rows = {r.preset: r for r in result.rows}
    assert list(rows) == ["revolve-4", "budget-3KiB", "budget-1MiB"]
    assert rows["revolve-4"].plan is None and rows["revolve-4"].predicted_peak_bytes is None
    small, large = rows["budget-3KiB"], rows["budget-1MiB"]
    assert small.plan != large.plan
    for row, limit in ((small, 3 * 1024), (large, 2**20)):
        assert row.predicted_peak_bytes <= limit
        assert row.peak_tape_bytes == row.predicted_peak_bytes  # the RNN's bytes are exact
        assert row.predicted_seconds > 0 and row.grad_error == 0.0
    assert "budget-3KiB: ran " in result.table()


def test_a_saved_table_keeps_the_predictions_and_old_tables_still_load(result, tmp_path):
    again = SweepResult.load(result.save(tmp_path) / "sweep-rnn.json")
    assert again.rows == result.rows
    old = result.to_dict()
    for row in old["rows"]:
        for key in ("plan", "predicted_peak_bytes", "predicted_seconds"):
            del row[key]
    assert SweepResult.from_dict(json.loads(json.dumps(old))).rows[1].plan is None


def test_the_tradeoff_plot_marks_each_prediction(result):
    fig = tradeoff(result)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "budget: predicted (dotted to measured)" in labels
    assert "budget: predicted (dotted to measured)" not in [
        t.get_text() for t in tradeoff(result, x="memory_ratio").axes[0].get_legend().get_texts()]


def test_a_budget_column_prints_and_behaves_like_a_preset():
    run = BudgetRun("16MiB")
    assert run.name == run.label == "budget-16MiB" and run.lossless
    assert run.loop_strategy(10) is run.loop_strategy(20)  # one budget: its dry run is reused
    assert BudgetRun("1MiB", lossy=True).name == "budget-1MiB-lossy"


def test_the_command_line_runs_budgets_and_refuses_a_bad_one(tmp_path, capsys):
    status = cli.main(["sweep", "--budgets", "4KiB", "--size", "steps=12", "--size", "batch=2",
                       "--size", "hidden=8", "--size", "input_size=4", "--repeats", "1",
                       "--no-plots", "--quiet", "--out", str(tmp_path / "out")])
    assert status == 0
    assert "budget-4KiB: ran " in capsys.readouterr().out
    status = cli.main(["sweep", "--budgets", "4 lots", "--out", str(tmp_path / "bad")])
    assert status == 2 and "--budgets" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
