"""Storage strategies and checkpointing plans for the tape.

Saved-value strategies decide how each saved value is kept (`KeepAll`, `StoreInputs`,
`StoreOutputs`, `Quantized`, per-op `Policy`, or your own `Strategy` subclass); loop strategies
decide how a `scan` is checkpointed (`Binomial`, with a disk level or not, `Periodic`,
`Recompute`), and a `Budget` picks the fastest of them that fits a memory limit (`estimate`
shows its table); `Offload` keeps saved values on a storage level (host memory, disk);
`Recompute` is also the region strategy of `checkpoint`; `Selective` checkpoints only the
regions code marks with `region` (the attention core: selective recomputation). The kinds and
their contracts are in `kinds.py`. Apply any of them with ``checkpoint_ad.use(strategy)`` or a
``strategy=`` argument.
"""

from ..errors import RecomputeError
from . import checkpoint_policies, jax_policies, revolve
from .base import StoreInputs, StoreOutputs
from .budget import Budget, Estimate, estimate
from .dtr import Rematerializing
from .jax_policies import checkpoint_name, remat
from .kinds import KeepAll, LoopPlanner, LoopStrategy, RegionStrategy, Strategy
from .loop_strategies import Binomial, Periodic
from .multilevel import MultiLevel, MultiLevelPlan, multilevel_plan
from .offload import Offload
from .policy import Policy
from .quantized import Quantized
from .recompute import Recompute, checkpoint, checkpoint_sequential
from .revolve import binomial_plan, optimal_evaluations, periodic_plan, simulate_plan
from .scan import scan, while_loop
from .scope import current_loop_strategy, use
from .selective import Selective, region

__all__ = [
    "Binomial",
    "Budget",
    "Estimate",
    "KeepAll",
    "LoopPlanner",
    "LoopStrategy",
    "MultiLevel",
    "MultiLevelPlan",
    "Offload",
    "Periodic",
    "Policy",
    "Quantized",
    "Recompute",
    "RecomputeError",
    "RegionStrategy",
    "Rematerializing",
    "Selective",
    "Strategy",
    "StoreInputs",
    "StoreOutputs",
    "binomial_plan",
    "checkpoint",
    "checkpoint_name",
    "checkpoint_policies",
    "checkpoint_sequential",
    "current_loop_strategy",
    "estimate",
    "optimal_evaluations",
    "jax_policies",
    "multilevel_plan",
    "periodic_plan",
    "region",
    "remat",
    "revolve",
    "scan",
    "simulate_plan",
    "use",
    "while_loop",
]
