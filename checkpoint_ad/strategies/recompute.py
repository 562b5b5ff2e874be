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
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import events, random
from ..backend import nbytes as array_nbytes
from ..backend import to_device
from ..entry import Entry
from ..errors import RecomputeError, SavedValueModifiedError
from ..grad_mode import (
    _state,
    enable_grad,
    is_grad_enabled,
    made_before_rerun,
    refuse_trace,
    rerunning_region,
)
from ..origins import NO_ORIGIN, caller_origin, origin_text, rerun_boundary, rerunning_from
from ..pytree import flatten
from ..saved import (
    KEEP,
    PackedBuffer,
    SavedSlot,
    Strategy,
    buffer_for,
    current_packer,
    use_packer,
    watching_reads,
)
from ..tape import edge_of, graph_tensor, next_sequence
from ..tensor import Tensor
from .kinds import LoopStrategy, RegionStrategy
from .plans.revolve import Plan, periodic_plan
from .policy import NamesPolicy, as_strategy


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


class _Kept:
    """A value the region keeps rather than recomputes, in `strategy`'s stored form: one its
    policy names (`checkpoint_policies.save_only_these_names`, ...), or one packed after the
    first run ended (a loop inside the region re-tapes its steps for its own backward, when
    the region was already re-run: the value belongs to that backward, kept as it is)."""

    __slots__ = ("nbytes", "stored", "strategy")

    def __init__(self, strategy: Strategy, array: Any) -> None:
        self.strategy = strategy
        self.stored = strategy.pack(array)
        measured = strategy.stored_nbytes(self.stored)
        self.nbytes = array_nbytes(array) if measured is None else int(measured)

    def again(self) -> _Kept:
        """The same stored form for another slot saving the same value: its bytes are
        counted once, with the first."""
        twin = _Kept.__new__(_Kept)
        twin.strategy, twin.stored, twin.nbytes = self.strategy, self.stored, 0
        return twin


