"""Loop strategies built on Revolve plans: `Binomial` and `Periodic`."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import StrategyConfigError
from ..saved import Strategy
from .kinds import LoopStrategy
from .online import OnlinePlanner
from .revolve import Plan, binomial_plan, periodic_plan


def _check(owner: str, name: str, value: object, storage: object, needs: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise StrategyConfigError(
            f"{owner}({name}={value!r}): the plan needs {needs}; give an int >= 1"
        )
    if storage is not None and not isinstance(storage, Strategy):
        raise StrategyConfigError(
            f"{owner}(storage={storage!r}): storage must be a saved-value strategy object such "
            "as Quantized(bits=8), or None; for a preset name use "
            "checkpoint_ad.presets.load_preset(name).build()"
        )


@dataclass(frozen=True)
class Binomial(LoopStrategy):
    """Revolve checkpointing of a `scan` with at most `snapshots` stored carries.

    Optimal in recomputation for its memory (Griewank & Walther, ACM TOMS 26(1), 2000): the
    loop of n steps costs exactly ``(r+1)*n - C(s+r, s+1)`` step evaluations, r the smallest
    integer with ``C(s+r, s) >= n`` (the last step is run with its tape during the forward,
    so the first reverse needs no re-run). Snapshots are kept with `storage` (e.g.
    ``Quantized(8)``; as they are by default).
    """

    snapshots: int
    storage: Strategy | None = None

    def __post_init__(self) -> None:
        _check("Binomial", "snapshots", self.snapshots, self.storage, "at least one snapshot")

    def plan(self, n_steps: int) -> Plan:
        return binomial_plan(n_steps, self.snapshots)

    def online_planner(self) -> OnlinePlanner:
        """Online snapshots for a loop of unknown length: the optimum up to C(s + 2, 2)
        steps, measured within 1% of it up to 10**5 steps (see `online.py`)."""
        return OnlinePlanner(self.snapshots)


@dataclass(frozen=True)
class Periodic(LoopStrategy):
    """Checkpoint a `scan` every `every` steps; each segment is re-run with its tape in backward."""

    every: int
    storage: Strategy | None = None

    def __post_init__(self) -> None:
        _check("Periodic", "every", self.every, self.storage, "a period of at least one step")

    def plan(self, n_steps: int) -> Plan:
        return periodic_plan(n_steps, min(self.every, max(n_steps, 1)))
