"""Custom differentiable functions with a hand-written backward.

Their saved tensors go through the same saving path as built-in primitives, so every storage
strategy (and the profiler) sees them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .backend import namespace
from .errors import BackwardError, InplaceError
from .grad_mode import _state, enable_grad, no_grad
from .saved import SavedSlot, _watching, current_packer, note_reads
from .tape import Entry, add_entry, edge_of, save_tensor, unpack_saved
from .tensor import Tensor


class FunctionCtx:
    """What `forward` leaves for `backward`: saved tensors and any attributes you set."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self._to_save: tuple[Any, ...] | None = ()
        self._saved_count = 0
        self._entry: Entry | None = None  # set only while backward runs (no reference cycle)
        self._create_graph = False
        self._dirty: tuple[Any, ...] = ()
        self._non_differentiable: tuple[Any, ...] = ()
        self._materialize = True

    def mark_dirty(self, *tensors: Any) -> None:
        """Declare inputs that forward modified in place (and returns): the input tensors
        themselves become the outputs, with this function as their history."""
        self._dirty = tensors

    def mark_non_differentiable(self, *outputs: Any) -> None:
        """Declare outputs that carry no gradient (indices, masks): they will not require
        grad, and backward receives zeros for them (None without materialized grads)."""
        self._non_differentiable = outputs

    def set_materialize_grads(self, value: bool) -> None:
        """With False, backward receives None (not zeros) for outputs that got no gradient,
        so it can skip work for them."""
        self._materialize = bool(value)

    def save_for_backward(self, *tensors: Any) -> None:
        """Keep these tensors (inputs or outputs of forward, or None) for backward."""
        for t in tensors:
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(
                    f"save_for_backward takes Tensors or None, got {type(t).__name__}; "
                    "store other values as attributes of ctx"
                )
        self._to_save = tensors

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        """The saved tensors, unpacked (available in backward)."""
        entry = self._entry
        if entry is None:
            if self._to_save is None:
                raise BackwardError(
                    "saved_tensors can be read in forward (what was passed) or inside backward; "
                    "outside backward the saved values live on the tape only"
                )
            return self._to_save
        values = unpack_saved(entry, self._create_graph)
        result = []
        for i in range(self._saved_count):
            value = values.get(f"saved{i}")
            if value is None:
                result.append(None)
            else:
                result.append(value if isinstance(value, Tensor) else Tensor._wrap(value))
        return tuple(result)


class _FunctionOp:
    """Adapter that lets the backward sweep call a Function's backward like a primitive's."""

    def __init__(self, cls: type[Function], ctx: FunctionCtx, tensor_positions: list[int]):
        self.cls = cls
        self.ctx = ctx
        self.positions = tensor_positions
        self.name = cls.__name__

    def backward(
        self, entry: Entry, grads: list[Any], create_graph: bool, retain_graph: bool = False
    ) -> list[Any]:
        ctx = self.ctx
        ctx._create_graph = create_graph
        present = next(g for g in grads if g is not None)
        xp = namespace(present._data if isinstance(present, Tensor) else present)
        wrapped = []
        for g, (shape, dtype) in zip(grads, entry.out_meta):
            if g is None:
                if not ctx._materialize:
                    wrapped.append(None)
                    continue
                g = xp.zeros(shape, dtype=dtype)
            wrapped.append(g if isinstance(g, Tensor) else Tensor._wrap(g))
        mode = enable_grad() if create_graph else no_grad()
        ctx._entry = entry
        try:
            with mode:
                result = self.cls.backward(ctx, *wrapped)
        finally:
            ctx._entry = None
        result = result if isinstance(result, tuple) else (result,)
        n_args = ctx._n_args  # type: ignore[attr-defined]
        if len(result) > n_args and all(g is None for g in result[n_args:]):
            result = result[:n_args]  # trailing Nones for defaulted arguments are fine
        if len(result) != n_args:  # type: ignore[attr-defined]
            raise BackwardError(
                f"{self.name}.backward returned {len(result)} gradients, but forward took "
                f"{ctx._n_args} arguments; return one per argument (None for non-tensors)"  # type: ignore[attr-defined]
            )
        out = []
        for position, edge in zip(self.positions, entry.edges):
            g = result[position]
            if g is None or edge is None:
                out.append(None)
                continue
            if not isinstance(g, Tensor):
                raise BackwardError(
                    f"{self.name}.backward returned {type(g).__name__} for argument "
                    f"{position}; return Tensors (or None)"
                )
            out.append(g if create_graph else g._data)
        return out


