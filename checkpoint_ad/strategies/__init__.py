"""Storage strategies and checkpointing plans for the tape.

Storage strategies decide how each saved value is kept (`KeepAll`, `StoreInputs`,
`StoreOutputs`, `Quantized`, per-op `Policy`, or your own `Strategy` subclass); loop strategies
decide how a `scan` is checkpointed (`Binomial`, `Periodic`, `Recompute`). Apply either kind with
``checkpoint_ad.use(strategy)`` or a ``strategy=`` argument.
"""

from . import jax_policies
from . import jax_policies as checkpoint_policies
from .base import KeepAll, StoreInputs, StoreOutputs, Strategy
from .jax_policies import remat
from .policy import Policy
from .quantized import Quantized
from .recompute import Recompute, RecomputeError, checkpoint, checkpoint_sequential
from .revolve import binomial_plan, optimal_evaluations, periodic_plan, simulate_plan
from .scan import Binomial, Periodic, scan
from .scope import current_loop_strategy, use

__all__ = [
    "Binomial",
    "KeepAll",
    "Periodic",
    "Policy",
    "Quantized",
    "Recompute",
    "RecomputeError",
    "Strategy",
    "StoreInputs",
    "StoreOutputs",
    "binomial_plan",
    "checkpoint",
    "checkpoint_policies",
    "checkpoint_sequential",
    "current_loop_strategy",
    "optimal_evaluations",
    "jax_policies",
    "periodic_plan",
    "remat",
    "scan",
    "simulate_plan",
    "use",
]
