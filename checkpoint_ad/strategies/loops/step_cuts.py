"""Where a plan's run of a step cuts history that a gradient inside the step would follow.

A plan runs a step (in its forward, and again in the backward) on tensors without history:
a copy of the carry and leaves made of the rows of `xs`. Keeping every step (a Python
loop) hands step 0 the caller's carry itself and every step rows split off `xs`. The two
agree on a gradient the step takes inside it (`grad`, `backward(inputs=...)`), unless that
gradient, in the plain loop, also flows on through the carry's or the row's history into
what it differentiates: `xs` or a captured tensor computed from the initial carry, or a
captured tensor a later step's carry was computed from. The plan's copies cut that path,
and the value would differ silently; `StepCuts.check` raises instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...entry import Entry
from ...errors import StepGradientCutError
from ...tape import edge_of

Key = tuple[int, int]


@dataclass
class StepCuts:
    """The tensors step `t`'s run takes without history, and what each stands for."""

    t: int
    seq_before: int  # entries newer than this are the step's own
    # id of a tensor cut from history -> (what it is, in words; the outer tensors whose
    # history the plain loop follows from it; None: not kept, any tensor from outside may be)
    stands_for: dict[int, tuple[str, list[Any] | None]] = field(default_factory=dict)
    # id of step 0's carry copy -> the caller's tensor it is in the plain loop
    is_caller: dict[int, Any] = field(default_factory=dict)
    # (node id, index) of an edge from outside -> (its node, kept alive so the id stays its
    # own; the keys of its history, its own included): walked once per loop
    histories: dict[Key, tuple[Any, frozenset[Key]]] = field(default_factory=dict)
    # id of a later step's carry copy -> its leaf index, and which leaves require grad in
    # the plain loop at that step (asked only for a ``backward()`` without ``inputs=``)
    carry_leaf: dict[int, int] = field(default_factory=dict)
    plain_carry_rg: Callable[[], Sequence[bool]] | None = None

    def check(self, roots: list[Any], inputs: list[Any] | None) -> None:
        """Raise `StepGradientCutError` if a gradient from the edges `roots` with respect
        to `inputs` would, in the plain loop, also flow into one of the inputs along a path
        this run cuts: through a cut tensor's history, or (for step 0's carry, which is the
        caller's tensor there) through a tensor from outside computed from it. `inputs`
        None: a ``backward()`` without ``inputs=``, which fills every leaf it reaches."""
        if inputs is None:
            self._check_every_leaf(roots)
            return
        targets: dict[Key, Any] = {}  # the inputs as the plain loop has them, from outside
        own: dict[int, Key] = {}  # id of an input cut tensor -> its target's key
        for t in inputs:
            if not hasattr(t, "_entry"):
                continue
            plain = self.is_caller.get(id(t))
            if plain is None and id(t) in self.stands_for:
                continue  # a row, or a later step's carry: no history of other inputs has it
            edge = edge_of(t if plain is None else plain)
            if edge is None or (type(edge[0]) is Entry and edge[0].seq > self.seq_before):
                continue  # made in this step
            key = (id(edge[0]), edge[1])
            targets[key] = t
            if plain is not None:
                own[id(t)] = key
        if not targets:
            return
        cuts, outside = self._reached(roots)
        for cut in cuts:
            what, outer = self.stands_for[id(cut)]
            if outer is None:
                hits = set(targets)
            else:
                hits = set().union(*(self._history(edge_of(o)) for o in outer)) & set(targets)
            hits.discard(own.get(id(cut)))
            if hits:
                raise StepGradientCutError(_message(what, self._name(targets, hits)))
        carries = set(own.values())  # the caller's carry, reached from outside the step
        if carries:
            for edge in outside:
                hits = self._history(edge) & carries
                if hits:
                    raise StepGradientCutError(_message(
                        "a tensor from outside the step computed from that carry",
                        self._name(targets, hits)))

    def _check_every_leaf(self, roots: list[Any]) -> None:
        """``backward()`` without ``inputs=`` fills the `.grad` of every leaf it reaches:
        in the plain loop it goes on through the history of the step's carry and rows into
        the tensors they were computed from (the initial carry's, `xs`', captured weights'),
        which this run's copies lack, so refuse where a cut tensor it reaches has a history
        that needs a gradient there."""
        plain_rg: Sequence[bool] | None = None
        for cut in self._reached(roots)[0]:
            what, outer = self.stands_for[id(cut)]
            if outer is not None:
                needs = any(getattr(o, "requires_grad", False) for o in outer)
            elif self.plain_carry_rg is None or id(cut) not in self.carry_leaf:
                needs = True  # not known: it may
            else:
                plain_rg = self.plain_carry_rg() if plain_rg is None else plain_rg
                needs = bool(plain_rg[self.carry_leaf[id(cut)]])
            if needs:
                raise StepGradientCutError(
                    f"a step of a checkpointed loop calls backward() without inputs= and "
                    f"reaches {what}; keeping every step (a Python loop), it would go on "
                    "through that tensor's history and add into the .grad of what it was "
                    "computed from, but this plan runs the step on a copy without that "
                    "history, so those .grad would differ. Pass inputs= (the tensors whose "
                    ".grad the step needs: checked the same way), take cad.grad(...) with "
                    "respect to them, or run this loop keeping every step (strategy=None)")

    def _name(self, targets: dict[Key, Any], hits: set[Key]) -> str:
        target = targets[next(iter(hits))]
        if id(target) in self.is_caller:
            return "the loop's initial carry"
        return f"a {target.dtype}{list(target.shape)} tensor from outside the step"

    def _reached(self, roots: list[Any]) -> tuple[list[Any], list[Any]]:
        """(the cut tensors, the edges into tensors from outside) a sweep from `roots`
        reaches through the step's own entries."""
        found: dict[int, Any] = {}
        outside: dict[Key, Any] = {}
        seen: set[int] = set()
        stack = [e for e in roots if e is not None]
        while stack:
            edge = stack.pop()
            node = edge[0]
            if id(node) in self.stands_for:
                found[id(node)] = node
            elif type(node) is Entry and node.seq > self.seq_before:
                if id(node) not in seen:
                    seen.add(id(node))
                    stack.extend(e for e in node.edges if e is not None)
            else:
                outside[(id(node), edge[1])] = edge
        return list(found.values()), list(outside.values())

    def _history(self, edge: Any) -> frozenset[Key]:
        """The keys of the history of the edge `edge` (None: none), its own included."""
        if edge is None:
            return frozenset()
        key = (id(edge[0]), edge[1])
        known = self.histories.get(key)
        if known is not None:
            return known[1]
        keys: set[Key] = set()
        stack = [edge]
        seen: set[int] = set()
        while stack:
            node, index = stack.pop()
            keys.add((id(node), index))
            if type(node) is Entry and id(node) not in seen:
                seen.add(id(node))
                stack.extend(e for e in node.edges if e is not None)
        self.histories[key] = (edge[0], frozenset(keys))
        return self.histories[key][1]


def _message(what: str, wrt: str) -> str:
    return (
        f"a step of a checkpointed loop takes a gradient (grad/backward) with respect to {wrt} "
        f"that reaches {what}; keeping every step (a Python loop), it would also flow on "
        "through that tensor's history, which was computed from what it differentiates, but "
        "this plan runs the step on a copy without that history, so the value would differ. "
        "Run this loop keeping every step (strategy=None), or give the loop xs and captured "
        "tensors not computed from the initial carry (e.g. .detach() them), and take the "
        "gradient with respect to tensors the carry was not computed from"
    )
