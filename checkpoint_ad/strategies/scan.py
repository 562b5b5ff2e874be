"""`scan`: the unrolled loop users wrap, and the executor of checkpointing plans over it.

With a loop strategy (`Binomial`, `Periodic`, `Recompute`) the whole loop is one tape entry.
Its forward runs the steps without a tape, taking the plan's snapshots; its backward executes
the rest of the plan (restore, advance, re-run a step with a tape and back-propagate through
it, free), so at any time it holds at most the plan's snapshots plus one step's (or one
segment's) tape. Tensors the step function captures by closure get their gradients, and those
flow on down the outer tape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import events
from ..autograd import sweep
from ..backend import is_floating, namespace
from ..errors import BackwardError, ShapeError
from ..function import Function
from ..grad_mode import enable_grad, is_grad_enabled, no_grad
from ..ops.shape import stack
from ..saved import KEEP, use_packer
from ..tape import Entry, active_tapes, edge_of
from ..tensor import Tensor
from .base import Strategy
from .recompute import Recompute
from .revolve import (
    Advance,
    Free,
    Plan,
    Restore,
    Reverse,
    ReverseSegment,
    Snapshot,
    binomial_plan,
    periodic_plan,
)
from .scope import current_loop_strategy


@dataclass(frozen=True)
class Binomial:
    """Revolve checkpointing of a `scan` with at most `snapshots` stored carries.

    Optimal in recomputation for its memory (Griewank & Walther, ACM TOMS 26(1), 2000): the
    loop of n steps costs ``(r+1)*n - C(s+r, s+1)`` step evaluations, r the smallest integer
    with ``C(s+r, s) >= n`` (plus one, to hand the loop's outputs to the caller). Snapshots are
    kept with `storage` (e.g. ``Quantized(8)``; as they are by default).
    """

    snapshots: int
    storage: Strategy | None = None
    is_loop_strategy = True

    def plan(self, n_steps: int) -> Plan:
        return binomial_plan(n_steps, self.snapshots)


@dataclass(frozen=True)
class Periodic:
    """Checkpoint a `scan` every `every` steps; each segment is re-run with its tape in backward."""

    every: int
    storage: Strategy | None = None
    is_loop_strategy = True

    def plan(self, n_steps: int) -> Plan:
        return periodic_plan(n_steps, min(self.every, max(n_steps, 1)))


# ------------------------------------------------------------------ pytrees of tensors
def _flatten(tree: Any, leaves: list[Any]) -> Any:
    if tree is None or isinstance(tree, Tensor):
        leaves.append(tree)
        return "*"
    if isinstance(tree, (tuple, list)):
        return (type(tree), [_flatten(t, leaves) for t in tree])
    if isinstance(tree, dict):
        return (dict, [(k, _flatten(v, leaves)) for k, v in tree.items()])
    raise TypeError(
        f"scan carries and outputs may be Tensors, None, or tuples/lists/dicts of them; got "
        f"{type(tree).__name__} (wrap numbers with checkpoint_ad.tensor)"
    )


def _unflatten(spec: Any, leaves: Any) -> Any:
    if spec == "*":
        return next(leaves)
    kind, parts = spec
    if kind is dict:
        return {k: _unflatten(s, leaves) for k, s in parts}
    return kind(_unflatten(s, leaves) for s in parts)


def _leaves(tree: Any) -> tuple[list[Any], Any]:
    leaves: list[Any] = []
    return leaves, _flatten(tree, leaves)


# ------------------------------------------------------------------ the loop
class _Unstack(Function):
    """Split a tensor along its first axis; the backward stacks the pieces' gradients."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(Tensor._wrap(x._data[t]) for t in range(x.shape[0]))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Tensor:
        return stack(list(grads), axis=0)


@dataclass
class _Loop:
    step: Callable[[Any, Any], Any]
    carry_spec: Any
    xs_leaves: list[Any]
    xs_spec: Any
    n: int
    y_spec: Any = None
    evaluations: int = 0

    def x_at(self, t: int) -> Any:
        """The scanned input of step t, without history (for re-runs under a plan)."""
        if self.xs_spec is None:
            return None
        parts = [None if x is None else Tensor._wrap(x._data[t]) for x in self.xs_leaves]
        return _unflatten(self.xs_spec, iter(parts))

    def all_x(self) -> list[Any]:
        """Every step's input, split off xs by one differentiable operation per leaf (so the
        backward stacks the step gradients once instead of scattering into xs at every step)."""
        if self.xs_spec is None:
            return [None] * self.n
        columns = []
        for x in self.xs_leaves:
            if x is None:
                columns.append([None] * self.n)
            elif x.requires_grad and is_grad_enabled():
                columns.append(list(_Unstack.apply(x)))
            else:
                columns.append([Tensor._wrap(x._data[t]) for t in range(self.n)])
        return [_unflatten(self.xs_spec, iter(row)) for row in zip(*columns)]

    def call(self, t: int, carry_leaves: list[Any], x: Any) -> tuple[list[Any], list[Any]]:
        self.evaluations += 1
        carry, y = self._checked(self.step(_unflatten(self.carry_spec, iter(carry_leaves)), x), t)
        new_leaves, spec = _leaves(carry)
        if spec != self.carry_spec:
            raise ShapeError(
                f"scan: step {t} returned a carry structured as {spec}, but the initial carry "
                f"is {self.carry_spec}; the carry must keep its structure"
            )
        y_leaves, y_spec = _leaves(y)
        if self.y_spec is None:
            self.y_spec = y_spec
        elif y_spec != self.y_spec:
            raise ShapeError(f"scan: step {t} returned outputs structured as {y_spec}, "
                             f"step 0 as {self.y_spec}; every step must return the same structure")
        return new_leaves, y_leaves

    @staticmethod
    def _checked(result: Any, t: int) -> tuple[Any, Any]:
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(f"scan: step must return (carry, y); step {t} returned {result!r:.80}")
        return result


def _stack_outputs(per_step: list[list[Any]]) -> list[Any]:
    """Each output leaf stacked over the steps (None leaves stay None)."""
    return [None if c[0] is None else stack(c, axis=0) for c in _columns(per_step)]


def scan(
    step: Callable[[Any, Any], Any],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    strategy: Any = None,
) -> tuple[Any, Any]:
    """Run ``carry, y = step(carry, x)`` over the leading axis of `xs`; return (carry, ys).

    Semantics of JAX's `lax.scan`: carries and outputs may be Tensors, None, or tuples, lists
    and dicts of them; `ys` stacks each output along a new leading axis. `strategy` (or the
    innermost loop strategy given to `use`) says how the loop is checkpointed: None keeps every
    step's tape; `Binomial(s)`, `Periodic(k)` and `Recompute()` trade recomputation for memory;
    a storage strategy (e.g. `Quantized`) applies to the values every step saves.

    >>> import checkpoint_ad as cad
    >>> w = cad.tensor(0.5, requires_grad=True)
    >>> carry, ys = cad.scan(lambda h, x: (cad.tanh(h * w + x),) * 2, cad.tensor(0.0),
    ...                      xs=cad.tensor([1.0, 2.0, 3.0]), strategy=cad.strategies.Binomial(2))
    >>> ys.shape
    (3,)
    """
    carry_leaves, carry_spec = _leaves(init)
    xs_leaves, xs_spec = ([], None) if xs is None else _leaves(xs)
    n = _length(xs_leaves, length)
    loop = _Loop(step, carry_spec, xs_leaves, xs_spec, n)
    if strategy is None:
        strategy = current_loop_strategy()
    if isinstance(strategy, Recompute):
        strategy = Periodic(1)
    if n == 0:
        return init, None
    if strategy is None or not getattr(strategy, "is_loop_strategy", False):
        if strategy is not None:
            with use_packer(strategy):
                return _keep_all(loop, carry_leaves)
        return _keep_all(loop, carry_leaves)
    if not is_grad_enabled():  # nothing will be differentiated: no plan needed
        return _keep_all(loop, carry_leaves)
    return _PlannedScan(loop, strategy).run(carry_leaves)


def _length(xs_leaves: list[Any], length: int | None) -> int:
    sizes = {x.shape[0] for x in xs_leaves if x is not None and x.ndim > 0}
    if len(sizes) > 1:
        raise ShapeError(f"scan: xs leaves have different leading lengths {sorted(sizes)}")
    if length is not None:
        if not isinstance(length, int) or length < 0:
            raise ValueError(f"scan: length must be a non-negative int, got {length!r}")
        if sizes and sizes != {length}:
            raise ShapeError(f"scan: length={length} but xs has leading length {sizes.pop()}")
        return length
    if not sizes:
        raise ValueError("scan needs xs with a leading axis to scan over, or length=")
    return sizes.pop()


def _keep_all(loop: _Loop, carry_leaves: list[Any]) -> tuple[Any, Any]:
    per_step = []
    for t, x in enumerate(loop.all_x()):
        carry_leaves, y_leaves = loop.call(t, carry_leaves, x)
        per_step.append(y_leaves)
    ys = _stack_outputs(per_step)
    return _unflatten(loop.carry_spec, iter(carry_leaves)), _unflatten(loop.y_spec, iter(ys))


class _PlannedScan:
    """Runs a loop under a checkpointing plan: one tape entry for the whole loop."""

    def __init__(self, loop: _Loop, strategy: Any) -> None:
        self.loop = loop
        self.strategy = strategy
        self.storage = strategy.storage or KEEP
        self.plan = strategy.plan(loop.n)
        self.name = f"scan[{type(strategy).__name__.lower()}]"
        self.snapshots: dict[int, list[Any]] = {}
        self.same: dict[int, int] = {}
        self.externals: dict[tuple[int, int], Any] = {}

    # ------------------------------------------------------------- forward
    def run(self, carry_leaves: list[Any]) -> tuple[Any, Any]:
        loop = self.loop
        self.carry_rg = [t is not None and t.requires_grad for t in carry_leaves]
        self.carry_meta = [None if t is None else (t.shape, t.dtype) for t in carry_leaves]
        state = [None if t is None else t._data for t in carry_leaves]
        position = 0
        actions = self.plan  # decoded action by action: a 10^6-step plan stays compact
        cursor = 0
        per_step: list[list[Any]] = []
        while cursor < len(actions) and not isinstance(actions[cursor], (Reverse, ReverseSegment)):
            action = actions[cursor]
            if isinstance(action, Snapshot):
                self.snapshots[action.step] = self._pack(state)
            elif isinstance(action, Advance):
                for t in range(action.start, action.stop):
                    state, ys = self._forward_step(t, state)
                    per_step.append(ys)
                position = action.stop
            cursor += 1
        self.cursor = cursor
        self.current = state  # the state in hand that the first reverse action starts from
        for t in range(position, loop.n):
            state, ys = self._forward_step(t, state)
            per_step.append(ys)
        final = [None if a is None else Tensor._wrap(a) for a in state]
        outputs = final + [
            None if c[0] is None else namespace(c[0]).stack(c, axis=0) for c in _columns(per_step)
        ]
        return self._record(carry_leaves, outputs, len(final))

    def _forward_step(self, t: int, state: list[Any]) -> tuple[list[Any], list[Any]]:
        loop = self.loop
        if t == 0:
            self._seq_before = _next_seq()
            carry = self._as_tensors(state, grad=True)
            x = self._x_tensors(t)
            with enable_grad():
                new, ys = loop.call(t, carry, x)
            inputs = carry + (_leaves(x)[0] if x is not None else [])
            self.externals = self._discover(new + ys, inputs)
            # outputs that are the new carry itself (RNNs return h, h): their adjoints are
            # added in the order a plain tape would add them
            self.same = {k: next(j for j, c in enumerate(new) if c is y)
                         for k, y in enumerate(ys) if y is not None and any(c is y for c in new)}
        else:
            with no_grad():
                new, ys = loop.call(t, self._as_tensors(state, grad=False), loop.x_at(t))
        return [None if v is None else v._data for v in new], [
            None if y is None else y._data for y in ys
        ]

    def _as_tensors(self, state: list[Any], grad: bool) -> list[Any]:
        out = []
        for array, rg in zip(state, self.carry_rg):
            if array is None:
                out.append(None)
                continue
            t = Tensor._wrap(array)
            t._requires_grad = grad and (rg or is_floating(array.dtype))
            out.append(t)
        return out

    def _x_tensors(self, t: int) -> Any:
        loop = self.loop
        if loop.xs_spec is None:
            return None
        parts = []
        for x in loop.xs_leaves:
            if x is None:
                parts.append(None)
                continue
            part = Tensor._wrap(x._data[t])
            part._requires_grad = x.requires_grad
            parts.append(part)
        return _unflatten(loop.xs_spec, iter(parts))

    def _discover(self, outputs: list[Any], step_inputs: list[Any]) -> dict[Any, Any]:
        """The tensors outside the loop that a step's tape reaches (closure captures)."""
        inside = {id(c) for c in step_inputs if c is not None}
        stack_ = [o._entry for o in outputs if o is not None and o._entry is not None]
        seen: set[int] = set()
        found = {}
        while stack_:
            entry = stack_.pop()
            if id(entry) in seen:
                continue
            seen.add(id(entry))
            for edge in entry.edges:
                if edge is None:
                    continue
                node, index = edge
                if type(node) is Entry:
                    if node.seq > self._seq_before:  # recorded by the step examined
                        stack_.append(node)
                    else:
                        found[(id(node), index)] = edge
                elif id(node) not in inside:
                    found[(id(node), index)] = edge
        return found

    def _pack(self, state: list[Any]) -> list[Any]:
        return [None if a is None else self.storage.pack(a) for a in state]

    def _unpack(self, stored: list[Any]) -> list[Any]:
        return [None if s is None else self.storage.unpack(s) for s in stored]

    def _record(self, carry_leaves: list[Any], outputs: list[Any], n_carry: int) -> Any:
        loop = self.loop
        inputs = [*carry_leaves, *loop.xs_leaves]
        edges = [None if t is None else edge_of(t) for t in inputs] + list(self.externals.values())
        entry = Entry(self, tuple(edges), {})
        arrays = [None if o is None else (o._data if isinstance(o, Tensor) else o)
                  for o in outputs]
        entry.out_meta = tuple(
            ((), None) if a is None else (tuple(a.shape), a.dtype) for a in arrays
        )
        self.n_inputs = len(inputs)
        results = [None if a is None else Tensor._wrap(a, entry=entry, index=i)
                   for i, a in enumerate(arrays)]
        for tape in active_tapes:
            tape._entries.append(entry)
        carry = _unflatten(loop.carry_spec, iter(results[:n_carry]))
        ys = _unflatten(loop.y_spec, iter(results[n_carry:])) if loop.y_spec is not None else None
        return carry, ys

    # ------------------------------------------------------------- backward
    def backward(self, entry: Entry, grads: list[Any], create_graph: bool) -> list[Any]:
        if create_graph:
            raise BackwardError(
                f"{self.name} does not support create_graph=True (higher-order gradients "
                "through a checkpointed loop); use scan without a loop strategy for those"
            )
        if self.cursor is None:
            raise BackwardError(
                f"trying to backward through {entry.describe()} a second time; its snapshots "
                "were freed by the first backward; pass retain_graph=True to keep them"
            )
        loop = self.loop
        n_carry = len(self.carry_meta)
        adj_carry = [None if g is None else g for g in grads[:n_carry]]
        adj_ys = grads[n_carry:]
        adj_xs: list[list[Any]] = [[None] * loop.n for _ in loop.xs_leaves]
        adj_ext: dict[tuple[int, int], Any] = {}
        self.owned: dict[int, Any] = {}  # gradient sums made here, safe to add into in place
        state = self.current
        for index in range(self.cursor, len(self.plan)):
            action = self.plan[index]
            if isinstance(action, Snapshot):
                self.snapshots[action.step] = self._pack(state)
            elif isinstance(action, Advance):
                if events.listeners:
                    events.emit("recompute_begin", self.name)
                with no_grad():
                    for t in range(action.start, action.stop):
                        new, _ = loop.call(t, self._as_tensors(state, False), loop.x_at(t))
                        state = [None if v is None else v._data for v in new]
                if events.listeners:
                    events.emit("recompute_end", self.name)
            elif isinstance(action, Restore):
                state = self._unpack(self.snapshots[action.step])
            elif isinstance(action, Free):
                del self.snapshots[action.step]
            elif isinstance(action, (Reverse, ReverseSegment)):
                start = action.step if isinstance(action, Reverse) else action.start
                stop = start + 1 if isinstance(action, Reverse) else action.stop
                adj_carry = self._reverse(start, stop, state, adj_carry, adj_ys, adj_xs, adj_ext)
                state = None
        self.cursor = None
        self.owned = {}  # the sums now leave as gradients: never touch them again
        self.current = None
        self.snapshots.clear()
        results = []
        for i, meta in enumerate(self.carry_meta):
            results.append(None if meta is None else adj_carry[i])
        for k, x in enumerate(loop.xs_leaves):
            if x is None or not x.requires_grad:
                results.append(None)
                continue
            xp = namespace(x._data)
            rows = [xp.zeros(x.shape[1:], dtype=x.dtype) if g is None else g for g in adj_xs[k]]
            results.append(xp.stack(rows, axis=0))
        for key in self.externals:
            results.append(adj_ext.get(key))
        return results

    def _reverse(
        self,
        start: int,
        stop: int,
        state: list[Any],
        adj_carry: list[Any],
        adj_ys: list[Any],
        adj_xs: list[list[Any]],
        adj_ext: dict[tuple[int, int], Any],
    ) -> list[Any]:
        """Re-run steps start..stop-1 with a tape and back-propagate through them."""
        loop = self.loop
        carry_in = self._as_tensors(state, grad=True)
        carry = carry_in
        x_parts: list[tuple[int, list[Any]]] = []
        y_out: list[tuple[int, list[Any]]] = []
        self._seq_before = _next_seq()
        if events.listeners:
            events.emit("recompute_begin", self.name)
        with enable_grad():
            for t in range(start, stop):
                x = self._x_tensors(t)
                carry, ys = loop.call(t, carry, x)
                x_parts.append((t, _leaves(x)[0] if x is not None else []))
                y_out.append((t, ys))
        if events.listeners:
            events.emit("recompute_end", self.name)
        produced = carry + [y for _, ys in y_out for y in ys]
        found = self._discover(produced, carry_in + [p for _, parts in x_parts for p in parts])
        if not set(found) <= set(self.externals):
            raise BackwardError(
                f"scan: steps {start}..{stop - 1} used tensors from outside the loop that step 0 "
                "did not use; with a checkpointing strategy every step must capture the same "
                "tensors (pass values that vary by step through xs instead)"
            )
        roots = []
        for c, g in zip(carry, adj_carry):
            if c is not None and g is not None and c.requires_grad:
                roots.append((edge_of(c), g))
        for t, ys in y_out:
            for k, (y, g) in enumerate(zip(ys, adj_ys)):
                if t == stop - 1 and stop < loop.n and k in self.same:
                    continue  # already added into adj_carry when the next step was reversed
                if y is not None and g is not None and y.requires_grad:
                    roots.append((edge_of(y), g[t]))
        capture: dict[tuple[int, int], int] = {}
        for c in carry_in:
            if c is not None and c.requires_grad:
                capture[(id(c), 0)] = len(capture)
        for _, parts in x_parts:
            for p in parts:
                if p is not None and p.requires_grad:
                    capture[(id(p), 0)] = len(capture)
        for key in self.externals:
            capture.setdefault(key, len(capture))
        # carry on adding each captured tensor's gradient in the order a plain tape would
        initial: list[Any] = [None] * len(capture)
        if start > 0:
            for k, j in self.same.items():
                c = carry_in[j]
                if c is not None and c.requires_grad and adj_ys[k] is not None:
                    initial[capture[(id(c), 0)]] = adj_ys[k][start - 1]
        for key in self.externals:
            initial[capture[key]] = adj_ext.get(key)
        captured = (
            sweep(roots, retain_graph=False, create_graph=False, capture=capture, initial=initial,
                  owned=self.owned)
            if roots
            else initial
        )
        new_adj = []
        for c in carry_in:
            keep = c is not None and c.requires_grad
            new_adj.append(captured[capture[(id(c), 0)]] if keep else None)
        for t, parts in x_parts:
            for k, p in enumerate(parts):
                if p is not None and p.requires_grad:
                    adj_xs[k][t] = captured[capture[(id(p), 0)]]
        for key in self.externals:
            if captured[capture[key]] is not None:
                adj_ext[key] = captured[capture[key]]
        return new_adj


def _columns(per_step: list[list[Any]]) -> list[list[Any]]:
    if not per_step:
        return []
    return [[ys[k] for ys in per_step] for k in range(len(per_step[0]))]


def _next_seq() -> int:
    from ..tape import _sequence

    return next(_sequence)
