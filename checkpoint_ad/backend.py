"""Which array library holds a value, on which device, and the few calls the standard lacks.

The engine never imports numpy or cupy for computation: it asks `namespace(array)` for the
array namespace of its inputs and writes numeric code once against the array-API standard.
numpy (>= 2.1) is used directly because it implements the standard natively; other libraries
go through `array_api_compat`.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType
from typing import Any

import array_api_compat
import numpy as np

from .errors import DeviceError, DTypeError

_namespaces: dict[type, ModuleType] = {np.ndarray: np}


def namespace(array: Any) -> ModuleType:
    """The array-API namespace of `array` (cached per array type)."""
    kind = type(array)
    xp = _namespaces.get(kind)
    if xp is None:
        if isinstance(array, (np.ndarray, np.generic)):  # numpy scalars from 0-d results
            xp = np
        else:
            xp = array_api_compat.array_namespace(array)
        _namespaces[kind] = xp
    return xp


def is_array(value: Any) -> bool:
    """True for arrays of any array-API library (not Python scalars or lists)."""
    if isinstance(value, np.ndarray):
        return True
    return array_api_compat.is_array_api_obj(value) and not isinstance(value, np.generic)


def device_name(array: Any) -> str:
    """A short device label: 'cpu' for numpy, 'cuda:N' for cupy, 'lib:device' otherwise."""
    if isinstance(array, np.ndarray):
        return "cpu"
    module = type(array).__module__.split(".")[0]
    if module == "cupy":
        return f"cuda:{array.device.id}"
    return f"{module}:{getattr(array, 'device', '?')}"


def cupy_or_none() -> ModuleType | None:
    """cupy if it is installed and a GPU is visible, else None."""
    try:
        cupy = importlib.import_module("cupy")
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return None
    return cupy


def to_device(data: Any, device: str) -> Any:
    """Move or convert `data` (array, scalar or nested list) to `device` ('cpu' or 'cuda[:N]')."""
    if device == "cpu":
        if isinstance(data, np.ndarray) or not is_array(data):
            return np.asarray(data)
        if type(data).__module__.startswith("cupy"):
            return data.get()
        try:
            return np.asarray(data)
        except (TypeError, ValueError, RuntimeError):
            return np.from_dlpack(data)
    if device.startswith("cuda"):
        cupy = cupy_or_none()
        if cupy is None:
            raise DeviceError(
                f"device {device!r} was asked for, but no CUDA GPU with cupy is available here; "
                "install the 'gpu' extra on a machine with a GPU, or use device='cpu'"
            )
        index = int(device.split(":")[1]) if ":" in device else 0
        with cupy.cuda.Device(index):
            return cupy.asarray(data)
    raise DeviceError(f"unknown device {device!r}; use 'cpu' or 'cuda' (optionally 'cuda:N')")


def is_floating(dtype: Any) -> bool:
    """True for real floating dtypes of any namespace."""
    return getattr(dtype, "kind", None) == "f" or "float" in str(dtype)


def itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is not None:
        return int(size)
    return np.dtype(str(dtype).rsplit(".", 1)[-1]).itemsize


def nbytes(array: Any) -> int:
    """Bytes held by `array` (works for namespaces whose arrays lack `.nbytes`)."""
    size = getattr(array, "nbytes", None)
    if size is not None:
        return int(size)
    count = 1
    for dim in array.shape:
        count *= int(dim)
    return count * itemsize(array.dtype)


def has_array_index(index: Any) -> bool:
    """True when an index uses integer or boolean arrays (advanced indexing)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(not isinstance(p, (int, slice, type(None), type(Ellipsis))) for p in parts)


