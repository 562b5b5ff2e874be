"""Per-op policies: mix strategies inside one region, deciding primitive by primitive."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..tape import Form, Primitive
from .base import KeepAll, StoreInputs, Strategy
from .quantized import Quantized
from .storage.offload import Offload

Answer = Any  # "save", "recompute", "quantize", or a Strategy


@dataclass(frozen=True)
class Policy(Strategy):
    """Ask `decide(primitive)` how each primitive's saved values are kept.

    Answers: ``"save"`` (keep as is, preferred form), ``"recompute"`` (save only the inputs and
    recompute the output inside the rule, as `StoreInputs`), ``"quantize"`` (`quantize` below,
    8-bit by default), or any strategy object. With ``per_call=True`` it is asked
    ``decide(primitive, shapes, attrs)`` for each call (the input shapes and attributes; a
    traced scan step replays the answer for every step, so it may depend on nothing else);
    otherwise once per primitive name.

    >>> import checkpoint_ad as cad
    >>> policy = cad.strategies.Policy(
    ...     lambda prim: "save" if prim.name == "matmul" else "quantize")
    """

    decide: Callable[..., Answer]
    quantize: Strategy = field(default_factory=lambda: Quantized(bits=8))
    _cache: dict[str, Strategy] = field(default_factory=dict, repr=False, compare=False)
    # True: `decide(prim, shapes, attrs)` answers for each call, from its input shapes and
    # attributes (JAX's dots_with_no_batch_dims_saveable); shapes are None where no call is
    # known (the forms of a checkpointed region nested inside). False: once per primitive.
    per_call: bool = False

    lossless: ClassVar[bool] = False

    def for_primitive(self, prim: Primitive) -> Strategy:
        strategy = self._cache.get(prim.name)
        if strategy is None:
            answer = self.decide(prim, None, {}) if self.per_call else self.decide(prim)
            strategy = self._resolve(prim, answer)
            self._cache[prim.name] = strategy
        return strategy

    def for_call(self, prim: Primitive, shapes: tuple[tuple[int, ...], ...],
                 attrs: dict[str, Any]) -> Strategy:
        if not self.per_call:
            return self.for_primitive(prim)
        return self._resolve(prim, self.decide(prim, shapes, attrs))

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


def has_batch_dims(prim: Primitive, shapes: tuple[tuple[int, ...], ...] | None,
                   attrs: dict[str, Any]) -> bool | None:
    """Whether one call of a product (matmul, einsum: JAX's dot_general) has batch
    dimensions: an axis both operands carry, with a size other than 1 in each, that the
    output keeps (a batched matmul (b, n, k) @ (b, k, m); not x @ W with x of shape (..., n)
    and W (n, m), nor a size-1 axis broadcast against the other's). None: not a product of
    two or more operands (a one-operand einsum is no dot), or the shapes are not known."""
    if prim.name not in _PRODUCTS or shapes is None or len(shapes) < 2:
        return None
    if prim.name == "matmul":
        a, b = shapes[0][:-2], shapes[1][:-2]
        return any(x != 1 and y != 1 for x, y in zip(reversed(a), reversed(b)))
    terms, _, output = attrs["subscripts"].replace(" ", "").partition("->")
    sizes: dict[str, list[int]] = {}
    for term, shape in zip(terms.split(","), shapes):
        for letter, size in zip(term, shape):
            sizes.setdefault(letter, []).append(size)
    return any(len(sizes.get(c, ())) > 1 and 1 not in sizes[c] for c in output)


@dataclass(frozen=True)
class NoBatchDots:
    """`dots_with_no_batch_dims_saveable`'s per-call answer (and, with `offload`, that of
    `offload_dot_with_no_batch_dims`): a product with no batch dimensions is kept (or stored
    through `offload`), anything else recomputed."""

    offload: Strategy | None = None

    def __call__(self, prim: Primitive, shapes: tuple[tuple[int, ...], ...] | None,
                 attrs: dict[str, Any]) -> Answer:
        if has_batch_dims(prim, shapes, attrs) is False:
            return self.offload if self.offload is not None else "save"
        return "recompute"


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
        if self.name == "dots_with_no_batch_dims_saveable":
            return Policy(NoBatchDots(), per_call=True)
        return Policy(save_products)


nothing_saveable = NamedPolicy("nothing_saveable")
everything_saveable = NamedPolicy("everything_saveable")
dots_saveable = NamedPolicy("dots_saveable")
dots_with_no_batch_dims_saveable = NamedPolicy("dots_with_no_batch_dims_saveable")


@dataclass(frozen=True)
class OffloadDotsPolicy(NamedPolicy):
    """JAX's ``offload_dot_with_no_batch_dims(offload_src, offload_dst)``: what products
    with no batch dimensions save is stored through `Offload(level)`; everything else is
    recomputed as under `dots_with_no_batch_dims_saveable`."""

    src: str = "device"
    dst: str = "pinned_host"

    def __repr__(self) -> str:
        return (f"checkpoint_policies.{self.name}(offload_src={self.src!r}, "
                f"offload_dst={self.dst!r})")

    def strategy(self) -> Strategy | None:
        return Policy(NoBatchDots(Offload(_OFFLOAD_LEVELS[self.dst])), per_call=True)


def offload_dot_with_no_batch_dims(offload_src: str = "device",
                                   offload_dst: str = "pinned_host") -> OffloadDotsPolicy:
    """JAX's policy: the values products with no batch dimensions save go through `Offload`
    (`offload_dst` "pinned_host" or "host": host memory; "disk": the disk level); everything
    else is recomputed. `offload_src` is where the values are (JAX's "device"; accepted for
    source compatibility)."""
    _offload_level(offload_dst, "offload_dot_with_no_batch_dims")
    return OffloadDotsPolicy("offload_dot_with_no_batch_dims", offload_src, offload_dst)


def as_strategy(policy: Any) -> Strategy | None:
    """The saved-value strategy a JAX-style policy means (None: recompute the region)."""
    if policy is None:
        return None
    if isinstance(policy, NamedPolicy):
        return policy.strategy()
    if isinstance(policy, NamesPolicy):
        return None  # a region (`checkpoint` keeps the named values it says)
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


# ------------------------------------------------------------------ named values
_names: dict[int, tuple[weakref.ref, str]] = {}  # id(array) -> (the array, weakly; its name)


def checkpoint_name(x: Any, name: str) -> Any:
    """JAX's ``checkpoint_name``: `x` itself, its value named `name` for the policies
    `save_only_these_names`, `save_any_names_but_these` and `save_and_offload_only_these_names`
    (outside a region with such a policy the name does nothing).

    >>> import checkpoint_ad as cad
    >>> h = cad.checkpoint_name(cad.ones(2), "h")
    >>> h.shape
    (2,)
    """
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name: the name must be a str, got {type(name).__name__}")
    array = x._data
    key = id(array)
    _names[key] = (weakref.ref(array, lambda _, key=key: _names.pop(key, None)), name)
    return x


def name_of(array: Any) -> str | None:
    """The name `checkpoint_name` gave `array` (None: none)."""
    found = _names.get(id(array))
    return found[1] if found is not None and found[0]() is array else None


@dataclass(frozen=True)
class NamesPolicy:
    """A JAX policy over named values: a region that keeps only its inputs and the values
    named (`checkpoint_name`) as `saved` says (in memory) or `offloaded` says (through
    `Offload(level)`), and re-runs for any other value its backward reads."""

    kind: str
    names: tuple[str, ...]
    offloaded: tuple[str, ...] = ()
    level: str = "host"

    def __repr__(self) -> str:
        if self.kind == "save_and_offload_only_these_names":
            return (f"checkpoint_policies.{self.kind}(names_which_can_be_saved={self.names!r}, "
                    f"names_which_can_be_offloaded={self.offloaded!r}, level={self.level!r})")
        return f"checkpoint_policies.{self.kind}{self.names!r}"

    def storage(self, array: Any) -> Strategy | None:
        """How a value the region's first run saves is kept (None: recomputed)."""
        name = name_of(array)
        if name is None:
            return None
        if self.kind == "save_any_names_but_these":
            return _SAVE if name not in self.names else None
        if name in self.names:
            return _SAVE
        if name in self.offloaded:
            return Offload(self.level)
        return None


def _names_of(names: Any, what: str) -> tuple[str, ...]:
    names = tuple(names)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} takes names (str), got {names!r}")
    return names


