"""The disk level: stored forms written to a private temporary folder behind the computation and
read back ahead of the backward sweep.

Why threads: a write or read of a large array takes as long as several forward steps; done on
the calling thread it would add to the run time whatever the plan saves. A writer thread
writes each value while the computation goes on; a reader thread reads values back in the
order they will be needed, so the backward sweep finds them in memory:

- imperative use: the tape is walked in reverse, so after a value is unpacked, the live values
  saved just before it (in pack order) are read next; a value stays in memory after its read
  until an earlier one is read (a buffer two entries share, or ``x * x``, is read once);
- a plan (a checkpointed loop) knows its restore order: the executor calls `prefetch` with the
  values its next restores read, and each is dropped from memory once read.

A value is held by reference until its write is done, not copied: the same guarantee as
keeping it in memory (the engine's version counters catch an in-place change before the
backward reads it), and a value unpacked before its write finished is served from memory.
The folder is made at the first write and removed when its last value is freed (after the
backward), and at interpreter exit whatever is left; each file is removed when its value dies
(a tape released, a loop's snapshot freed, or the tensors dropped after an error).

Faults: a write that fails (a full or read-only disk) keeps its value in memory and is raised
when that value is read back, in the backward sweep of the computation that saved it, never in
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
import os
import pickle
import re
import shutil
import stat
import struct
import tempfile
import threading
import time
import weakref
from collections import deque
from typing import Any

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
"""Bytes read ahead of the backward sweep in imperative use (at least two values)."""
WAIT_SECONDS = 120.0
"""The longest the calling thread waits for an I/O thread that makes no progress."""

_PREFIX = "checkpoint-ad-"
_OURS = re.compile(r"checkpoint-ad-(\d+)-[a-z0-9_]+")  # checkpoint-ad-<pid>-<mkdtemp's random>

_HEADER = struct.Struct("<QQ")  # pickle header length, buffer count
_LENGTH = struct.Struct("<Q")


class _Record:
    """One stored form on disk: its file, and the copies of it held in memory."""

    __slots__ = ("error", "freed", "loaded", "nbytes", "path", "planned", "reading", "serial",
                 "used", "value", "wanted", "written")

    def __init__(self, serial: int, path: str, value: Any, nbytes: int, planned: bool) -> None:
        self.serial = serial
        self.path = path
        self.value = value  # held until written
        self.nbytes = nbytes
        self.planned = planned  # read in an order the caller announces (a loop's snapshots)
        self.loaded: Any = None  # read back ahead of use
        self.written = self.freed = self.reading = self.wanted = self.used = False
        self.error: BaseException | None = None


class DiskRef:
    """The handle a stored form keeps: its record on disk; the file goes when this dies."""

    __slots__ = ("__weakref__", "nbytes", "record", "store")

    def __init__(self, store: DiskStore, record: _Record) -> None:
        self.store = store
        self.record = record
        self.nbytes = record.nbytes

    def read(self) -> Any:
        return self.store.get(self)

    def __repr__(self) -> str:
        return f"<DiskRef {os.path.basename(self.record.path)} {self.nbytes} bytes>"


class DiskStore:
    """The files of one parent folder (None: the system's temporary folder)."""

    def __init__(self, parent: str | None) -> None:
        self.parent = parent
        self.cond = threading.Condition(threading.RLock())
        self.folder: str | None = None
        self.live: dict[int, _Record] = {}
        self.lifo: list[int] = []  # serials of live imperative records, ascending
        self.kept: list[_Record] = []  # imperative records read and still held in memory
        self.serial = 0
        self.writes: deque[_Record] = deque()
        self.reads: deque[_Record] = deque()
        self.pending_bytes = 0
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
            path = os.path.join(self.folder, f"{self.serial}.bin")  # type: ignore[arg-type]
            record = _Record(self.serial, path, value, nbytes, planned)
            self.live[record.serial] = record
            if not planned:
                self.lifo.append(record.serial)
            self.pending_bytes += nbytes
            self.writes.append(record)
            self.cond.notify_all()
        ref = DiskRef(self, record)
        weakref.finalize(ref, self._free, record)  # holds the store and record, not the handle
        if events.listeners:
            events.emit("io_write", nbytes)
            if stalled:
                events.emit("io_stall", stalled)
        return ref

    def get(self, ref: DiskRef) -> Any:
        """The stored form of `ref`: from memory when its write is not done or it was read
        ahead, else read now (the wait is reported as an 'io_stall' event)."""
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
            if record.value is not None:  # not written yet: served from memory, no read
                value = record.value
                from_disk = False
            else:
                started = time.perf_counter()
                if record.reading:
                    self._start()
                    self._wait(lambda: not record.reading, lambda: record.reading,
                               f"the disk reader to read {record.path!r} back")
                value = record.loaded
                if value is None:
                    value = self._read_now(record)
                stalled = time.perf_counter() - started
            if record.planned:
                record.loaded = None  # the plan says when it is needed again
                record.wanted = False
            else:
                self._passed(record, value)
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
                self._want(ref.record)
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
            _write(path, value)
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

    def _want(self, record: _Record) -> None:
        if record.freed or record.loaded is not None or record.reading:
            return
        record.wanted = True  # kept in memory when its write completes
        if record.written and record not in self.reads:
            self.reads.append(record)

    def _passed(self, record: _Record, value: Any) -> None:
        """Imperative read of `record`: keep it (read again soon, maybe), drop the values read
        before it that are later in pack order (the sweep is past them), read ahead."""
        record.loaded = value
        record.used = True
        still = []
        for other in self.kept:
            if other.serial > record.serial:
                other.loaded = None
            elif other is not record:
                still.append(other)
        still.append(record)
        self.kept = still
        at = bisect.bisect_left(self.lifo, record.serial)
        budget = READ_AHEAD_BYTES
        for count, position in enumerate(range(at - 1, -1, -1)):
            other = self.live[self.lifo[position]]
            if count >= 2 and budget < other.nbytes:
                break
            budget -= other.nbytes
            self._want(other)
        self.cond.notify_all()

    def _read_now(self, record: _Record) -> Any:
        if record.freed:
            raise OffloadError(f"{record.path} was read after its value was freed")
        try:
            return _read(record.path)
        except OSError as exc:
            raise OffloadError(
                f"reading an offloaded value back from {record.path!r} failed ({exc}); was the "
                "temporary folder removed or the disk changed while the program ran?"
            ) from exc

    def _free(self, record: _Record) -> None:
        with self.cond:
            record.freed = True
            record.value = record.loaded = None
            self.live.pop(record.serial, None)
            if not record.planned:
                at = bisect.bisect_left(self.lifo, record.serial)
                if at < len(self.lifo) and self.lifo[at] == record.serial:
                    del self.lifo[at]
                if record.used:
                    self.kept = [r for r in self.kept if r is not record]
            if record.written:
                _unlink(record.path)
            if not record.written and record in self.writes:  # never written: nothing to do
                self.writes.remove(record)
                self.pending_bytes -= record.nbytes
                self.cond.notify_all()
            self._maybe_remove_folder()

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

    # ------------------------------------------------------------- the I/O threads
    def _write_loop(self) -> None:
        while True:
            with self.cond:
                while not self.writes and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                record = self.writes.popleft()
            try:
                self._write_one(record)
            except BaseException as exc:  # the thread outlives any error
                with self.cond:
                    if record.error is None and not record.written:
                        record.error = exc
                    self.cond.notify_all()

    def _write_one(self, record: _Record) -> None:
        """Write one record; the bookkeeping is done whatever fails (a failed cleanup too)."""
        value = record.value
        error = None
        try:
            value = host_arrays(value)  # a device array's copy to pinned memory, done
            _write(record.path, value)
        except BaseException as exc:  # raised where the value is read; it stays in memory
            error = exc
        with self.cond:
            self.pending_bytes -= record.nbytes
            try:
                if record.freed:  # its folder may be gone already: nothing to report
                    _unlink(record.path)
                elif error is not None:
                    record.error = error
                    _unlink(record.path)
                else:
                    record.written = True
                    if record.wanted:
                        record.loaded = value
                    record.value = None
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
                record = self.reads.popleft()
                if record.freed or record.loaded is not None or not record.written:
                    continue
                record.reading = True
            value = None
            try:
                value = _read(record.path)
            except BaseException:  # read again on the calling thread, which reports the
                pass  # error; the thread outlives it
            finally:
                with self.cond:
                    record.reading = False
                    if not record.freed:
                        record.loaded = value
                    self.cond.notify_all()
                    with contextlib.suppress(OSError):
                        self._maybe_remove_folder()

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


def _write(path: str, value: Any) -> None:
    """Write a stored form: a pickle header, then each array's bytes out of band (no copy)."""
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(_HEADER.pack(len(header), len(views)))
        for view in views:
            f.write(_LENGTH.pack(view.nbytes))
        f.write(header)
        for view in views:
            f.write(view)


def _read(path: str) -> Any:
    """Read a stored form written by `_write` (from our own private folder)."""
    with open(path, "rb") as f:
        header_length, count = _HEADER.unpack(f.read(_HEADER.size))
        lengths = [_LENGTH.unpack(f.read(_LENGTH.size))[0] for _ in range(count)]
        header = f.read(header_length)
        buffers = []
        for length in lengths:
            buffer = bytearray(length)
            if f.readinto(buffer) != length:
                raise OSError(f"{path} is shorter than written")
            buffers.append(buffer)
    return pickle.loads(header, buffers=buffers)


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


def store_for(parent: str | None) -> DiskStore:
    """The store writing under `parent` (one per folder, made on first use)."""
    key = None if parent is None else os.path.abspath(parent)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = DiskStore(key)
        return store


@atexit.register
def _close_all() -> None:
    for store in list(_stores.values()):
        store.close()
