"""An explicit tape in the style of TensorFlow's `GradientTape`."""

from __future__ import annotations

from typing import Any

from .autograd import grad
from .errors import BackwardError
from .inspect import TapeView
from .tape import Entry, start_tape, stop_tape
from .tensor import Tensor


class GradientTape:
    """Record the operations run inside the block and differentiate them afterwards.

    A one-shot tape (the default) frees its saved values after its first `gradient` call; a
    persistent tape answers any number of calls until it is deleted or `release()`d.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor(2.0, requires_grad=True)
    >>> with cad.GradientTape() as tape:
    ...     y = x ** 3
    >>> tape.gradient(y, x).item()
    12.0
    """

    def __init__(self, persistent: bool = False) -> None:
        self.persistent = persistent
        self._entries: list[Entry] = []
        self._used = False
        self._recording = False

    def __enter__(self) -> GradientTape:
        if self._recording:
            raise BackwardError("this GradientTape is already recording; tapes are not re-entrant")
        self._recording = True
        start_tape(self)
        return self

    def __exit__(self, *exc: object) -> None:
        stop_tape(self)
        self._recording = False

    def watch(self, tensor: Tensor) -> None:
        """Start tracking a leaf tensor that was made without requires_grad."""
        if not isinstance(tensor, Tensor):
            raise TypeError(f"watch() takes a Tensor, got {type(tensor).__name__}")
        if tensor.is_leaf:
            tensor.requires_grad_(True)

    @property
    def entries(self) -> TapeView:
        """What this tape recorded, in execution order."""
        return TapeView(self._entries)

    def gradient(
        self, target: Tensor, sources: Any, output_gradients: Any = None
    ) -> Any:
        """d(target)/d(sources), shaped like `sources`; None for sources not used."""
        if self._used and self.persistent:
            raise BackwardError(
                "this persistent GradientTape was released; record the computation again "
                "under a new tape"
            )
        if self._used:
            raise BackwardError(
                "this GradientTape was not persistent and its gradient() was already taken, "
                "which freed it; create it with GradientTape(persistent=True) to call "
                "gradient() more than once"
            )
        if self._recording and not self.persistent:
            raise BackwardError(
                "gradient() of a one-shot GradientTape must be called after its `with` block "
                "ends; use persistent=True to take gradients inside the block"
            )
        result = grad(
            target,
            sources,
            grad_outputs=output_gradients,
            retain_graph=True,
            allow_unused=True,
        )
        if not self.persistent:
            self.release()
        if isinstance(sources, Tensor):  # TensorFlow's: shaped like `sources`
            return result[0]
        return result if isinstance(sources, tuple) else list(result)

    def release(self) -> None:
        """Free every saved value this tape recorded."""
        for entry in self._entries:
            entry.release()
        self._entries = []
        self._used = True

    def __repr__(self) -> str:
        kind = "persistent" if self.persistent else "one-shot"
        return f"<GradientTape {kind}, {len(self._entries)} entries>"
