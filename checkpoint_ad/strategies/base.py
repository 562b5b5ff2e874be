"""The saved-value strategies that only choose which values to keep.

The contract every saved-value strategy follows is the engine's `Strategy` (defined next to
the saving path in `checkpoint_ad/saved.py`, documented with the other kinds in `kinds.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..saved import KeepAll, Strategy
from ..tape import Form, Primitive

__all__ = ["KeepAll", "StoreInputs", "StoreOutputs", "Strategy"]


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
