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


class CupyPoolProbe(MemoryProbe):
    """Bytes in use in cupy's default memory pool, sampled at engine events."""

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


def probe_for(device: str, enabled: bool = True) -> MemoryProbe:
    """How to measure `device`'s memory (a probe that measures nothing when not `enabled`)."""
    if not enabled:
        return MemoryProbe()
    if device.startswith("cuda"):
        from ..backend import cupy_or_none

        cupy = cupy_or_none()
        return CupyPoolProbe(cupy) if cupy is not None else MemoryProbe()
    return TracemallocProbe()


_process: list[Any] = []  # [(pid, psutil.Process)]: making one costs more than reading it


def rss_bytes() -> int | None:
    """Resident set size of this process (psutil), or None if psutil is missing."""
    try:
        import psutil
    except ImportError:
        return None
    pid = os.getpid()
    if not _process or _process[0][0] != pid:  # first call, or in a forked child
        _process[:] = [(pid, psutil.Process(pid))]
    return int(_process[0][1].memory_info().rss)


def synchronize(device: str) -> None:
    """Wait for queued GPU work so that wall-clock times include it."""
    if device.startswith("cuda"):
        from ..backend import cupy_or_none

        cupy = cupy_or_none()
        if cupy is not None:
            cupy.cuda.Device().synchronize()
