"""Whether operations are recorded on the tape: `no_grad`, `enable_grad`, `inference_mode`."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class _ModeState(threading.local):
    grad_enabled: bool = True
    inference: bool = False


_state = _ModeState()


def is_grad_enabled() -> bool:
    """True when new operations are recorded for differentiation."""
    return _state.grad_enabled


def is_inference_mode_enabled() -> bool:
    return _state.inference


class _GradModeContext:
    """Context manager and decorator that sets the recording mode, restoring it on exit."""

    _enabled: bool
    _inference: bool | None = None

    def __enter__(self) -> None:
        self._saved = (_state.grad_enabled, _state.inference)
        _state.grad_enabled = self._enabled
        if self._inference is not None:
            _state.inference = self._inference

    def __exit__(self, *exc: object) -> None:
        _state.grad_enabled, _state.inference = self._saved

    def __call__(self, func: F) -> F:
        mode = type(self)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with mode():
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class no_grad(_GradModeContext):
    """Run without recording: results do not require grad and nothing is saved.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0, 2.0], requires_grad=True)
    >>> with cad.no_grad():
    ...     y = x * 2
    >>> y.requires_grad
    False
    """

    _enabled = False


class enable_grad(_GradModeContext):
    """Record again inside a `no_grad` region."""

    _enabled = True


class inference_mode(_GradModeContext):
    """Like `no_grad`, and tensors made inside may never be saved for a later backward.

    Use it for pure evaluation: it states the intent and catches the mistake of feeding an
    evaluation result into a differentiated computation that would need to keep it.
    """

    _enabled = False
    _inference = True