class RegionPacker(Strategy):
    """Stands in for the saved values of one re-runnable region.

    A re-run serves one backward sweep: each value is handed out as often as the region's
    entries hold it (counted when the first run ends, `close`) and let go after its last read,
    so the region runs again only for a value the sweep reads after that (a second sweep
    with `retain_graph`, or an entry the count could not see).

    While the first run lasts, every saved slot gets a value of its own (`shares_buffers`),
    even for a tensor saved before: the re-run's tensors are not the same objects as the
    first run's (each argument is restored on its own, while the first run may have been
    given one tensor twice, or one its function also captures), so a count of distinct
    tensors would differ between the runs, while a count of slots does not.

    References point one way, handle -> packer -> region, never back: the region's inputs are
    freed by reference counting once the sweep has dropped the last entry that saved through
    this packer, not later by the cyclic collector."""

    lossless = True
    shares_buffers = False  # True once the first run ended (`close`)

    def __init__(self, region: Any, choose: Any, keep: Any = None) -> None:
        self.region = region
        self.keep = keep  # array -> the strategy keeping it from the first run, or None
        self.kept: set[int] = set()  # values kept so: no re-run needed for them
        self.meta: list[tuple[tuple[int, ...], Any]] = []
        self.originals: list[Any] | None = [] if region.debug else None
        self.values: list[Any] | None = None
        self.reads: list[int] = []  # per value: how many saved slots hold its handle
        self.left: list[int] = []  # per value: reads left before it is let go
        self.unread = 0  # values not yet let go
        self.closed = False
        # while the first run lasts, its values held weakly (no more memory than the plain
        # function's): a gradient taken inside the region (`grad` with create_graph) reads
        # those still alive, and the others from `early`, one re-run's values, kept until
        # the first run ends (only when such a gradient needed a value no longer alive)
        self.first_run: list[Any] | None = []
        self.early: list[Any] | None = None
        # id(array) -> (its index, the form keeping it), for a value the policy keeps: saved
        # again by another slot, it is stored once (`first_run` tells whether it is the same)
        self.kept_forms: dict[int, tuple[int, _Kept]] | None = {}
        self._choose = choose
        # the tensors from outside the region that its first run read (`note_reads`), by
        # version counter: id -> (counter, dtype, shape, what read it); none held (a counter
        # holds no tensor). `skip`: counters not to guard (the arguments' own, guarded by
        # their saved slots, and those of tensors the first run made). Once it ended,
        # `captured` holds guards with versions (`check_captured`).
        self.seq_before = 0
        self.skip: set[int] | None = None
        self.captured: Any = None

    def choose_form(self, prim: Any) -> Any:
        return self._choose(prim) if self._choose is not None else prim.forms[0]

    def pack(self, array: Any) -> _Handle | _Kept:
        if self.closed:
            return _Kept(KEEP, array)
        self.meta.append((tuple(array.shape), array.dtype))
        if self.first_run is not None:
            self.first_run.append(_weak(array))
        if self.originals is not None:
            self.originals.append(array.copy())
        index = len(self.meta) - 1
        storage = self.keep(array) if self.keep is not None else None
        if storage is None:
            return _Handle(self, index)
        self.kept.add(index)
        forms = self.kept_forms
        known = forms.get(id(array)) if forms is not None else None
        if known is not None and self._alive(known[0]) is array:
            return known[1].again()
        kept = _Kept(storage, array)
        if forms is not None:
            forms[id(array)] = (index, kept)
        return kept

    def watch(self, args: Any, kwargs: Any, seq_before: int) -> None:
        """The first run starts (entries after `seq_before` are its own): guard what it reads
        from outside, but its arguments (`note_reads`)."""
        self.seq_before = seq_before
        self.skip = {id(t._version) for t in (*args, *kwargs.values()) if isinstance(t, Tensor)}
        self.captured = {}

    def note_reads(self, op: Any, tensors: Any, result: Any, view: bool) -> None:
        """An operation of the first run read `tensors` and made `result`: note each tensor
        from outside the region (not made by it, not an argument), whose re-run reads it
        again, as PyTorch's saved tensors are noted, and mark `result` as the region's (a
        view shares its base's counter: the base may be from outside)."""
        skip, captured = self.skip, self.captured
        if skip is None:
            return
        for t in tensors:
            counter = t._version
            key = id(counter)
            if key in skip or key in captured:
                continue
            entry = t._entry
            if entry is not None and entry.seq > self.seq_before:
                continue
            name = getattr(op, "name", None) or getattr(op, "__name__", "an operation")
            frame = result._entry.origin_frame if result is not None and (
                result._entry is not None) else NO_ORIGIN
            where = f"first read by {name!r}"
            if frame[0] is not None:
                where += f" at {origin_text(frame)}"
            captured[key] = (counter, t.dtype, t.shape, where)
        if result is not None and not view:
            skip.add(id(result._version))

    def check_captured(self) -> None:
        """Before a re-run: raise where a tensor from outside that the first run read was
        modified in place since (the re-run would read the new values and give another
        gradient than the plain function, silently)."""
        for counter, version, dtype, shape, where in self.captured or ():
            if counter.value != version:
                origin = self.region.origin
                called = f" (called at {origin_text(origin)})" if origin else ""
                raise SavedValueModifiedError(
                    f"the checkpointed region {self.region.name!r}{called} re-reads a tensor it "
                    f"captures ({dtype}{list(shape)}, {where}) when it re-runs in the "
                    "backward, but it was modified in place since the region ran (version "
                    f"{version}, now {counter.value}); modify it after the backward, or "
                    "modify a copy (c = c.clone()) or use an out-of-place operation "
                    "(c = c * 2 rather than c.mul_(2)); PyTorch raises the same for a saved "
                    "tensor modified by an inplace operation"
                )

    def _noted_versions(self) -> None:
        """The captured tensors' versions as they are now: what a re-run must find (a
        change the region makes itself, in its first run or a re-run, is its own)."""
        self.captured = [(counter, counter.value, dtype, shape, where)
                         for counter, _, dtype, shape, where in self.captured or ()]

    def _alive(self, i: int) -> Any:
        """The first run's value `i` if it is still alive (None: gone, or no first run)."""
        ref = self.first_run[i] if self.first_run is not None else None
        return ref() if type(ref) is weakref.ref else ref

    def close(self, outputs: Any, seq_before: int) -> None:
        """The first run returned `outputs`: count the reads of each value by the entries it
        made (those after `seq_before` that lead to an output), and take no more values."""
        self.closed = True
        self.captured = [(counter, counter.value, dtype, shape, where) for
                         counter, dtype, shape, where in (self.captured or {}).values()]
        self.skip = None
        self.shares_buffers = True  # a value saved from now on is kept as is: store it once
        self.first_run = self.early = None
        self.kept_forms = None
        reads = [0] * len(self.meta)
        stack = [t._entry for t in flatten(outputs)[0]
                 if isinstance(t, Tensor) and t._entry is not None]
        seen: set[int] = set()
        while stack:
            entry = stack.pop()
            if entry.seq <= seq_before or id(entry) in seen:
                continue
            seen.add(id(entry))
            for slot in entry.slots or ():
                buffer = slot.buffer
                if type(buffer) is PackedBuffer and buffer.packer is self and (
                        type(buffer.packed) is _Handle):
                    reads[buffer.packed.index] += 1
            stack.extend(node for node in entry.nodes if type(node) is Entry)
        self.reads = [max(1, n) for n in reads]  # unseen: read once, as a slot of its own

    def unpack(self, handle: _Handle | _Kept) -> Any:
        if type(handle) is _Kept:
            return handle.strategy.unpack(handle.stored)
        if self.first_run is not None:  # read inside the first run
            return self._read_early(handle.index)
        values = self.values
        if values is None or values[handle.index] is None:
            self.check_captured()
            self.region.materialize(self)
            self._noted_versions()
            values = self.values
            assert values is not None
            self.left = list(self.reads) if self.closed else [1] * len(self.meta)
            for i in self.kept:  # read from what the first run kept
                values[i] = None
            self.unread = len(self.meta) - len(self.kept)
        assert values is not None
        i = handle.index
        value = values[i]
        self.left[i] -= 1
        if self.left[i] <= 0:  # its last read in this sweep: let go of it
            values[i] = None
            self.unread -= 1
            if self.unread <= 0:
                self.values = None
        return value

    def _read_early(self, i: int) -> Any:
        """Value `i`, read while the first run still runs: the first run's array if it is
        alive (its tensor still held, as a gradient taken inside the region usually finds
        it), else a re-run's. The re-run runs the whole function, which saves more values
        than the first run has so far: `accept` takes their prefix."""
        value = self._alive(i)
        if value is not None:
            return value
        if self.early is None or len(self.early) <= i:
            self.region.materialize(self)
        assert self.early is not None
        return self.early[i]

    def stored_nbytes(self, handle: _Handle | _Kept) -> int:
        return handle.nbytes if type(handle) is _Kept else 0

    def stored_level(self, handle: _Handle | _Kept) -> str:
        return handle.strategy.stored_level(handle.stored) if type(handle) is _Kept else "device"

    def accept(self, values: list[Any], what: str) -> None:
        """Take the values a re-run saved, after checking they match the first run (so far,
        when the re-run served a read inside the first run: `early`)."""
        if not self.closed and len(values) >= len(self.meta):
            values = values[:len(self.meta)]
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
        if self.closed:
            self.values = values
        else:
            self.early = values


