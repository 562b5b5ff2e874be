"""checkpoint-ad: reverse-mode automatic differentiation that fits in memory.

A define-by-run tape engine whose saved values all pass through one visible saving path, so
storage strategies (store inputs/outputs, recompute, quantize, binomial checkpointing) can
decide how each is kept, and the profiler can measure it.
"""

from . import factories, func, nn, optim, strategies, testing
from . import random as random  # cad.random; left out of __all__: it would shadow the stdlib module
from .autograd import backward
from .errors import (
    AnomalyError,
    BackwardError,
    BudgetError,
    CheckpointADError,
    DeviceError,
    DTypeError,
    GradcheckError,
    InplaceError,
    SavedValueModifiedError,
    ShapeError,
    StrategyConfigError,
)
from .factories import *  # noqa: F403 - zeros, ones, rand... are public API
from .factories import __all__ as _factory_names
from .func import grad, value_and_grad
from .function import Function, FunctionCtx, once_differentiable
from .grad_mode import (
    detect_anomaly,
    enable_grad,
    inference_mode,
    is_anomaly_enabled,
    is_grad_enabled,
    no_grad,
    record_origins,
    set_grad_enabled,
)
from .gradient_tape import GradientTape
from .inspect import TapeView, tape_of
from .ops import *  # noqa: F403 - the op functions are the public API
from .ops import __all__ as _op_names
from .ops import linalg
from .profiler import Profile, profile
from .progress_bar import progress
from .saved import Packer, saved_values_hooks, use_packer
from .strategies import (
    checkpoint,
    checkpoint_name,
    checkpoint_policies,
    checkpoint_sequential,
    estimate,
    remat,
    scan,
    use,
    while_loop,
)
from .tensor import Tensor, tensor

# isort: split
# the factories' zeros_like/ones_like (dtype=, device=, requires_grad=) win over the ops' ones
from .factories import ones_like, zeros_like  # noqa: F401

__version__ = "0.1.0"

__all__ = [
    "AnomalyError",
    "BackwardError",
    "BudgetError",
    "CheckpointADError",
    "DTypeError",
    "DeviceError",
    "Function",
    "FunctionCtx",
    "GradcheckError",
    "GradientTape",
    "InplaceError",
    "Packer",
    "Profile",
    "SavedValueModifiedError",
    "ShapeError",
    "StrategyConfigError",
    "TapeView",
    "Tensor",
    "backward",
    "checkpoint",
    "checkpoint_name",
    "checkpoint_policies",
    "checkpoint_sequential",
    "detect_anomaly",
    "enable_grad",
    "estimate",
    "grad",
    "inference_mode",
    "is_anomaly_enabled",
    "is_grad_enabled",
    "no_grad",
    "once_differentiable",
    "profile",
    "progress",
    "record_origins",
    "remat",
    "saved_values_hooks",
    "scan",
    "set_grad_enabled",
    "strategies",
    "tape_of",
    "tensor",
    "testing",
    "use",
    "use_packer",
    "value_and_grad",
    "while_loop",
    *_op_names,
    *_factory_names,
    "factories",
    "func",
    "linalg",
    "nn",
    "optim",
]
