"""A primitive's forms: the backward rules of each differentiable argument, with the saved values
(by name) each rule reads. What a form needs is what the saving strategy must keep."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VJP:
    """One argument's backward rule and the saved values (by name) it reads."""

    needs: tuple[str, ...]
    rule: Callable[..., Any]


def vjp(needs: str, rule: Callable[..., Any]) -> VJP:
    """Shorthand for the op tables: ``vjp("a b", lambda g, a, b: ...)``."""
    return VJP(tuple(needs.split()), rule)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: forms live in the tables
class Form:
    """A complete backward for a primitive: one rule per differentiable argument."""

    rules: dict[str, VJP]

    @functools.cached_property
    def needs(self) -> frozenset[str]:
        """The saved values (by name) the form's rules read: none means it saves nothing."""
        return frozenset(n for r in self.rules.values() for n in r.needs)

    @property
    def kind(self) -> str:
        """'none', 'inputs', 'output' or 'both': what this form saves."""
        needs = self.needs
        if not needs:
            return "none"
        if "out" not in needs:
            return "inputs"
        return "output" if needs == {"out"} else "both"


_needed: dict[tuple[Form, tuple[bool, ...]], tuple[tuple[str, int], ...]] = {}


def needed_values(
    form: Form, args: tuple[str, ...], mask: tuple[bool, ...]
) -> tuple[tuple[str, int], ...]:
    """(name, argument position or -1 for the output) of every value `form` (of a primitive
    with arguments `args`) needs when the arguments flagged in `mask` require grad; sorted,
    so slots come in a stable order. Worked out once per form and mask."""
    key = (form, mask)
    needed = _needed.get(key)
    if needed is None:
        names: set[str] = set()
        for name, requires_grad in zip(args, mask):
            rule = form.rules.get(name)
            if requires_grad and rule is not None:
                names.update(rule.needs)
        needed = _needed[key] = tuple(
            (n, -1 if n == "out" else args.index(n)) for n in sorted(names)
        )
    return needed
