"""The command line: the main job on a tiny size, the other commands, and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_ad.cli import main

TINY = ["--size", "steps=6", "--size", "batch=2", "--size", "hidden=4", "--size", "input_size=3"]


def test_sweep_writes_table_profiles_and_plots(tmp_path, capsys):
    code = main(["sweep", "--presets", "keep-all,revolve-4,int8", "--out", str(tmp_path),
                 "--quiet", *TINY])
    assert code == 0
    out = capsys.readouterr().out
    assert "revolve-4" in out and "int8" in out and "grad error" in out
    names = {p.name for p in tmp_path.iterdir()}
    assert {"sweep-rnn.csv", "sweep-rnn.json", "rnn-keep-all.json", "rnn-revolve-4.json"} <= names
    assert any(n.endswith(".png") for n in names) and any(n.endswith(".svg") for n in names)
    # and plot can redraw them from the saved files
    again = tmp_path / "again"
    assert main(["plot", str(tmp_path), "--out", str(again)]) == 0
    assert any(p.suffix == ".png" for p in again.iterdir())
    assert main(["plot", str(tmp_path / "rnn-int8.json"), "--out", str(again)]) == 0


def test_profile_and_strategies_commands(tmp_path, capsys):
    assert main(["profile", "--strategy", "store-outputs", "--save", str(tmp_path / "p.json"),
                 *TINY]) == 0
    out = capsys.readouterr().out
    assert "peak tape" in out and (tmp_path / "p.json").exists()
    assert main(["strategies"]) == 0
    listing = capsys.readouterr().out
    assert "revolve-8" in listing and "lossy" in listing and "lossless" in listing


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checkpoint_ad.cli", *args],
                          capture_output=True, text=True, check=False, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})


@pytest.mark.parametrize(("args", "words"), [
    (["sweep", "--model", "transformer", "--no-plots"], "unknown model"),
    (["sweep", "--presets", "no-such-preset", "--no-plots"], "no-such-preset"),
    (["sweep", "--size", "steps=-3", "--no-plots"], "steps"),
    (["sweep", "--size", "steps", "--no-plots"], "key=value"),
    (["sweep", "--out", "/proc/forbidden", "--no-plots"], "cannot write"),
    (["plot", "/no/such/path"], "no such file"),
])
def test_bad_input_exits_nonzero_with_one_line(args, words):
    result = _run(*args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert words in result.stderr.lower() or words in result.stderr


def test_malformed_preset_file_is_one_line(tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text("name = 'broken'\n[loop\nkind = 'binomial'\n")
    result = _run("sweep", "--presets", str(bad), "--no-plots", *TINY)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "broken.toml" in result.stderr