def _only_boolean_masks(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    arrays = [p for p in parts if not isinstance(p, (int, slice, type(None), type(Ellipsis)))]
    return all("bool" in str(getattr(p, "dtype", "")) for p in arrays)


def scatter_add(xp: ModuleType, target: Any, index: Any, values: Any) -> Any:
    """`target[index] += values` in place, adding repeated indices (which `+=` would drop)."""
    if not has_array_index(index) or _only_boolean_masks(index):
        target[index] = target[index] + values  # no repeated positions: plain update is exact
        return target
    if xp is np:
        np.add.at(target, index, values)
        return target
    if type(target).__module__.startswith("cupy"):
        cupyx = importlib.import_module("cupyx")  # optional: present only with cupy
        cupyx.scatter_add(target, index, values)
        return target
    raise NotImplementedError(
        f"gradients of integer-array indexing are not available for {xp.__name__} arrays "
        "(the array-API standard has no scatter-add); use slices, or numpy/cupy arrays"
    )


def resolve_dtype(xp: ModuleType, dtype: Any) -> Any:
    """`dtype` as `xp`'s dtype object; names such as 'float32' are looked up in `xp`."""
    if dtype is None or not isinstance(dtype, str):
        return dtype
    resolved = getattr(xp, dtype, None)
    if resolved is None:
        raise DTypeError(f"unknown dtype {dtype!r} for {xp.__name__}; use e.g. 'float32'")
    return resolved


def broadcast_axes(source: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...]:
    """The axes of `target` to sum over (keeping dims) to undo broadcasting `source` to it.

    Tuples on paths run once per op or rule are built from a list, not a generator: a tuple
    from a generator is sized by a guess and shrunk, and once freed it joins the interpreter's
    free list for its size instead of returning its memory, so a loop's backward held (and
    tracemalloc counted) memory that grew with its steps, up to about 100 KiB per size."""
    lead = len(target) - len(source)
    return tuple(range(lead)) + tuple(
        [i + lead for i, d in enumerate(source) if d == 1 and target[i + lead] != 1]
    )


def broadcast_view(array: Any, shape: tuple[int, ...]) -> Any:
    """`array` broadcast to `shape` as a read-only view, `array.ndim == len(shape)` (a reduced
    gradient spread back). Why: numpy's `broadcast_to` is Python around an iterator and costs
    more than the arithmetic on a small gradient; a view with zero strides made directly is
    the same array, made in one call. Other libraries (and arrays numpy cannot view that way)
    use their namespace's `broadcast_to`."""
    if type(array) is np.ndarray and array.flags.c_contiguous:
        strides = [0 if have == 1 and want != 1 else stride
                   for have, want, stride in zip(array.shape, shape, array.strides)]
        view = np.ndarray(shape, array.dtype, array, 0, strides)
        view.setflags(write=False)
        return view
    return namespace(array).broadcast_to(array, shape)


_erf_ufuncs: dict[type, Any] = {}


def erf(array: Any) -> Any:
    """The error function of each element, in `array`'s dtype (float32 stays float32).

    The array-API standard has no erf: numpy arrays use scipy's ufunc where scipy is
    installed (libm's ``math.erf`` per element otherwise: the same values, about ten times
    slower), cupy arrays cupyx's; other libraries go through numpy and back.
    """
    kind = type(array)
    ufunc = _erf_ufuncs.get(kind)
    if ufunc is None:
        ufunc = _erf_ufuncs[kind] = _find_erf(array)
    return ufunc(array)


_ERF_CHUNK = 1024  # elements per call of the per-element erf (its Python floats: ~32 B each)
_erf_element = np.frompyfunc(math.erf, 1, 1)


def _erf_by_element(a: Any) -> Any:
    """libm's erf per element into an array of `a`'s dtype, a chunk at a time: through
    Python floats, a whole array at once would take 8x its float32 bytes (an object array
    and its floats) beside it, memory no profile sees (GELU's erf form in an MLP)."""
    out = np.empty(np.shape(a), dtype=a.dtype)
    flat_in, flat_out = np.reshape(a, -1), out.reshape(-1)
    for start in range(0, flat_in.size, _ERF_CHUNK):
        flat_out[start:start + _ERF_CHUNK] = _erf_element(flat_in[start:start + _ERF_CHUNK])
    return out


def _find_erf(array: Any) -> Any:
    if type(array).__module__.startswith("cupy"):
        return importlib.import_module("cupyx.scipy.special").erf
    try:
        special = importlib.import_module("scipy.special")
    except ImportError:  # an optional speed-up: scipy is not a dependency
        numpy_erf = _erf_by_element
    else:
        numpy_erf = special.erf
    if isinstance(array, np.ndarray):
        return numpy_erf
    xp = namespace(array)
    return lambda a: xp.asarray(numpy_erf(np.asarray(a)), dtype=a.dtype)
