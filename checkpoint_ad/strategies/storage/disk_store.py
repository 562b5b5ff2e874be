"""The disk level: stored forms written to a private temporary folder behind the computation and
read back ahead of the backward sweep.

Why threads: a write or read of a large array takes as long as several forward steps; done on
the calling thread it would add to the run time whatever the plan saves. A writer thread
writes values while the computation goes on; a reader thread reads values back in the order
they will be needed, so the backward sweep finds them in memory.

Why files of many values: a Python loop of 20,000 steps saves some 60,000 small values, and a
file each costs an open, a close and an unlink, more than the step that saved it. The writer
takes every value queued when it wakes (waiting up to `LINGER_SECONDS` for `CHUNK_BYTES` of
them) and writes them as one file; a file is read back whole into one aligned buffer (the
arrays read back are slices of it, so it lives while any of them does), and removed when its
last value is freed. A plan's snapshot (large, read alone) gets a file of its own.

- imperative use: the tape is walked in reverse, so when the sweep reaches a file, the files
  written just before it are read next (up to `READ_AHEAD_BYTES`); a value stays in memory
  after its read until an earlier one is read (a buffer two entries share, or ``x * x``, is
  read once), and a file the sweep has left is dropped from memory;
- a plan (a checkpointed loop) knows its restore order: the executor calls `prefetch` with the
  values its next restores read, and each is dropped from memory once read.

A value is held by reference until its write is done, not copied: the same guarantee as
keeping it in memory (the engine's version counters catch an in-place change before the
backward reads it), and a value unpacked before its write finished is served from memory.
The folder is made at the first write and removed when its last value is freed (after the
backward), and at interpreter exit whatever is left; each file is removed when its values die
(a tape released, a loop's snapshot freed, or the tensors dropped after an error).

Faults: a write that fails (a full or read-only disk) keeps its values in memory and is raised
when one of them is read back, in the backward sweep of the computation that saved it, never in
a later one. The I/O threads survive any error, and one found dead is started again. Every wait
is bounded: with no progress for `WAIT_SECONDS` the wait ends in an `OffloadError` that says
what it waited for. A process killed outright (``kill -9``) cannot remove its folder: the folder
carries the pid in its name and is locked (``flock``) while its process lives, so the next
process that makes a folder in the same parent removes it.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import operator
import os
import pickle
import re
import shutil
import stat
import struct
import tempfile
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from ... import events
from ...errors import OffloadError
from .host_memory import host_arrays

try:
    import fcntl
except ImportError:  # not POSIX: folders of killed processes are left to the system
    fcntl = None  # type: ignore[assignment]

PENDING_WRITE_BYTES = 256 * 2**20
"""Bytes waiting to be written before `put` waits for the writer (memory held by the queue)."""
READ_AHEAD_BYTES = 64 * 2**20
"""Bytes read ahead of the backward sweep in imperative use (at least two files)."""
READ_AHEAD_FILES = 32
"""Files read ahead at most (the walk over them is done on reaching each file)."""
CHUNK_BYTES = 4 * 2**20
"""A file holds queued values up to this many bytes (a larger value gets a file of its own)."""
LINGER_SECONDS = 0.02
"""How long the writer waits for `CHUNK_BYTES` of values before writing what is queued."""
WAIT_SECONDS = 120.0
"""The longest the calling thread waits for an I/O thread that makes no progress."""

_PREFIX = "checkpoint-ad-"
_OURS = re.compile(r"checkpoint-ad-(\d+)-[a-z0-9_]+")  # checkpoint-ad-<pid>-<mkdtemp's random>

_HEADER = struct.Struct("<QQ")  # layout length, data length
_ALIGN = 64  # each array's bytes start at a multiple of this in the file and in memory
_ZEROS = bytes(_ALIGN)
_first = operator.attrgetter("first")
_UNWRITTEN = object()  # where the sweep is while it reads values not yet in a file


class _Record:
    """One stored form: the value until written, then its place in a file."""

    __slots__ = ("chunk", "error", "freed", "index", "nbytes", "pending", "planned", "serial",
                 "used", "value", "wanted", "written")

    def __init__(self, serial: int, value: Any, nbytes: int, planned: bool) -> None:
        self.serial = serial
        self.value = value  # held until written
        self.nbytes = nbytes
        self.planned = planned  # read in an order the caller announces (a loop's snapshots)
        self.chunk: _Chunk | None = None  # the file it is (being) written in
        self.index = 0  # its place in that file
        self.pending = True  # counted in the store's pending bytes
        self.written = self.freed = self.wanted = self.used = False
        self.error: BaseException | None = None

    @property
    def path(self) -> str | None:
        return None if self.chunk is None else self.chunk.path

    @property
    def loaded(self) -> Any:
        """Its value read back and held in memory, or None."""
        chunk = self.chunk
        if chunk is None or chunk.values is None:
            return None
        return chunk.values[self.index]


class _Chunk:
    """One file: the records written in it, and their values once read back."""

    __slots__ = ("first", "gone", "live", "nbytes", "path", "planned", "queued", "reading",
                 "records", "values", "wanted", "written")

    def __init__(self, path: str, records: list[_Record]) -> None:
        self.path = path
        self.records = records
        self.first = records[0].serial
        self.live = len(records)  # records not freed
        self.nbytes = sum(r.nbytes for r in records)
        self.planned = records[0].planned
        self.values: list[Any] | None = None  # read back (None: only on disk)
        self.wanted = any(r.wanted for r in records)  # keep the values when written
        self.written = self.reading = self.queued = self.gone = False


class DiskRef:
    """The handle a stored form keeps: its record on disk; it is freed when this dies."""

    __slots__ = ("nbytes", "record", "store")

    def __init__(self, store: DiskStore, record: _Record) -> None:
        self.store = store
        self.record = record
        self.nbytes = record.nbytes

    def read(self) -> Any:
        return self.store.get(self)

    def __del__(self) -> None:  # a finalizer per value costs more than the value's write
        with contextlib.suppress(Exception):  # at interpreter exit: `close` removes the folder
            self.store._free(self.record)

    def __repr__(self) -> str:
        return f"<DiskRef #{self.record.serial} {self.nbytes} bytes>"


class DiskStore:
    """The files of one parent folder (None: the system's temporary folder)."""

    def __init__(self, parent: str | None) -> None:
        self.parent = parent
        self.cond = threading.Condition(threading.RLock())
        self.folder: str | None = None
        self.live: dict[int, _Record] = {}
        self.chunks: list[_Chunk] = []  # imperative files, in write order
        self.loaded: list[_Chunk] = []  # imperative files held in memory
        self.at: Any = None  # the file the imperative sweep reads now (or _UNWRITTEN)
        self.kept: list[_Record] = []  # imperative records read and still held in memory
        self.file_count = 0
        self.files_written = self.values_written = 0  # in all, since the store was made
        self.serial = 0
        self.writes: deque[_Record] = deque()
        self.reads: deque[_Chunk] = deque()
        self.pending_bytes = 0  # queued or being written
        self.queued_bytes = 0  # queued, not yet taken into a file
        self.probing = 0  # `measure` calls writing a probe file now
        self.closed = False
        self.threads: dict[str, threading.Thread] = {}
        self.lock_fd: int | None = None  # the folder, locked while this process lives
        self.swept = False  # folders of killed processes in `parent` removed once

    # ------------------------------------------------------------- the calling thread
    def put(self, value: Any, nbytes: int, planned: bool) -> DiskRef:
        """Queue `value` (a stored form) for writing; the returned handle reads it back."""
        stalled = 0.0
        with self.cond:
            writer = self.threads.get("writer")
            if self.folder is None or writer is None or not writer.is_alive():
                self._start()
            if self.pending_bytes and self.pending_bytes + nbytes > PENDING_WRITE_BYTES:
                started = time.perf_counter()
                self._wait(lambda: not (self.pending_bytes
                                        and self.pending_bytes + nbytes > PENDING_WRITE_BYTES),
                           lambda: self.pending_bytes,
                           f"the disk writer to write the {self.pending_bytes} bytes queued "
                           f"under {self.folder!r}")
                stalled = time.perf_counter() - started
                self._start()  # the folder went if every queued value was freed meanwhile
            self.serial += 1
            record = _Record(self.serial, value, nbytes, planned)
            self.live[record.serial] = record
            self.pending_bytes += nbytes
            self.writes.append(record)
            queued = self.queued_bytes
            self.queued_bytes = queued + nbytes
            if not queued or queued < CHUNK_BYTES <= queued + nbytes:
                self.cond.notify_all()  # the writer's first value, or a file's worth
        ref = DiskRef(self, record)
        if events.listeners:
            events.emit("io_write", nbytes)
            if stalled:
                events.emit("io_stall", stalled)
        return ref

    def get(self, ref: DiskRef) -> Any:
        """The stored form of `ref`: from memory when its write is not done or it was read
        ahead, else its file is read now (the wait is reported as an 'io_stall' event)."""
        record = ref.record
        stalled = 0.0
        from_disk = True
        with self.cond:
            if record.error is not None:
                raise OffloadError(
                    f"writing this saved value to {record.path!r} failed ({record.error}), so "
                    "the computation that saved it stops here; free some space or pass a "
                    "writable folder, e.g. Offload('disk', dir=...)"
                ) from record.error
            chunk = record.chunk
            if record.value is not None:  # not written yet: served from memory, no read
                value = record.value
                from_disk = False
            else:
                assert chunk is not None  # written, so in a file
                started = time.perf_counter()
                if chunk.reading:
                    self._start()
                    self._wait(lambda: not chunk.reading, lambda: chunk.reading,
                               f"the disk reader to read {chunk.path!r} back")
                value = record.loaded
                if value is None:
                    value = self._read_now(record, chunk)
                stalled = time.perf_counter() - started
            if record.planned:
                record.wanted = False
                if chunk is not None:
                    chunk.values = None  # the plan says when it is needed again
                    chunk.wanted = False
            else:
                self._passed(record, chunk)
        if events.listeners:
            if from_disk:
                events.emit("io_read", record.nbytes)
            if stalled > 1e-5:
                events.emit("io_stall", stalled)
        return value

    def prefetch(self, refs: list[DiskRef]) -> None:
        """Read these values ahead, in this order (a plan's next restores)."""
        with self.cond:
            for ref in refs:
                record = ref.record
                if record.freed:
                    continue
                record.wanted = True  # its file keeps it in memory when written
                if record.chunk is not None:
                    self._want(record.chunk)
            self.cond.notify_all()

    def measure(self, value: Any) -> tuple[float, float]:
        """Seconds to write and to read back `value` now, on the calling thread (to price a
        disk level before a plan is made)."""
        with self.cond:
            self._start()
            self.serial += 1
            path = os.path.join(self.folder, f"{self.serial}.probe")  # type: ignore[arg-type]
            self.probing += 1
        try:
            started = time.perf_counter()
            _write(path, [value])
            written = time.perf_counter()
            _read(path)
            read = time.perf_counter()
        finally:
            _unlink(path)
            with self.cond:
                self.probing -= 1
                self._maybe_remove_folder()
        return written - started, read - written

    @property
    def files(self) -> int:
        """Files in the folder now (written or being written; a file holds many values)."""
        return self.file_count

    @property
    def values(self) -> int:
        """Values stored now (written or waiting to be)."""
        return len(self.live)

    # ------------------------------------------------------------- bookkeeping (lock held)
    def _start(self) -> None:
        if self.closed:
            raise OffloadError("the disk level is closed (the interpreter is exiting)")
        if self.folder is None:
            if not self.swept:
                self.swept = True
                remove_stale_folders(self.parent)
            try:
                self.folder = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=self.parent)
            except OSError as exc:
                raise OffloadError(
                    f"cannot make a temporary folder under {self.parent or tempfile.gettempdir()!r}"
                    f" for offloaded values ({exc}); pass a writable folder: "
                    "Offload('disk', dir=...)"
                ) from exc
            self.lock_fd = _lock(self.folder)
        for target, name in ((self._write_loop, "writer"), (self._read_loop, "reader")):
            thread = self.threads.get(name)
            if thread is None or not thread.is_alive():  # first use, or died: start again
                thread = threading.Thread(target=target, name=f"checkpoint-ad-disk-{name}",
                                          daemon=True)
                thread.start()
                self.threads[name] = thread

    def _wait(self, done: Any, progress: Any, what: str) -> None:
        """Wait (lock held) until `done()`; `progress()` changing restarts the clock, and
        `WAIT_SECONDS` without a change raises an `OffloadError` naming `what`."""
        started = time.perf_counter()
        last, since = progress(), started
        while not done():
            self.cond.wait(min(1.0, WAIT_SECONDS))
            now = time.perf_counter()
            if progress() != last:
                last, since = progress(), now
            elif now - since >= WAIT_SECONDS and not done():
                raise OffloadError(
                    f"waited {now - started:.1f} s for {what}, the last {now - since:.1f} s "
                    "without progress; the disk is stalled or failing: check it, or pass "
                    "another folder, e.g. Offload('disk', dir=...)"
                )
            self._start()  # an I/O thread that died is started again

    def _want(self, chunk: _Chunk) -> None:
        if chunk.gone or chunk.values is not None or chunk.reading or chunk.queued:
            return
        chunk.wanted = True  # kept in memory when its write completes
        if chunk.written:
            chunk.queued = True
            self.reads.append(chunk)

    def _passed(self, record: _Record, chunk: _Chunk | None) -> None:
        """Imperative read of `record`: keep it (read again soon, maybe), drop the values read
        before it that are later in pack order (the sweep is past them); on reaching another
        file, drop the files the sweep has left and read ahead the ones before it."""
        record.used = True
        still = []
        for other in self.kept:
            if other.serial > record.serial:
                _drop_value(other)
            elif other is not record:
                still.append(other)
        still.append(record)
        self.kept = still
        if chunk is not self.at and (chunk is not None or self.at is not _UNWRITTEN):
            self._reached(record, chunk)

    def _reached(self, record: _Record, chunk: _Chunk | None) -> None:
        left, self.at = self.at, chunk if chunk is not None else _UNWRITTEN
        if chunk is None:  # not taken by the writer yet: every file is before it
            first, at = record.serial, len(self.chunks)
        else:
            first = chunk.first
            at = bisect.bisect_left(self.chunks, first, key=_first)
        if self.loaded:  # the sweep has left these (the last one may still be read once)
            still = []
            for other in self.loaded:
                if other.first > first and other is not left:
                    other.values = None
                else:
                    still.append(other)
            self.loaded = still
        budget = READ_AHEAD_BYTES
        for count, position in enumerate(range(at - 1, -1, -1)):
            other = self.chunks[position]
            if count >= 2 and (budget < other.nbytes or count >= READ_AHEAD_FILES):
                break
            budget -= other.nbytes
            self._want(other)
        self.cond.notify_all()

    def _hold(self, chunk: _Chunk, values: list[Any]) -> None:
        """Keep a file's values read back (freed records' values are not kept)."""
        for index, record in enumerate(chunk.records):
            if record.freed:
                values[index] = None
        chunk.values = values
        if not chunk.planned and chunk not in self.loaded:
            self.loaded.append(chunk)

    def _read_now(self, record: _Record, chunk: _Chunk) -> Any:
        if record.freed:
            raise OffloadError(f"{chunk.path} was read after its value was freed")
        try:
            values = _read(chunk.path)
        except OSError as exc:
            raise OffloadError(
                f"reading an offloaded value back from {chunk.path!r} failed ({exc}); was the "
                "temporary folder removed or the disk changed while the program ran?"
            ) from exc
        if not record.planned:
            self._hold(chunk, values)
        return values[record.index]

    def _free(self, record: _Record) -> None:
        with self.cond:
            record.freed = True
            record.value = None
            self.live.pop(record.serial, None)
            if record.pending:  # never written: nothing to write
                record.pending = False
                self.pending_bytes -= record.nbytes
                if record.chunk is None:
                    self.queued_bytes -= record.nbytes
                self.cond.notify_all()
            if record.used and not record.planned:
                self.kept = [r for r in self.kept if r is not record]
            chunk = record.chunk
            if chunk is not None:
                _drop_value(record)
                chunk.live -= 1
                if not chunk.live and chunk.written:  # one being written: the writer removes it
                    self._forget(chunk)
                    _unlink(chunk.path)
            self._maybe_remove_folder()

    def _forget(self, chunk: _Chunk) -> None:
        """A file whose values are all freed, or whose write failed: out of the books."""
        if chunk.gone:
            return
        chunk.gone = True
        chunk.values = None
        self.file_count -= 1
        if not chunk.planned:
            at = bisect.bisect_left(self.chunks, chunk.first, key=_first)
            if at < len(self.chunks) and self.chunks[at] is chunk:
                del self.chunks[at]
            if chunk in self.loaded:
                self.loaded.remove(chunk)
            if self.at is chunk:
                self.at = None

    def _maybe_remove_folder(self) -> None:
        """Remove the folder once no value lives in it. A thread may still be writing or
        reading a freed value's file: its write then fails or goes to a removed file, and is
        ignored, so the folder goes at once (after backward, not some time after)."""
        if self.live or self.probing or self.folder is None:
            return
        self._remove_folder()

    def _remove_folder(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)  # type: ignore[arg-type]
        self.folder = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def _take(self) -> tuple[_Chunk, list[Any]] | None:
        """The queued records of the next file (up to `CHUNK_BYTES`; a plan's alone), and
        their values."""
        batch: list[_Record] = []
        size = 0
        writes = self.writes
        while writes:
            record = writes[0]
            if record.freed:  # freed while queued: its bytes are already uncounted
                writes.popleft()
                continue
            if batch and (record.planned or batch[0].planned
                          or size + record.nbytes > CHUNK_BYTES):
                break
            writes.popleft()
            self.queued_bytes -= record.nbytes
            batch.append(record)
            size += record.nbytes
        if not batch:
            return None
        chunk = _Chunk(os.path.join(self.folder, f"{batch[0].serial}.bin"),  # type: ignore[arg-type]
                       batch)
        for index, record in enumerate(batch):
            record.chunk = chunk
            record.index = index
        if not chunk.planned:
            self.chunks.append(chunk)
        self.file_count += 1
        return chunk, [record.value for record in batch]

    # ------------------------------------------------------------- the I/O threads
    def _write_loop(self) -> None:
        while True:
            with self.cond:
                while not self.writes and not self.closed:
                    self.cond.wait()
                deadline = time.monotonic() + LINGER_SECONDS
                while not self.closed and self.queued_bytes < CHUNK_BYTES:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)  # a fuller file: fewer files, fewer system calls
                if self.closed:
                    return
                taken = self._take()
            if taken is None:
                continue
            chunk, values = taken
            try:
                self._write_one(chunk, values)
            except BaseException as exc:  # the thread outlives any error
                with self.cond:
                    for record in chunk.records:
                        if record.error is None and not record.written and not record.freed:
                            record.error = exc
                    self.cond.notify_all()
            finally:  # let go of the written arrays before waiting for the next ones: the
                taken = chunk = values = None  # idle thread's frame held the last chunk's

    def _write_one(self, chunk: _Chunk, values: list[Any]) -> None:
        """Write one file; the bookkeeping is done whatever fails (a failed cleanup too)."""
        error = None
        try:
            values = [v if type(v) is np.ndarray else host_arrays(v) for v in values]
            _write(chunk.path, values)  # a device array's copy to pinned memory, waited for
        except BaseException as exc:  # raised where a value is read; they stay in memory
            error = exc
        with self.cond:
            for record in chunk.records:
                if record.pending:
                    record.pending = False
                    self.pending_bytes -= record.nbytes
            try:
                if not chunk.live:  # every value freed meanwhile; the folder may be gone
                    self._forget(chunk)
                    _unlink(chunk.path)
                elif error is not None:
                    for record in chunk.records:
                        if not record.freed:
                            record.error = error
                    self._forget(chunk)
                    _unlink(chunk.path)
                else:
                    chunk.written = True
                    self.files_written += 1
                    self.values_written += len(chunk.records)
                    for record in chunk.records:
                        record.written = True
                        record.value = None
                    if chunk.wanted:
                        self._hold(chunk, values)
                self._maybe_remove_folder()
            finally:
                self.cond.notify_all()

    def _read_loop(self) -> None:
        while True:
            with self.cond:
                while not self.reads and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                chunk = self.reads.popleft()
                chunk.queued = False
                if chunk.gone or chunk.values is not None or not chunk.written:
                    continue
                chunk.reading = True
            values = None
            try:
                values = _read(chunk.path)
            except BaseException:  # read again on the calling thread, which reports the
                pass  # error; the thread outlives it
            finally:
                with self.cond:
                    chunk.reading = False
                    if values is not None and not chunk.gone:
                        self._hold(chunk, values)
                    self.cond.notify_all()
                    with contextlib.suppress(OSError):
                        self._maybe_remove_folder()
            values = chunk = None  # the idle thread's frame is not to hold the last read

    def close(self) -> None:
        """Stop the threads and remove the folder with whatever is in it (at exit)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        for thread in self.threads.values():
            thread.join(timeout=5.0)
        with self.cond:
            if self.folder is not None:
                self._remove_folder()


def _drop_value(record: _Record) -> None:
    chunk = record.chunk
    if chunk is not None and chunk.values is not None:
        chunk.values[record.index] = None


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _write(path: str, values: list[Any]) -> None:
    """Write stored forms to one file: a layout, then each array's bytes (no copy). A plain
    array is its bytes; any other form is pickled with its arrays' bytes out of band."""
    entries: list[tuple] = []
    buffers: list[tuple[int, Any]] = []
    end = 0
    for value in values:
        if (type(value) is np.ndarray and value.flags.c_contiguous
                and value.dtype.fields is None and not value.dtype.hasobject):
            entries.append(("a", value.dtype.str, value.shape, end, value.nbytes))
            buffers.append((end, value.reshape(-1).view(np.uint8)))
            end = _aligned(end + value.nbytes)
            continue
        pickled: list[pickle.PickleBuffer] = []
        header = pickle.dumps(value, protocol=5, buffer_callback=pickled.append)
        spans = []
        for buffer in pickled:
            raw = buffer.raw()
            spans.append((end, raw.nbytes))
            buffers.append((end, raw))
            end = _aligned(end + raw.nbytes)
        entries.append(("p", header, spans))
    size = buffers[-1][0] + buffers[-1][1].nbytes if buffers else 0
    layout = pickle.dumps(entries, protocol=5)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(_HEADER.pack(len(layout), size))
        f.write(layout)
        f.write(_ZEROS[:_aligned(_HEADER.size + len(layout)) - _HEADER.size - len(layout)])
        at = 0
        for start, view in buffers:
            if start > at:
                f.write(_ZEROS[:start - at])
            f.write(view)
            at = start + view.nbytes


