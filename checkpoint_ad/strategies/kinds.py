"""The three kinds of strategy, and what the engine asks of each.

- A **saved-value strategy** (`Strategy`) decides how each value a backward rule needs is
  kept: which form a primitive records (`choose_form`), how a value is stored (`pack` /
  `unpack` / `stored_nbytes`), whether that is exact (`lossless`). The tape calls it for every
  saved value. Built-ins: `KeepAll`, `StoreInputs`, `StoreOutputs`, `Quantized`, `Policy`,
  and `Rematerializing` (a byte limit kept by evicting and recomputing, see `dtr.py`).
- A **loop strategy** (`LoopStrategy`) decides how a `scan` is checkpointed: `plan(n)` gives
  the plan (frozen actions, see `revolve.py`) that the loop executor runs, and `storage` the
  saved-value strategy its snapshots are kept with; for a loop whose length is known only when
  it ends (`scan(..., until=...)`, `while_loop`), `online_planner()` gives the planner that
  grows the plan step by step (see `online.py`). Built-ins: `Binomial` (both kinds of loop),
  `Periodic`, `Recompute` (loops of known length).
- A **loop planner** (`LoopPlanner`) is a saved-value strategy that also picks a loop strategy
  for each `scan` it meets, from the loop itself (`choose(loop, carry_leaves)`): `Budget`
  prices candidate plans from one measured step and runs the fastest that fits.
- A **region strategy** (`RegionStrategy`) decides what `checkpoint(fn, ...)` does with a
  region: today `Recompute`, which keeps only the region's inputs and re-runs it in backward.

`use(strategy)` dispatches on these types; nothing is asked with attribute probes.

A saved-value strategy of your own, in five lines:

>>> from dataclasses import dataclass
>>> import numpy as np
>>> import checkpoint_ad as cad
>>> @dataclass(frozen=True)
... class Float16(cad.strategies.Strategy):
...     lossless = False
...     def pack(self, array): return array.astype("float16"), array.dtype
...     def unpack(self, stored): return stored[0].astype(stored[1])
>>> x = cad.tensor([1.0, 2.0], requires_grad=True)
>>> with cad.use(Float16()):
...     y = cad.tanh(x).sum()

A loop strategy of your own (every step's carry kept: the plan of a store-all schedule):

>>> @dataclass(frozen=True)
... class StoreEveryCarry(cad.strategies.LoopStrategy):
...     storage: cad.strategies.Strategy | None = None
...     def plan(self, n_steps):
...         return cad.strategies.revolve.store_all_plan(n_steps)
>>> w = cad.tensor(0.5, requires_grad=True)
>>> carry, _ = cad.scan(lambda h, x: (h * w + x, None), cad.tensor(0.0),
...                     xs=cad.tensor([1.0, 2.0]), strategy=StoreEveryCarry())

A region strategy of your own (a region that keeps its inputs as 8-bit codes):

>>> @dataclass(frozen=True)
... class RecomputeFromInt8(cad.strategies.RegionStrategy):
...     storage: cad.strategies.Strategy = cad.strategies.Quantized(bits=8)
>>> h = cad.tanh(cad.tensor(np.linspace(-1, 1, 512), requires_grad=True))
>>> y = cad.checkpoint(lambda v: cad.sin(v) * w, h, strategy=RecomputeFromInt8())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import StrategyConfigError
from ..saved import KeepAll, Strategy
from .plans.online import OnlinePlanner
from .plans.revolve import Plan

__all__ = ["KeepAll", "LoopPlanner", "LoopStrategy", "RegionStrategy", "Strategy"]


class LoopStrategy:
    """How a `scan` loop is checkpointed: a plan over its steps, and snapshot storage.

    Subclasses are frozen dataclasses with a `storage` field (a `Strategy`, or None to keep
    snapshots as they are) and a `plan(n_steps)` method returning a `revolve.Plan`.
    """

    storage: Strategy | None = None

    def plan(self, n_steps: int) -> Plan:
        raise NotImplementedError(f"{type(self).__name__} must define plan(n_steps)")

    def plan_for_loop(self, n_steps: int, measure: Callable[[], tuple[float, float]]) -> Plan:
        """The plan the executor runs; `measure()` times the loop now and gives the (write,
        read) cost of one disk snapshot of its carry in forward steps, for a strategy whose
        plan depends on them (`Binomial` with a disk level and no costs given)."""
        return self.plan(n_steps)
    def online_planner(self) -> OnlinePlanner:
        """The planner of a loop of unknown length (`advance()` per step, `finish(n)`)."""
        raise StrategyConfigError(
            f"{self!r} plans loops of known length only, but this loop's length is known only "
            "when `until` stops it; use Binomial(snapshots), which plans online, or give the "
            "loop a fixed length= (or xs) without until"
        )


class LoopPlanner(Strategy):
    """A saved-value strategy that also decides, per `scan`, which loop strategy runs it.

    `choose(loop, carry_leaves)` sees the loop (a `loop.StepLoop`: its step, length and
    scanned inputs) and its initial carry, and returns ``(loop_strategy or None, storage)``:
    the plan to run (None keeps every step) and the saved-value strategy every step's
    values go through. `use` puts a planner on both stacks: outside a `scan` it acts as the
    saved-value strategy it is.
    """

    def choose(self, loop: Any, carry_leaves: list[Any]) -> tuple[LoopStrategy | None, Strategy]:
        raise NotImplementedError(f"{type(self).__name__} must define choose(loop, carry_leaves)")

    def choose_open(self, loop: Any, carry_leaves: list[Any], limit: int | None,
                    ) -> tuple[LoopStrategy | None, Strategy]:
        """The plan for a loop that ends when `until` says so, after at most `limit` steps
        (None: no limit): a loop strategy that plans online (`online_planner()`), or None to
        keep every step. A planner that only prices loops of known length says so."""
        raise StrategyConfigError(
            f"{self!r} prices plans for a loop of known length, but this loop stops when "
            "`until` says so; give it a loop strategy that plans online (Binomial(snapshots)) "
            "or a fixed length= (or xs)")


class RegionStrategy:
    """What `checkpoint(fn, ...)` does with a region of code: keep only the region's inputs,
    stored with `storage` (None: as the enclosing saved-value strategy stores them), and
    re-run the region when the backward sweep needs its values; with `debug`, the re-run
    checks every value against the first run's. Subclasses are frozen dataclasses that set
    these fields (`Recompute` is the built-in one)."""

    storage: Strategy | None = None
    debug: bool = False
