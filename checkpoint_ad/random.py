"""Randomness the engine can replay: one generator per thread, restorable for re-runs.

A checkpointed region or a loop step that draws random numbers (a dropout mask) must draw the
same ones when it is re-run for the backward sweep, or its gradients are wrong. Code that draws
through `generator()` (random factories, `nn.Dropout`) gets that for free: `checkpoint` keeps
the generator's state where its region starts, a planned `scan` keeps it with each snapshot,
and a re-run draws from a copy restored from that state, so the re-run sees the same numbers
and the caller's stream is not advanced twice. Draws are in the same order as without
checkpointing, so a checkpointed function returns what the plain one does. Each thread has its
own generator, so threads never share a stream.

>>> import checkpoint_ad as cad
>>> cad.random.manual_seed(0)
>>> saved = cad.random.get_state()
>>> first = cad.random.generator().random()
>>> with cad.random.replaying(saved):
...     again = cad.random.generator().random()
>>> first == again
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from threading import local
from typing import Any

import numpy as np

from .grad_mode import _state

GeneratorState = tuple[type, dict[str, Any]]


class _Streams(local):
    def __init__(self) -> None:
        self.stack: list[np.random.Generator] = [np.random.default_rng()]


_streams = _Streams()


def generator() -> np.random.Generator:
    """The generator to draw from here: a re-run's replayed one inside it, else the thread's."""
    return _streams.stack[-1]


def manual_seed(seed: int) -> None:
    """Reseed the calling thread's generator."""
    _streams.stack[0] = np.random.default_rng(seed)


def get_state() -> GeneratorState:
    """The current generator's state, to replay what is drawn from here on."""
    bits = generator().bit_generator
    return type(bits), bits.state


def restored(state: GeneratorState) -> np.random.Generator:
    """A new generator that draws what the one saved as `state` would have drawn next."""
    kind, values = state
    bits = kind()
    bits.state = values
    return np.random.Generator(bits)


def rewind(stream: np.random.Generator, state: GeneratorState) -> None:
    """Set `stream` (a generator from `restored`) back to `state`, cheaper than a new one."""
    stream.bit_generator.state = state[1]


@contextmanager
def replaying(state: GeneratorState) -> Iterator[np.random.Generator]:
    """Draw from a copy of the generator as it was at `state` inside the block (the caller's
    generator does not move)."""
    with using(restored(state)) as stream:
        yield stream


@contextmanager
def using(stream: np.random.Generator) -> Iterator[np.random.Generator]:
    """Draw from `stream` inside the block."""
    _streams.stack.append(stream)
    try:
        yield stream
    finally:
        _streams.stack.pop()


def resolve(given: object, op: str) -> np.random.Generator | np.random.RandomState:
    """What a `generator=` argument means: None is the engine's replayable generator, an int
    a fresh generator seeded with it, a numpy Generator or RandomState itself (it advances,
    and is not replayed)."""
    if given is None:
        return generator()
    if isinstance(given, (int, np.integer)) and not isinstance(given, bool):
        return np.random.default_rng(int(given))
    if isinstance(given, (np.random.Generator, np.random.RandomState)):
        return given
    raise TypeError(
        f"{op}: generator must be a numpy.random.Generator, an int seed or None, got "
        f"{type(given).__name__}"
    )


def sample(given: object, op: str, make: Callable[[Any], Any], key: tuple[Any, ...]) -> Any:
    """The array `make(rng)` draws from what `generator=` `given` means (see `resolve`).

    Every random factory draws through here, so a loop step being traced learns that this
    array is a draw from the engine's generator (described by `key`: the op and what shapes
    the draw) and its replays draw again, from the replayed stream, instead of freezing it.
    """
    array = make(resolve(given, op))
    tracer = _state.tracer
    if tracer is not None and given is None:
        tracer.note_draw(make, (op, *key), array)
    return array
