"""`Offload`: keep saved values on a slower, larger storage level (host memory or disk).

Where a stored value lives is a property of its stored form, not of the strategy that chose
the value: `Offload` wraps another saved-value strategy (`inner`, e.g. ``Quantized(8)``) and
moves what it stores. Composition reads inside out: ``Offload("disk", inner=Quantized(8))``
quantizes, then writes the codes. The profiler counts an offloaded value's bytes on its level
(`Profile.level_peak_bytes`), so the device's tape bytes drop when values leave it.

Levels:
- ``"host"``: device (GPU) arrays are copied to pinned host memory on a side stream and back
  when the backward sweep reads them. A numpy array is in host memory already: on the CPU this
  level keeps values as they are (they count as device memory, which is the same memory).
- ``"disk"``: values are written to a private temporary folder (under `dir`, default the
  system's) by a background thread, the values queued together in one file (a Python loop's
  many small values cost a few files, not one each), and read back ahead of the sweep in
  reverse write order (see `disk_store.py`).
  The folder is removed when its last value is freed and at interpreter exit.

>>> import numpy as np
>>> import checkpoint_ad as cad
>>> x = cad.tensor(np.linspace(-1, 1, 1000), requires_grad=True)
>>> with cad.use(cad.strategies.Offload("disk")):
...     y = cad.tanh(cad.tanh(x)).sum()
>>> y.backward()
>>> cad.strategies.Offload("disk").folder is None  # every file gone after backward
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from ...backend import is_array
from ...backend import nbytes as array_nbytes
from ...errors import StrategyConfigError
from ...saved import KEEP, Strategy
from ...tape import Form, Primitive
from .disk_store import DiskRef, store_for
from .host_memory import device_of, to_device, to_host

__all__ = ["LEVELS", "Offload", "Offloaded"]

LEVELS = ("host", "disk")


@dataclass(eq=False, slots=True)
class Offloaded:
    """The stored form of an offloaded value: where it lives, and how to get it back (not
    frozen: made once per saved value, and a frozen dataclass's constructor costs 3x)."""

    level: str  # "device" (kept where it is), "host" or "disk"
    value: Any  # the inner stored form, its host copy, or a DiskRef
    nbytes: int
    device: int | None  # the GPU it came from (None: host memory)


@dataclass(frozen=True)
class Offload(Strategy):
    """Store saved values on storage level `level` ("host" or "disk"), through `inner`.

    ``dir`` (disk only) is the folder the private temporary folder is made in; None uses the
    system's temporary folder. ``inner`` (default: values as they are) chooses forms and codes
    values first, e.g. ``Offload("disk", inner=Quantized(8))`` writes int8 codes. Leaf values
    (parameters, input data) are kept by reference: the caller holds them anyway. Usable with
    ``use(...)`` and as a loop strategy's ``storage`` (``Binomial(8, storage=Offload("disk"))``
    writes its snapshots to disk).

    >>> from checkpoint_ad.strategies import Quantized
    >>> Offload("disk", inner=Quantized(bits=8))
    Offload(level='disk', dir=None, inner=Quantized(bits=8, group_size=128, stochastic=False, seed=None))
    """  # noqa: E501

    level: str = "host"
    dir: str | None = None
    inner: Strategy | None = None
    planned: bool = field(default=False, repr=False, compare=False)
    """Reads come in an order the caller announces with `prefetch` (a plan's snapshots)."""
    reads_ahead: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise StrategyConfigError(
                f"Offload(level={self.level!r}): the level must be one of {', '.join(LEVELS)}"
            )
        if self.dir is not None:
            if self.level != "disk":
                raise StrategyConfigError(
                    f"Offload({self.level!r}, dir={self.dir!r}): dir is the folder of the disk "
                    "level; use Offload('disk', dir=...)"
                )
            if not isinstance(self.dir, (str, os.PathLike)) or not os.path.isdir(self.dir):
                raise StrategyConfigError(
                    f"Offload('disk', dir={self.dir!r}): dir must be an existing folder (a "
                    "private temporary folder is made inside it), or None for the system's"
                )
            object.__setattr__(self, "dir", os.fspath(self.dir))
        if self.inner is not None and (
            not isinstance(self.inner, Strategy) or isinstance(self.inner, Offload)
        ):
            raise StrategyConfigError(
                f"Offload(inner={self.inner!r}): inner must be a saved-value strategy such as "
                "Quantized(8) (not another Offload: a value lives on one level), or None"
            )

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        """Exact unless `inner` is lossy: moving bytes loses nothing."""
        return self.inner is None or self.inner.lossless

    @property
    def folder(self) -> str | None:
        """The private folder the disk level writes in now (None when nothing is stored)."""
        return store_for(self.dir).folder if self.level == "disk" else None

    def for_leaf(self) -> Strategy:
        return KEEP  # the caller holds parameters and inputs anyway: moving them saves nothing

    def for_plan(self) -> Strategy:
        return self if self.planned else replace(self, planned=True)

    def choose_form(self, prim: Primitive) -> Form:
        return self.inner.choose_form(prim) if self.inner is not None else prim.forms[0]

    def pack(self, array: Any) -> Offloaded:
        if self.inner is None and type(array) is np.ndarray:  # the common case, made short
            size = array.nbytes
            if self.level == "host":
                return Offloaded("device", array, size, None)
            return Offloaded("disk", store_for(self.dir).put(array, size, self.planned), size,
                             None)
        stored = self.inner.pack(array) if self.inner is not None else array
        measured = self.inner.stored_nbytes(stored) if self.inner is not None else None
        size = array_nbytes(array) if measured is None else int(measured)
        device = device_of(stored)
        if self.level == "host":
            if device is None:  # in host memory already (numpy): nothing to move
                return Offloaded("device", stored, size, None)
            return Offloaded("host", to_host(stored), size, device)
        form = to_host(stored) if device is not None else stored
        return Offloaded("disk", store_for(self.dir).put(form, size, self.planned), size, device)

    def unpack(self, stored: Offloaded) -> Any:
        value = stored.value
        if isinstance(value, DiskRef):
            value = value.read()
        if stored.device is not None:
            value = to_device(value, stored.device)
        return self.inner.unpack(value) if self.inner is not None else value

    def stored_nbytes(self, stored: Offloaded) -> int:
        return stored.nbytes

    def stored_level(self, stored: Offloaded) -> str:
        return stored.level

    def prefetch(self, stored: list[Any]) -> None:
        refs = [s.value for s in stored if isinstance(s, Offloaded) and s.level == "disk"]
        if refs:
            refs[0].store.prefetch(refs)

    def time_io(self, array: Any) -> tuple[float, float]:
        """Seconds to write `array` to this level and read it back, measured now on the
        calling thread (how a disk level is priced before a plan is made); (0, 0) for the
        host level."""
        if self.level != "disk" or not is_array(array):
            return 0.0, 0.0
        stored = self.inner.pack(array) if self.inner is not None else array
        return store_for(self.dir).measure(stored)
