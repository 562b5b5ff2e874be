"""Sweeps on Dask workers: the same table as a serial sweep, clear errors, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from checkpoint_ad import sweep_cluster
from checkpoint_ad.cli import main
from checkpoint_ad.errors import (
    ClusterError,
    MissingExtraError,
    PresetError,
    SweepConfigError,
    SweepRunError,
)
from checkpoint_ad.presets import Preset, load_preset
from checkpoint_ad.sweep import sweep
from checkpoint_ad.sweep_runs import SweepRun

SIZES = {"steps": 6, "batch": 4, "hidden": 32, "input_size": 3}  # int8 changes grads
TINY = [arg for key, value in SIZES.items() for arg in ("--size", f"{key}={value}")]
PRESETS = ["keep-all", "revolve-2", "int8", "every-2"]
# measured, so they differ from run to run (and tracemalloc in a worker also sees the
# worker's own threads); every other column must be the serial sweep's exactly
MEASURED = {"seconds", "time_ratio", "recompute_seconds", "device_peak_bytes", "seconds_min",
            "seconds_max"}


def _exact(rows: list) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in MEASURED} for row in rows]


def _children() -> set[int]:
    """This process's children, but multiprocessing's resource tracker: one per interpreter,
    started with the first spawned process and meant to outlive it."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if not any("resource_tracker" in part for part in child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:  # ended while listed
            continue
    return pids


def _wait_for_no_new_children(before: set[int], seconds: float = 30.0) -> set[int]:
    """The processes started since `before` that are still alive after at most `seconds`."""
    deadline = time.monotonic() + seconds
    while (left := _children() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@dataclass(frozen=True)
class FailingPreset(Preset):
    """A preset whose run raises inside the worker (a user's strategy with a bug, say)."""

    error: Exception | None = None  # None: a ValueError, as a bug would raise

    def loop_strategy(self, n_steps: int):
        raise self.error or ValueError("a bug in a user's strategy")


# ------------------------------------------------------------------ same table as serial
@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    import dask

    from checkpoint_ad.sweep_cluster import NO_FRAME_SAMPLING

    with dask.config.set(NO_FRAME_SAMPLING):  # peaks that do not depend on frame sampling
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                           host="127.0.0.1", dashboard_address=None)
    with cluster, distributed.Client(cluster, set_as_default=False) as dask_client:
        yield dask_client


def test_cli_workers_2_writes_the_serial_sweeps_rows_files_and_plots(tmp_path):
    pytest.importorskip("distributed")
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    common = ["sweep", "--presets", ",".join(PRESETS), "--quiet", "--repeats", "1", *TINY]
    assert main([*common, "--out", str(serial)]) == 0
    assert main([*common, "--out", str(parallel), "--workers", "2"]) == 0
    assert sorted(p.name for p in serial.iterdir()) == sorted(p.name for p in parallel.iterdir())
    one = json.loads((serial / "sweep-rnn.json").read_text())
    two = json.loads((parallel / "sweep-rnn.json").read_text())
    assert [r["preset"] for r in two["rows"]] == PRESETS
    assert _exact(two["rows"]) == _exact(one["rows"])
    assert (one["model"], one["device"], one["meta"]) == (two["model"], two["device"], two["meta"])
    profile = json.loads((parallel / "rnn-int8.json").read_text())
    assert profile["meta"]["blas_threads"] == 1 and profile["meta"]["worker"].startswith("tcp://")


def test_a_client_gives_the_serial_gradient_errors_and_stays_open(client):
    serial = sweep("rnn", PRESETS, sizes=SIZES, progress=False, repeats=1)
    parallel = sweep("rnn", PRESETS, sizes=SIZES, progress=False, repeats=1, client=client)
    assert _exact([asdict(r) for r in parallel.rows]) == _exact([asdict(r) for r in serial.rows])
    errors = {r.preset: r.grad_error for r in parallel.rows}
    assert errors["revolve-2"] == errors["every-2"] == 0.0 < errors["int8"]
    assert set(parallel.profiles) == set(serial.profiles)
    assert client.status == "running"  # a client of the caller's own is not closed


def test_the_reference_alone_is_measured_but_not_a_row(client):
    result = sweep("rnn", ["revolve-2"], sizes=SIZES, progress=False, repeats=1, client=client)
    assert [r.preset for r in result.rows] == ["revolve-2"]
    assert set(result.profiles) == {"keep-all", "revolve-2"}
    assert result.rows[0].memory_ratio == (result.profiles["revolve-2"].peak_tape_bytes
                                           / result.profiles["keep-all"].peak_tape_bytes)


def test_the_progress_bar_counts_every_run(client, monkeypatch):
    seen = []

    def bar(items, show, total=None):
        for item in items:
            seen.append((show, total))
            yield item

    monkeypatch.setattr(sweep_cluster, "progress", bar)
    sweep("rnn", ["keep-all", "revolve-2"], sizes=SIZES, repeats=1, client=client)
    assert seen == [(True, 2), (True, 2)]


