"""The user's value: an array plus what autograd needs to know about it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .backend import device_name, is_array, is_floating, namespace, to_device
from .errors import BackwardError, DTypeError, InplaceError
from .grad_mode import _state, no_grad
from .saved import VersionCounter


class Tensor:
    """An array that can record the operations applied to it for reverse-mode differentiation.

    Make one with `checkpoint_ad.tensor`. Results of operations on tensors that require grad
    require grad themselves and point at the tape entry that produced them (`grad_fn`).

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    >>> (x * x).sum().backward()
    >>> x.grad.numpy().tolist()
    [2.0, 4.0, 6.0]
    """

    __slots__ = (
        "__weakref__",
        "_base",
        "_data",
        "_entry",
        "_index",
        "_inference",
        "_leaf_target",
        "_requires_grad",
        "_saved_ref",
        "_version",
        "grad",
    )
    __array_ufunc__ = None  # make numpy defer to our reflected operators
    __array_priority__ = 1000

    _data: Any
    _entry: Any
    _index: int
    _requires_grad: bool
    _version: VersionCounter
    _leaf_target: Tensor | None
    _inference: bool
    _base: Tensor | None
    grad: Tensor | None

    def __init__(self, data: Any, requires_grad: bool = False) -> None:
        if not is_array(data):
            raise TypeError(
                f"Tensor() takes an array, got {type(data).__name__}; "
                "use checkpoint_ad.tensor(...) to convert Python data"
            )
        self._init(data, None, 0, VersionCounter())
        self.requires_grad = requires_grad

    def _init(self, data: Any, entry: Any, index: int, counter: VersionCounter) -> None:
        self._data = data
        self._entry = entry
        self._index = index
        self._requires_grad = entry is not None
        self._version = counter
        self._leaf_target = None
        self._inference = _state.inference
        self._base = None
        self._saved_ref = None
        self.grad = None

    @classmethod
    def _wrap(
        cls, data: Any, entry: Any = None, index: int = 0, counter: VersionCounter | None = None
    ) -> Tensor:
        """Fast internal constructor: no checks, optional shared version counter (views)."""
        if isinstance(data, np.generic):  # numpy turns 0-d results into scalars
            data = np.asarray(data)
        t = object.__new__(cls)
        t._init(data, entry, index, counter if counter is not None else VersionCounter())
        return t

    # ----------------------------------------------------------------- attributes
    @property
    def data(self) -> Any:
        """The backend array (numpy or cupy). Changing it bypasses version checks."""
        return self._data

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._data.shape)

    @property
    def dtype(self) -> Any:
        return self._data.dtype

    @property
    def ndim(self) -> int:
        return self._data.ndim

    @property
    def device(self) -> str:
        return device_name(self._data)

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if self._entry is not None and not value:
            raise BackwardError(
                "requires_grad can only be changed on leaf tensors; this tensor was computed "
                f"by {self._entry.describe()}; use .detach() to get a tensor without history"
            )
        if value and not is_floating(self.dtype):
            raise DTypeError(
                f"only floating-point tensors can require gradients, got dtype {self.dtype}; "
                "convert first, e.g. cad.tensor(x, dtype='float64')"
            )
        self._requires_grad = bool(value)

    @property
    def is_leaf(self) -> bool:
        """True unless the tensor was produced by a recorded operation."""
        return self._entry is None

    @property
    def grad_fn(self) -> Any:
        """The tape entry that produced this tensor (None for leaves)."""
        return self._entry

    @property
    def version(self) -> int:
        """How many in-place changes its storage has seen."""
        return self._version.value

    # ----------------------------------------------------------------- conversions
    def numpy(self) -> np.ndarray:
        """The values as a numpy array (copied to the host for GPU tensors)."""
        return to_device(self._data, "cpu")

    def item(self) -> float:
        if self.numel() != 1:
            raise ValueError(
                f"item() needs a tensor with exactly one element, this one has shape "
                f"{list(self.shape)}; index or reduce it first (e.g. .sum())"
            )
        return self.numpy().reshape(()).item()

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def detach(self) -> Tensor:
        """The same storage without history: shares the version counter."""
        t = Tensor._wrap(self._data, counter=self._version)
        t._base = self
        return t

    def clone(self) -> Tensor:
        """A copy with its own storage, still differentiable."""
        from .ops import elementwise

        return elementwise.copy(self)

    def cpu(self) -> Tensor:
        return self.to("cpu")

    def cuda(self) -> Tensor:
        return self.to("cuda")

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        self.requires_grad = requires_grad
        return self

    def retain_grad(self) -> Tensor:
        """Fill `.grad` of this non-leaf tensor during `backward()` as for leaves."""
        if self._entry is None:
            if not self._requires_grad:
                raise BackwardError(
                    "retain_grad() on a tensor that does not require grad has no effect; "
                    "set requires_grad=True on it or on the tensors it is computed from"
                )
            return self
        import weakref

        if self._entry.retained is None:
            self._entry.retained = {}
        self._entry.retained[self._index] = weakref.ref(self)
        return self

    def backward(
        self,
        gradient: Any = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
    ) -> None:
        """Accumulate d(self)/d(leaf) into `.grad` of every leaf that requires grad."""
        from .autograd import backward

        backward(self, gradient, retain_graph=retain_graph, create_graph=create_graph)

    # ----------------------------------------------------------------- in-place
    def _tracked(self, other: Any) -> bool:
        other_grad = isinstance(other, Tensor) and other._requires_grad
        return _state.grad_enabled and (self._requires_grad or other_grad)

    def _inplace(self, op_name: str, compute: Any, other: Any = None) -> Tensor:
        if self._tracked(other):
            if self._entry is None and self._requires_grad:
                raise InplaceError(
                    f"{op_name} on a leaf tensor that requires grad ({self.dtype}"
                    f"{list(self.shape)}) would lose its history; do it under "
                    "checkpoint_ad.no_grad() (e.g. an optimizer step) or use an out-of-place op"
                )
            if self._base is not None:
                raise InplaceError(
                    f"{op_name} on a view or detached alias of another tensor cannot be "
                    "recorded for differentiation; apply it to the base tensor or use an "
                    "out-of-place op"
                )
            result = compute(self)
            self._data = result._data
            self._entry = result._entry
            self._index = result._index
            self._requires_grad = result._requires_grad
            self._version = VersionCounter(self._version.value + 1)
            self._saved_ref = None
            return self
        with no_grad():
            result = compute(self)
        if result.dtype != self.dtype:
            result = result.astype(self.dtype)
        self._data[...] = result._data
        self._version.value += 1
        return self

    def add_(self, other: Any) -> Tensor:
        return self._inplace("add_", lambda s: s + other, other)

    def sub_(self, other: Any) -> Tensor:
        return self._inplace("sub_", lambda s: s - other, other)

    def mul_(self, other: Any) -> Tensor:
        return self._inplace("mul_", lambda s: s * other, other)

    def div_(self, other: Any) -> Tensor:
        return self._inplace("div_", lambda s: s / other, other)

    def zero_(self) -> Tensor:
        from .ops import elementwise

        return self._inplace("zero_", elementwise.zeros_like)

    def copy_(self, src: Any) -> Tensor:
        from .ops import elementwise, shape

        def compute(s: Tensor) -> Tensor:
            value = as_tensor(src, like=(s,))
            return shape.broadcast_to(elementwise.astype(value, s.dtype), s.shape)

        return self._inplace("copy_", compute, src)

    __iadd__ = add_
    __isub__ = sub_
    __imul__ = mul_
    __itruediv__ = div_

    def __setitem__(self, index: Any, value: Any) -> None:
        from .ops import shape

        self._inplace("x[index] = value", lambda s: shape.setitem(s, index, value), value)

    # ----------------------------------------------------------------- display
    def __repr__(self) -> str:
        body = np.array2string(self.numpy(), separator=", ", threshold=20, precision=4)
        extra = ""
        if self._entry is not None:
            extra = f", grad_fn=<{self._entry.name}>"
        elif self._requires_grad:
            extra = ", requires_grad=True"
        device = "" if self.device == "cpu" else f", device={self.device!r}"
        return f"tensor({body}, dtype={self.dtype}{device}{extra})"

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise ValueError(
                f"the truth value of a tensor with {self.numel()} elements is ambiguous; "
                "use .any()/.all() style reductions or compare .item()"
            )
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __iter__(self) -> Any:
        for i in range(len(self)):
            yield self[i]

    __hash__ = object.__hash__

    # ---- PyTorch-style methods
    # What a PyTorch user types without thinking. Each is an ordinary method that forwards to
    # the public op function, so there is one implementation per operation.
    def size(self, dim: int | None = None) -> Any:
        """The shape (``size()``) or the length of one axis (``size(d)``), as in PyTorch.

        >>> import checkpoint_ad as cad
        >>> x = cad.zeros(2, 3)
        >>> x.size(), x.size(-1), x.numel()
        ((2, 3), 3, 6)
        """
        if dim is None:
            return self.shape
        if not -self.ndim <= dim < max(self.ndim, 1):
            raise IndexError(f"size({dim}): a {self.ndim}-d tensor has no dimension {dim}")
        return self.shape[dim]

    def numel(self) -> int:
        """The number of elements."""
        count = 1
        for d in self._data.shape:
            count *= int(d)
        return count

    def dim(self) -> int:
        """The number of axes (PyTorch's name for `ndim`)."""
        return self.ndim

    def view(self, *shape: Any) -> Tensor:
        """`reshape`, PyTorch's name: ``x.view(3, -1)`` or ``x.view((3, -1))``."""
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        return _ops().reshape(self, shape)

    def unsqueeze(self, dim: int) -> Tensor:
        return _ops().unsqueeze(self, dim)

    def permute(self, *dims: Any) -> Tensor:
        return _ops().permute(self, *dims)

    def swapaxes(self, a: int, b: int) -> Tensor:
        return _ops().swapaxes(self, a, b)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        return _ops().flatten(self, start_dim, end_dim)

    def expand(self, *sizes: Any) -> Tensor:
        return _ops().expand(self, *sizes)

    def t(self) -> Tensor:
        """The transpose of a matrix (a 0-d or 1-d tensor is returned as it is)."""
        return self if self.ndim < 2 else _ops().transpose(self, 0, 1)

    def chunk(self, chunks: int, dim: int = 0) -> list[Tensor]:
        return _ops().chunk(self, chunks, dim)

    def split(self, split_size: int | Sequence[int], dim: int = 0) -> list[Tensor]:
        """Pieces of `split_size` (or of the listed sizes) along `dim`, PyTorch's meaning."""
        return _ops().split(self, split_size, dim=dim)

    def repeat(self, *sizes: Any) -> Tensor:
        """Whole-tensor repetition, PyTorch's meaning (numpy's `tile`)."""
        if len(sizes) == 1 and not isinstance(sizes[0], int):
            sizes = tuple(sizes[0])
        return _ops().tile(self, sizes)

    def float(self) -> Tensor:
        return _ops().astype(self, "float32")

    def double(self) -> Tensor:
        return _ops().astype(self, "float64")

    def half(self) -> Tensor:
        return _ops().astype(self, "float16")

    def to(self, *args: Any, dtype: Any = None, device: str | None = None) -> Tensor:
        """This tensor converted: ``to("cuda")``, ``to("float64")``, ``to(dtype=...)``,
        ``to(other)`` (other's dtype and device). Differentiable; returns self when nothing
        changes.

        >>> import checkpoint_ad as cad
        >>> cad.ones(2).to("float64").dtype.name
        'float64'
        """
        for arg in args:
            if isinstance(arg, Tensor):
                dtype, device = arg.dtype, arg.device
            elif isinstance(arg, str) and arg.split(":")[0] in ("cpu", "cuda"):
                device = arg
            else:
                dtype = arg
        out = self
        if device is not None and not (
            device == out.device or (device == "cuda" and out.device == "cuda:0")
        ):
            out = _ops().to_device(out, device)
        if dtype is not None:
            out = _ops().astype(out, dtype)
        return out

    def masked_fill(self, mask: Any, value: float) -> Tensor:
        return _ops().masked_fill(self, mask, value)

    def clamp(self, min: float | None = None, max: float | None = None) -> Tensor:
        return _ops().clamp(self, min, max)

    def prod(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return _ops().prod(self, dim=dim, keepdim=keepdim)

    def cumsum(self, dim: int) -> Tensor:
        return _ops().cumsum(self, dim=dim)

    def argmax(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return _ops().argmax(self, dim=dim, keepdim=keepdim)

    def argmin(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return _ops().argmin(self, dim=dim, keepdim=keepdim)

    def flip(self, *dims: Any) -> Tensor:
        if len(dims) == 1 and not isinstance(dims[0], int):
            dims = tuple(dims[0])
        return _ops().flip(self, dims=dims)

    def norm(self, p: float | str | None = None, dim: Any = None, keepdim: bool = False) -> Tensor:
        return _ops().norm(self, p, dim=dim, keepdim=keepdim)


def _ops() -> Any:
    """The op functions, looked up when a PyTorch-style method runs (ops imports this module)."""
    from . import ops

    return ops


def _default_float(xp: Any) -> Any:
    return xp.float32


def _resolve_dtype(xp: Any, dtype: Any) -> Any:
    if dtype is None or not isinstance(dtype, str):
        return dtype
    resolved = getattr(xp, dtype, None)
    if resolved is None:
        raise DTypeError(f"unknown dtype {dtype!r} for {xp.__name__}; use e.g. 'float32'")
    return resolved


def tensor(
    data: Any, requires_grad: bool = False, dtype: Any = None, device: str | None = None
) -> Tensor:
    """Make a leaf tensor.

    Arrays keep their dtype and array library; Python scalars and lists become float32
    unless `dtype` says otherwise. `device` is 'cpu' or 'cuda[:N]' (cupy); by default the
    data stays where it is (numpy arrays and Python data on the CPU).

    An array of the right dtype and device is not copied (like ``torch.from_numpy``): large
    inputs cost no second copy, and an in-place update of the tensor (under `no_grad`, e.g. an
    optimizer step) is seen through the caller's array. Pass ``array.copy()`` to keep them
    apart.

    >>> import checkpoint_ad as cad
    >>> cad.tensor([1, 2]).dtype
    dtype('float32')
    """
    if isinstance(data, Tensor):
        data = data._data
    if isinstance(data, np.generic):
        data = np.asarray(data)
    if is_array(data):
        if device is not None and device_name(data) != device and not (
            device == "cuda" and device_name(data).startswith("cuda")
        ):
            data = to_device(data, device)
        xp = namespace(data)
        if dtype is not None:
            data = xp.astype(data, _resolve_dtype(xp, dtype))
    else:
        host = np.asarray(data, dtype=_resolve_dtype(np, dtype) or np.float32)
        data = to_device(host, device or "cpu")
    return Tensor(data, requires_grad=requires_grad)


def as_tensor(value: Any, like: Sequence[Any] = ()) -> Tensor:
    """`value` as a Tensor; Python scalars take the dtype and device of the first tensor in
    `like` so that `x * 2` keeps x's float32."""
    if isinstance(value, Tensor):
        return value
    ref = next((t for t in like if isinstance(t, Tensor)), None)
    if ref is None:
        return tensor(value)
    ref_data = ref._data
    if type(ref_data) is np.ndarray and isinstance(value, (int, float)) and not isinstance(
        value, bool
    ):  # the common `x * 2.0` on numpy: skip the generic path
        if ref_data.dtype.kind == "f" or isinstance(value, int):
            return Tensor._wrap(np.asarray(value, dtype=ref_data.dtype))
        return Tensor._wrap(np.asarray(value))
    if is_array(value) or isinstance(value, np.generic):
        data = np.asarray(value) if isinstance(value, np.generic) else value
        return Tensor._wrap(data)
    xp = namespace(ref._data)
    if isinstance(value, bool) or (not is_floating(ref.dtype) and isinstance(value, float)):
        return Tensor._wrap(xp.asarray(value, device=getattr(ref._data, "device", None)))
    try:
        data = xp.asarray(value, dtype=ref.dtype, device=getattr(ref._data, "device", None))
    except TypeError:  # namespaces without a device keyword
        data = xp.asarray(value, dtype=ref.dtype)
    return Tensor._wrap(data)


def _install_operators() -> None:
    """Tensor operators delegate to the public op functions (defined in checkpoint_ad.ops)."""
    from . import ops

    def binary(fn: Any) -> tuple[Any, Any]:
        return (lambda a, b: fn(a, b)), (lambda a, b: fn(b, a))

    pairs = {
        "add": ops.add,
        "sub": ops.subtract,
        "mul": ops.multiply,
        "truediv": ops.divide,
        "pow": ops.power,
        "matmul": ops.matmul,
    }
    for name, fn in pairs.items():
        forward, reflected = binary(fn)
        setattr(Tensor, f"__{name}__", forward)
        setattr(Tensor, f"__r{name}__", reflected)
    Tensor.__neg__ = lambda a: ops.negative(a)  # type: ignore[attr-defined]
    Tensor.__pos__ = lambda a: a  # type: ignore[attr-defined]
    Tensor.__abs__ = lambda a: ops.abs(a)  # type: ignore[attr-defined]
    comparisons = {
        "lt": ops.less,
        "le": ops.less_equal,
        "gt": ops.greater,
        "ge": ops.greater_equal,
        "eq": ops.equal,
        "ne": ops.not_equal,
    }
    for name, fn in comparisons.items():
        setattr(Tensor, f"__{name}__", fn)
    Tensor.__and__ = lambda a, b: ops.logical_and(a, b)  # type: ignore[attr-defined]
    Tensor.__or__ = lambda a, b: ops.logical_or(a, b)  # type: ignore[attr-defined]
    Tensor.__invert__ = lambda a: ops.logical_not(a)  # type: ignore[attr-defined]
    Tensor.__getitem__ = lambda a, index: ops.getitem(a, index)  # type: ignore[attr-defined]
    Tensor.T = property(lambda a: ops.transpose(a))  # type: ignore[attr-defined]
    Tensor.mT = property(lambda a: ops.matrix_transpose(a))  # type: ignore[attr-defined]
    methods = (
        "exp log sin cos tanh sigmoid relu sqrt abs clip sum mean max min reshape transpose "
        "expand_dims squeeze matmul softmax log_softmax logsumexp astype"
    )
    for name in methods.split():
        setattr(Tensor, name, getattr(ops, name))
