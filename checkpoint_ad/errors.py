"""The library's exceptions: each derives from the builtin a caller would catch."""

from __future__ import annotations


class CheckpointADError(Exception):
    """Base class of every error raised on purpose by checkpoint_ad."""


class BackwardError(CheckpointADError, RuntimeError):
    """The backward sweep cannot run as asked (freed tape, missing seed, no graph)."""


class StepNeedsTapeError(BackwardError):
    """A step of a checkpointed loop, run without a tape for its values alone, takes a
    gradient inside it (`grad`, `backward`), which needs the step's graph."""


class StepGradientCutError(BackwardError):
    """A step of a loop under a plan that re-runs steps takes a gradient inside it which,
    keeping every step (a Python loop), would also flow through the history of the step's
    carry or scanned row into what it differentiates (e.g. `xs` computed from the initial
    carry); the plan runs the step on a copy without that history, so it refuses."""


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


class RequiresGradConversionError(CheckpointADError, TypeError):
    """A tensor that requires grad was asked to become a plain array (numpy, DLPack), which
    would silently leave the graph; PyTorch refuses the same way."""


class GradcheckError(CheckpointADError, AssertionError):
    """Analytic and numerical derivatives disagree."""


class StrategyConfigError(CheckpointADError, ValueError):
    """A strategy was built with arguments that cannot work (caught when it is built)."""


class ScheduleError(CheckpointADError, ValueError):
    """A plan cannot be made or is not valid for the loop it is meant to reverse."""


class PlanInvariantError(ScheduleError):
    """A plan broke an invariant during :func:`simulate_plan`; says which action and which rule."""

    def __init__(self, index: int, action: object, invariant: str, detail: str) -> None:
        self.index = index
        self.action = action  # None for a check at the end of the plan
        self.invariant = invariant
        where = (
            f"the end of the plan (after {index} actions)"
            if action is None
            else f"action {index} {action!r}"
        )
        super().__init__(f"{where} breaks invariant '{invariant}': {detail}")


class QuantizationError(CheckpointADError, ValueError):
    """Quantization was asked for something it cannot do (bad bits, group size or dtype)."""


class BudgetError(CheckpointADError, MemoryError, ValueError):
    """A memory budget cannot be kept: no plan fits it (a `scan` under `Budget`), or what must
    stay in memory alone passes it (imperative code under eviction).

    `minimum_bytes` is the smallest budget that would have worked (at the point of failure,
    for eviction)."""

    def __init__(self, message: str, minimum_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


class BudgetWarning(UserWarning):
    """A budget was passed this once, for a reason it names: loops planned one after another
    in a first pass, before the budget knew the later ones (it plans them together next)."""


class RecomputeError(CheckpointADError, RuntimeError):
    """Re-running a checkpointed region did not reproduce what its first run saved."""


class ModelConfigError(CheckpointADError, ValueError):
    """A model was asked for with an unknown name, an unknown option, or a bad size or dtype."""


class UnknownModelError(ModelConfigError):
    """`build` was given a name that is not in `MODELS`."""


class ModelTooLargeError(ModelConfigError, MemoryError):
    """A model's run would not fit in memory: said before anything is allocated, with the
    estimate (`needed`) and what was `available`, in bytes."""

    def __init__(self, message: str, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available

    def __reduce__(self) -> tuple:  # keep every field when pickled (e.g. by Dask)
        return type(self), (str(self), self.needed, self.available)


class PresetError(CheckpointADError, ValueError):
    """A preset cannot be found, parsed, trusted, or turned into strategies."""


class UsageError(CheckpointADError, ValueError):
    """A command-line argument the library would reject later, caught early."""


class PlotError(CheckpointADError, ValueError):
    """Nothing to plot (an empty sweep or profile) or an axis the plots do not know."""


class FileFormatError(CheckpointADError, ValueError):
    """A saved JSON document is not in the form this version of checkpoint-ad writes."""


class ProfileFormatError(FileFormatError):
    """A JSON document is not a checkpoint-ad profile this version can read."""


class SweepFormatError(FileFormatError):
    """A JSON document is not a sweep table (``sweep-<model>.json``) this version can read."""


class OutputError(CheckpointADError, OSError):
    """A file cannot be written where asked: a symlink in the way, a name that would leave its
    folder, or the operating system refused (read-only, full, over a size limit)."""


class SweepConfigError(CheckpointADError, ValueError):
    """A sweep was asked to run with arguments it cannot use (e.g. repeats below 1)."""


class MissingExtraError(CheckpointADError, ImportError):
    """A feature needs an optional dependency that is not installed; says which extra to add."""


class ClusterError(CheckpointADError, OSError):
    """A Dask cluster for a sweep could not be started or reached (e.g. a bad scheduler
    address); says which address and what to check."""


class SweepRunError(CheckpointADError, RuntimeError):
    """One run of a sweep failed on a worker. The message names the preset, the model, the
    worker and the original error; `remote_traceback` is where it happened, and `unexpected`
    is True when the original was not an error checkpoint-ad reports on purpose (a bug)."""

    def __init__(self, message: str, remote_traceback: str = "", unexpected: bool = False):
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.unexpected = unexpected

    def __reduce__(self) -> tuple:  # keep every field when pickled (e.g. by Dask)
        return type(self), (str(self), self.remote_traceback, self.unexpected)


class AnomalyError(CheckpointADError, RuntimeError):
    """Under `detect_anomaly()`, a backward rule produced a nan or inf gradient."""


class ModuleConfigError(CheckpointADError, ValueError):
    """A layer was asked for with sizes or options that cannot work (e.g. zero features)."""


class StateDictError(CheckpointADError, KeyError):
    """A state dict does not fit the module: missing or unexpected names, or other shapes."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


class OptimizerConfigError(CheckpointADError, ValueError):
    """An optimizer was given no parameters, a non-leaf tensor, or an invalid hyperparameter."""


class OffloadError(CheckpointADError, OSError):
    """A saved value could not be written to or read back from its storage level (a full or
    read-only disk, a temporary folder removed from outside)."""
