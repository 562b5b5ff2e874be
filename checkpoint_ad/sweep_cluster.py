"""Sweeps beyond one process: a sweep's runs fanned out over Dask distributed.

Why Dask and not a pool of our own: it already starts worker processes (a `LocalCluster`) or
reaches a real cluster by its scheduler's address, ships the runs and their results, notices
lost workers, and cancels work; all this module adds is what keeps timings comparable with a
serial sweep:

- one run at a time per worker process (a lock, for workers that have several threads):
  tracemalloc and BLAS thread pools belong to the whole process, so two runs sharing one
  would spoil each other's memory peak and time;
- BLAS threads pinned with threadpoolctl (one by default) and recorded in each profile's meta
  (``blas_threads``, with the ``worker`` address), as the local cluster's workers are;
- one unmeasured warm-up run per worker process and problem, as the serial sweep does once;
- a local cluster's workers run without Dask's worker profiler (`NO_FRAME_SAMPLING`): it
  samples the running task's frames from another thread and keeps them, and the arrays
  their locals hold, alive a while, so a run's measured peak tape would depend on its
  timing. Give workers of your own cluster the same setting for peaks that match a serial
  sweep's.

Results come back in any order and are put back in the sweep's order, so the table, files and
plots are those of a serial sweep. Whatever this module started (a local cluster, a connection)
is closed again on the way out, on errors and Ctrl-C too; a ``Client`` passed in stays open.
Workers of a real cluster need checkpoint-ad (and any preset classes of your own) installed.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
import traceback
import uuid
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .errors import (
    CheckpointADError,
    ClusterError,
    MissingExtraError,
    SweepConfigError,
    SweepRunError,
)
from .sweep_runs import RunOutcome, SweepRun, blas_threads, measure, progress, warm_up

INSTALL_HINT = "python3 -m pip install 'checkpoint-ad[dask]'"
NO_FRAME_SAMPLING = {"distributed.worker.profile.enabled": False}
"""Dask configuration without the worker profiler (see the module's docstring)."""

LOOPBACK = "127.0.0.1"  # where a local cluster's scheduler, nannies and workers listen
CONNECT_TIMEOUT_S = 10
"""How long to wait for a scheduler given by address before saying it cannot be reached."""
SCHEMES = ("tcp", "tls", "ws", "wss", "ucx")
_ADDRESS = re.compile(rf"({'|'.join(SCHEMES)})://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{{1,5}})")

_alone = threading.Lock()  # one run at a time in a worker process (see the module's docstring)
_warmed: set[tuple[str, str, str]] = set()  # the problems this worker process has warmed up


@dataclass(frozen=True)
class RunFailure:
    """What a worker sends back instead of an outcome when its run raised."""

    worker: str
    error: str  # "TypeName: message"
    remote_traceback: str
    unexpected: bool  # not an error checkpoint-ad (or the memory limit) reports on purpose


def check_cluster_options(workers: int | None, client: Any) -> None:
    """Refuse bad `workers` / `client` arguments, and a missing Dask, before any run starts."""
    if workers is None and client is None:
        return
    if workers is not None and client is not None:
        raise SweepConfigError("sweep: give workers= (a local cluster of that many processes) "
                               "or client= (a cluster of your own), not both")
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool)
                                or workers < 1):
        raise SweepConfigError(f"sweep: workers must be a positive int, got {workers!r}")
    distributed = _require_dask()
    if client is not None and not isinstance(client, (str, distributed.Client)):
        raise SweepConfigError("sweep: client must be a distributed.Client or a scheduler "
                               f"address such as 'tcp://host:8786', got {type(client).__name__}")
    if isinstance(client, str):
        check_address(client)


def check_address(address: str) -> None:
    """Refuse a scheduler address not of the form ``scheme://host:port`` before connecting
    (Dask would look a bare word up as a host name, then wait for it)."""
    match = _ADDRESS.fullmatch(address)
    if match is None or not 0 < int(match.group(3)) < 65536:
        raise SweepConfigError(
            f"sweep: {address!r} is not a scheduler address; give scheme://host:port, e.g. "
            f"tcp://127.0.0.1:8786 (schemes: {', '.join(SCHEMES)})")


def _require_dask() -> Any:
    try:
        import distributed
        import threadpoolctl  # noqa: F401  (the workers pin their threads with it)
    except ImportError as exc:
        raise MissingExtraError(
            f"sweeps over workers need Dask distributed and threadpoolctl, and {exc.name!r} "
            f"is not installed; install the 'dask' extra: {INSTALL_HINT}") from exc
    return distributed