def _read(path: str) -> list[Any]:
    """Read the stored forms written by `_write` (from our own private folder): one read
    into one aligned buffer, whose slices the arrays are."""
    with open(path, "rb") as f:
        layout_length, data_length = _HEADER.unpack(f.read(_HEADER.size))
        entries = pickle.loads(f.read(layout_length))
        f.seek(_aligned(_HEADER.size + layout_length))
        raw = np.empty(data_length + _ALIGN, np.uint8)
        skip = -raw.ctypes.data % _ALIGN
        data = raw[skip:skip + data_length]
        if f.readinto(data) != data_length:
            raise OSError(f"{path} is shorter than written")
    values = []
    for entry in entries:
        if entry[0] == "a":
            _, dtype, shape, start, nbytes = entry
            values.append(data[start:start + nbytes].view(dtype).reshape(shape))
        else:
            values.append(pickle.loads(entry[1], buffers=[data[s:s + n] for s, n in entry[2]]))
    return values


def _unlink(path: str) -> None:
    """Remove a file if it can be; one left (a read-only disk) goes with its folder."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def _lock(folder: str) -> int | None:
    """Lock `folder` for as long as this process lives (the lock dies with the process, even
    under ``kill -9``); None where locks are not available."""
    if fcntl is None:
        return None
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a filesystem without locks: the pid in the name is all there is
        os.close(fd)
        return None
    return fd


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's
        return False
    return False


def remove_stale_folders(parent: str | None) -> list[str]:
    """Remove the folders under `parent` (None: the system's temporary folder) that a killed
    process of this user left: named ``checkpoint-ad-<pid>-...``, that pid gone, and the
    folder's lock free (so no live process holds it, whatever its pid namespace). A folder of
    a live process is never removed. Returns the folders removed."""
    if fcntl is None:
        return []  # os.kill(pid, 0) is no liveness check outside POSIX
    root = parent or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        match = _OURS.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if not _process_gone(int(match[1])):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                         | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: a live process (in another pid namespace) owns it
            os.close(fd)
            continue
        except OSError:
            pass  # no locks on this filesystem: the pid is gone, which is all we can know
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(path)
    return removed


_stores: dict[str | None, DiskStore] = {}
_stores_lock = threading.Lock()


_given: dict[str | None, DiskStore] = {}  # by the folder as given (no abspath per value)


def store_for(parent: str | None) -> DiskStore:
    """The store writing under `parent` (one per folder, made on first use)."""
    store = _given.get(parent)
    if store is not None:
        return store
    key = None if parent is None else os.path.abspath(parent)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = DiskStore(key)
        if parent is None or os.path.isabs(parent):  # a relative one follows the working folder
            _given[parent] = store
        return store


@atexit.register
def _close_all() -> None:
    for store in list(_stores.values()):
        store.close()
