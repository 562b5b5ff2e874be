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

import sys

from ..errors import RecomputeError
from . import budget, checkpoint_policies, jax_policies, loops, plans, storage
from .base import StoreInputs, StoreOutputs
from .budget import Budget, Estimate, estimate
from .budget.dtr import Rematerializing
from .jax_policies import checkpoint_name, remat
from .kinds import KeepAll, LoopPlanner, LoopStrategy, RegionStrategy, Strategy
from .loops.scan import scan, while_loop
from .plans import revolve
from .plans.loop_strategies import Binomial, Periodic
from .plans.multilevel import MultiLevel, MultiLevelPlan, multilevel_plan
from .plans.revolve import binomial_plan, optimal_evaluations, periodic_plan, simulate_plan
from .policy import Policy
from .quantized import Quantized
from .recompute import Recompute, checkpoint, checkpoint_sequential
from .scope import current_loop_strategy, use
from .selective import Selective, region
from .storage.offload import Offload

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

# Module paths from before the package was split into folders by job (plans/, loops/,
# budget/, storage/): `import checkpoint_ad.strategies.revolve` and the like still give
# the same module objects, so code written against them keeps working.
_MOVED = {
    "candidates": budget.candidates,
    "compiled_step": loops.compiled_step,
    "disk_store": storage.disk_store,
    "dtr": budget.dtr,
    "grad_flow": loops.grad_flow,
    "host_memory": storage.host_memory,
    "kept_loop": loops.kept_loop,
    "loop": loops.loop,
    "loop_backward": loops.loop_backward,
    "loop_forward": loops.loop_forward,
    "loop_guards": loops.loop_guards,
    "loop_pull_back": loops.loop_pull_back,
    "loop_snapshots": loops.loop_snapshots,
    "loop_steps": loops.loop_steps,
    "loop_strategies": plans.loop_strategies,
    "multilevel": plans.multilevel,
    "offload": storage.offload,
    "online": plans.online,
    "output_rows": loops.output_rows,
    "overhead": budget.overhead,
    "plan_executor": loops.plan_executor,
    "pricing": budget.pricing,
    "program_cache": loops.program_cache,
    "revolve": plans.revolve,
    "scan": loops.scan,
    "shared_budget": budget.shared_budget,
    "step_program": loops.step_program,
    "step_pull_back": loops.step_pull_back,
    "step_trace": loops.step_trace,
    "untaped_loop": loops.untaped_loop,
}
for _name, _module in _MOVED.items():
    sys.modules[f"{__name__}.{_name}"] = _module
