"""checkpoint-ad: reverse-mode automatic differentiation that fits in memory.

A define-by-run tape engine whose saved values all pass through one visible saving path, so
storage strategies (store inputs/outputs, recompute, quantize, binomial checkpointing) can
decide how each is kept, and the profiler can measure it.
"""

from . import testing
from .autograd import backward, grad
from .errors import (
    BackwardError,
    CheckpointADError,
    DeviceError,
    DTypeError,
    GradcheckError,
    InplaceError,
    SavedValueModifiedError,
    ShapeError,
)
from .function import Function, FunctionCtx
from .grad_mode import enable_grad, inference_mode, is_grad_enabled, no_grad
from .gradient_tape import GradientTape
from .inspect import TapeView, tape_of
from .ops import *  # noqa: F403 - the op functions are the public API
from .ops import __all__ as _op_names
from .saved import Packer, saved_values_hooks, use_packer
from .tensor import Tensor, _install_operators, tensor

_install_operators()

# Names PyTorch, JAX and numpy users reach for (docs/coming-from-pytorch-and-jax.md)
from . import (  # noqa: E402 - they build on everything above
    factories,
    nn,
    optim,
    strategies,
)
from .factories import *  # noqa: E402, F403 - factories shadow the ops' zeros_like/ones_like
from .factories import __all__ as _factory_names  # noqa: E402
from .ops import linalg  # noqa: E402
from .profiler import Profile, profile  # noqa: E402
from .strategies import (  # noqa: E402
    checkpoint,
    checkpoint_policies,
    checkpoint_sequential,
    remat,
    scan,
    use,
)

__version__ = "0.1.0"

__all__ = [
    "BackwardError",
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
    "TapeView",
    "Tensor",
    "backward",
    "checkpoint",
    "checkpoint_policies",
    "checkpoint_sequential",
    "enable_grad",
    "grad",
    "inference_mode",
    "is_grad_enabled",
    "no_grad",
    "profile",
    "remat",
    "saved_values_hooks",
    "scan",
    "strategies",
    "tape_of",
    "tensor",
    "testing",
    "use",
    "use_packer",
    *_op_names,
    *_factory_names,
    "factories",
    "linalg",
    "nn",
    "optim",
]
