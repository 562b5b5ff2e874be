"""The plan executor: runs a `scan` under a loop strategy's plan as one tape entry.

Its forward runs the steps without a tape, taking the plan's snapshots; its backward executes
the rest of the plan (restore, advance, re-run a step with a tape and back-propagate through
it, free), so at any time it holds at most the plan's snapshots plus one step's (or one
segment's) tape. Tensors the step function captures by closure get their gradients, and those
flow on down the outer tape. Snapshots are saved values of the loop's entry (packed through
the one saving path with the strategy's `storage`), so the profiler sees them.
"""

from __future__ import annotations

from typing import Any

from .. import events
from ..autograd import Capture, backpropagate
from ..backend import is_floating, namespace
from ..errors import BackwardError
from ..grad_mode import enable_grad, no_grad
from ..pytree import flatten, unflatten
from ..saved import KEEP, SavedSlot, pack_value
from ..tape import Entry, add_entry, edge_of, next_sequence
from ..tensor import Tensor
from .kinds import LoopStrategy
from .loop import StepLoop, columns
from .revolve import Advance, Free, Restore, Reverse, ReverseSegment, Snapshot


class PlannedLoop:
    """Runs a loop under a checkpointing plan: one tape entry for the whole loop."""

    def __init__(self, loop: StepLoop, strategy: LoopStrategy) -> None:
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
            None if c[0] is None else namespace(c[0]).stack(c, axis=0) for c in columns(per_step)
        ]
        return self._record(carry_leaves, outputs, len(final))

    def _forward_step(self, t: int, state: list[Any]) -> tuple[list[Any], list[Any]]:
        loop = self.loop
        if t == 0:
            self._seq_before = next_sequence()
            carry = self._as_tensors(state, grad=True)
            x = self._x_tensors(t)
            with enable_grad():
                new, ys = loop.call(t, carry, x)
            inputs = carry + (flatten(x)[0] if x is not None else [])
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
        return unflatten(loop.xs_spec, iter(parts))

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
        return [None if a is None else pack_value(a, self.storage) for a in state]

    def _unpack(self, stored: list[Any]) -> list[Any]:
        return [None if s is None else s.unpack() for s in stored]

    def _snapshot_slots(self, entry: Entry, results: list[Any]) -> tuple[SavedSlot, ...]:
        """The snapshots held when the loop's entry is recorded, as its saved values."""
        return tuple(
            SavedSlot(f"snapshot{step}.{k}", buffer, None, None)
            for step, buffers in sorted(self.snapshots.items())
            for k, buffer in enumerate(buffers)
            if buffer is not None
        )

    def _record(self, carry_leaves: list[Any], outputs: list[Any], n_carry: int) -> Any:
        loop = self.loop
        inputs = [*carry_leaves, *loop.xs_leaves]
        edges = [None if t is None else edge_of(t) for t in inputs] + list(self.externals.values())
        arrays = [None if o is None else (o._data if isinstance(o, Tensor) else o)
                  for o in outputs]
        self.n_inputs = len(inputs)
        results = add_entry(self, tuple(edges), arrays, {}, self._snapshot_slots)
        carry = unflatten(loop.carry_spec, iter(results[:n_carry]))
        ys = unflatten(loop.y_spec, iter(results[n_carry:])) if loop.y_spec is not None else None
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
        entry.slots = ()  # the plan frees snapshots as it goes: the entry must not keep them
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
        self._seq_before = next_sequence()
        if events.listeners:
            events.emit("recompute_begin", self.name)
        with enable_grad():
            for t in range(start, stop):
                x = self._x_tensors(t)
                carry, ys = loop.call(t, carry, x)
                x_parts.append((t, flatten(x)[0] if x is not None else []))
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
        sink = Capture(capture, initial=initial, owned=self.owned)
        if roots:
            backpropagate(roots, retain_graph=False, create_graph=False, capture=sink)
        captured = sink.values
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


