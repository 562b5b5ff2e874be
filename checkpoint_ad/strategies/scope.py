"""`use(strategy)`: apply a strategy to a region of code (innermost wins)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..saved import Strategy, use_packer
from .kinds import LoopPlanner, LoopStrategy


class _LoopStack(threading.local):
    def __init__(self) -> None:
        self.items: list[Any] = []


_loops = _LoopStack()


def current_loop_strategy() -> LoopStrategy | LoopPlanner | None:
    """The innermost loop strategy (`Binomial`, `Periodic`...) or planner (`Budget`) in
    effect, or None."""
    return _loops.items[-1] if _loops.items else None


@contextmanager
def use(strategy: Any) -> Iterator[Any]:
    """Apply `strategy` to everything recorded inside the block.

    Storage strategies (`StoreOutputs`, `Quantized`, a `Policy`...) decide how saved values are
    kept; loop strategies (`Binomial`, `Periodic`, `Recompute`) decide how `scan` loops are
    checkpointed. A loop planner (`Budget`) is both: it picks each `scan`'s plan, and is the
    saved-value strategy elsewhere. Blocks nest, and the innermost strategy of each kind wins.

    >>> import checkpoint_ad as cad
    >>> with cad.use(cad.strategies.Quantized(bits=8)):
    ...     pass
    """
    if isinstance(strategy, LoopPlanner):
        _loops.items.append(strategy)
        try:
            with use_packer(strategy):
                yield strategy
        finally:
            _loops.items.pop()
        return
    if isinstance(strategy, LoopStrategy):
        _loops.items.append(strategy)
        try:
            yield strategy
        finally:
            _loops.items.pop()
        return
    if not isinstance(strategy, Strategy):
        raise TypeError(
            f"use() takes a strategy (a saved-value Strategy such as Quantized(8), or a loop "
            f"strategy such as Binomial(8)), got {strategy!r}; see checkpoint_ad.strategies.kinds"
        )
    with use_packer(strategy):
        yield strategy
