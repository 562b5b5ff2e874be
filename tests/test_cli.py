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
    assert "on cpu, 1 BLAS thread" in out and "BLAS threads per run: 1" in out
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


def _child_env() -> dict[str, str]:
    """The parent's environment with this checkout first on the import path (the rest kept:
    dependencies may be installed on PYTHONPATH rather than in site-packages)."""
    paths = (str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH"))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checkpoint_ad.cli", *args],
                          capture_output=True, text=True, check=False, cwd=cwd, env=_child_env())


@pytest.mark.parametrize(("args", "words"), [
    (["sweep", "--model", "transformer", "--no-plots"], "unknown model"),
    (["sweep", "--presets", "no-such-preset", "--no-plots"], "no-such-preset"),
    (["sweep", "--size", "steps=-3", "--no-plots"], "steps"),
    (["sweep", "--size", "steps", "--no-plots"], "key=value"),
    (["sweep", "--out", "/proc/forbidden", "--no-plots"], "cannot write"),
    (["plot", "/no/such/path"], "no such file"),
    (["profile", "--size", "device=cuda"], "--device cuda"),
    (["sweep", "--size", "widht=3", "--no-plots"], "its sizes are steps, batch"),
    (["sweep", "--budgets", "1.5B", "--no-plots"], "whole number of bytes"),
    (["sweep", "--budgets", "1e400B", "--no-plots"], "2**63"),
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


# ----------------------------------------------------------------- files are safe
def _tiny_sweep_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    assert main(["sweep", "--presets", "keep-all,revolve-4", "--out", str(folder), "--quiet",
                 "--no-plots", "--repeats", "1", *TINY]) == 0
    return folder


def test_plot_keeps_names_from_data_inside_the_output_folder(tmp_path):
    import json

    folder = _tiny_sweep_folder(tmp_path)
    table = json.loads((folder / "sweep-rnn.json").read_text())
    table["model"] = "../escaped/pwn"
    (folder / "sweep-rnn.json").write_text(json.dumps(table))
    out = tmp_path / "out" / "plots"
    assert main(["plot", str(folder), "--out", str(out)]) == 0
    assert not (tmp_path / "out" / "escaped").exists() and not (tmp_path / "escaped").exists()
    names = sorted(p.name for p in out.iterdir())
    assert names and all(n.startswith("escaped_pwn-") for n in names)


def test_a_planted_link_in_the_output_folder_is_never_written_through(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".write-test").symlink_to(target)
    (out / "sweep-rnn.csv").symlink_to(target)
    result = _run("sweep", "--presets", "keep-all", "--out", str(out), "--quiet", "--no-plots",
                  "--repeats", "1", *TINY)
    assert result.returncode == 2, result.stderr
    assert "symbolic link" in result.stderr and result.stderr.count("\n") == 1
    assert target.read_text() == "keep me"


def test_the_main_job_writes_a_fresh_run_folder_not_the_committed_profiles(tmp_path):
    for _ in range(2):
        result = _run("sweep", "--presets", "keep-all", "--quiet", "--no-plots", "--repeats",
                      "1", *TINY, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    runs = sorted((tmp_path / "profiles" / "runs").iterdir())
    assert len(runs) == 2 and all(r.name.startswith("rnn-") for r in runs)
    assert all((r / "sweep-rnn.json").is_file() for r in runs)
    assert sorted(p.name for p in (tmp_path / "profiles").iterdir()) == ["runs"]


def test_a_profile_save_cut_short_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"old": true}')
    script = ("import resource, sys\n"
              "from checkpoint_ad.cli import main\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
              f"sys.exit(main(['profile', '--save', {str(path)!r}, *{TINY!r}]))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=False, env=_child_env())
    assert result.returncode == 2, result.stderr
    assert "cannot write" in result.stderr and "nothing was changed" in result.stderr
    assert path.read_text() == '{"old": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary file left


def _interrupt_while_saving(monkeypatch) -> None:
    """Ctrl-C in the saving step: after the table and profiles, while the plots are drawn."""
    from checkpoint_ad import plots

    def interrupted(result, folder):
        (Path(folder) / "rnn-tradeoff.png").write_bytes(b"half a plot")
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "plot_sweep", interrupted)


def test_a_sweep_interrupted_while_saving_leaves_no_output_folder(monkeypatch, tmp_path, capsys):
    _interrupt_while_saving(monkeypatch)
    out = tmp_path / "runs" / "new"
    assert main(["sweep", "--presets", "keep-all", "--out", str(out), "--quiet", "--repeats",
                 "1", *TINY]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no folder, no hidden staging folder


def test_a_sweep_interrupted_while_saving_leaves_an_existing_folder_as_it_was(
    monkeypatch, tmp_path
):
    out = _tiny_sweep_folder(tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _interrupt_while_saving(monkeypatch)
    assert main(["sweep", "--presets", "keep-all,int8", "--out", str(out), "--quiet",
                 "--repeats", "1", *TINY]) == 130
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_sweep_into_an_existing_folder_replaces_its_files_and_keeps_the_others(tmp_path):
    out = _tiny_sweep_folder(tmp_path)
    (out / "notes.txt").write_text("mine")
    old_table = (out / "sweep-rnn.json").read_text()
    assert main(["sweep", "--presets", "keep-all,int8", "--out", str(out), "--quiet",
                 "--no-plots", "--repeats", "1", *TINY]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "rnn-int8.json").is_file()
    assert (out / "sweep-rnn.json").read_text() != old_table
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


_SIGINT_WHILE_SAVING = """
import os, signal, sys, time
# Ctrl-C in a terminal raises KeyboardInterrupt; a child inherits an ignored SIGINT from its
# parent (a test runner whose earlier tests left it so), and Python keeps it ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
from checkpoint_ad import sweep
from checkpoint_ad.cli import main
real_save = sweep.SweepResult.save
def save(self, folder):
    real_save(self, folder)  # every table and profile file written...
    os.kill(os.getpid(), signal.SIGINT)  # ...then Ctrl-C, before the plots
    time.sleep(5)
sweep.SweepResult.save = save
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(os.name != "posix", reason="a real SIGINT")
def test_a_real_ctrl_c_while_saving_leaves_no_output_folder(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-c", _SIGINT_WHILE_SAVING, "sweep", "--presets", "keep-all,revolve-4",
         "--out", str(out), "--quiet", "--repeats", "1", *TINY],
        capture_output=True, text=True, check=False, env=_child_env(), timeout=300)
    assert result.returncode == 130, result.stderr
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------- bad input at the door
def test_profile_save_to_a_read_only_place_fails_before_the_run(monkeypatch, capsys):
    from checkpoint_ad import sweep

    def must_not_run(*args, **kwargs):
        raise AssertionError("the run started before the output place was checked")

    monkeypatch.setattr(sweep, "run_one", must_not_run)
    assert main(["profile", "--save", "/proc/nope/p.json", *TINY]) == 2
    assert "cannot write" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--presets", "no-such-preset"],
    ["--model", "transformer"],
    ["--size", "steps=-3"],
    ["--repeats", "0"],
])
def test_failed_validation_leaves_no_output_folder(tmp_path, args):
    out = tmp_path / "new" / "deeper"
    assert main(["sweep", "--out", str(out), "--quiet", "--no-plots", *args]) == 2
    assert list(tmp_path.iterdir()) == []


def test_too_large_a_size_is_one_line_that_names_it():
    result = _run("sweep", "--size", "hidden=200000", "--presets", "keep-all", "--no-plots",
                  "--quiet", "--out", os.devnull + "-not-used")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "out of memory" in result.stderr and "hidden=200000" in result.stderr
    assert "smaller" in result.stderr


def test_the_size_keys_named_in_an_error_leave_out_the_device():
    result = _run("profile", "--size", "nope=1")
    assert result.returncode == 2 and "device" not in result.stderr.split("its sizes are")[1]


@pytest.mark.parametrize("model", ["rnn", "lstm", "residual_mlp", "heat", "neural_ode"])
def test_a_run_too_large_for_memory_is_refused_before_it_allocates(model):
    key = "layers" if model == "residual_mlp" else "steps"
    for command in (["sweep", "--no-plots", "--out", os.devnull + "-unused"], ["profile"]):
        result = subprocess.run(
            [sys.executable, "-c", "import resource, sys\n"
             "from checkpoint_ad.cli import main\n"  # 2 GiB of address space at most: an
             "resource.setrlimit(resource.RLIMIT_AS, (2**31, 2**31))\n"  # allocation fails
             f"sys.exit(main({[*command, '--model', model, '--size', f'{key}=100000000']!r}))"],
            capture_output=True, text=True, check=False, env=_child_env(), timeout=120)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "out of memory ahead" in result.stderr and "available" in result.stderr
        assert f"{key}=100000000" in result.stderr and "GiB" in result.stderr


@pytest.mark.parametrize(("raised", "code", "words"), [
    (KeyboardInterrupt(), 130, "interrupted"),
    (MemoryError(), 2, "out of memory running rnn with steps=6"),
])
def test_interrupts_and_memory_errors_are_one_line(monkeypatch, capsys, raised, code, words):
    from checkpoint_ad import sweep

    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(sweep, "sweep", fail)
    assert main(["sweep", "--out", os.devnull + "-unused", "--quiet", *TINY]) == code
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_a_bug_is_not_hidden_as_a_one_line_error(monkeypatch):
    from checkpoint_ad import sweep

    def buggy(*args, **kwargs):
        raise ValueError("an honest bug")

    monkeypatch.setattr(sweep, "sweep", buggy)
    with pytest.raises(ValueError, match="an honest bug"):
        main(["sweep", "--quiet", "--no-plots", "--out", "unused", *TINY])


def test_exit_codes_are_documented_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for words in ("0 done", "2 bad input", "130 interrupted", "1 an unexpected"):
        assert words in help_text


def test_strategies_with_no_presets_is_an_error(monkeypatch, tmp_path, capsys):
    from checkpoint_ad import presets

    monkeypatch.setattr(presets, "SHIPPED_DIR", tmp_path)
    assert main(["strategies"]) == 2
    assert "no presets found" in capsys.readouterr().err


def test_python_presets_need_the_flag(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "mine.toml").write_text(
        'name = "mine"\ndescription = "d"\n[storage]\nkind = "python"\n'
        'class = "checkpoint_ad.strategies:KeepAll"\n')
    refused = _run("strategies", "--presets-dir", str(tmp_path / "mine"))
    assert refused.returncode == 2 and "--allow-python-presets" in refused.stderr
    allowed = _run("strategies", "--presets-dir", str(tmp_path / "mine"),
                   "--allow-python-presets")
    assert allowed.returncode == 0 and "mine" in allowed.stdout


# ----------------------------------------------------------------- the first hour
def test_version_and_python_dash_m_run_the_command_line():
    from checkpoint_ad import __version__

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert __version__ == project["project"]["version"]
    result = subprocess.run([sys.executable, "-m", "checkpoint_ad", "--version"],
                            capture_output=True, text=True, check=False, env=_child_env())
    assert result.returncode == 0 and result.stdout == f"checkpoint-ad {__version__}\n"


def test_profile_names_the_model_its_sizes_and_credits_the_models_own_lines():
    result = subprocess.run([sys.executable, "-m", "checkpoint_ad", "profile", "--strategy",
                             "revolve-2", *TINY], capture_output=True, text=True, check=False,
                            env=_child_env())
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("rnn (steps=6, batch=2, input_size=3, hidden=4")
    assert "revolve-2" in first
    origins = result.stdout.split("origin")[-1].splitlines()[1:]
    assert origins and all("checkpoint_ad/models/" in line for line in origins if line.strip())
    assert "runpy" not in result.stdout and "cli.py" not in result.stdout
