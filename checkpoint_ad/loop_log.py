"""Which `scan` loops ran, and how: replayed from a step program or recorded, and why.

Why: a loop that takes gradients says how it ran on its tape entry (``cad.tape_of``), but a
loop run without gradients (a validation pass, a rollout under `no_grad`) records nothing, so
nothing told its user whether it took the replayed path or fell back to running every step
op by op. `loops()` collects one `LoopInfo` per loop run inside it, with or without
gradients. Nothing is collected, and nothing is paid, outside such a block: `scan` asks one
thread-local list per call, not per operation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .origins import origin_text, user_frame_from_caller


@dataclass(frozen=True)
class LoopInfo:
    """One `scan` (or `while_loop`) run."""

    mode: str
    """"replayed", "replayed (program reused from an earlier call)", or "recorded: <why>"."""
    steps: int
    """Steps run forward (a loop stopped by `until`: those that ran)."""
    gradients: bool
    """Whether it ran with gradients on (a tape entry holds it then)."""
    strategy: str
    """The loop's strategy as given (``keep-all`` for none)."""
    origin: str
    """'file:line' of the call in user code."""


_local = threading.local()


def listening() -> bool:
    """Whether a `loops()` block of this thread is open (what `scan` asks once per call)."""
    return bool(getattr(_local, "collectors", None))


def report(mode: str, steps: int, gradients: bool, strategy: str) -> None:
    """Add one loop to every open `loops()` block of this thread; called from `scan`, so
    that the user's line is the first frame outside this package above the call."""
    info = LoopInfo(mode, steps, gradients, strategy, origin_text(user_frame_from_caller()))
    for collected in _local.collectors:
        collected.append(info)


@contextmanager
def loops() -> Iterator[list[LoopInfo]]:
    """Collect the loops this thread runs inside the block, in the order they end.

    >>> import checkpoint_ad as cad
    >>> with cad.inspect.loops() as ran, cad.no_grad():
    ...     h, ys = cad.scan(lambda h, x: (cad.tanh(h + x),) * 2, cad.tensor(0.0),
    ...                      cad.tensor([1.0, 2.0, 3.0, 4.0]))
    >>> ran[0].mode, ran[0].steps, ran[0].gradients
    ('replayed', 4, False)
    """
    collected: list[LoopInfo] = []
    collectors = getattr(_local, "collectors", None)
    if collectors is None:
        collectors = _local.collectors = []
    collectors.append(collected)
    try:
        yield collected
    finally:  # by identity: two blocks' lists may be equal
        del collectors[next(i for i, c in enumerate(collectors) if c is collected)]


@contextmanager
def muted() -> Iterator[None]:
    """No `loops()` block of this thread hears the loops run inside this one (a budget's dry
    run: loops the library runs to price one, which the caller did not run); they hear
    again after it."""
    collectors = getattr(_local, "collectors", None)
    _local.collectors = []
    try:
        yield
    finally:
        _local.collectors = collectors