@contextmanager
def connect(workers: int | None = None, client: Any = None) -> Iterator[Any]:
    """A ``distributed.Client`` to run on: `client` itself if it is one, a connection to the
    scheduler at address `client`, else a new local cluster of `workers` single-threaded
    processes. What this opened is closed when the block ends, however it ends."""
    check_cluster_options(workers, client)
    distributed = _require_dask()
    import dask

    if isinstance(client, distributed.Client):
        yield client
        return
    if isinstance(client, str):
        try:
            own = distributed.Client(client, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
        except (OSError, ValueError, TypeError) as exc:  # TimeoutError is an OSError
            raise ClusterError(
                f"cannot reach a Dask scheduler at {client!r} ({type(exc).__name__}: {exc}); "
                "check the address (tcp://host:port) and that the scheduler is running"
            ) from exc
        with own:
            yield own
        return
    try:
        # Dask's worker profiler samples the running task's frames from another thread and
        # keeps them (and the arrays their locals hold) alive a while: measured peaks would
        # depend on its timing, so a sweep's own workers run without it
        with _children_ignore_ctrl_c(), dask.config.set(NO_FRAME_SAMPLING), \
                warnings.catch_warnings():
            # the scheduler's HTTP server (on loopback) takes another port when 8787 is taken,
            # and says so on stderr: nothing a user of a sweep needs to read
            warnings.filterwarnings("ignore", message="Port .* is already in use")
            cluster = distributed.LocalCluster(
                n_workers=workers or 1, threads_per_worker=1, processes=True,
                # every port on loopback, and no dashboard: nobody reads a sweep's, and it
                # listened on every interface
                host=LOOPBACK, dashboard_address=None,
                # a run's own errors come back as its result; what workers log while being
                # closed mid-run (a scheduler gone before their heartbeat) is noise
                silence_logs=logging.CRITICAL)
    except (OSError, RuntimeError) as exc:
        raise ClusterError(f"cannot start a local Dask cluster of {workers} workers "
                           f"({type(exc).__name__}: {exc})") from exc
    try:
        with distributed.Client(cluster, set_as_default=False) as own:
            yield own
    finally:
        cluster.close()


@contextmanager
def _children_ignore_ctrl_c() -> Iterator[None]:
    """Start processes that ignore SIGINT: Ctrl-C in a terminal reaches the whole process
    group, and the workers should not die mid-run with tracebacks of their own; this process
    hears it and closes the cluster. (An ignored signal stays ignored in a child, and Python
    then installs no KeyboardInterrupt handler.) Only the main thread may change handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_on_cluster(
    runs: Sequence[SweepRun],
    *,
    workers: int | None = None,
    client: Any = None,
    progress_bar: bool = True,
    threads: int = 1,
) -> list[RunOutcome]:
    """Each run measured on a Dask worker, `threads` BLAS threads each; outcomes in `runs`'s
    order. The first run that fails raises `SweepRunError` (the others are cancelled)."""
    distributed = _require_dask()
    sweep_id = uuid.uuid4().hex[:8]
    with connect(workers, client) as dask_client:
        futures = [dask_client.submit(run_in_worker, run, threads, pure=False,
                                      key=f"checkpoint-ad-run-{sweep_id}-{i}")
                   for i, run in enumerate(runs)]
        where = {future.key: i for i, future in enumerate(futures)}
        outcomes: list[RunOutcome | None] = [None] * len(runs)
        try:
            done = distributed.as_completed(futures, loop=dask_client.loop)
            for future in progress(done, progress_bar, total=len(futures)):
                i = where[future.key]
                outcomes[i] = _outcome(runs[i], future)
        finally:  # after a failure or Ctrl-C nothing of this sweep keeps running
            dask_client.cancel(futures)
    return [outcome for outcome in outcomes if outcome is not None]


def _outcome(run: SweepRun, future: Any) -> RunOutcome:
    try:
        result = future.result()
    except Exception as exc:  # the run never reported back: its worker died or was lost
        raise SweepRunError(f"{run.describe()} did not come back from its Dask worker "
                            f"({type(exc).__name__}: {exc})", unexpected=True) from exc
    if isinstance(result, RunFailure):
        raise SweepRunError(f"{run.describe()} failed on worker {result.worker}: "
                            f"{result.error}", result.remote_traceback, result.unexpected)
    return result


def run_in_worker(run: SweepRun, threads: int = 1) -> RunOutcome | RunFailure:
    """Measure `run` in this worker process, alone and with `threads` BLAS threads.

    Errors come back as a `RunFailure` (with the traceback as text) rather than raised, so
    that any exception, picklable or not, reaches the caller with its message intact."""
    with _alone:
        try:
            from threadpoolctl import threadpool_limits

            with threadpool_limits(limits=threads):
                problem = (run.model, run.device, json.dumps(run.sizes, sort_keys=True))
                if problem not in _warmed:
                    warm_up(run)
                    _warmed.add(problem)
                outcome = measure(run)
                outcome.profile.meta.update(worker=_worker_address(),
                                            blas_threads=blas_threads())
            return outcome
        except Exception as exc:
            message = str(exc).splitlines()[0] if str(exc) else ""
            return RunFailure(_worker_address(), f"{type(exc).__name__}: {message}",
                              traceback.format_exc(),
                              not isinstance(exc, (CheckpointADError, MemoryError)))


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except (ImportError, ValueError):  # called outside a worker (e.g. in a test)
        return "local"

