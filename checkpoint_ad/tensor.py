"""The user's value: an array plus what autograd needs to know about it, and its operators.

The state lives in `TensorBase` (tensor_base.py); this class adds what computes: Python
operators and methods, each a call into the op tables (`checkpoint_ad.ops`), in-place updates
guarded by version counters, and `backward`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import ops
from .autograd import backward as _backward
from .backend import is_array, namespace
from .entry import _NO_ATTRS, Entry, RemovableHandle, add_hook
from .errors import BackwardError, InplaceError, RequiresGradConversionError, ShapeError
from .grad_mode import _state, made_before_rerun, no_grad, refuse_trace, step_scope
from .ops.elementwise import ADD, DIVIDE, MULTIPLY, NEGATIVE, POWER, SUBTRACT
from .ops.shape import GETITEM, RESHAPE, TRANSPOSE
from .saved import VersionCounter, _watching, note_reads, pack_value
from .tape import next_sequence, record, refresh_view
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

    def _rederive(self) -> None:
        refresh_view(self)

    @classmethod
    def _wrap(
        cls, data: Any, entry: Any = None, index: int = 0, counter: VersionCounter | None = None
    ) -> Tensor:
        """Fast internal constructor: no checks, optional shared version counter (views)."""
        return make_tensor(data, entry, index, counter)

    # ----------------------------------------------------------------- operators
    # The arithmetic operators record their primitive directly: what `ops.add(self, other)`
    # does, without its two calls (they run once per operation of every user's loop).
    def __add__(self, other: Any) -> Tensor:
        return record(ADD, (self, other), _NO_ATTRS)

    def __radd__(self, other: Any) -> Tensor:
        return record(ADD, (other, self), _NO_ATTRS)

    def __sub__(self, other: Any) -> Tensor:
        return record(SUBTRACT, (self, other), _NO_ATTRS)

    def __rsub__(self, other: Any) -> Tensor:
        return record(SUBTRACT, (other, self), _NO_ATTRS)

    def __mul__(self, other: Any) -> Tensor:
        return record(MULTIPLY, (self, other), _NO_ATTRS)

    def __rmul__(self, other: Any) -> Tensor:
        return record(MULTIPLY, (other, self), _NO_ATTRS)

    def __truediv__(self, other: Any) -> Tensor:
        return record(DIVIDE, (self, other), _NO_ATTRS)

    def __rtruediv__(self, other: Any) -> Tensor:
        return record(DIVIDE, (other, self), _NO_ATTRS)

    def __pow__(self, other: Any) -> Tensor:
        return record(POWER, (self, other), _NO_ATTRS)

    def __rpow__(self, other: Any) -> Tensor:
        return record(POWER, (other, self), _NO_ATTRS)

    def __matmul__(self, other: Any) -> Tensor:
        return ops.matmul(self, other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return ops.matmul(other, self)

    def __neg__(self) -> Tensor:
        return record(NEGATIVE, (self,), _NO_ATTRS)

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
        inputs: Sequence[Tensor] | None = None,
    ) -> None:
        """Accumulate d(self)/d(leaf) into `.grad` of every leaf that requires grad (only
        into `inputs`, leaves or not, when given)."""
        _backward(self, gradient, retain_graph, create_graph, inputs)

    def register_hook(self, hook: Callable[[Tensor], Tensor | None]) -> RemovableHandle:
        """Call `hook(grad)` with this tensor's gradient during backward; a Tensor it returns
        replaces the gradient. For a leaf, hooks see the gradient summed over the pass,
        before it reaches `.grad`. Returns a handle whose `.remove()` unregisters it.

        >>> import checkpoint_ad as cad
        >>> x = cad.tensor([1.0, 2.0], requires_grad=True)
        >>> handle = x.register_hook(lambda g: g * 10)
        >>> (x * x).sum().backward()
        >>> x.grad.tolist()
        [20.0, 40.0]
        >>> handle.remove()
        """
        refuse_trace("registers a tensor hook")
        scope = _state.step_scope
        if scope is not None:
            # a checkpointed loop's step run for its values alone: the run of the step that
            # the reverse pulls back registers the hook again, and it fires there; step 0's
            # carry stands for the caller's tensor, which holds the hook (see `hook_target`);
            # a tensor from before the loop holds one slot per registration (`slot_hook`)
            handle = scope.slot_hook(self, hook)
            if handle is not None:
                return handle
            target = scope.hook_target(self)
            if target is None:
                return add_hook({}, hook)
            if target is not self:  # registered as in the scope the loop runs in
                with step_scope(getattr(scope, "outer", None)):
                    return target.register_hook(hook)
        if not self._current()._requires_grad:
            raise BackwardError(
                f"cannot register a hook on a tensor that does not require grad ({self.dtype}"
                f"{list(self.shape)}): it gets no gradient; set requires_grad=True first"
            )
        if made_before_rerun(self):  # a checkpointed region's re-run: registered already
            return add_hook({}, hook)
        if self._entry is None:
            target = self if self._leaf_target is None else self._leaf_target
            if target._hooks is None:
                target._hooks = {}
            handle = add_hook(target._hooks, hook)
        else:
            handle = add_hook(self._entry._hooks().outputs.setdefault(self._index, {}), hook)
        if scope is not None:
            scope.note_hook(handle)
        return handle

    # ----------------------------------------------------------------- in-place
    def _tracked(self, other: Any) -> bool:
        other_grad = isinstance(other, Tensor) and other._requires_grad
        return _state.grad_enabled and (self._requires_grad or other_grad)

    def _inplace(self, op_name: str, compute: Any, other: Any = None) -> Tensor:
        """Change this tensor's storage in place, as PyTorch does: views and detached aliases
        see the new values and share the bumped version counter (so values saved before are
        caught at backward), and the history is rebased onto the recorded operation; on a
        view, the base's history is rebased onto an out-of-place write of the view into it."""
        if _state.inplace_watch is not None:
            _state.inplace_watch(self)
        self._current()
        if not self._tracked(other):
            with no_grad():
                result = self._same_shape(op_name, compute(self))
            if result.dtype != self.dtype:
                result = result.astype(self.dtype)
            self._write(op_name, result._data)
            self._version.value += 1
            return self
        if self._version.scanned_row:
            raise InplaceError(
                f"{op_name} on a step's row of a scan's xs ({self.dtype}{list(self.shape)}) "
                "while recording a gradient through it (the row or the other operand requires "
                "grad): a step's x is one of the views `for x in xs` gives (PyTorch's unbind), "
                "which may not be changed in place then, under any loop strategy; use an "
                "out-of-place op (x = x * 2) or change a copy (x = x.clone())"
            )
        if self._entry is None and self._requires_grad:
            raise InplaceError(
                f"{op_name} on a leaf tensor that requires grad ({self.dtype}"
                f"{list(self.shape)}) would lose its history; do it under "
                "checkpoint_ad.no_grad() (e.g. an optimizer step) or use an out-of-place op"
            )
        base = self._base
        if base is not None and not _shares_storage(self._data, base._data):
            # advanced indexing copies: not a view after all, so it changes alone
            self._base = self._view = None
            self._version = VersionCounter(self._version.value)
            base = None
        if base is not None and base._entry is None and base._requires_grad:
            raise InplaceError(
                f"{op_name} on a view of a leaf tensor that requires grad ({base.dtype}"
                f"{list(base.shape)}) would change the leaf; do it under checkpoint_ad.no_grad() "
                "or apply an out-of-place op to a .clone() of the leaf"
            )
        mark = next_sequence()
        result = self._inplace_result(op_name, compute)
        _protect_saved(result, self._version, mark)
        if base is None:
            self._write(op_name, result._data)
            self._rebase(result)
        else:
            new_base = _put(base, self._view[0], result, op_name)  # type: ignore[index]
            self._write(op_name, result._data)  # the view's storage is the base's
            base._rebase(new_base)
            refresh_view(self)
        self._version.value += 1
        return self

    def _inplace_result(self, op_name: str, compute: Any) -> Tensor:
        """The recorded out-of-place value of an in-place op, in this tensor's shape and
        dtype, and still carrying this tensor's history when the op itself drops it."""
        result = self._same_shape(op_name, compute(self))
        if result.dtype != self.dtype:
            result = ops.astype(result, self.dtype)
        if self._requires_grad and not result._requires_grad:
            # zero_() or copy_(constant): the result still depends on self, with gradient 0
            zero = ops.zeros_like(self)
            result = ops.where(ops.not_equal(zero, zero), self, result)
        return result

    def _same_shape(self, op_name: str, result: Tensor) -> Tensor:
        if result.shape != self.shape:
            raise ShapeError(
                f"{op_name} would make a result of shape {list(result.shape)} in a tensor of "
                f"shape {list(self.shape)}; in-place ops cannot change the shape: broadcast "
                "the other operand to it, or use the out-of-place op"
            )
        return result

    def _write(self, op_name: str, data: Any) -> None:
        try:
            self._data[...] = data
        except (ValueError, TypeError) as exc:
            raise InplaceError(
                f"{op_name} cannot write into this {self.dtype}{list(self.shape)} tensor's "
                f"storage ({exc}); a broadcast view is read-only: .clone() it first"
            ) from exc

    def _rebase(self, result: TensorBase) -> None:
        """Make this tensor the output of `result`'s entry (its storage is kept); a
        retain_grad() moves to the new version, as in PyTorch."""
        retained = self._entry.retained if self._entry is not None else None
        ref = retained.pop(self._index, None) if retained else None
        self._entry = result._entry
        self._index = result._index
        self._requires_grad = result._requires_grad
        self._saved_ref = None
        if ref is not None and ref() is self and self._entry is not None:
            self.retain_grad()

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
        body = np.array2string(self._host_values(), separator=", ", threshold=20, precision=4)
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

    # ----------------------------------------------------------------- array interop
    def _plain_array(self, what: str) -> Any:
        """The underlying array, refused for a tensor that requires grad: the array would carry
        on without the graph, and gradients through what is done with it would be lost."""
        refuse_trace(f"reads a tensor's values into Python ({what})")
        if self._requires_grad:
            raise RequiresGradConversionError(
                f"cannot convert a tensor that requires grad ({self.dtype}{list(self.shape)} on "
                f"{self.device}) with {what}: the result would silently leave the graph; call "
                "t.detach().numpy() (or pass t.detach()) to take its values"
            )
        if _watching:  # a checkpointed region's first run: its re-run reads it again
            note_reads(Tensor.__array__, (self,), None, False)
        return self._data

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """NumPy's conversion hook, so ``np.asarray(t)`` gives the values as one array (not an
        object array of 0-d tensors); device arrays are copied to the host.

        >>> import numpy as np, checkpoint_ad as cad
        >>> np.asarray(cad.tensor([1.0, 2.0]))
        array([1., 2.], dtype=float32)
        """
        data = self._plain_array("np.asarray / __array__")
        host = data if isinstance(data, np.ndarray) else self.numpy()
        if copy is False and (host is not data or (dtype is not None and host.dtype != dtype)):
            raise ValueError(
                f"np.asarray(copy=False) of a {self.dtype} tensor on {self.device} needs a copy "
                "(to the host or to another dtype); pass copy=None or copy=True"
            )
        if dtype is not None:
            host = host.astype(dtype, copy=False)
        return np.array(host, copy=True) if copy else host

    def __dlpack__(self, **kwargs: Any) -> Any:
        """DLPack export (``np.from_dlpack(t)``, ``torch.from_dlpack(t)``), delegated to the
        underlying array; the same refusal as `__array__` for tensors that require grad."""
        data = self._plain_array("DLPack (__dlpack__)")
        if not hasattr(data, "__dlpack__"):
            raise TypeError(f"the {type(data).__name__} behind this tensor has no DLPack "
                            "export; use t.numpy()")
        return data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """The (device type, device id) pair of the underlying array, for DLPack consumers."""
        if not hasattr(self._data, "__dlpack_device__"):
            raise TypeError(f"the {type(self._data).__name__} behind this tensor has no DLPack "
                            "export; use t.numpy()")
        return self._data.__dlpack_device__()

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

    def contiguous(self) -> Tensor:
        """This tensor (PyTorch's layout call: every op here accepts any layout)."""
        return self

    def tril(self, diagonal: int = 0) -> Tensor:
        return ops.tril(self, diagonal)

    def triu(self, diagonal: int = 0) -> Tensor:
        return ops.triu(self, diagonal)

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

    amax = ops.amax
    amin = ops.amin

    def var(self, dim: Any = None, unbiased: bool | None = None, keepdim: bool = False, *,
            correction: int | None = None, axis: Any = None, ddof: int | None = None,
            keepdims: bool = False) -> Tensor:
        """Variance over `dim`, PyTorch's method: dividing by n - 1 unless `correction=` (or
        `unbiased=False`, or numpy's `ddof=`) says otherwise. The function `cad.var` keeps
        numpy's default of n.

        >>> import checkpoint_ad as cad
        >>> x = cad.tensor([1.0, 2.0, 3.0, 4.0])
        >>> round(x.var().item(), 4), x.var(correction=0).item()
        (1.6667, 1.25)
        """
        return _torch_statistic(ops.var, self, dim, unbiased, keepdim, correction, axis, ddof,
                                keepdims)

    def std(self, dim: Any = None, unbiased: bool | None = None, keepdim: bool = False, *,
            correction: int | None = None, axis: Any = None, ddof: int | None = None,
            keepdims: bool = False) -> Tensor:
        """Standard deviation, the square root of `var` (same keywords and PyTorch's default
        correction of 1); its gradient is 0 where it is 0, as PyTorch's.

        >>> import checkpoint_ad as cad
        >>> cad.tensor([1.0, 3.0]).std(correction=0).item()
        1.0
        """
        return _torch_statistic(ops.std, self, dim, unbiased, keepdim, correction, axis, ddof,
                                keepdims)

    def detach_(self) -> Tensor:
        """Detach in place, as PyTorch's ``detach_``: this tensor becomes a leaf that does not
        require grad (its storage, values and ``.grad`` are kept). Refused on a view, as in
        PyTorch (its base would still carry the history); use ``detach()`` there.

        >>> import checkpoint_ad as cad
        >>> x = cad.tensor([1.0, 2.0], requires_grad=True)
        >>> y = (x * 2).detach_()
        >>> y.is_leaf, y.requires_grad, y.grad_fn
        (True, False, None)
        """
        if self._base is not None:
            raise InplaceError(
                f"detach_() on a view ({self.dtype}{list(self.shape)}) cannot detach it in "
                "place: it shares its base's storage and history; use .detach() instead"
            )
        refuse_trace("detaches a tensor in place (detach_)")
        entry = self._entry
        if entry is not None and entry.retained:
            entry.retained.pop(self._index, None)
        self._entry = None
        self._index = 0
        self._requires_grad = False
        self._leaf_target = None
        self._saved_ref = None
        return self


