"""`progress()`: a progress bar over the loop steps a block runs, for long loops.

The bar ticks on the engine's 'step' event (`events`): once per step a `scan` evaluates,
recorded, replayed or run again by a checkpointing plan in the backward sweep. It listens only
inside the block and only to the calling thread, so code that asks for no bar pays nothing
(the engine emits events only while someone listens).

>>> import io
>>> import checkpoint_ad as cad
>>> with cad.progress(total=5, file=io.StringIO()) as bar:
...     _ = cad.scan(lambda h, x: (h + x, h), cad.tensor(0.0), cad.tensor([1.0] * 5))
>>> bar.n
5
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

from . import events

__all__ = ["progress"]


@contextmanager
def progress(total: int | None = None, desc: str = "steps", **options: Any) -> Iterator[tqdm]:
    """A tqdm bar counting the loop steps evaluated in this block (in this thread); `total`
    is the steps expected, if known (a plan's `evaluations` for a forward and backward under a
    loop strategy), and `options` go to tqdm (e.g. ``file=``, ``disable=``). Yields the bar."""
    bar = tqdm(total=total, desc=desc, unit="step", **options)
    stop = events.subscribe_handlers({"step": lambda _count: bar.update(1)})
    try:
        yield bar
    finally:
        stop()
        bar.close()
