"""Whether operations are recorded on the tape (`no_grad`, `enable_grad`, `set_grad_enabled`,
`inference_mode`), and whether backward checks its gradients (`detect_anomaly`)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class _ModeState(threading.local):
    """This thread's modes. `plain` says gradients are on, inference mode is off and nothing
    traces: the recording fast path then asks one thread-local question, not three."""

    anomaly: bool = False
    step_scope: StepScope | None = None  # the checkpointed loop's step running now
    gradients_taken: int = 0  # backward()/grad() calls so far (a step that takes any: see
    # `StepLoop.takes_gradients`)
    origins: bool = False  # inside record_origins() or detect_anomaly(): entries keep their line
    plain: bool = True
    _grad_enabled: bool = True
    _inference: bool = False
    _tracer: Any = None
    # called with each tensor about to be changed in place while a budget's dry run watches
    # (`pricing._Writes`), None otherwise: in-place ops are rare, so asking costs nothing
    inplace_watch: Any = None
    # while a checkpointed region runs again (`rerunning_region`): the sequence number its
    # entries start at, None otherwise
    rerun_floor: int | None = None

    @property
    def grad_enabled(self) -> bool:
        return self._grad_enabled

    @grad_enabled.setter
    def grad_enabled(self, value: bool) -> None:
        self._grad_enabled = value
        self._refresh_plain()

    @property
    def inference(self) -> bool:
        return self._inference

    @inference.setter
    def inference(self, value: bool) -> None:
        self._inference = value
        self._refresh_plain()

    @property
    def tracer(self) -> Any:
        """A loop's step tracer while it traces (strategies/step_trace.py)."""
        return self._tracer

    @tracer.setter
    def tracer(self, value: Any) -> None:
        self._tracer = value
        self._refresh_plain()

    def _refresh_plain(self) -> None:
        """`plain` from the three modes it sums up, after any of them changed."""
        self.plain = self._grad_enabled and not self._inference and self._tracer is None


_state = _ModeState()


class StepScope:
    """A step of a checkpointed loop running now (set by the loop, see `step_scope`): how
    a hook, `retain_grad()` or a gradient taken inside the step behaves where the step runs
    for its values alone (without a tape, or with one nobody pulls back), or runs again.

    A plan runs a step's tape for the reverse once per backward; its other runs keep no
    tape. `register_hook` is dropped where `drops_hooks` (it is registered again by the run
    that is pulled back, and fires there); a gradient taken where `untaped` raises
    `StepNeedsTapeError` (the loop runs such steps with a tape); `retain` may take over a
    `retain_grad()` (see `strategies/loop.py`'s `PlannedStep`).
    """

    __slots__ = ()
    untaped: bool = False
    drops_hooks: bool = False

    def retain(self, tensor: Any) -> bool:
        """Deal with `tensor.retain_grad()`; False: retain it as usual."""
        return False

    def hook_target(self, tensor: Any) -> Any:
        """Where `tensor.register_hook` registers: `tensor` itself, another tensor it
        stands for (step 0's copy of the caller's carry: the caller's), or None to drop
        the hook (this run's copy of that carry, whose hook the caller's tensor holds)."""
        return None if self.drops_hooks else tensor

    def slot_hook(self, tensor: Any, hook: Any) -> Any:
        """Register `hook` on `tensor` where this run keeps it apart (a tensor from before a
        planned loop: see `loops.loop.HookSlot`) and return its handle; None: as usual."""
        return None

    def note_hook(self, handle: Any) -> None:
        """A hook this run of the step registered (`handle` removes it): a run whose tape
        the loop lets go unreversed takes back those on tensors from outside the step."""

    def check_gradient(self, roots: list[Any], inputs: list[Any] | None) -> None:
        """Refuse a gradient taken in the step (from the graph edges `roots`, with respect
        to `inputs`; None: a ``backward()`` filling every leaf it reaches) whose value this
        run of the step cannot give as a plain loop would."""

    def fills_grads(self) -> bool:
        """Whether a ``backward()`` in this run of the step fills `.grad`: not where the
        loop's forward ran the step already (a plan's re-run) or its values are measured
        and dropped (a budget's dry run), as a Python loop runs each step once."""
        return not self.drops_hooks


