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


# ------------------------------------------------------------------ JAX's named policies
_PRODUCTS = frozenset({"matmul", "einsum"})


def save_products(prim: Primitive) -> str:
    """`dots_saveable`'s answer for one primitive: keep products, recompute the rest."""
    return "save" if prim.name in _PRODUCTS else "recompute"


@dataclass(frozen=True)
class NamedPolicy:
    """One of JAX's named checkpoint policies, with the strategy it maps onto."""

    name: str

    def __repr__(self) -> str:
        return f"checkpoint_policies.{self.name}"

    def strategy(self) -> Strategy | None:
        """The storage strategy for the region, or None for a recomputed region."""
        if self.name == "nothing_saveable":
            return None
        if self.name == "everything_saveable":
            return KeepAll()
        return Policy(save_products)


nothing_saveable = NamedPolicy("nothing_saveable")
everything_saveable = NamedPolicy("everything_saveable")
dots_saveable = NamedPolicy("dots_saveable")


def as_strategy(policy: Any) -> Strategy | None:
    """The saved-value strategy a JAX-style policy means (None: recompute the region)."""
    if policy is None:
        return None
    if isinstance(policy, NamedPolicy):
        return policy.strategy()
    if isinstance(policy, Strategy):
        return policy
    if callable(policy):
        def decide(prim: Primitive) -> Any:
            answer = policy(prim)
            if isinstance(answer, bool):
                return "save" if answer else "recompute"
            return answer

        return Policy(decide)
    raise TypeError(
        f"policy must be one of checkpoint_policies (e.g. dots_saveable), a callable "
        f"taking a primitive, or a strategy; got {type(policy).__name__}"
    )