class Function:
    """Subclass with static `forward(ctx, *args)` and `backward(ctx, *grads)`; call `.apply`.

    >>> import checkpoint_ad as cad
    >>> class Square(cad.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x * x
    ...     @staticmethod
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return 2 * x * g
    >>> x = cad.tensor(3.0, requires_grad=True)
    >>> Square.apply(x).backward()
    >>> x.grad.item()
    6.0
    """

    @staticmethod
    def forward(ctx: FunctionCtx, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("subclasses of Function must define a static forward")

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Any) -> Any:
        raise NotImplementedError("subclasses of Function must define a static backward")

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        positions = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        tensors = [args[i] for i in positions]
        needs = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        ctx = FunctionCtx(needs)
        ctx._n_args = len(args)  # type: ignore[attr-defined]
        with no_grad():
            raw = cls.forward(ctx, *args, **kwargs)
        single = not isinstance(raw, (tuple, list))
        outputs = (raw,) if single else tuple(raw)
        for i, o in enumerate(outputs):
            if not isinstance(o, Tensor):
                raise TypeError(
                    f"{cls.__name__}.forward must return Tensors, output {i} is "
                    f"{type(o).__name__}"
                )
        if _watching:  # a checkpointed region's first run: what it reads from outside
            note_reads(cls, tensors, None, False)
        if not (_state.grad_enabled and any(needs)):
            return raw
        packer = current_packer()
        to_save = ctx._to_save or ()

        def save(entry: Entry, results: list[Any]) -> tuple[SavedSlot, ...]:
            slots = []
            for i, t in enumerate(to_save):
                if t is None:
                    continue
                own = next((k for k, o in enumerate(outputs) if o is t), None)
                if own is not None:
                    slots.append(save_tensor(results[own], f"saved{i}", packer, entry, own))
                else:
                    slots.append(save_tensor(t, f"saved{i}", packer, entry, edge_of(t)))
            return tuple(slots)

        dirty = _check_dirty(cls.__name__, ctx._dirty, tensors, outputs)
        op = _FunctionOp(cls, ctx, positions)
        edges = tuple(edge_of(t._current()) for t in tensors)
        results = add_entry(op, edges, [o._data for o in outputs], {}, save)
        ctx._saved_count = len(to_save)
        ctx._to_save = None
        for i in dirty:
            results[i] = _rebase_dirty(outputs[i], results[i])
        for i, o in enumerate(outputs):
            if any(o is n for n in ctx._non_differentiable):
                results[i] = Tensor._wrap(o._data, counter=results[i]._version)
        return results[0] if single else results



def _check_dirty(
    name: str, dirty: tuple[Any, ...], inputs: list[Any], outputs: tuple[Any, ...]
) -> list[int]:
    """Output positions of the inputs marked dirty, after checking they may be rebased."""
    positions = []
    for t in dirty:
        if not any(t is i for i in inputs):
            raise BackwardError(
                f"{name}.forward marked a tensor dirty that is not one of its inputs; "
                "mark_dirty takes the inputs that forward modified in place"
            )
        position = next((k for k, o in enumerate(outputs) if o is t), None)
        if position is None:
            raise BackwardError(
                f"{name}.forward modified an input in place (mark_dirty) but did not return "
                "it; return the modified input as an output"
            )
        if t._entry is None and t._requires_grad:
            raise InplaceError(
                f"{name}.forward modified a leaf tensor that requires grad in place "
                f"({t.dtype}{list(t.shape)}); that would lose its history: pass a .clone()"
            )
        if t._base is not None:
            raise InplaceError(
                f"{name}.forward modified a view in place (mark_dirty); that is only "
                "supported for tensors that own their storage: pass a .clone()"
            )
        positions.append(position)
    return positions


def _rebase_dirty(t: Tensor, result: Tensor) -> Tensor:
    """Make input `t`, modified in place by forward, the function's output: its storage and
    version counter stay (so values saved from it earlier are caught), its history moves."""
    t._version.value += 1  # even if forward bypassed the counter (writing .data)
    entry = result._entry
    t._rebase(result)
    for slot in entry.slots or ():
        if slot.edge == result._index and isinstance(slot.edge, int):
            slot.counter = t._version  # saved as an output: later changes of t are caught
            slot.version = t._version.value
    return t


class _OnceDifferentiated:
    """The history of a `once_differentiable` backward's results: differentiating them
    again raises instead of silently giving zero."""

    def __init__(self, name: str) -> None:
        self.name = f"{name}.backward"

    def backward(
        self, entry: Entry, grads: list[Any], create_graph: bool, retain_graph: bool = False
    ) -> list[Any]:
        raise BackwardError(
            f"{self.name} is decorated with once_differentiable, so its result cannot be "
            "differentiated again (as asked by a higher-order gradient); write that backward "
            "with differentiable operations and drop the decorator"
        )


def once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a `Function.backward` that cannot itself be differentiated (it uses raw arrays,
    or is not worth differentiating): it runs without recording, and a higher-order
    gradient through it raises `BackwardError` instead of silently giving zero.

    >>> import checkpoint_ad as cad
    >>> class Square(cad.Function):
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         ctx.save_for_backward(x)
    ...         return x * x
    ...     @staticmethod
    ...     @cad.once_differentiable
    ...     def backward(ctx, g):
    ...         (x,) = ctx.saved_tensors
    ...         return 2 * x * g
    >>> x = cad.tensor(3.0, requires_grad=True)
    >>> (g,) = cad.grad(Square.apply(x), [x], create_graph=True)
    >>> g.item()
    6.0
    >>> cad.grad(g, [x])
    Traceback (most recent call last):
    ...
    checkpoint_ad.errors.BackwardError: Square.backward is decorated with once_differentiable...
    """

    @functools.wraps(backward)
    def wrapper(ctx: FunctionCtx, *grads: Any) -> Any:
        if not ctx._create_graph:
            return backward(ctx, *grads)
        with no_grad():
            result = backward(ctx, *grads)
        entry = ctx._entry
        edges = tuple(
            e
            for e in (*(edge_of(g) for g in grads if isinstance(g, Tensor)), *entry.edges)
            if e is not None
        )
        if not edges:
            return result
        op = _OnceDifferentiated(entry.op.name)
        single = not isinstance(result, tuple)
        wrapped = tuple(
            add_entry(op, edges, [r._data])[0] if isinstance(r, Tensor) else r
            for r in ((result,) if single else result)
        )
        return wrapped[0] if single else wrapped

    return wrapper
