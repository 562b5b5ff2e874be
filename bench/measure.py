"""How every benchmark times and measures: medians with the collector frozen, memory peaks,
thread pinning, and the record of the machine a run happened on.

Why these choices:

- Timing: one warm-up call (first-touch page faults, BLAS buffers, JAX compilation), then the
  median of the repeats. ``gc.freeze()`` around each timed call moves everything alive into the
  permanent generation, so a collection triggered by the tape's many small objects does not
  traverse the whole heap (HIPS autograd's times swung 2-4x without it).
- Memory, ``tracemalloc``: numpy reports every data buffer to tracemalloc, so its peak above the
  level before the call is the Python-side peak: arrays plus tape objects. Torch and XLA
  allocate outside Python and are invisible to it.
- Memory, RSS: the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) above
  the resident set measured with psutil after ``malloc_trim`` returned freed heap pages to the
  system. It sees every allocator, so it is the one measure all columns share; it counts pages,
  so it is coarser (allocator caches, page granularity) than tracemalloc.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import re
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


class Workload(Protocol):
    """What a benchmark configuration hands to `measure`.

    `run()` does one forward+backward (or one unit of work) and keeps its results on the object;
    `clear()` drops them, so that a memory measurement starts from the inputs alone.
    """

    def run(self) -> None: ...

    def clear(self) -> None: ...


# ------------------------------------------------------------------------------------ threads
def thread_env(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables that pin BLAS, OpenMP and XLA to `threads` threads.

    They must be set before numpy, torch or jax is imported, which is why every configuration
    runs in a fresh worker process started with them.
    """
    env = dict(os.environ if base is None else base)
    for name in THREAD_ENV_VARS:
        env[name] = str(threads)
    xla = f"intra_op_parallelism_threads={threads}"
    if threads == 1:
        xla = f"--xla_cpu_multi_thread_eigen=false {xla}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla}".strip()
    return env


_limits: list[Any] = []  # keeps the threadpoolctl limiter alive for the life of the worker


def pin_threads(threads: int) -> str:
    """Limit every thread pool loaded so far (numpy's BLAS, torch's OpenMP) to `threads`.

    Call again after importing a library that brings its own pool. Returns how it was done.
    """
    how = ["env"]
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        how.append("threadpoolctl missing")
    else:
        _limits.append(threadpool_limits(limits=threads))
        how.append("threadpoolctl")
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_num_threads(threads)
        how.append("torch.set_num_threads")
    return "+".join(how)


def blas_info() -> list[dict[str, Any]]:
    """The thread pools loaded in this process (threadpoolctl), in a short form."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keys = ("user_api", "internal_api", "version", "num_threads", "architecture", "threading_layer")
    pools = []
    for pool in threadpool_info():
        entry = {k: pool[k] for k in keys if pool.get(k) is not None}
        entry["library"] = os.path.basename(pool.get("filepath", ""))
        pools.append(entry)
    return pools


# ------------------------------------------------------------------------------------ timing
@dataclass(frozen=True)
class Timing:
    """Median, fastest and slowest of `repeats` timed calls, in seconds."""

    median: float
    low: float
    high: float
    repeats: int


def time_median(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> Timing:
    """Median wall time of `fn` over `repeats` calls after `warmup` untimed ones."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        gc.collect()
        gc.freeze()
        try:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.unfreeze()
    return Timing(statistics.median(times), min(times), max(times), repeats)


def paired_ratio(fn: Callable[[], Any], base: Callable[[], Any], repeats: int) -> Timing:
    """Median, least and most over `repeats` rounds of (time of `fn` / time of `base`), the
    two run back to back in each round, in alternating order: a ratio of two columns timed in
    separate workers also measures how the machine's speed drifted between them (tens of
    percent over a minute on shared cores), which this cancels."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    ratios = []
    for round_ in range(repeats):
        seconds = {}
        for which, call in ((0, fn), (1, base)) if round_ % 2 == 0 else ((1, base), (0, fn)):
            seconds[which] = time_median(call, 1, warmup=0).median
        ratios.append(seconds[0] / max(seconds[1], 1e-12))
    return Timing(statistics.median(ratios), min(ratios), max(ratios), repeats)


# ------------------------------------------------------------------------------------ memory
def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)


def _high_water_mark() -> int | None:
    try:
        with open("/proc/self/status") as status:
            match = re.search(r"VmHWM:\s+(\d+)\s+kB", status.read())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class _Sampler(threading.Thread):
    """Fallback where VmHWM cannot be reset: psutil's RSS sampled every millisecond."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _rss()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, _rss())


def rss_peak_delta(work: Workload) -> tuple[int | None, str]:
    """Peak resident bytes of one `work.run()` above the resident set before it, and how."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        return None, "psutil missing"
    work.clear()
    gc.collect()
    _malloc_trim()
    base = _rss()
    if _reset_high_water_mark() and _high_water_mark() is not None:
        work.run()
        peak = _high_water_mark() or 0
        source = "VmHWM"
    else:
        sampler = _Sampler()
        sampler.start()
        work.run()
        sampler.done.set()
        sampler.join()
        peak = max(sampler.peak, _rss())
        source = "psutil 1 ms samples"
    work.clear()
    return max(peak - base, 0), source


def tracemalloc_peak(work: Workload) -> int:
    """Peak bytes traced by tracemalloc during one `work.run()`, above the level before it."""
    work.clear()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        work.run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        work.clear()
    return max(peak - base, 0)


def measure(
    work: Workload,
    repeats: int,
    *,
    warmup: int = 1,
    rss: bool = True,
    traced: bool = False,
    check: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Time `work` and measure its memory, in this order: warm-up, timed repeats, `check`
    (which reads the last timed run's results, e.g. its gradients), RSS, traced.

    tracemalloc slows every allocation, so its run comes last and is never timed.
    """
    timing = time_median(work.run, repeats, warmup)
    result: dict[str, Any] = {
        "seconds": timing.median,
        "spread": [timing.low, timing.high],
        "repeats": timing.repeats,
    }
    if check is not None:
        result.update(check())
    if rss:
        result["rss_bytes"], result["rss_source"] = rss_peak_delta(work)
    if traced:
        result["tracemalloc_bytes"] = tracemalloc_peak(work)
    work.clear()
    return result


# ------------------------------------------------------------------------------------ machine
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def machine(threads: int) -> dict[str, Any]:
    """Date, machine, versions and thread settings, recorded with every run."""
    try:
        import psutil

        memory = f"{psutil.virtual_memory().total / 2**30:.1f} GiB"
        load = [round(x, 2) for x in psutil.getloadavg()]
    except ImportError:
        memory, load = "unknown", None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory": memory,
        "load_average_at_start": load,
        "python": platform.python_version(),
        "threads": threads,
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "versions": {
            name: _version(name)
            for name in ("checkpoint-ad", "numpy", "torch", "jax", "jaxlib", "autograd",
                         "threadpoolctl", "psutil")
        },
    }
