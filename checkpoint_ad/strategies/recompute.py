"""Recompute: a region keeps only its inputs and is re-run when the backward sweep needs it.

The region runs once with recording on, so its tape entries (and the graph edges to every
tensor it used, arguments or captured by closure, leaf or not) exist as usual, but every value
they save is replaced by a small handle. The first handle the backward sweep unpacks re-runs the
region from its saved inputs, collecting the values in the same order, and hands them out; they
are dropped again once all were read. Gradients therefore flow through the original graph:
`backward()`, `grad()`, nesting, closures and keyword arguments work unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import events, random
from ..backend import to_device
from ..errors import RecomputeError
from ..grad_mode import enable_grad, is_grad_enabled
from ..origins import caller_origin, rerun_boundary, rerunning_from
from ..saved import SavedSlot, Strategy, buffer_for, current_packer, use_packer
from ..tensor import Tensor
from .kinds import LoopStrategy, RegionStrategy
from .policy import as_strategy
from .revolve import Plan, periodic_plan


@dataclass(frozen=True)
class Recompute(RegionStrategy, LoopStrategy):
    """Keep only a region's inputs; recompute its saved values during backward.

    As the strategy of a `scan`, every step is such a region: only the carries are kept, and
    each step is re-run with its tape when the backward sweep reaches it (the periodic plan
    with a period of one step). With ``debug=True`` the first run of a `checkpoint` region
    also keeps a copy of every saved value and the recompute checks that each one comes back
    equal (costly: for finding non-determinism).
    """

    debug: bool = False
    storage: Strategy | None = None

    def plan(self, n_steps: int) -> Plan:
        return periodic_plan(n_steps, 1)

    def __repr__(self) -> str:
        return f"Recompute(debug={self.debug})" if self.debug else "Recompute()"


class _Handle:
    __slots__ = ("index", "packer")

    def __init__(self, packer: RegionPacker, index: int) -> None:
        self.packer = packer
        self.index = index


class RegionPacker(Strategy):
    """Stands in for the saved values of one re-runnable region (or one step of a loop)."""

    lossless = True

    def __init__(self, region: Any, key: int, choose: Any) -> None:
        self.region = region
        self.key = key
        self.meta: list[tuple[tuple[int, ...], Any]] = []
        self.originals: list[Any] | None = [] if region.debug else None
        self.values: list[Any] | None = None
        self.unread = 0
        self._choose = choose

    def choose_form(self, prim: Any) -> Any:
        return self._choose(prim) if self._choose is not None else prim.forms[0]

    def pack(self, array: Any) -> _Handle:
        self.meta.append((tuple(array.shape), array.dtype))
        if self.originals is not None:
            self.originals.append(array.copy())
        return _Handle(self, len(self.meta) - 1)

    def unpack(self, handle: _Handle) -> Any:
        if self.values is None:
            self.region.materialize(self.key)
            self.unread = len(self.meta)
        assert self.values is not None
        value = self.values[handle.index]
        self.unread -= 1
        if self.unread <= 0:
            self.values = None  # everything read: drop until a later sweep asks again
        return value

    def stored_nbytes(self, handle: _Handle) -> int:
        return 0

    def accept(self, values: list[Any], what: str) -> None:
        """Take the values a re-run saved, after checking they match the first run."""
        if len(values) != len(self.meta):
            raise RecomputeError(
                f"recomputing {what} saved {len(values)} values, but its first run saved "
                f"{len(self.meta)}; the function must take the same path each time (does it "
                "branch on state that changed between forward and backward?)"
            )
        for i, (value, (shape, dtype)) in enumerate(zip(values, self.meta)):
            if tuple(value.shape) != shape or value.dtype != dtype:
                raise RecomputeError(
                    f"recomputing {what}: saved value #{i} came back as {value.dtype}"
                    f"{list(value.shape)}, but the first run saved {dtype}{list(shape)}; "
                    "the function must compute the same shapes and dtypes each time"
                )
            if self.originals is not None and not _same(value, self.originals[i]):
                raise RecomputeError(
                    f"recomputing {what}: saved value #{i} ({dtype}{list(shape)}) differs from "
                    "the first run's (debug=True check); the function is not deterministic "
                    "(unseeded randomness, or a captured tensor changed?)"
                )
        self.values = values


def _same(a: Any, b: Any) -> bool:
    return bool(np.array_equal(to_device(a, "cpu"), to_device(b, "cpu"), equal_nan=True))


class Collector(Strategy):
    """A packer that keeps values and remembers them in order (used while re-running)."""

    def __init__(self, choose: Any) -> None:
        self.values: list[Any] = []
        self._choose = choose

    def choose_form(self, prim: Any) -> Any:
        return self._choose(prim) if self._choose is not None else prim.forms[0]

    def pack(self, array: Any) -> Any:
        self.values.append(array)
        return array

    def unpack(self, stored: Any) -> Any:
        return stored


def _random_state() -> Any:
    return np.random.get_state()


class _Region:
    """One `checkpoint` call: its inputs, and how to re-run it."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        strategy: RegionStrategy,
        replay_rng: bool,
    ) -> None:
        self.fn = fn
        self.debug = strategy.debug
        self.replay_rng = replay_rng
        self.name = getattr(fn, "__qualname__", repr(fn))
        outer = current_packer()
        keep_with = strategy.storage or outer
        self.args = [self._keep(a, keep_with) for a in args]
        self.kwargs = {k: self._keep(v, keep_with) for k, v in kwargs.items()}
        # the generators' states, for the re-run to draw what the first run drew
        self.rng = _random_state() if replay_rng else None
        self.engine_state = random.get_state() if replay_rng else None
        self.packer = RegionPacker(self, 0, outer.choose_form)
        self.origin = caller_origin()  # what entries of `fn` re-run name, if it is ours

    def _keep(self, value: Any, packer: Strategy) -> Any:
        if not isinstance(value, Tensor):
            return ("value", value)
        if value._entry is None:
            packer = packer.for_leaf()  # the caller holds it anyway
        slot = SavedSlot("input", buffer_for(value, packer), value._version, None)
        return ("tensor", slot, value.requires_grad)

    def _restore(self, kept: Any) -> Any:
        if kept[0] == "value":
            return kept[1]
        _, slot, requires_grad = kept
        array = slot.unpack(lambda: f"the checkpointed region {self.name!r}")
        t = Tensor._wrap(array)
        t._requires_grad = requires_grad
        return t

    @rerun_boundary
    def materialize(self, key: int) -> None:
        with events.recomputing(self.name), rerunning_from(self.origin):
            args = [self._restore(a) for a in self.args]
            kwargs = {k: self._restore(v) for k, v in self.kwargs.items()}
            collector = Collector(self.packer._choose)
            if not self.replay_rng:
                with enable_grad(), use_packer(collector):
                    self.fn(*args, **kwargs)
            else:
                outer_rng = _random_state()
                np.random.set_state(self.rng)
                try:
                    with enable_grad(), use_packer(collector), random.replaying(
                        self.engine_state
                    ):
                        self.fn(*args, **kwargs)
                finally:
                    np.random.set_state(outer_rng)
            self.packer.accept(collector.values, f"checkpointed function {self.name!r}")


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    strategy: RegionStrategy | None = None,
    debug: bool = False,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    policy: Any = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; re-run it during backward.

    Tensors `fn` captures by closure get their gradients too. Randomness is replayed: the
    re-run draws what the first run drew from the engine's generator
    (`checkpoint_ad.random.generator()`, which `nn.Dropout` and the random factories use; exact
    in any thread) and from numpy's global random state (exact while one thread draws from it),
    so a checkpointed function computes what the plain one does.

    PyTorch's keywords are accepted and never passed to `fn`: `use_reentrant` is ignored (a
    region here always behaves like PyTorch's non-reentrant checkpoint: it works under
    `grad()`, with keyword arguments, and when no input requires grad);
    ``preserve_rng_state=False`` neither saves nor replays the generators' states (faster,
    for functions that draw nothing, or whose re-run may draw other numbers: it draws the
    next ones, and numpy's global state moves on past them, as in PyTorch). JAX's `policy`
    (`checkpoint_policies.dots_saveable`, ..., a callable answering per primitive, or a
    saved-value strategy) runs `fn` with the saved-value strategy the policy means instead of
    recomputing it
    (`nothing_saveable`, the default, recomputes); see `checkpoint_ad.strategies.jax_policies`.

    >>> import checkpoint_ad as cad
    >>> w = cad.tensor([0.5, -1.0], requires_grad=True)
    >>> y = cad.checkpoint(lambda h: cad.tanh(h * w), cad.tensor([1.0, 2.0]))
    >>> y.sum().backward()
    >>> w.grad.shape
    (2,)
    """
    if not callable(fn):
        raise TypeError(f"checkpoint needs a function to re-run, got {type(fn).__name__}")
    saving = as_strategy(policy)
    if saving is not None:
        if strategy is not None:
            raise TypeError(
                "checkpoint takes a region strategy= or a JAX-style policy=, not both"
            )
        with use_packer(saving):
            return fn(*args, **kwargs)
    if strategy is not None and not isinstance(strategy, RegionStrategy):
        raise TypeError(
            f"checkpoint(strategy=...) takes a region strategy such as Recompute(), got "
            f"{strategy!r}"
        )
    if not is_grad_enabled():
        return fn(*args, **kwargs)
    strategy = strategy or Recompute()
    if debug and not strategy.debug:
        strategy = replace(strategy, debug=True)
    region = _Region(fn, args, kwargs, strategy, bool(preserve_rng_state))
    with use_packer(region.packer):
        return fn(*args, **kwargs)


def checkpoint_sequential(
    functions: Sequence[Callable[[Any], Any]], segments: int | None = None, input: Any = None
) -> Any:
    """Run ``functions`` in order, checkpointing each of `segments` groups but the last.

    The default of round(sqrt(n)) segments keeps about 2*sqrt(n) layers' values at a time for
    one extra forward pass.
    """
    functions = list(functions)
    if not functions:
        raise ValueError("checkpoint_sequential needs at least one function")
    n = len(functions)
    segments = max(1, round(math.sqrt(n))) if segments is None else segments
    if not isinstance(segments, int) or not segments >= 1:
        raise ValueError(f"checkpoint_sequential: segments must be a positive int, got {segments}")
    segments = min(segments, n)
    size = math.ceil(n / segments)
    groups = [functions[i : i + size] for i in range(0, n, size)]

    def run(group: list[Callable[[Any], Any]], value: Any) -> Any:
        for f in group:
            value = f(value)
        return value

    value = input
    for group in groups[:-1]:
        value = checkpoint(run, group, value)
    return run(groups[-1], value)

