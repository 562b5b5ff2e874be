"""The command line runs the main job on a tiny size and rejects bad input in one line."""

from __future__ import annotations

import subprocess
import sys

from checkpoint_ad.cli import main


def test_example_runs_and_prints_the_table(capsys):
    assert main(["example", "--steps", "12", "--hidden", "8", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "binomial, 4 snapshots" in out and "int4 storage" in out
    rows = [line for line in out.splitlines() if line.startswith(("keep every", "binomial"))]
    assert len(rows) == 3
    assert all(float(line.split()[-1]) < 1e-5 for line in rows)  # lossless rows agree


def test_bad_sizes_exit_nonzero_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "checkpoint_ad.cli", "example", "--steps", "-3"],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "positive" in result.stderr
