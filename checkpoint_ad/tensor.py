"""The user's value: an array plus what autograd needs to know about it, and its operators.

The state lives in `TensorBase` (tensor_base.py); this class adds what computes: Python
operators and methods, each a call into the op tables (`checkpoint_ad.ops`), in-place updates
guarded by version counters, and `backward`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import ops
from .autograd import backward as _backward
from .backend import is_array
from .errors import InplaceError
from .grad_mode import _state, no_grad
from .saved import VersionCounter
from .tensor_base import TensorBase, as_tensor, as_tensor_like, make_tensor, tensor

__all__ = ["Tensor", "as_tensor", "tensor"]


class Tensor(TensorBase, made_by_engine=True):
    """An array that can record the operations applied to it for reverse-mode differentiation.

    Make one with `checkpoint_ad.tensor`. Results of operations on tensors that require grad
    require grad themselves and point at the tape entry that produced them (`grad_fn`).

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    >>> (x * x).sum().backward()
    >>> x.grad.numpy().tolist()
    [2.0, 4.0, 6.0]
    """

    __slots__ = ()
    __array_ufunc__ = None  # make numpy defer to our reflected operators
    __array_priority__ = 1000

    def __init__(self, data: Any, requires_grad: bool = False) -> None:
        if not is_array(data):
            raise TypeError(
                f"Tensor() takes an array, got {type(data).__name__}; "
                "use checkpoint_ad.tensor(...) to convert Python data"
            )
        self._init(data, None, 0, VersionCounter())
        self.requires_grad = requires_grad

    @classmethod
    def _wrap(
        cls, data: Any, entry: Any = None, index: int = 0, counter: VersionCounter | None = None
    ) -> Tensor:
        """Fast internal constructor: no checks, optional shared version counter (views)."""
        return make_tensor(data, entry, index, counter)

    # ----------------------------------------------------------------- operators
    def __add__(self, other: Any) -> Tensor:
        return ops.add(self, other)

    def __radd__(self, other: Any) -> Tensor:
        return ops.add(other, self)

    def __sub__(self, other: Any) -> Tensor:
        return ops.subtract(self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return ops.subtract(other, self)

    def __mul__(self, other: Any) -> Tensor:
        return ops.multiply(self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return ops.multiply(other, self)

    def __truediv__(self, other: Any) -> Tensor:
        return ops.divide(self, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return ops.divide(other, self)

    def __pow__(self, other: Any) -> Tensor:
        return ops.power(self, other)

    def __rpow__(self, other: Any) -> Tensor:
        return ops.power(other, self)

    def __matmul__(self, other: Any) -> Tensor:
        return ops.matmul(self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return ops.matmul(other, self)

    def __neg__(self) -> Tensor:
        return ops.negative(self)

    def __pos__(self) -> Tensor:
        return self

    def __abs__(self) -> Tensor:
        return ops.abs(self)

    def __getitem__(self, index: Any) -> Tensor:
        return ops.getitem(self, index)

    __lt__ = ops.less
    __le__ = ops.less_equal
    __gt__ = ops.greater
    __ge__ = ops.greater_equal
    __eq__ = ops.equal  # type: ignore[assignment]  # elementwise, as in numpy
    __ne__ = ops.not_equal  # type: ignore[assignment]
    __and__ = ops.logical_and
    __or__ = ops.logical_or
    __invert__ = ops.logical_not
    __hash__ = TensorBase.__hash__

    T = property(ops.transpose, doc="The axes reversed.")
    mT = property(ops.matrix_transpose, doc="The last two axes swapped.")

    # ----------------------------------------------------------------- methods
    exp = ops.exp
    log = ops.log
    sin = ops.sin
    cos = ops.cos
    tanh = ops.tanh
    sigmoid = ops.sigmoid
    relu = ops.relu
    sqrt = ops.sqrt
    abs = ops.abs
    clip = ops.clip
    sum = ops.sum
    mean = ops.mean
    max = ops.max
    min = ops.min
    reshape = ops.reshape
    transpose = ops.transpose
    expand_dims = ops.expand_dims
    squeeze = ops.squeeze
    matmul = ops.matmul
    softmax = ops.softmax
    log_softmax = ops.log_softmax
    logsumexp = ops.logsumexp
    astype = ops.astype

    def clone(self) -> Tensor:
        """A copy with its own storage, still differentiable."""
        return ops.copy(self)

    def cpu(self) -> Tensor:
        return self.to("cpu")

    def cuda(self) -> Tensor:
        return self.to("cuda")

    def backward(
        self,
        gradient: Any = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
    ) -> None:
        """Accumulate d(self)/d(leaf) into `.grad` of every leaf that requires grad."""
        _backward(self, gradient, retain_graph=retain_graph, create_graph=create_graph)

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
        return self._inplace("zero_", ops.zeros_like)

    def copy_(self, src: Any) -> Tensor:
        def compute(s: Tensor) -> Tensor:
            value = as_tensor_like(src, like=(s,))
            return ops.broadcast_to(ops.astype(value, s.dtype), s.shape)

        return self._inplace("copy_", compute, src)

    __iadd__ = add_
    __isub__ = sub_
    __imul__ = mul_
    __itruediv__ = div_

    def __setitem__(self, index: Any, value: Any) -> None:
        self._inplace("x[index] = value", lambda s: ops.setitem(s, index, value), value)

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
        if self._element_count() != 1:
            raise ValueError(
                f"the truth value of a tensor with {self._element_count()} elements is ambiguous; "
                "use .any()/.all() style reductions or compare .item()"
            )
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __iter__(self) -> Any:
        for i in range(len(self)):
            yield self[i]

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
        return ops.reshape(self, shape)

    def unsqueeze(self, dim: int) -> Tensor:
        return ops.unsqueeze(self, dim)

    def permute(self, *dims: Any) -> Tensor:
        return ops.permute(self, *dims)

    def swapaxes(self, a: int, b: int) -> Tensor:
        return ops.swapaxes(self, a, b)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        return ops.flatten(self, start_dim, end_dim)

    def expand(self, *sizes: Any) -> Tensor:
        return ops.expand(self, *sizes)

    def t(self) -> Tensor:
        """The transpose of a matrix (a 0-d or 1-d tensor is returned as it is)."""
        return self if self.ndim < 2 else ops.transpose(self, 0, 1)

    def chunk(self, chunks: int, dim: int = 0) -> list[Tensor]:
        return ops.chunk(self, chunks, dim)

    def split(self, split_size: int | Sequence[int], dim: int = 0) -> list[Tensor]:
        """Pieces of `split_size` (or of the listed sizes) along `dim`, PyTorch's meaning."""
        return ops.split(self, split_size, dim=dim)

    def repeat(self, *sizes: Any) -> Tensor:
        """Whole-tensor repetition, PyTorch's meaning (numpy's `tile`)."""
        if len(sizes) == 1 and not isinstance(sizes[0], int):
            sizes = tuple(sizes[0])
        return ops.tile(self, sizes)

    def float(self) -> Tensor:
        return ops.astype(self, "float32")

    def double(self) -> Tensor:
        return ops.astype(self, "float64")

    def half(self) -> Tensor:
        return ops.astype(self, "float16")

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
            out = ops.to_device(out, device)
        if dtype is not None:
            out = ops.astype(out, dtype)
        return out

    def masked_fill(self, mask: Any, value: float) -> Tensor:
        return ops.masked_fill(self, mask, value)

    def clamp(self, min: float | None = None, max: float | None = None) -> Tensor:
        return ops.clamp(self, min, max)

    def prod(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return ops.prod(self, dim=dim, keepdim=keepdim)

    def cumsum(self, dim: int) -> Tensor:
        return ops.cumsum(self, dim=dim)

    def argmax(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return ops.argmax(self, dim=dim, keepdim=keepdim)

    def argmin(self, dim: int | None = None, keepdim: bool = False) -> Tensor:
        return ops.argmin(self, dim=dim, keepdim=keepdim)

    def flip(self, *dims: Any) -> Tensor:
        if len(dims) == 1 and not isinstance(dims[0], int):
            dims = tuple(dims[0])
        return ops.flip(self, dims=dims)

    def norm(self, p: float | str | None = None, dim: Any = None, keepdim: bool = False) -> Tensor:
        return ops.norm(self, p, dim=dim, keepdim=keepdim)
