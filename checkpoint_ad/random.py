"""Randomness the engine can replay: one generator per thread, forked per region and step.

A checkpointed region or a loop step that draws random numbers (a dropout mask) must draw the
same ones when it is re-run for the backward sweep, or its gradients are wrong. Code that draws
through `generator()` gets that for free: `checkpoint` runs its region, and `scan` each step,
under a generator forked from a seed taken once from the enclosing one, and re-runs fork the
same seed again. Forks are per thread, so threads never share a stream.

>>> import checkpoint_ad as cad
>>> cad.random.manual_seed(0)
>>> with cad.random.fork(cad.random.new_seed()) as seed:
...     first = cad.random.generator().random()
>>> with cad.random.fork(seed):
...     again = cad.random.generator().random()
>>> first == again
True
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


class _Streams(threading.local):
    def __init__(self) -> None:
        self.stack: list[np.random.Generator] = [np.random.default_rng()]


_streams = _Streams()


def generator() -> np.random.Generator:
    """The generator to draw from here: the innermost region's or step's, else the thread's."""
    return _streams.stack[-1]


def manual_seed(seed: int) -> None:
    """Reseed the calling thread's own generator (regions and steps fork from it)."""
    _streams.stack[0] = np.random.default_rng(seed)


def new_seed() -> tuple[int, ...]:
    """A fresh seed drawn from the current generator, for a region or loop to fork from."""
    return (int(generator().integers(2**63)),)


@contextmanager
def fork(seed: tuple[int, ...], *path: int) -> Iterator[tuple[int, ...]]:
    """Draw from a generator made from `seed` (and `path`, e.g. a step number) inside the
    block; the same arguments give the same stream every time."""
    stream = np.random.default_rng(np.random.SeedSequence([*seed, *path]))
    _streams.stack.append(stream)
    try:
        yield seed
    finally:
        _streams.stack.pop()