def save_only_these_names(*names: str) -> NamesPolicy:
    """JAX's policy: keep the values named one of `names`, recompute everything else."""
    return NamesPolicy("save_only_these_names", _names_of(names, "save_only_these_names"))


def save_any_names_but_these(*names: str) -> NamesPolicy:
    """JAX's policy: keep every named value but those named one of `names`; recompute the
    rest."""
    return NamesPolicy("save_any_names_but_these", _names_of(names, "save_any_names_but_these"))


_OFFLOAD_LEVELS = {"pinned_host": "host", "host": "host", "disk": "disk"}


def save_and_offload_only_these_names(
    *, names_which_can_be_saved: Any, names_which_can_be_offloaded: Any,
    offload_src: str = "device", offload_dst: str = "pinned_host",
) -> NamesPolicy:
    """JAX's policy: keep values named one of `names_which_can_be_saved`, store those named
    one of `names_which_can_be_offloaded` through `Offload` (`offload_dst` "pinned_host" or
    "host": host memory; "disk": the disk level), recompute the rest. `offload_src` is
    where the values are (JAX's "device"; accepted for source compatibility)."""
    level = _offload_level(offload_dst, "save_and_offload_only_these_names")
    return NamesPolicy(
        "save_and_offload_only_these_names",
        _names_of(names_which_can_be_saved, "names_which_can_be_saved"),
        _names_of(names_which_can_be_offloaded, "names_which_can_be_offloaded"), level)


def _offload_level(offload_dst: str, what: str) -> str:
    level = _OFFLOAD_LEVELS.get(offload_dst)
    if level is None:
        raise ValueError(
            f"{what}: offload_dst={offload_dst!r}; use {', '.join(map(repr, _OFFLOAD_LEVELS))}"
        )
    return level
