"""Per-op policies: mix strategies inside one region, deciding primitive by primitive."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..tape import Form, Primitive
from .base import KeepAll, StoreInputs, Strategy
from .quantized import Quantized

Answer = Any  # "save", "recompute", "quantize", or a Strategy


@dataclass(frozen=True)
class Policy(Strategy):
    """Ask `decide(primitive)` how each primitive's saved values are kept.

    Answers: ``"save"`` (keep as is, preferred form), ``"recompute"`` (save only the inputs and
    recompute the output inside the rule, as `StoreInputs`), ``"quantize"`` (`quantize` below,
    8-bit by default), or any strategy object.

    >>> import checkpoint_ad as cad
    >>> policy = cad.strategies.Policy(
    ...     lambda prim: "save" if prim.name == "matmul" else "quantize")
    """

    decide: Callable[[Primitive], Answer]
    quantize: Strategy = field(default_factory=lambda: Quantized(bits=8))
    _cache: dict[str, Strategy] = field(default_factory=dict, repr=False, compare=False)

    lossless: ClassVar[bool] = False

    def for_primitive(self, prim: Primitive) -> Strategy:
        strategy = self._cache.get(prim.name)
        if strategy is None:
            strategy = self._resolve(prim, self.decide(prim))
            self._cache[prim.name] = strategy
        return strategy

    def _resolve(self, prim: Primitive, answer: Answer) -> Strategy:
        if isinstance(answer, Strategy):
            return answer
        named = {"save": _SAVE, "recompute": _RECOMPUTE, "quantize": self.quantize}
        if answer not in named:
            raise ValueError(
                f"policy answered {answer!r} for {prim.name!r}; answer 'save', 'recompute', "
                "'quantize' or a strategy object"
            )
        return named[answer]

    def choose_form(self, prim: Primitive) -> Form:
        return self.for_primitive(prim).choose_form(prim)


_SAVE = KeepAll()
_RECOMPUTE = StoreInputs()
