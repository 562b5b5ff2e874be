"""Writing output files safely: every file checkpoint-ad writes goes through here.

Why: output names are built from data (a profile's ``model`` field, a preset's name), output
folders may hold links someone else planted, and a run can be cut short (a full disk, a size
limit, Ctrl-C). So a name is reduced to one harmless path component, a write never goes through a
symlink, and a file is written to a temporary file in the same folder and moved into place with
`os.replace`: the old file stays whole until the new one is complete.

>>> safe_name("../escaped/pwn")
'escaped_pwn'
>>> safe_name("revolve-8-int8")
'revolve-8-int8'
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .errors import OutputError

__all__ = ["check_writable", "child", "safe_name", "staged", "write_bytes", "write_text",
           "write_with", "writing"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]+")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # absent on Windows, where links need privileges


def safe_name(text: str) -> str:
    """`text` as one file-name component: runs of characters other than letters, digits and
    ``. _ + = -`` (and runs of dots) become ``_``, and leading dots and underscores go (no
    ``..``, no hidden file).
    """
    name = re.sub(r"\.\.+", "_", _UNSAFE.sub("_", str(text)))  # no ".." anywhere
    name = re.sub(r"__+", "_", name).lstrip("._")
    if not name:
        raise OutputError(f"{text!r} leaves nothing usable as a file name; give it a name with "
                          "letters or digits")
    return name


def child(folder: str | Path, name: str) -> Path:
    """The path of a file called `safe_name(name)` directly inside `folder`."""
    return Path(folder) / safe_name(name)


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise OutputError(f"{str(path)!r} is a symbolic link; checkpoint-ad does not write "
                          "through links: remove it or choose another output folder")


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create folder {str(folder)!r}: {exc.strerror or exc}") from exc


def _open_new(folder: Path, stem: str) -> tuple[int, Path]:
    """A new file in `folder` opened for writing; never an existing file, never a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_BINARY", 0)
    while True:
        temporary = folder / f".{stem}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(temporary, flags, 0o666), temporary  # the umask applies, as usual
        except FileExistsError:
            continue
        except OSError as exc:
            raise OutputError(f"cannot write in {str(folder)!r}: {exc.strerror or exc}") from exc


@contextmanager
def writing(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Open `path` for writing (``"w"`` text, ``"wb"`` bytes); the file appears only once the
    block ends without an error, replacing any old file whole. A link at `path` is refused.
    """
    path = Path(path)
    if mode not in ("w", "wb"):
        raise ValueError(f"writing: mode must be 'w' or 'wb', got {mode!r}")
    _refuse_link(path)
    _make_folder(path.parent)
    descriptor, temporary = _open_new(path.parent, path.name)
    try:
        encoding = "utf-8" if mode == "w" else None
        with os.fdopen(descriptor, mode, encoding=encoding) as handle:
            yield handle
        _refuse_link(path)  # planted while we wrote: os.replace would not follow it, but say so
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        if isinstance(exc, OutputError):
            raise
        raise OutputError(f"cannot write {str(path)!r}: {exc.strerror or exc}; nothing was "
                          "changed there") from exc
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically; see `writing`."""
    with writing(path, "w") as handle:
        handle.write(text)
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically; see `writing`."""
    with writing(path, "wb") as handle:
        handle.write(data)
    return Path(path)


def write_with(path: str | Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Let `write` fill a binary file object (e.g. ``fig.savefig``), then move it to `path`."""
    with writing(path, "wb") as handle:
        write(handle)
    return Path(path)


def check_writable(folder: str | Path) -> Path:
    """Create `folder` if needed and prove a file can be made in it, before a long run.

    The probe is a new file with a random name opened exclusively, so no existing file or link
    is touched, and it is removed at once.
    """
    folder = Path(folder)
    try:
        _make_folder(folder)
        descriptor, probe = _open_new(folder, "write-test")
    except OutputError as exc:
        raise OutputError(f"cannot write to folder {str(folder)!r}: "
                          f"{exc.__cause__.strerror or exc.__cause__}") from exc.__cause__
    os.close(descriptor)
    probe.unlink()
    return folder


@contextmanager
def staged(folder: str | Path) -> Iterator[Path]:
    """A set of files written whole or not at all: the block writes into a hidden staging
    folder beside `folder` (same parent, so moves are renames), and the files go into `folder`
    only when the block ends without an error. An error or Ctrl-C inside the block removes the
    staging folder and leaves `folder` as it was.

    An empty `folder` is replaced by the staging folder in one rename; into a folder that has
    files already (an earlier run's), each file is moved in with `os.replace`, an old file of
    the same name replaced whole, the others kept. Ctrl-C during the moves is held until they
    are done, so the set arrives complete.
    """
    folder = Path(folder)
    _make_folder(folder.parent)
    staging = folder.parent / f".{folder.name}.partial-{secrets.token_hex(4)}"
    try:
        staging.mkdir()
    except OSError as exc:
        raise OutputError(f"cannot write in {str(folder.parent)!r}: "
                          f"{exc.strerror or exc}") from exc
    try:
        yield staging
        with _interrupts_held():
            _move_in(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_in(staging: Path, folder: Path) -> None:
    _refuse_link(folder)
    try:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # empty (made to prove it writable): the staging folder takes its place
        if not folder.exists():
            os.rename(staging, folder)
            return
        items = sorted(staging.iterdir())
        for item in items:  # every name checked before the first move
            _refuse_link(folder / item.name)
        for item in items:
            os.replace(item, folder / item.name)
    except OSError as exc:
        if isinstance(exc, OutputError):
            raise
        raise OutputError(f"cannot move the files written into {str(folder)!r}: "
                          f"{exc.strerror or exc}") from exc


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C inside the block is raised after it (in the main thread; elsewhere no signal
    arrives anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
