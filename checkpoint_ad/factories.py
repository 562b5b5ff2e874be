"""Tensors made from nothing but a shape: zeros, ones, ranges, identity, random values.

Why a module of its own: these make *leaves* (no tape entry, nothing to differentiate), so they
sit beside `checkpoint_ad.tensor` rather than in the op tables. Every factory takes the sizes
either as separate ints or as one sequence (``zeros(2, 3)`` and ``zeros((2, 3))``), and the
keywords ``dtype=``, ``device=`` and ``requires_grad=``. Values are built on the host with numpy
and moved to `device` once.

Random factories draw from the generator you pass (a ``numpy.random.Generator`` or an int
seed); without one they draw from the engine's generator (`checkpoint_ad.random`), which
`manual_seed` seeds and which checkpointed regions and every `scan` step replay when re-run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import random
from .backend import device_name, to_device
from .backend import resolve_dtype as _resolve_dtype
from .errors import DTypeError, ShapeError
from .tensor import Tensor

Generator = np.random.Generator | int | None

__all__ = [
    "arange", "empty", "empty_like", "eye", "full", "full_like", "linspace", "manual_seed",
    "ones", "ones_like", "rand", "rand_like", "randint", "randn", "randn_like", "zeros",
    "zeros_like",
]


def _sizes(op: str, size: tuple[Any, ...]) -> tuple[int, ...]:
    """The shape from ``f(2, 3)`` or ``f((2, 3))`` (or ``f([2, 3])``, or ``f()`` for 0-d)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    for d in size:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ShapeError(
                f"{op}: sizes must be non-negative ints, got {size!r}; pass e.g. {op}(2, 3) "
                f"or {op}((2, 3))"
            )
    return tuple(int(d) for d in size)


def _host_dtype(dtype: Any, default: Any = np.float32) -> Any:
    if dtype is None:
        return default
    if isinstance(dtype, str):
        return _resolve_dtype(np, dtype)
    try:
        return np.dtype(dtype)
    except TypeError:  # a dtype of another library (cupy's are numpy's; others by name)
        return _resolve_dtype(np, str(dtype).rsplit(".", 1)[-1])


def _leaf(host: np.ndarray, device: str | None, requires_grad: bool) -> Tensor:
    data = host if device in (None, "cpu") else to_device(host, device)
    return Tensor(data, requires_grad=requires_grad)


def _on_device(host: np.ndarray, device: str | None) -> Any:
    return host if device in (None, "cpu") else to_device(host, device)


def _like(x: Any, dtype: Any, device: str | None) -> tuple[tuple[int, ...], Any, str]:
    data = getattr(x, "_data", x)
    if not hasattr(data, "shape"):
        raise TypeError(f"*_like factories take a tensor or array, got {type(x).__name__}")
    host_dtype = _host_dtype(dtype if dtype is not None else data.dtype)
    return tuple(data.shape), host_dtype, device if device is not None else device_name(data)


def manual_seed(seed: int) -> None:
    """Seed the calling thread's engine generator (what random factories, `nn.Dropout` and the
    initialisation of `nn` layers draw from by default) and numpy's global random state.

    >>> import checkpoint_ad as cad
    >>> cad.manual_seed(0); a = cad.rand(3)
    >>> cad.manual_seed(0); b = cad.rand(3)
    >>> bool((a == b).numpy().all())
    True
    """
    random.manual_seed(seed)
    np.random.seed(seed)


def zeros(*size: Any, dtype: Any = None, device: str | None = None,
          requires_grad: bool = False) -> Tensor:
    """A tensor of zeros (float32 unless `dtype` says otherwise).

    >>> import checkpoint_ad as cad
    >>> cad.zeros(2, 3).shape, cad.zeros((2,), dtype="float64").dtype.name
    ((2, 3), 'float64')
    """
    return _leaf(np.zeros(_sizes("zeros", size), _host_dtype(dtype)), device, requires_grad)


def ones(*size: Any, dtype: Any = None, device: str | None = None,
         requires_grad: bool = False) -> Tensor:
    """A tensor of ones.

    >>> import checkpoint_ad as cad
    >>> cad.ones(2).tolist()
    [1.0, 1.0]
    """
    return _leaf(np.ones(_sizes("ones", size), _host_dtype(dtype)), device, requires_grad)


