"""Loop strategies built on Revolve plans: `Binomial` (one level, or RAM + disk) and `Periodic`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import isfinite

from ...errors import StrategyConfigError
from ...saved import Strategy
from ..kinds import LoopStrategy
from .multilevel import MultiLevelPlan, multilevel_plan
from .online import OnlinePlanner, TwoLevelOnlinePlanner
from .revolve import Plan, binomial_plan, periodic_plan

ONLINE_DISK = 64
"""Disk slots of an online loop under ``Binomial(s, disk=None)``."""


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
    ``Quantized(8)``, ``Offload("disk")``; as they are by default).

    A second level: with `disk` (an int, or None for unlimited; 0, the default, means no disk
    level) the plan is the optimal RAM + disk one (H-Revolve, see `multilevel.py`): up to
    `disk` more snapshots written to disk, each write costing `write_cost` and each read
    `read_cost` forward steps. Costs left None are measured when the loop runs (one step of
    the loop and one write and read of its carry are timed); ``plan(n)`` alone, with no loop
    to time, counts them as one step each. Disk snapshots go through ``Offload("disk")``,
    with a lossy `storage` inside it.

    >>> Binomial(2, disk=1, write_cost=0.5, read_cost=0.5).plan(20).disk_writes
    1
    """

    snapshots: int
    storage: Strategy | None = None
    disk: int | None = 0
    write_cost: float | None = None
    read_cost: float | None = None

    def __post_init__(self) -> None:
        _check("Binomial", "snapshots", self.snapshots, self.storage, "at least one snapshot")
        if self.disk is not None and (
            not isinstance(self.disk, int) or isinstance(self.disk, bool) or self.disk < 0
        ):
            raise StrategyConfigError(
                f"Binomial(disk={self.disk!r}): disk is the number of disk snapshots, an int "
                ">= 0 (0: no disk level), or None for as many as the plan wants"
            )
        for name in ("write_cost", "read_cost"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
                or not isfinite(value) or value < 0
            ):
                raise StrategyConfigError(
                    f"Binomial({name}={value!r}): a cost is a finite number >= 0 of forward "
                    "steps, or None to measure it when the loop runs"
                )

    def plan(self, n_steps: int) -> Plan:
        if self.disk == 0:
            return binomial_plan(n_steps, self.snapshots)
        return self._multilevel(n_steps, 1.0 if self.write_cost is None else self.write_cost,
                                1.0 if self.read_cost is None else self.read_cost)

    def plan_for_loop(self, n_steps: int, measure: Callable[[], tuple[float, float]]) -> Plan:
        if self.disk == 0 or (self.write_cost is not None and self.read_cost is not None):
            return self.plan(n_steps)
        write, read = measure()
        return self._multilevel(
            n_steps,
            write if self.write_cost is None else self.write_cost,
            read if self.read_cost is None else self.read_cost,
        )

    def _multilevel(self, n_steps: int, write: float, read: float) -> MultiLevelPlan:
        return multilevel_plan(n_steps, self.snapshots, self.disk, write, read)

    def __repr__(self) -> str:
        text = f"Binomial(snapshots={self.snapshots!r}, storage={self.storage!r}"
        if self.disk != 0:
            text += (f", disk={self.disk!r}, write_cost={self.write_cost!r}, "
                     f"read_cost={self.read_cost!r}")
        return text + ")"

    def online_planner(self) -> OnlinePlanner | TwoLevelOnlinePlanner:
        """Online snapshots for a loop of unknown length: the optimum up to C(s + 2, 2)
        steps, measured within 1% of it up to 10**5 steps (see `online.py`). With a disk
        level, `TwoLevelOnlinePlanner`: the online plan over RAM + disk slots, RAM first;
        ``disk=None`` (unlimited) means `ONLINE_DISK` slots there, since an online plan must
        fix its slots before it knows the length (write and read costs are not weighed)."""
        if self.disk == 0:
            return OnlinePlanner(self.snapshots)
        return TwoLevelOnlinePlanner(self.snapshots, ONLINE_DISK if self.disk is None
                                     else self.disk)


@dataclass(frozen=True)
class Periodic(LoopStrategy):
    """Checkpoint a `scan` every `every` steps; each segment is re-run with its tape in backward."""

    every: int
    storage: Strategy | None = None

    def __post_init__(self) -> None:
        _check("Periodic", "every", self.every, self.storage, "a period of at least one step")

    def plan(self, n_steps: int) -> Plan:
        return periodic_plan(n_steps, min(self.every, max(n_steps, 1)))