def _weak(array: Any) -> Any:
    """A weak reference to `array`, or `array` itself where it takes none (a numpy scalar:
    a few bytes)."""
    try:
        return weakref.ref(array)
    except TypeError:
        return array


def _same(a: Any, b: Any) -> bool:
    return bool(np.array_equal(to_device(a, "cpu"), to_device(b, "cpu"), equal_nan=True))


class Collector(Strategy):
    """A packer that keeps values and remembers them in order (used while re-running): kept
    by reference, so the profiler counts a parameter or region input saved again as the
    caller's or the region's, not as new tape bytes."""

    watches_only = True
    shares_buffers = False  # a value per saved slot, as the first run's `RegionPacker`

    def __init__(self, choose: Any) -> None:
        self.values: list[Any] = []
        self._choose = choose
        # id -> (tensor, its `_saved_ref` before): tensors from outside the re-run (a
        # captured parameter) whose saved buffer the re-run replaced
        self.replaced: dict[int, tuple[Tensor, Any]] = {}

    def replacing(self, tensor: Tensor, ref: Any) -> None:
        if made_before_rerun(tensor) and id(tensor) not in self.replaced:
            self.replaced[id(tensor)] = (tensor, ref)

    def restore(self) -> None:
        """Give the tensors from outside the re-run their saved buffers back: a re-run run
        inside the first run (a gradient taken there) must not change what the rest of the
        first run shares (a parameter the first run saved, then saves again, is stored once,
        as the re-runs store it; with the re-run's buffer in its place it was stored twice)."""
        for tensor, ref in self.replaced.values():
            tensor._saved_ref = ref
        self.replaced.clear()

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
        # a tensor passed twice (``checkpoint(f, h, h)``) is kept once, and the re-run gets one
        # tensor for it too: a value the first run saved once (for every entry that used the
        # tensor) is then saved once by the re-run, as the first run's count expects
        kept: dict[int, Any] = {}
        self.args = [self._keep(a, keep_with, kept) for a in args]
        self.kwargs = {k: self._keep(v, keep_with, kept) for k, v in kwargs.items()}
        # the generators' states, for the re-run to draw what the first run drew
        self.rng = _random_state() if replay_rng else None
        self.engine_state = random.get_state() if replay_rng else None
        # how the region's primitives choose their forms; the region holds no reference to
        # its packer (the packer holds it): no cycle, so it dies with the last entry of the
        # region the sweep releases, and with it the inputs it kept
        self.choose = outer.choose_form
        self.origin = caller_origin()  # what entries of `fn` re-run name, if it is ours

    def _keep(self, value: Any, packer: Strategy, kept: dict[int, Any]) -> Any:
        if not isinstance(value, Tensor):
            return ("value", value)
        same = kept.get(id(value))
        if same is not None:  # (the tensor is alive in `args`: its id is not reused)
            return same
        if value._entry is None:
            packer = packer.for_leaf()  # the caller holds it anyway
        slot = SavedSlot("input", buffer_for(value, packer), value._version, None)
        item = kept[id(value)] = ("tensor", slot, edge_of(value._current()))
        return item

    def _restore(self, kept: Any, restored: dict[int, Tensor]) -> Any:
        if kept[0] == "value":
            return kept[1]
        t = restored.get(id(kept))
        if t is not None:  # the same input in another place: the same tensor
            return t
        _, slot, edge = kept
        array = slot.unpack(lambda: f"the checkpointed region {self.name!r}")
        # where the input sat in the graph, as PyTorch's re-run does: a gradient the function
        # takes inside (`grad` with create_graph) reaches the inputs through the graph
        # outside the region as its first run did (b = a * 2 passed beside a)
        t = restored[id(kept)] = graph_tensor(array, edge)
        return t

    @rerun_boundary
    def materialize(self, packer: RegionPacker) -> None:
        with events.recomputing(self.name), rerunning_from(self.origin), rerunning_region(
                next_sequence()):
            restored: dict[int, Tensor] = {}
            args = [self._restore(a, restored) for a in self.args]
            kwargs = {k: self._restore(v, restored) for k, v in self.kwargs.items()}
            collector = Collector(self.choose)
            outer_rng = _random_state() if self.replay_rng else None
            try:
                if not self.replay_rng:
                    with enable_grad(), use_packer(collector):
                        self.fn(*args, **kwargs)
                else:
                    np.random.set_state(self.rng)
                    with enable_grad(), use_packer(collector), random.replaying(
                        self.engine_state
                    ):
                        self.fn(*args, **kwargs)
            finally:
                if outer_rng is not None:
                    np.random.set_state(outer_rng)
                collector.restore()
            packer.accept(collector.values, f"checkpointed function {self.name!r}")


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
    names = policy if isinstance(policy, NamesPolicy) else None
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
    packer = RegionPacker(region, region.choose, names.storage if names is not None else None)
    tracer = _state.tracer
    if tracer is not None and tracer.region_pending:  # a selective region, traced: the
        tracer.region_pending = False  # replay re-runs it (`selective.region`)
    else:
        refuse_trace("opens a checkpointed region (checkpoint, or remat without a saving "
                     "policy), which a replay would not re-run")
    seq_before = next_sequence()
    packer.watch(args, kwargs, seq_before)
    with use_packer(packer), watching_reads(packer):
        outputs = fn(*args, **kwargs)
    packer.close(outputs, seq_before)
    return outputs