def empty(*size: Any, dtype: Any = None, device: str | None = None,
          requires_grad: bool = False) -> Tensor:
    """A tensor whose values are whatever the memory held: fill it before reading it.

    >>> import checkpoint_ad as cad
    >>> cad.empty(4, 2).shape
    (4, 2)
    """
    return _leaf(np.empty(_sizes("empty", size), _host_dtype(dtype)), device, requires_grad)


def full(size: Sequence[int] | int, fill_value: float, *, dtype: Any = None,
         device: str | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor of `size` filled with `fill_value`.

    >>> import checkpoint_ad as cad
    >>> cad.full((2,), 7.0).tolist()
    [7.0, 7.0]
    """
    shape = _sizes("full", (size,) if isinstance(size, int) else tuple(size))
    return _leaf(np.full(shape, fill_value, _host_dtype(dtype)), device, requires_grad)


def arange(start: float, end: float | None = None, step: float = 1, *, dtype: Any = None,
           device: str | None = None, requires_grad: bool = False) -> Tensor:
    """Values from `start` up to (not including) `end`, `step` apart; ``arange(n)`` is 0..n-1.

    All-int arguments give int64 (as numpy and PyTorch do), anything else float32.

    >>> import checkpoint_ad as cad
    >>> cad.arange(4).tolist(), cad.arange(0, 1, 0.5).tolist()
    ([0, 1, 2, 3], [0.0, 0.5])
    """
    if end is None:
        start, end = 0, start
    if step == 0:
        raise ValueError("arange: step must not be 0")
    ints = all(isinstance(v, (int, np.integer)) for v in (start, end, step))
    host = np.arange(start, end, step, dtype=_host_dtype(dtype, np.int64 if ints else np.float32))
    return _leaf(host, device, requires_grad)


def linspace(start: float, end: float, steps: int, *, dtype: Any = None,
             device: str | None = None, requires_grad: bool = False) -> Tensor:
    """`steps` evenly spaced values from `start` to `end`, both included.

    >>> import checkpoint_ad as cad
    >>> cad.linspace(0, 1, 3).tolist()
    [0.0, 0.5, 1.0]
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"linspace: steps must be a non-negative int, got {steps!r}")
    host = np.linspace(start, end, steps, dtype=_host_dtype(dtype))
    return _leaf(host, device, requires_grad)


def eye(n: int, m: int | None = None, *, dtype: Any = None, device: str | None = None,
        requires_grad: bool = False) -> Tensor:
    """The n x m identity matrix (square when `m` is omitted).

    >>> import checkpoint_ad as cad
    >>> cad.eye(2).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """
    _sizes("eye", (n,) if m is None else (n, m))
    return _leaf(np.eye(n, m, dtype=_host_dtype(dtype)), device, requires_grad)


def rand(*size: Any, generator: Generator = None, dtype: Any = None,
         device: str | None = None, requires_grad: bool = False) -> Tensor:
    """Uniform values in [0, 1), drawn from `generator` (default: the engine's).

    >>> import checkpoint_ad as cad
    >>> a, b = cad.rand(3, generator=7), cad.rand(3, generator=7)
    >>> a.tolist() == b.tolist(), bool(((a >= 0) & (a < 1)).numpy().all())
    (True, True)
    """
    shape = _sizes("rand", size)
    host = _host_dtype(dtype)

    def make(rng: Any) -> Any:
        values = rng.random(shape) if isinstance(rng, np.random.Generator) else (
            rng.random_sample(shape))
        return _on_device(np.asarray(values, dtype=host), device)

    data = random.sample(generator, "rand", make, (shape, host, device))
    return Tensor(data, requires_grad=requires_grad)


def randn(*size: Any, generator: Generator = None, dtype: Any = None,
          device: str | None = None, requires_grad: bool = False) -> Tensor:
    """Standard normal values, drawn from `generator` (default: the engine's).

    >>> import checkpoint_ad as cad
    >>> cad.randn(2, 3, generator=0).shape
    (2, 3)
    """
    shape = _sizes("randn", size)
    host = _host_dtype(dtype)

    def make(rng: Any) -> Any:
        return _on_device(np.asarray(rng.standard_normal(shape), dtype=host), device)

    data = random.sample(generator, "randn", make, (shape, host, device))
    return Tensor(data, requires_grad=requires_grad)


