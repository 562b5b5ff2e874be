"""The library's exceptions: each derives from the builtin a caller would catch."""

from __future__ import annotations


class CheckpointADError(Exception):
    """Base class of every error raised on purpose by checkpoint_ad."""


class BackwardError(CheckpointADError, RuntimeError):
    """The backward sweep cannot run as asked (freed tape, missing seed, no graph)."""


class SavedValueModifiedError(CheckpointADError, RuntimeError):
    """A value saved for the backward sweep was changed in place after it was saved."""


class InplaceError(CheckpointADError, RuntimeError):
    """An in-place operation would make the recorded tape wrong."""


class DeviceError(CheckpointADError, ValueError):
    """Tensors on different devices (or array libraries) were mixed in one operation."""


class ShapeError(CheckpointADError, ValueError):
    """Shapes do not fit together for the operation."""


class DTypeError(CheckpointADError, TypeError):
    """A dtype is not allowed where it was given (e.g. gradients of integer tensors)."""


class GradcheckError(CheckpointADError, AssertionError):
    """Analytic and numerical derivatives disagree."""


class StrategyConfigError(CheckpointADError, ValueError):
    """A strategy was built with arguments that cannot work (caught when it is built)."""
