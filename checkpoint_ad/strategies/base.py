"""The storage-strategy contract and the strategies that only choose what to keep.

A strategy is a small frozen dataclass with:

- ``pack(array) -> stored`` and ``unpack(stored) -> array``: ``unpack(pack(a))`` has a's shape,
  dtype and device, and equals a exactly when ``lossless`` is True;
- ``stored_nbytes(stored) -> int``: the bytes the stored form really holds;
- ``choose_form(primitive) -> Form``: which backward form (what the rule reads: inputs, output,
  both) a primitive records under this strategy.

Apply one to a region with ``with checkpoint_ad.use(strategy):`` (innermost wins), or pass
``strategy=`` to `checkpoint` and `scan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..backend import nbytes
from ..tape import Form, Primitive


@dataclass(frozen=True)
class Strategy:
    """Keep every saved value as it is, recording each primitive's preferred form.

    Subclass it and override `pack`/`unpack`/`stored_nbytes` (and `lossless`) to change how
    values are stored, or `choose_form` to change which values are saved.
    """

    lossless: ClassVar[bool] = True

    def pack(self, array: Any) -> Any:
        return array

    def unpack(self, stored: Any) -> Any:
        return stored

    def stored_nbytes(self, stored: Any) -> int:
        return nbytes(stored)

    def choose_form(self, prim: Primitive) -> Form:
        return prim.forms[0]


@dataclass(frozen=True)
class KeepAll(Strategy):
    """Save what each rule needs, as is: the reference every other strategy is compared to."""


@dataclass(frozen=True)
class StoreInputs(Strategy):
    """Where a rule can be written from inputs or from the output, save the inputs.

    The output is recomputed from the inputs inside the rule (e.g. tanh's rule recomputes
    tanh(x)), which pays off when the inputs are kept anyway.
    """

    def choose_form(self, prim: Primitive) -> Form:
        return prim.form("inputs") or prim.forms[0]


@dataclass(frozen=True)
class StoreOutputs(Strategy):
    """Where a rule can be written from inputs or from the output, save the output.

    On chains like ``tanh(h @ W)`` the output is the next matmul's input, so one buffer serves
    both entries.
    """

    def choose_form(self, prim: Primitive) -> Form:
        return prim.form("output") or prim.form("both") or prim.forms[0]
