"""Which line of user code recorded an entry: found by walking the stack past this package's
own frames, only when someone asked (a profiler, anomaly detection, `record_origins`), and
shared by every entry recorded on the same line."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from . import events
from .grad_mode import _state, origin_blocks

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# id(code) -> defined inside this package? Keyed by id because hashing a code object hashes
# its bytecode and constants, per frame of every recorded op; `_codes_seen` keeps each code
# object alive so that its id stays its own while listed.
_code_kinds: dict[int, bool] = {}
_codes_seen: list[Any] = []
# (id(code), offset of its calling instruction) -> (code, line): a call site seen before costs
# one lookup, not a line-table scan (`f_lineno`); one shared pair per user code line
_call_sites: dict[tuple[int, int], tuple[Any, int]] = {}
# (id(code), line) -> (code, line): the shared pair, found once per call site
_origins: dict[tuple[int, int], tuple[Any, int]] = {}
_MAX_ORIGINS = 100_000
NO_ORIGIN: tuple[Any, int] = (None, 0)  # the origin of an entry recorded where no one asked


_user_dirs: tuple[str, ...] = ()  # folders of this package whose code counts as the user's now

BOUNDARY: Any = object()  # the kind of a re-run boundary's code: internal (truthy), marked
_boundaries: dict[int, Any] = {}  # id(code) -> code of the functions `rerun_boundary` marks
_rerun = threading.local()  # .origin: the origin the innermost re-run names, per thread


def _is_internal(code: Any) -> Any:
    internal = _code_kinds.get(id(code))
    if internal is None:
        if len(_codes_seen) > _MAX_ORIGINS:  # code made on the fly (exec) would pile up
            _code_kinds.clear()
            _codes_seen.clear()
        _codes_seen.append(code)
        name = code.co_filename
        internal = _code_kinds[id(code)] = BOUNDARY if id(code) in _boundaries else (
            name.startswith(_PACKAGE_DIR) and not name.startswith(_user_dirs))
    return internal


@contextmanager
def as_user_code(folder: str) -> Iterator[None]:
    """In this block, entries recorded by code under `folder` (a folder of this package, such
    as its built-in models) name their own lines. Where a person runs this package's own
    model (`checkpoint-ad profile`, a sweep), its lines are the user's: without this, the walk
    would pass them, and the sweep's and the command line's frames, and name the console
    script or runpy. The classification is the process's, for the block's duration."""
    global _user_dirs
    previous = _user_dirs
    _user_dirs = (*previous, os.path.abspath(folder))
    _forget_kinds()
    try:
        yield
    finally:
        _user_dirs = previous
        _forget_kinds()


def _forget_kinds() -> None:
    """Classify every code object again (which folders count as the user's changed)."""
    _code_kinds.clear()
    _codes_seen.clear()
    _call_sites.clear()


def rerun_boundary(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `function` as where this package runs a user's step again (a loop's steps taped
    for the backward sweep). An entry recorded under it whose walk reaches it before any user
    frame (the step is this package's code: a built-in model's, a layer's) names the origin
    `rerunning_from` gave, the line that ran the loop, rather than the line that called the
    backward sweep: as when the step was first run, and as a replayed step names it. (A
    checkpointed region's function, run again, likewise names the `checkpoint` call.)"""
    code = function.__code__
    _boundaries[id(code)] = code
    _code_kinds[id(code)] = BOUNDARY
    return function


@contextmanager
def rerunning_from(origin: tuple[Any, int] | None) -> Iterator[None]:
    """Entries recorded under a `rerun_boundary` in this block name `origin` (None: the line
    the walk finds above the boundary, as without this block)."""
    previous = getattr(_rerun, "origin", None)
    _rerun.origin = origin
    try:
        yield
    finally:
        _rerun.origin = previous


def caller_origin() -> tuple[Any, int] | None:
    """The origin of the user line that called into this package (a `scan`, a `checkpoint`),
    asked from inside it, when an entry recorded now would ask for one (a listener,
    `record_origins`); else None."""
    if not (events.listeners or (origin_blocks and _state.origins)):
        return None
    return _first_outside(sys._getframe(2))


def origin_text(frame: tuple[Any, int]) -> str:
    """'file:line' of an entry's `origin_frame` (code object, line number)."""
    code, line = frame
    return f"{code.co_filename}:{line}" if code is not None else "<unknown>"


def _line_pair(code: Any, line: int) -> tuple[Any, int]:
    """The one (code, line) pair of a user code line, shared by all its call sites."""
    if len(_origins) > _MAX_ORIGINS or len(_call_sites) > _MAX_ORIGINS:
        _origins.clear()
        _call_sites.clear()
    pair = _origins.get((id(code), line))
    if pair is None:
        pair = _origins[(id(code), line)] = (code, line)
    return pair


def _user_frame() -> tuple[Any, int]:
    """(code, line) of the nearest caller outside this package; formatted only when asked.

    Many entries ask (every one under `record_origins`, each that saves a value under a
    profiler), so the walk looks each frame's code up by id, the user frame's line up by its
    call site (`f_lasti`: `f_lineno` scans the code's line table), and the pair is shared by
    every entry recorded on the same line (a loop's entries hold no pair of their own)."""
    return _first_outside(sys._getframe(3))  # past the entry's maker and its caller


def user_frame_from_caller() -> tuple[Any, int]:
    """(code, line) of the nearest frame outside this package above the caller's."""
    return _first_outside(sys._getframe(1))


def _first_outside(frame: Any) -> tuple[Any, int]:
    """`frame` or the nearest above it whose code is not this package's, as (code, line)."""
    kinds = _code_kinds
    while frame is not None:
        code = frame.f_code
        internal = kinds.get(id(code))
        if internal is None:
            internal = _is_internal(code)
        if not internal:
            site = (id(code), frame.f_lasti)
            pair = _call_sites.get(site)
            if pair is None:
                pair = _call_sites[site] = _line_pair(code, frame.f_lineno)
            return pair
        if internal is BOUNDARY:  # a step of this package's, run again: its loop's line
            origin = getattr(_rerun, "origin", None)
            if origin is not None:
                return origin
        frame = frame.f_back
    return NO_ORIGIN