_SEQUENTIAL_KEYWORDS = frozenset({"preserve_rng_state", "debug"})


def checkpoint_sequential(
    functions: Sequence[Callable[[Any], Any]] | Any,
    segments: int | None = None,
    input: Any = None,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``functions`` in order, checkpointing each of `segments` groups but the last.

    PyTorch's signature: `functions` is a list of callables or an `nn.Sequential`;
    `use_reentrant` is accepted and ignored (see `checkpoint`), and `preserve_rng_state=`
    (and `debug=`) are passed on to each group's `checkpoint`. The default of
    round(sqrt(n)) segments keeps about 2*sqrt(n) layers' values at a time for one extra
    forward pass.

    >>> import checkpoint_ad as cad
    >>> layers = [lambda v: v * 2, cad.tanh, lambda v: v + 1]
    >>> x = cad.tensor([0.5, 1.0], requires_grad=True)
    >>> cad.checkpoint_sequential(layers, 2, x, use_reentrant=False).sum().backward()
    >>> x.grad.shape
    (2,)
    """
    unknown = sorted(set(kwargs) - _SEQUENTIAL_KEYWORDS)
    if unknown:
        raise TypeError(
            f"checkpoint_sequential got unexpected keyword arguments {unknown}; it takes "
            "use_reentrant, preserve_rng_state and debug"
        )
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
        value = checkpoint(run, group, value, **kwargs)
    return run(groups[-1], value)
