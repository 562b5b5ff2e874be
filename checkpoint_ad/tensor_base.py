"""What autograd knows about a value: its array, version counter, and the entry that made it.

`TensorBase` holds that state and nothing that computes. Its one subclass made by the engine,
`Tensor` (tensor.py), adds the operators and methods, which call the op tables; the tape and
the op tables make results with `make_tensor`, so they depend on this module and never on
tensor.py. That split is what keeps the engine free of an import cycle.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from .backend import device_name, is_array, is_floating, namespace, resolve_dtype, to_device
from .errors import BackwardError, DTypeError
from .grad_mode import _state, made_before_rerun, refuse_trace
from .saved import VersionCounter, _watching, note_reads

_new_object = object.__new__


class TensorBase:
    """The state of a tensor; see `checkpoint_ad.Tensor` for the user-facing class."""

    __slots__ = (
        "__weakref__",
        "_base",
        "_data",
        "_entry",
        "_hooks",
        "_index",
        "_inference",
        "_leaf_target",
        "_requires_grad",
        "_saved_ref",
        "_version",
        "_view",
        "grad",
    )

    _made_by_engine: ClassVar[type[TensorBase]]

    _data: Any
    _entry: Any
    _index: int
    _requires_grad: bool
    _version: VersionCounter
    _leaf_target: TensorBase | None
    _inference: bool
    _base: TensorBase | None  # the tensor whose storage this view shares (views only)
    # views only: (the view primitives and attributes that make it from _base, the entry
    # _base had then); a differing base entry means the base was changed in place since
    _view: tuple[tuple[tuple[Any, dict[str, Any]], ...], Any] | None
    _hooks: dict[int, Any] | None  # a leaf's gradient hooks (non-leaves: on their entry)
    grad: Any

    def __init_subclass__(cls, made_by_engine: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if made_by_engine:
            TensorBase._made_by_engine = cls

    def _init(self, data: Any, entry: Any, index: int, counter: VersionCounter) -> None:
        self._data = data
        self._entry = entry
        self._index = index
        self._requires_grad = entry is not None
        self._version = counter
        self._leaf_target = None
        self._inference = _state.inference
        self._base = None
        self._view = None
        self._saved_ref = None
        self._hooks = None
        self.grad = None

    # ----------------------------------------------------------------- attributes
    @property
    def data(self) -> Any:
        """The backend array (numpy or cupy). Changing it bypasses version checks."""
        if _watching:  # a checkpointed region's first run: its re-run reads it again
            note_reads(TensorBase.data.fget, (self,), None, False)
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
        return self._current()._requires_grad

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
        return self._current()._entry is None

    @property
    def grad_fn(self) -> Any:
        """The tape entry that produced this tensor (None for leaves)."""
        return self._current()._entry

    def _current(self) -> Any:
        """This tensor, its history re-derived first if it is a view whose base was changed
        in place since the view was made (as PyTorch regenerates a view's grad_fn)."""
        base = self._base
        if base is not None and self._view[1] is not base._entry:  # type: ignore[index]
            self._rederive()
        return self

    def _rederive(self) -> None:
        raise NotImplementedError("the engine's Tensor re-records views (tape.refresh_view)")

    @property
    def version(self) -> int:
        """How many in-place changes its storage has seen."""
        return self._version.value

    def _element_count(self) -> int:
        count = 1
        for dim in self._data.shape:
            count *= dim
        return count

    # ----------------------------------------------------------------- conversions
    def numpy(self) -> np.ndarray:
        """The values as a numpy array (copied to the host for GPU tensors)."""
        if _watching:  # a checkpointed region's first run: its re-run reads it again
            note_reads(TensorBase.numpy, (self,), None, False)
        return self._host_values()

    def _host_values(self) -> np.ndarray:
        """`numpy()` without telling a checkpointed region (a print reads no value the
        region computes with)."""
        refuse_trace("reads a tensor's values into Python (numpy/item/tolist/bool/float)")
        return to_device(self._data, "cpu")

    def item(self) -> float:
        if self._element_count() != 1:
            raise ValueError(
                f"item() needs a tensor with exactly one element, this one has shape "
                f"{list(self.shape)}; index or reduce it first (e.g. .sum())"
            )
        return self.numpy().reshape(()).item()

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def detach(self) -> Any:
        """The same storage without history: shares the version counter, so an in-place
        change through either is seen by both and caught where it was saved."""
        return make_tensor(self._data, counter=self._version)

    def requires_grad_(self, requires_grad: bool = True) -> Any:
        self.requires_grad = requires_grad
        return self

    def retain_grad(self) -> Any:
        """Fill `.grad` of this non-leaf tensor during `backward()` as for leaves."""
        refuse_trace("calls retain_grad()")
        scope = _state.step_scope
        if scope is not None and scope.retain(self._current()):  # a checkpointed loop's step
            return self
        if self._current()._entry is None:
            if not self._requires_grad:
                raise BackwardError(
                    "retain_grad() on a tensor that does not require grad has no effect; "
                    "set requires_grad=True on it or on the tensors it is computed from"
                )
            return self
        if made_before_rerun(self):  # a checkpointed region's re-run: retained already
            return self
        if self._entry.retained is None:
            self._entry.retained = {}
        self._entry.retained[self._index] = weakref.ref(self)
        return self

    __hash__ = object.__hash__


def make_tensor(
    data: Any, entry: Any = None, index: int = 0, counter: VersionCounter | None = None
) -> Any:
    """A `Tensor` over `data` with no checks (the engine's constructor); views pass the
    version counter they share."""
    if type(data) is not np.ndarray and isinstance(data, np.generic):  # numpy's 0-d results
        data = np.asarray(data)
    t = _new_object(TensorBase._made_by_engine)
    # `_init`, written out: every recorded op makes a tensor here
    t._data = data
    t._entry = entry
    t._index = index
    t._requires_grad = entry is not None
    if counter is None:
        counter = _new_object(VersionCounter)  # `VersionCounter()` without its __init__ call
        counter.value = 0
    t._version = counter
    t._leaf_target = t._base = t._view = t._saved_ref = t._hooks = t.grad = None
    t._inference = _state._inference
    return t



def as_tensor_like(value: Any, like: Sequence[Any]) -> Any:
    """`value` as a tensor; Python scalars take the dtype and device of the first tensor in
    `like` (which must hold one), so that `x * 2` keeps x's float32."""
    if isinstance(value, TensorBase):
        return value
    ref = next(t for t in like if isinstance(t, TensorBase))
    ref_data = ref._data
    if type(ref_data) is np.ndarray and isinstance(value, (int, float)) and not isinstance(
        value, bool
    ):  # the common `x * 2.0` on numpy: skip the generic path
        if ref_data.dtype.kind == "f" or isinstance(value, int):
            return make_tensor(np.asarray(value, dtype=ref_data.dtype))
        return make_tensor(np.asarray(value))
    if is_array(value) or isinstance(value, np.generic):
        return make_tensor(np.asarray(value) if isinstance(value, np.generic) else value)
    xp = namespace(ref_data)
    device = getattr(ref_data, "device", None)
    if isinstance(value, bool) or (not is_floating(ref.dtype) and isinstance(value, float)):
        return make_tensor(xp.asarray(value, device=device))
    try:
        data = xp.asarray(value, dtype=ref.dtype, device=device)
    except TypeError:  # namespaces without a device keyword
        data = xp.asarray(value, dtype=ref.dtype)
    return make_tensor(data)


def tensor(
    data: Any, requires_grad: bool = False, dtype: Any = None, device: str | None = None
) -> Any:
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
    if isinstance(data, TensorBase):
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
            data = xp.astype(data, resolve_dtype(xp, dtype))
    else:
        host = np.asarray(data, dtype=resolve_dtype(np, dtype) or np.float32)
        data = to_device(host, device or "cpu")
    if not is_array(data):
        raise TypeError(f"tensor() could not make an array from {type(data).__name__}")
    result = make_tensor(data)
    result.requires_grad = requires_grad
    return result


def as_tensor(value: Any, like: Sequence[Any] = ()) -> Any:
    """`value` as a Tensor; Python scalars take the dtype and device of the first tensor in
    `like` so that `x * 2` keeps x's float32."""
    if isinstance(value, TensorBase):
        return value  # type: ignore[return-value]
    if any(isinstance(t, TensorBase) for t in like):
        return as_tensor_like(value, like)
    return tensor(value)
