"""`profile()`: listen to the engine's events and fill a `Profile` while a block runs."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .. import events
from .memory import probe_for, rss_bytes, synchronize
from .records import Profile, SavedRecord


class _Recorder:
    """The event listener: keeps live saved bytes, phases and records up to date."""

    def __init__(self, profile: Profile, device: str) -> None:
        self.profile = profile
        self.device = device
        self.probe = probe_for(device)
        self.serials: dict[int, int] = {}  # id(buffer) -> serial (ids are reused; serials not)
        self.sizes: dict[int, int] = {}  # id(buffer) -> stored bytes, for live buffers
        self.counter = itertools.count()
        self.live = 0
        self.backward_depth = 0
        self.recompute_depth = 0
        self.backward_started = 0.0
        self.recompute_started = 0.0
        self.handlers = {
            "record": self._record,
            "apply": self._apply,
            "pack": self._pack,
            "free": self._free,
            "backward_begin": self._backward_begin,
            "backward_end": self._backward_end,
            "recompute_begin": self._recompute_begin,
            "recompute_end": self._recompute_end,
        }

    def __call__(self, kind: str, payload: Any) -> None:
        handler = self.handlers.get(kind)
        if handler is not None:
            handler(payload)

    # ------------------------------------------------------------- helpers
    @property
    def phase(self) -> str:
        if self.recompute_depth:
            return "recompute"
        return "backward" if self.backward_depth else "forward"

    def _point(self) -> None:
        p = self.profile
        p.timeline_seconds.append(time.perf_counter() - self.started)
        p.timeline_bytes.append(self.live)
        p.timeline_phase.append(self.phase)

    def _serial(self, buffer: Any) -> int:
        serial = self.serials.get(id(buffer))
        if serial is None:  # saved before profiling began: known from now on
            serial = self.serials[id(buffer)] = next(self.counter)
        return serial

    def _sample_rss(self) -> None:
        rss = rss_bytes()
        if rss is not None and (self.profile.rss_peak_bytes or 0) < rss:
            self.profile.rss_peak_bytes = rss

    # ------------------------------------------------------------- events
    def _record(self, entry: Any) -> None:
        self._apply(entry)
        for slot in entry.slots or ():
            buffer = slot.buffer
            if buffer is None:
                continue
            self.profile.records.append(SavedRecord(
                op=entry.name,
                role=slot.name,
                shape=tuple(int(d) for d in buffer.shape),
                dtype=str(buffer.dtype),
                logical_bytes=buffer.logical_nbytes,
                stored_bytes=buffer.stored_nbytes,
                origin=entry.origin,
                buffer=self._serial(buffer),
                phase=self.phase,
            ))

    def _apply(self, _: Any) -> None:
        self.profile.primitives += 1
        if self.recompute_depth:
            self.profile.recomputed_primitives += 1

    def _pack(self, buffer: Any) -> None:
        key = id(buffer)
        self.serials[key] = next(self.counter)
        self.sizes[key] = buffer.stored_nbytes
        self.live += buffer.stored_nbytes
        if self.live > self.profile.peak_tape_bytes:
            self.profile.peak_tape_bytes = self.live
        self.probe.sample()
        self._point()

    def _free(self, key: int) -> None:
        size = self.sizes.pop(key, None)
        if size is None:
            return
        self.serials.pop(key, None)
        self.live -= size
        self.probe.sample()
        self._point()

    def _backward_begin(self, _: Any) -> None:
        if self.backward_depth == 0 and self.recompute_depth == 0:
            synchronize(self.device)
            self._sample_rss()
            self.backward_started = time.perf_counter()
        self.backward_depth += 1

    def _backward_end(self, _: Any) -> None:
        self.backward_depth -= 1
        if self.backward_depth == 0 and self.recompute_depth == 0:
            synchronize(self.device)
            self.profile.backward_seconds += time.perf_counter() - self.backward_started
            self._sample_rss()

    def _recompute_begin(self, _: Any) -> None:
        if self.recompute_depth == 0:
            synchronize(self.device)
            self.recompute_started = time.perf_counter()
        self.recompute_depth += 1

    def _recompute_end(self, _: Any) -> None:
        self.recompute_depth -= 1
        if self.recompute_depth == 0:
            synchronize(self.device)
            self.profile.recompute_seconds += time.perf_counter() - self.recompute_started

    # ------------------------------------------------------------- lifetime
    def start(self) -> None:
        self._sample_rss()
        self.probe.start()
        self.profile.memory_source = self.probe.source
        synchronize(self.device)
        self.started = time.perf_counter()
        self._point()

    def stop(self) -> None:
        synchronize(self.device)
        elapsed = time.perf_counter() - self.started
        self._point()
        self.profile.forward_seconds = max(elapsed - self.profile.backward_seconds, 0.0)
        self.profile.device_peak_bytes = self.probe.stop()
        self._sample_rss()


@contextmanager
def profile(device: str = "cpu", **meta: Any) -> Iterator[Profile]:
    """Profile the tape of everything run inside the block.

    Yields the `Profile`, which is complete when the block exits. Nothing is measured, and
    nothing costs, outside such a block.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0, 2.0], requires_grad=True)
    >>> with cad.profile(model="demo") as prof:
    ...     cad.tanh(x).sum().backward()
    >>> prof.peak_tape_bytes, prof.records[0].op
    (8, 'tanh')
    """
    result = Profile(device=device, meta=dict(meta))
    recorder = _Recorder(result, device)
    recorder.start()
    unsubscribe = events.subscribe(recorder)
    try:
        yield result
    finally:
        unsubscribe()
        recorder.stop()