class _Dropping(StepScope):
    """A run of a step whose hooks and retained tensors nobody sees (a budget's dry run)."""

    __slots__ = ()
    drops_hooks = True

    def retain(self, tensor: Any) -> bool:
        return True


DRY_RUN = _Dropping()


class step_scope:
    """Run the block as (part of) a step of a checkpointed loop, `scope` saying how hooks,
    `retain_grad()` and gradients inside it behave; the enclosing scope comes back after."""

    __slots__ = ("_saved", "scope")

    def __init__(self, scope: StepScope | None) -> None:
        self.scope = scope

    def __enter__(self) -> None:
        self._saved = _state.step_scope
        _state.step_scope = self.scope

    def __exit__(self, *exc: object) -> None:
        _state.step_scope = self._saved

# one item per record_origins/detect_anomaly block open in any thread: while it is empty (the
# common case) the tape asks no thread-local question before skipping the origin line
origin_blocks: list[Any] = []


class rerunning_region:
    """Run the block as a checkpointed region's re-run, whose entries are numbered from
    `floor` on: see `made_before_rerun`."""

    __slots__ = ("_saved", "floor")

    def __init__(self, floor: int) -> None:
        self.floor = floor

    def __enter__(self) -> None:
        self._saved = _state.rerun_floor
        _state.rerun_floor = self.floor

    def __exit__(self, *exc: object) -> None:
        _state.rerun_floor = self._saved


def made_before_rerun(tensor: Any) -> bool:
    """Whether a checkpointed region runs again now and `tensor` is not its own (an input,
    a tensor it captured, a leaf): a hook or `retain_grad()` the function asks for on it was
    registered by its first run, and is not registered twice (it fires once, as in the
    plain function)."""
    floor = _state.rerun_floor
    if floor is None:
        return False
    entry = tensor._entry
    return entry is None or entry.seq < floor


def refuse_trace(reason: str) -> None:
    """Tell the step tracer, if one is tracing, that the step did something a replay cannot
    repeat (read a value into Python, register a hook, ...): the loop then records every step."""
    tracer = _state.tracer
    if tracer is not None:
        tracer.refuse(reason)


def is_grad_enabled() -> bool:
    """True when new operations are recorded for differentiation."""
    return _state.grad_enabled


def is_inference_mode_enabled() -> bool:
    return _state.inference


def origins_wanted() -> bool:
    """True where new tape entries keep the line of user code that recorded them."""
    return bool(origin_blocks) and _state.origins


def is_anomaly_enabled() -> bool:
    """True inside `detect_anomaly()`: backward checks every gradient for nan/inf."""
    return _state.anomaly