def randint(low: int, high: int, size: Sequence[int], *, generator: Generator = None,
            dtype: Any = None, device: str | None = None) -> Tensor:
    """Integers drawn uniformly from [low, high) (int64 unless `dtype` says otherwise).

    >>> import checkpoint_ad as cad
    >>> x = cad.randint(0, 5, (10,), generator=1)
    >>> x.dtype.name, bool(((x >= 0) & (x < 5)).numpy().all())
    ('int64', True)
    """
    shape = _sizes("randint", tuple(size))
    if high <= low:
        raise ValueError(f"randint: high ({high}) must be greater than low ({low})")
    host = _host_dtype(dtype, np.int64)

    def make(rng: Any) -> Any:
        values = rng.integers(low, high, shape) if isinstance(rng, np.random.Generator) else (
            rng.randint(low, high, shape))
        return _on_device(np.asarray(values, dtype=host), device)

    data = random.sample(generator, "randint", make, (low, high, shape, host, device))
    return Tensor(data, requires_grad=False)


def _from_like(op: str, x: Any, host_fn: Any, dtype: Any, device: str | None,
               requires_grad: bool) -> Tensor:
    shape, host_dtype, where = _like(x, dtype, device)
    return _leaf(np.asarray(host_fn(shape), dtype=host_dtype), where, requires_grad)


def zeros_like(x: Any, *, dtype: Any = None, device: str | None = None,
               requires_grad: bool = False) -> Tensor:
    """Zeros with x's shape, and its dtype and device unless given.

    >>> import checkpoint_ad as cad
    >>> cad.zeros_like(cad.ones(2, dtype="float64")).tolist()
    [0.0, 0.0]
    """
    return _from_like("zeros_like", x, np.zeros, dtype, device, requires_grad)


def ones_like(x: Any, *, dtype: Any = None, device: str | None = None,
              requires_grad: bool = False) -> Tensor:
    """Ones with x's shape, and its dtype and device unless given.

    >>> import checkpoint_ad as cad
    >>> cad.ones_like(cad.zeros(2)).tolist()
    [1.0, 1.0]
    """
    return _from_like("ones_like", x, np.ones, dtype, device, requires_grad)


def empty_like(x: Any, *, dtype: Any = None, device: str | None = None,
               requires_grad: bool = False) -> Tensor:
    """Uninitialised values with x's shape, dtype and device.

    >>> import checkpoint_ad as cad
    >>> cad.empty_like(cad.zeros(3)).shape
    (3,)
    """
    return _from_like("empty_like", x, np.empty, dtype, device, requires_grad)


def full_like(x: Any, fill_value: float, *, dtype: Any = None, device: str | None = None,
              requires_grad: bool = False) -> Tensor:
    """`fill_value` everywhere, with x's shape, dtype and device.

    >>> import checkpoint_ad as cad
    >>> cad.full_like(cad.zeros(2), 3.0).tolist()
    [3.0, 3.0]
    """
    return _from_like("full_like", x, lambda s: np.full(s, fill_value), dtype, device,
                      requires_grad)


def rand_like(x: Any, *, generator: Generator = None, dtype: Any = None,
              device: str | None = None, requires_grad: bool = False) -> Tensor:
    """Uniform [0, 1) values with x's shape, dtype and device.

    >>> import checkpoint_ad as cad
    >>> cad.rand_like(cad.zeros(2, 2), generator=0).shape
    (2, 2)
    """
    if not _floating(x, dtype):
        raise DTypeError("rand_like needs a floating dtype; pass dtype='float32'")
    return _from_like("rand_like", x, lambda s: rand(*s, generator=generator, dtype="float64")
                      .numpy(), dtype, device, requires_grad)


def randn_like(x: Any, *, generator: Generator = None, dtype: Any = None,
               device: str | None = None, requires_grad: bool = False) -> Tensor:
    """Standard normal values with x's shape, dtype and device.

    >>> import checkpoint_ad as cad
    >>> cad.randn_like(cad.zeros(3), generator=0).shape
    (3,)
    """
    if not _floating(x, dtype):
        raise DTypeError("randn_like needs a floating dtype; pass dtype='float32'")
    return _from_like("randn_like", x, lambda s: randn(*s, generator=generator,
                                                       dtype="float64").numpy(),
                      dtype, device, requires_grad)


def _floating(x: Any, dtype: Any) -> bool:
    chosen = _host_dtype(dtype if dtype is not None else getattr(x, "dtype", np.float32))
    return np.dtype(chosen).kind == "f"
