"""Bytes of the Python objects a structure holds, counted by walking it rather than traced.

Why not tracemalloc: it sees a new object as new memory only when the allocator asks the
system for it. A small tuple or list taken from the interpreter's free lists, which the first
few steps of a loop find full, is invisible to it, so a dry run of two steps traced about half
of what a long loop's steps hold each (764 bytes of a heat step's 1,573). `sys.getsizeof`
knows no free lists. The walk follows the references the collector knows
(`gc.get_referents`), counts each object once, stops at objects that are not per-step state
(types, modules, functions, code) and counts an array's header but not its data, which the
caller counts as saved bytes already.
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterable
from typing import Any

import numpy as np

_SHARED_KINDS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                 types.MethodType, types.CodeType, types.FrameType)
MOST_OBJECTS = 100_000
"""The walk stops after this many objects (a strategy object that reaches a large graph):
what it counted so far is returned, an undercount of what was left."""


def reachable(roots: Iterable[Any], stop: dict[int, Any] | None = None) -> dict[int, Any]:
    """The objects reachable from `roots` (id -> object), not entering any in `stop` nor the
    shared kinds above, and not looking inside arrays (their data is the caller's count)."""
    found: dict[int, Any] = {}
    stop = stop or {}
    pending = list(roots)
    while pending and len(found) < MOST_OBJECTS:
        obj = pending.pop()
        key = id(obj)
        if key in found or key in stop or isinstance(obj, _SHARED_KINDS):
            continue
        found[key] = obj
        if not _is_array(obj):
            pending.extend(gc.get_referents(obj))
    return found


def object_bytes(objects: Iterable[Any]) -> int:
    """What `objects` take themselves: `sys.getsizeof` of each, an array's data left out."""
    total = 0
    for obj in objects:
        size = sys.getsizeof(obj, 0)
        if _is_array(obj) and _owns_host_data(obj):
            size -= obj.nbytes
        total += max(0, size)
    return total


def added_bytes(later: Any, earlier: Any) -> int:
    """Bytes of the objects reachable from `later` but not from `earlier`: for two consecutive
    steps of a loop, what one more step holds (what they share, the strategy, the program, a
    carry both read, is the earlier one's)."""
    return object_bytes(reachable([later], stop=reachable([earlier])).values())


def _is_array(obj: Any) -> bool:
    return isinstance(obj, np.ndarray) or hasattr(obj, "__array_namespace__") or hasattr(
        obj, "__cuda_array_interface__")


def _owns_host_data(array: Any) -> bool:
    """Whether `sys.getsizeof(array)` includes its data: a numpy array owning it (a cupy
    array's size is its header's alone, its data being on the device)."""
    return isinstance(array, np.ndarray) and bool(array.flags.owndata)
