"""Measuring a device's memory: tracemalloc for numpy on CPU, cupy's pool on GPU, RSS."""

from __future__ import annotations

import os
import tracemalloc
from typing import Any


class MemoryProbe:
    """Tracks the peak bytes allocated on one device since `start()`."""

    source = "none"

    def start(self) -> None: ...

    def sample(self) -> None: ...

    def stop(self) -> int | None:
        return None


class TracemallocProbe(MemoryProbe):
    """Python-heap allocations, numpy's data included (numpy reports to tracemalloc)."""

    source = "tracemalloc"

    def start(self) -> None:
        self._owned = not tracemalloc.is_tracing()
        if self._owned:
            tracemalloc.start()
        self._base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()

    def stop(self) -> int:
        peak = tracemalloc.get_traced_memory()[1] - self._base
        if self._owned:
            tracemalloc.stop()
        return max(peak, 0)

    def current(self) -> int:
        """Bytes allocated now above the start (negative once more is freed than made)."""
        return tracemalloc.get_traced_memory()[0] - self._base

    def peak(self) -> int:
        """The most allocated above the start since the start or `reset_peak`."""
        return tracemalloc.get_traced_memory()[1] - self._base

    def reset_peak(self) -> None:
        """Restart the peak from `current` (tracemalloc's own: a caller's tracing loses
        its peak, so measure under it only what owns tracemalloc)."""
        tracemalloc.reset_peak()


class CupyPoolProbe(MemoryProbe):
    """Bytes in use in cupy's default memory pool, sampled at engine events.

    The fallback where cupy has no memory hooks: a buffer made and freed between two events
    (a temporary inside one rule) is missed."""

    source = "cupy-pool"

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    def start(self) -> None:
        self.pool = self.cupy.get_default_memory_pool()
        self._base = self.pool.used_bytes()
        self._peak = self._base

    def sample(self) -> None:
        used = self.pool.used_bytes()
        if used > self._peak:
            self._peak = used

    def stop(self) -> int:
        self.sample()
        return self._peak - self._base


class CupyHookProbe(MemoryProbe):
    """The exact peak of bytes handed out by cupy's memory pools, from a memory hook.

    cupy calls the hook on every pool allocation and release, so the peak includes the
    temporaries inside a rule that a sampling probe misses, and the engine's events need not
    sample anything. The hook sees this thread's allocations only (cupy's hooks are
    thread-local)."""

    source = "cupy-pool"

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy
        self.used = self.most = 0
        probe = self

        class _Hook(cupy.cuda.MemoryHook):
            name = f"checkpoint-ad-peak-{id(self)}"

            def malloc_postprocess(self, **kwargs: Any) -> None:
                probe.used += kwargs["mem_size"]
                if probe.used > probe.most:
                    probe.most = probe.used

            def free_postprocess(self, **kwargs: Any) -> None:
                probe.used -= kwargs["mem_size"]

        self._hook = _Hook()

    def start(self) -> None:
        self.used = self.most = 0
        self._hook.__enter__()

    def stop(self) -> int:
        self._hook.__exit__(None, None, None)
        return self.most

    def current(self) -> int:
        """Bytes handed out now above the start (negative once older blocks are freed)."""
        return self.used

    def peak(self) -> int:
        """The most handed out above the start since the start or `reset_peak`."""
        return self.most

    def reset_peak(self) -> None:
        self.most = self.used


def probe_for(device: str, enabled: bool = True) -> MemoryProbe:
    """How to measure `device`'s memory (a probe that measures nothing when not `enabled`)."""
    if not enabled:
        return MemoryProbe()
    if device.startswith("cuda"):
        from ..backend import cupy_or_none

        cupy = cupy_or_none()
        if cupy is None:
            return MemoryProbe()
        if hasattr(cupy.cuda, "MemoryHook"):
            return CupyHookProbe(cupy)
        return CupyPoolProbe(cupy)
    return TracemallocProbe()


_statm: dict[int, int] = {}  # pid -> open descriptor of its /proc/<pid>/statm
_PAGE = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """Resident set size of this process, or None if it cannot be read.

    A profile samples it at each sweep's start and end, so it must be cheap: on Linux, one
    read of /proc/<pid>/statm through a descriptor kept open (a few µs; psutil opens the file
    each time, ~10x slower); elsewhere psutil, if installed."""
    pid = os.getpid()
    fd = _statm.get(pid)
    if fd is None and os.path.exists(f"/proc/{pid}/statm"):
        fd = _statm[pid] = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
    if fd is not None:
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process(pid).memory_info().rss)


def synchronize(device: str) -> None:
    """Wait for queued GPU work so that wall-clock times include it."""
    if device.startswith("cuda"):
        from ..backend import cupy_or_none

        cupy = cupy_or_none()
        if cupy is not None:
            cupy.cuda.Device().synchronize()