class _GradModeContext:
    """Context manager and decorator that sets the recording mode, restoring it on exit.

    One object may be entered again while it is active (``with ng: ... with ng:``): each
    entry pushes the state it replaced, each exit pops its own.
    """

    _enabled: bool
    _inference: bool | None = None

    def __init__(self) -> None:
        self._saved: list[tuple[bool, bool]] = []

    def __enter__(self) -> None:
        self._saved.append((_state.grad_enabled, _state.inference))
        _state.grad_enabled = self._enabled
        if self._inference is not None:
            _state.inference = self._inference

    def __exit__(self, *exc: object) -> None:
        _state.grad_enabled, _state.inference = self._saved.pop()

    def _fresh(self) -> _GradModeContext:
        """An equal context with its own stack (one per decorated call: thread-safe)."""
        return type(self)()

    def __call__(self, func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class no_grad(_GradModeContext):
    """Run without recording: results do not require grad and nothing is saved.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0, 2.0], requires_grad=True)
    >>> with cad.no_grad():
    ...     y = x * 2
    >>> y.requires_grad
    False
    """

    _enabled = False


class enable_grad(_GradModeContext):
    """Record again inside a `no_grad` region."""

    _enabled = True


class inference_mode(_GradModeContext):
    """Like `no_grad`, and tensors made inside may never be saved for a later backward.

    Use it for pure evaluation: it states the intent and catches the mistake of feeding an
    evaluation result into a differentiated computation that would need to keep it.
    """

    _enabled = False
    _inference = True


class set_grad_enabled(_GradModeContext):
    """Turn recording on or off: at once when called, or for a block or a decorated function.

    The mode is set when the object is made (so a plain call works like PyTorch's), and a
    `with` block restores what was there before the call.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0], requires_grad=True)
    >>> with cad.set_grad_enabled(False):
    ...     (x * 2).requires_grad
    False
    >>> _ = cad.set_grad_enabled(False); cad.is_grad_enabled()
    False
    >>> _ = cad.set_grad_enabled(True); cad.is_grad_enabled()
    True
    """

    def __init__(self, mode: bool) -> None:
        super().__init__()
        self._enabled = bool(mode)
        self._before: tuple[bool, bool] | None = (_state.grad_enabled, _state.inference)
        _state.grad_enabled = self._enabled

    def __enter__(self) -> None:
        before, self._before = self._before, None
        super().__enter__()
        if before is not None:  # the first block restores the mode from before the call
            self._saved[-1] = before

    def _fresh(self) -> _GradModeContext:
        return set_grad_enabled(self._enabled)

    def __call__(self, func: F) -> F:
        if self._before is not None:  # used as a decorator: the call itself changes nothing
            _state.grad_enabled, _state.inference = self._before
            self._before = None
        enabled = self._enabled

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with set_grad_enabled(enabled):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"set_grad_enabled({self._enabled})"


class detect_anomaly:
    """Check every gradient of a backward run inside the block for nan and inf.

    The first tape entry whose backward makes one raises `AnomalyError`, naming the forward
    operation, the line of user code that recorded it (entries recorded inside the block keep
    it, as under `record_origins`), and which input's gradient went bad. Outside the block
    backward pays one flag check per entry.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([0.0], requires_grad=True)
    >>> with cad.detect_anomaly():
    ...     cad.sqrt(x).sum().backward()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    checkpoint_ad.errors.AnomalyError: backward of tape entry ... 'sqrt' ... gave inf ...
    """

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = bool(enabled)
        self._saved: list[bool] = []

    def __enter__(self) -> None:
        self._saved.append((_state.anomaly, _state.origins))
        _state.anomaly = self._enabled
        _state.origins = self._enabled or _state.origins
        origin_blocks.append(self)

    def __exit__(self, *exc: object) -> None:
        origin_blocks.pop()  # any item: only their number matters
        _state.anomaly, _state.origins = self._saved.pop()

    def __repr__(self) -> str:
        return f"detect_anomaly(enabled={self._enabled})"


class record_origins:
    """Keep, for every tape entry recorded inside the block, the line of user code that ran it.

    Finding that line walks the Python stack on every recorded operation, which costs more
    than many small operations themselves, so plain runs skip it: their entries list their
    origin as "<unknown>". A profiler (anything listening to engine events) and
    `detect_anomaly` keep lines too. Use this block to see lines in `tape_of(...)` listings
    and in error messages that name a tape entry.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0], requires_grad=True)
    >>> with cad.record_origins():
    ...     y = x * 2
    >>> "doctest" in y.grad_fn.origin  # this example's own "file" and line
    True
    >>> (x * 2).grad_fn.origin
    '<unknown>'
    """

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = bool(enabled)
        self._saved: list[bool] = []

    def __enter__(self) -> None:
        self._saved.append(_state.origins)
        _state.origins = self._enabled
        origin_blocks.append(self)

    def __exit__(self, *exc: object) -> None:
        origin_blocks.pop()
        _state.origins = self._saved.pop()

    def __repr__(self) -> str:
        return f"record_origins(enabled={self._enabled})"