def _torch_statistic(fn: Any, x: Tensor, dim: Any, unbiased: bool | None, keepdim: bool,
                     correction: int | None, axis: Any, ddof: int | None, keepdims: bool) -> Any:
    """`fn` (ops.var or ops.std) with PyTorch's method arguments and default correction 1."""
    if isinstance(dim, bool):  # PyTorch's older x.var(unbiased)
        dim, unbiased = None, dim
    if correction is None and unbiased is None and ddof is None:
        correction = 1
    return fn(x, axis, 0 if ddof is None else ddof, keepdims, dim=dim, keepdim=keepdim or None,
              correction=correction, unbiased=unbiased)


def _shares_storage(a: Any, b: Any) -> bool:
    """Whether two arrays may overlap in memory (True where the library cannot say)."""
    if isinstance(a, np.ndarray):
        return bool(np.may_share_memory(a, b))
    library = sys.modules.get(type(a).__module__.split(".")[0])
    check = getattr(library, "may_share_memory", None)  # cupy has it; others: assume a view
    return True if check is None else bool(check(a, b))


def _protect_saved(result: TensorBase, counter: VersionCounter, mark: int) -> None:
    """Give the entries an in-place op just recorded (after `mark`) their own copy of any
    value they saved from the storage about to be overwritten: they need the old value,
    as PyTorch's in-place rules save `original_self`."""
    stack = [result._entry] if result._entry is not None else []
    seen: set[int] = set()
    while stack:
        entry = stack.pop()
        if entry.seq <= mark or id(entry) in seen:
            continue
        seen.add(id(entry))
        slots = entry.slots or ()
        changed = False
        for slot in slots:
            buffer = slot.buffer
            if slot.counter is not counter or buffer is None:
                continue
            array = buffer.packed if buffer.source is None else buffer.source()
            if array is not None:
                copied = namespace(array).asarray(array, copy=True)
                slot.buffer = pack_value(copied, buffer.packer)
            slot.counter = None
            changed = True
        if changed:
            entry.slots = slots  # an inline value's slot is made on reading: store it
        stack.extend(e[0] for e in entry.edges if e is not None and type(e[0]) is Entry)


def _unview(prim: Any, base: Tensor, value: Tensor, attrs: dict[str, Any], op_name: str) -> Any:
    """`base` with the part that view primitive `prim` selects replaced by `value`."""
    if prim is GETITEM:
        return ops.setitem(base, attrs["index"], value)
    if prim is RESHAPE:
        return ops.reshape(value, attrs["source"])
    if prim is TRANSPOSE:
        axes = attrs["axes"]
        return ops.transpose(value, tuple(sorted(range(len(axes)), key=axes.__getitem__)))
    raise InplaceError(
        f"{op_name} on a view made by {prim.name!r} cannot be written back into its base "
        "(several elements share one memory location); .clone() the view first"
    )


def _put(base: Tensor, chain: Any, value: Tensor, op_name: str) -> Any:
    """Out-of-place: `base` with the view that `chain` makes of it replaced by `value`
    (recorded, so the base's new history leads through the view's new value)."""
    (prim, attrs), rest = chain[0], chain[1:]
    if rest:
        value = _put(prim(base, **attrs), rest, value, op_name)
    return _unview(prim, base, value, attrs, op_name)
