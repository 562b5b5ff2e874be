"""Memory held only by reference cycles: arrays that reference counting alone never frees.

A cycle (a closure that refers to its own tensor, a region pointing back at its tape) keeps
everything it reaches alive until the cyclic collector runs, which may be long after the
step: the process pays for it, and no strategy can save it. At the end of a block measured
under tracemalloc, `collect_cycles` runs the collector with ``DEBUG_SAVEALL`` (so that the
unreachable objects are kept and can be looked at), sums the arrays they hold that were
made while tracemalloc traced (each root array once), names the lines that allocated them,
and then frees them.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from collections import defaultdict
from typing import Any

import numpy as np

# numpy's and this package's folders: their frames are not the line that made an array
_LIBRARIES = (os.path.dirname(np.__file__), os.path.dirname(os.path.dirname(__file__)))


def collect_cycles() -> tuple[int, dict[str, int]]:
    """(bytes of the arrays reachable only through reference cycles, those bytes by the line
    that allocated each array, 'file:line'); the cycles are freed on return."""
    flags, before = gc.get_debug(), len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        garbage = gc.garbage[before:]
        del gc.garbage[before:]
    finally:
        gc.set_debug(flags)
    lines = _lines_of(garbage)
    del garbage
    gc.collect()  # the saved objects, now unreferenced
    return sum(lines.values()), dict(lines)


def _lines_of(garbage: list[Any]) -> dict[str, int]:
    """Bytes of the traced root arrays `garbage` holds (itself or one reference away), by
    the line that made each (a function of its own: no loop variable outlives it)."""
    arrays: dict[int, Any] = {}
    for obj in garbage:
        for ref in (obj, *gc.get_referents(obj)):
            root = _root(ref)
            if root is not None:
                arrays[id(root)] = root
    lines: dict[str, int] = defaultdict(int)
    for array in arrays.values():
        trace = tracemalloc.get_object_traceback(array) if tracemalloc.is_tracing() else None
        if trace is not None:  # untraced: made before tracing began, not the block's
            lines[_line(trace)] += int(array.nbytes)
    return dict(lines)


def _line(trace: Any) -> str:
    """'file:line' of the most recent frame of `trace` outside numpy and this package (the
    user's line, where tracemalloc keeps enough frames: ``tracemalloc.start(16)`` before the
    block), else of its most recent frame."""
    frames = list(trace)  # the oldest first
    for frame in reversed(frames):
        if not frame.filename.startswith(_LIBRARIES):
            return f"{frame.filename}:{frame.lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}"


def _root(obj: Any) -> Any:
    """The array owning `obj`'s memory, or None if `obj` is no array (numpy or cupy)."""
    if not (hasattr(obj, "nbytes") and hasattr(obj, "shape")):
        return None
    base = getattr(obj, "base", None)
    while base is not None and hasattr(base, "shape"):
        obj, base = base, getattr(base, "base", None)
    return obj