# ------------------------------------------------------------------ failures
def test_a_run_that_raises_names_its_preset_model_and_message(client):
    failing = FailingPreset("broken", "raises in the worker")
    with pytest.raises(SweepRunError) as caught:
        sweep("rnn", ["revolve-2", failing], sizes=SIZES, progress=False, repeats=1,
              client=client)
    message = str(caught.value)
    assert "'broken'" in message and "'rnn'" in message and "tcp://" in message
    assert "ValueError: a bug in a user's strategy" in message
    assert caught.value.unexpected and "loop_strategy" in caught.value.remote_traceback


def test_a_reported_error_in_a_worker_is_not_called_a_bug(client):
    failing = FailingPreset("refused", "", error=PresetError("preset 'refused' is refused"))
    with pytest.raises(SweepRunError, match="PresetError: preset 'refused' is refused") as caught:
        sweep("rnn", [failing], sizes=SIZES, progress=False, repeats=1, client=client)
    assert not caught.value.unexpected


def test_a_failed_run_closes_the_local_cluster():
    pytest.importorskip("distributed")
    before = _children()
    with pytest.raises(SweepRunError, match="broken"):
        sweep("rnn", [FailingPreset("broken", "")], sizes=SIZES, progress=False, repeats=1,
              workers=2)
    assert _wait_for_no_new_children(before) == set()


def test_ctrl_c_closes_the_local_cluster(monkeypatch):
    pytest.importorskip("distributed")

    def interrupted(items, show, total=None):
        for _ in items:
            raise KeyboardInterrupt
        yield

    monkeypatch.setattr(sweep_cluster, "progress", interrupted)
    before = _children()
    with pytest.raises(KeyboardInterrupt):
        sweep("rnn", PRESETS, sizes=SIZES, progress=False, repeats=1, workers=2)
    assert _wait_for_no_new_children(before) == set()


def test_errors_in_a_worker_come_back_as_failures_with_their_traceback():
    run = SweepRun("rnn", FailingPreset("broken", ""), "cpu", SIZES, {"model": "rnn"}, 1)
    failure = sweep_cluster.run_in_worker(run)
    assert isinstance(failure, sweep_cluster.RunFailure)
    assert failure.error == "ValueError: a bug in a user's strategy" and failure.unexpected
    assert "Traceback" in failure.remote_traceback


def test_a_worker_pins_blas_threads_and_records_them():
    pytest.importorskip("threadpoolctl")
    run = SweepRun("rnn", load_preset("revolve-2"), "cpu", SIZES, {"model": "rnn"}, 1)
    outcome = sweep_cluster.run_in_worker(run, threads=1)
    assert outcome.profile.meta["blas_threads"] in (1, None)  # None: no BLAS pool loaded
    assert outcome.profile.meta["worker"] == "local"
    assert all(np.isfinite(g).all() for g in outcome.grads)


def test_the_sweep_run_error_survives_pickling():
    import pickle

    error = SweepRunError("run failed", "Traceback: ...", unexpected=True)
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.remote_traceback, again.unexpected) == (
        "run failed", "Traceback: ...", True)


# ------------------------------------------------------------------ bad input
def test_a_bad_scheduler_address_is_a_clear_error():
    dask = pytest.importorskip("dask")
    pytest.importorskip("distributed")
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        with pytest.raises(ClusterError, match=r"tcp://127\.0\.0\.1:9.*check the address"):
            sweep("rnn", ["keep-all"], sizes=SIZES, progress=False, repeats=1,
                  client="tcp://127.0.0.1:9")
        with pytest.raises(SweepConfigError, match="'not-a-scheme://x' is not a scheduler"):
            sweep("rnn", ["keep-all"], sizes=SIZES, progress=False, repeats=1,
                  client="not-a-scheme://x")


@pytest.mark.parametrize("address", ["garbage", "localhost:8786", "tcp://host", "tcp://h:0",
                                     "tcp://h:70000", "tcp://h:1/path"])
def test_a_malformed_scheduler_address_is_refused_before_connecting(address, monkeypatch):
    distributed = pytest.importorskip("distributed")

    def must_not_connect(*args, **kwargs):
        raise AssertionError("a connection was tried")

    monkeypatch.setattr(distributed, "Client", must_not_connect)
    with pytest.raises(SweepConfigError, match="scheme://host:port"):
        sweep_cluster.check_cluster_options(None, address)


def test_the_cli_refuses_a_garbage_scheduler_at_once_in_one_line(tmp_path):
    pytest.importorskip("distributed")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "checkpoint_ad.cli", "sweep", "--scheduler",
                             "garbage", "--quiet", "--no-plots", "--out", str(tmp_path / "o")],
                            capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "'garbage' is not a scheduler address" in result.stderr
    assert time.monotonic() - started < 30  # it waited 60 s for a host named garbage


