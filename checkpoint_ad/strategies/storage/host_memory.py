"""Moving a stored form between the device and host memory: the host storage level.

Why a module of its own: on a GPU, host memory is a level below the device (more of it, slower
to reach), and copies to it overlap the computation only from pinned (page-locked) memory. On
the CPU a numpy array already lives in host memory, so every call here is the identity there.
Stored forms may be arrays or small dataclasses/tuples of arrays (a `QuantizedArray`); each
array inside is moved.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import numpy as np

from ...backend import is_array


@dataclasses.dataclass(eq=False)
class PinnedCopy:
    """A device array being copied into pinned host memory on a side stream.

    `array` is the host copy; it may be read only after `wait()`. The device array is held
    until then, so the copy never reads freed memory."""

    array: np.ndarray
    device: int
    event: Any
    source: Any

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
            self.source = None
        return self.array


def _cupy() -> Any:
    return importlib.import_module("cupy")  # only reached with a cupy array in hand


def _is_device_array(value: Any) -> bool:
    return is_array(value) and not isinstance(value, np.ndarray)


def to_host(stored: Any) -> Any:
    """The stored form with every device array replaced by a `PinnedCopy` (started, not
    waited for); host arrays stay as they are."""
    return map_arrays(stored, _start_copy)


def host_arrays(stored: Any) -> Any:
    """A form made by `to_host`, with every copy waited for: plain numpy arrays only."""
    return map_arrays(stored, lambda a: a.wait() if isinstance(a, PinnedCopy) else a)


def to_device(stored: Any, device: int) -> Any:
    """A form made by `to_host` (or read back from disk) with every array in it moved back
    to GPU `device`."""
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return map_arrays(stored, lambda a: cupy.asarray(
            a.wait() if isinstance(a, PinnedCopy) else a))


def device_of(stored: Any) -> int | None:
    """The GPU holding the stored form's arrays, or None when they are in host memory."""
    found: list[int] = []

    def note(a: Any) -> Any:
        if not found and _is_device_array(a):
            found.append(a.device.id)
        return a

    map_arrays(stored, note)
    return found[0] if found else None


def _start_copy(array: Any) -> Any:
    if not _is_device_array(array):
        return array
    cupy = _cupy()
    cupyx = importlib.import_module("cupyx")
    pinned = cupyx.empty_pinned(array.shape, dtype=array.dtype)
    device = array.device.id
    with cupy.cuda.Device(device):
        stream = cupy.cuda.Stream(non_blocking=True)
        stream.wait_event(cupy.cuda.get_current_stream().record())  # after the array is made
        array.get(out=pinned, stream=stream, blocking=False)
        event = stream.record()
    return PinnedCopy(pinned, device, event, array)


def map_arrays(stored: Any, fn: Any) -> Any:
    """`stored` with `fn` applied to every array (and `PinnedCopy`) inside arrays, tuples,
    lists, dicts and dataclass instances; other values are kept."""
    if is_array(stored) or isinstance(stored, PinnedCopy):
        return fn(stored)
    if isinstance(stored, (tuple, list)):
        return type(stored)(map_arrays(v, fn) for v in stored)
    if isinstance(stored, dict):
        return {k: map_arrays(v, fn) for k, v in stored.items()}
    if dataclasses.is_dataclass(stored) and not isinstance(stored, type):
        changes = {f.name: map_arrays(getattr(stored, f.name), fn)
                   for f in dataclasses.fields(stored) if f.init}
        return dataclasses.replace(stored, **changes)
    return stored