def _listening() -> set[tuple[int, Any]]:
    """(pid, address) of every listening socket of this process and its children."""
    found = set()
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            found |= {(process.pid, c.laddr) for c in process.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:  # ended while listed
            continue
    return found


def test_a_local_cluster_listens_on_loopback_only():
    pytest.importorskip("distributed")
    before = _listening()  # another test's cluster may still be up: not this one's
    with sweep_cluster.connect(workers=2) as dask_client:
        assert len(dask_client.scheduler_info()["workers"]) == 2
        listening = [address for _, address in _listening() - before]
    assert len(listening) >= 5  # the scheduler, and a nanny and a worker each
    assert {address.ip for address in listening} <= {"127.0.0.1", "::1"}, listening


def test_the_cli_reports_a_bad_scheduler_in_one_line_and_writes_nothing(tmp_path, capsys):
    dask = pytest.importorskip("dask")
    pytest.importorskip("distributed")
    out = tmp_path / "new"
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        code = main(["sweep", "--scheduler", "tcp://127.0.0.1:9", "--presets", "keep-all",
                     "--quiet", "--no-plots", "--out", str(out), *TINY])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "cannot reach a Dask scheduler at 'tcp://127.0.0.1:9'" in err
    assert not out.exists()


@pytest.mark.parametrize(("args", "words"), [
    (["--workers", "0"], "--workers must be 1 or more"),
    (["--workers", "2", "--scheduler", "tcp://127.0.0.1:9"], "give one of them"),
])
def test_cli_cluster_flags_are_checked_before_anything_runs(tmp_path, capsys, args, words):
    out = tmp_path / "new"
    assert main(["sweep", *args, "--quiet", "--out", str(out), *TINY]) == 2
    assert words in capsys.readouterr().err
    assert not out.exists()


def test_cli_workers_must_be_a_number(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["sweep", "--workers", "two"])
    assert exited.value.code == 2 and "--workers" in capsys.readouterr().err


def test_cli_flags_reach_the_sweep(monkeypatch, tmp_path):
    from checkpoint_ad import sweep as sweep_module

    pytest.importorskip("distributed")
    asked = {}

    def fake(*args, **kwargs):
        asked.update(kwargs)
        raise KeyboardInterrupt  # stop before anything is written

    monkeypatch.setattr(sweep_module, "sweep", fake)
    assert main(["sweep", "--workers", "3", "--quiet", "--out", str(tmp_path / "a")]) == 130
    assert (asked["workers"], asked["client"]) == (3, None)
    assert main(["sweep", "--scheduler", "tcp://h:1", "--quiet",
                 "--out", str(tmp_path / "b")]) == 130
    assert (asked["workers"], asked["client"]) == (None, "tcp://h:1")
    assert main(["sweep", "--quiet", "--out", str(tmp_path / "c")]) == 130
    assert (asked["workers"], asked["client"]) == (None, None)


@pytest.mark.parametrize(("options", "words"), [
    ({"workers": 0}, "workers must be a positive int"),
    ({"workers": True}, "workers must be a positive int"),
    ({"workers": 2, "client": "tcp://h:1"}, "not both"),
    ({"client": 42}, "client must be a distributed.Client or a scheduler address"),
])
def test_bad_cluster_arguments_fail_before_any_run(options, words):
    pytest.importorskip("distributed")
    with pytest.raises(SweepConfigError, match=words):
        sweep("rnn", ["keep-all"], sizes=SIZES, progress=False, **options)


def test_without_dask_the_error_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed now fails
    with pytest.raises(MissingExtraError, match=r"checkpoint-ad\[dask\]"):
        sweep("rnn", ["keep-all"], sizes=SIZES, progress=False, workers=2)
    out = tmp_path / "new"
    assert main(["sweep", "--workers", "2", "--quiet", "--out", str(out), *TINY]) == 2
    assert "install the 'dask' extra" in capsys.readouterr().err
    assert not Path(out).exists()


def test_a_bug_on_a_worker_shows_its_traceback_and_exits_1(monkeypatch, capsys):
    from checkpoint_ad import sweep as sweep_module

    def failed(*args, **kwargs):
        raise SweepRunError("preset 'x' on model 'rnn' failed on worker w: ValueError: bad",
                            "Traceback (most recent call last):\n  in the worker\n",
                            unexpected=True)

    monkeypatch.setattr(sweep_module, "sweep", failed)
    assert main(["sweep", "--quiet", "--no-plots", "--out", "unused", *TINY]) == 1
    err = capsys.readouterr().err
    assert "in the worker" in err and err.rstrip().endswith("ValueError: bad")


def _ignores_ctrl_c(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_ctrl_c_in_a_terminal_stops_the_cli_and_its_workers_quietly():
    """Ctrl-C reaches the whole process group: the workers ignore it, the command closes them
    and says one line."""
    pytest.importorskip("distributed")
    command = [sys.executable, "-m", "checkpoint_ad.cli", "sweep", "--workers", "2", "--quiet",
               "--no-plots", "--presets", "keep-all,revolve-2", "--size", "steps=4000",
               "--out", os.devnull + "-never-written"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        parent = psutil.Process(process.pid)
        deadline = time.monotonic() + 120
        # running: both workers started and this command listening to Ctrl-C again
        while (len(parent.children()) < 2 or _ignores_ctrl_c(process.pid)) \
                and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        workers = parent.children(recursive=True)
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130 and err == "checkpoint-ad: interrupted\n", err
    assert psutil.wait_procs(workers, timeout=30)[1] == []
