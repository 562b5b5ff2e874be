"""The plan executor: runs a `scan` under a loop strategy's plan as one tape entry.

Its forward runs the steps without a tape, taking the plan's snapshots, except the last step
(or segment), which it runs with a tape kept for the first reverse action: so a loop costs
exactly the plan's step evaluations. A loop of unknown length (``until=``) grows its plan as
it goes: every step runs with a tape, kept until the next step is announced to the loop
strategy's online planner, whose answer (take or drop snapshots of the kept tape's starting
state, then drop the tape) is executed and appended to the plan; when `until` stops the loop,
the planner's reversal completes the plan and the kept tape serves its first reverse action.
From there on (backward, rebuilds) the grown plan is run like any other.

Its backward executes the rest of the plan (restore, advance, re-run a step with a tape and pull
the adjoint back through it, free), holding at most the plan's snapshots plus one step's (or one
segment's) tape. Snapshots are saved values of the loop's entry, packed through the one saving
path with the strategy's `storage`, so the profiler sees them.

What makes the loop's gradients the same as keeping every step's tape:
- every step draws its randomness from a generator forked for that step (`StepLoop.call`), and
  numpy's global random state is stored with each snapshot and restored with it;
- the initial carry, `xs` and the tensors the step captures are version-checked before the
  backward re-runs anything (a value changed in place raises `SavedValueModifiedError`);
- outputs that are the new carry itself (or several times the same tensor) add their adjoints;
- with `retain_graph` the backward works on copies and leaves the forward's state as it was;
  an exception in a re-run leaves the loop rebuildable (the next backward re-runs the forward
  part of the plan from the initial carry), so a retry works;
- under `create_graph` the loop is re-run once with a tape from its real inputs (higher-order
  gradients need every step's graph anyway) and differentiated like a plain loop;
- a step run for its values alone drops the hooks it registers (the run its reverse pulls back
  registers them again, and they fire there), a re-run's `retain_grad()` fills the tensor the
  forward made, and a step that takes a gradient inside it runs with a tape even then
  (`loop.PlannedStep`).

The class holds the loop's state and its tape entry's interface (`run`, `backward`,
`adds_onto`); the parts, each a module of functions taking the executor:
- `loop_forward`: the plan's forward, up to its first reverse action (or a growing plan's);
- `loop_backward`: the rest of the plan in the backward, and the backward with a graph;
- `loop_pull_back`: the pull-back of one reverse action's segment, taped or replayed;
- `loop_steps`: running one step (recorded, traced, for its values) or taping a segment,
  and the tensors step 0 captures;
- `loop_snapshots`: snapshots, their storage and the random states they carry;
- `loop_guards`: the version checks of what the backward reads again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from ... import random
from ...ops import concatenate, expand_dims
from ...pytree import unflatten
from ...saved import KEEP, PackedBuffer, SavedSlot, current_packer, freed_error
from ...tape import Entry, add_entry, edge_of, next_sequence
from ...tensor import Tensor
from ...tensor_base import make_tensor
from ..kinds import LoopStrategy
from ..plans.revolve import Action
from .grad_flow import Deps, deps_of_program, outputs_requiring_grad
from .loop import StepLoop, as_row, row
from .loop_backward import backward_with_graph, run_backward
from .loop_forward import (
    ForwardState,
    forward_step,
    replay_forward,
    run_forward_prefix,
    run_growing_plan,
    run_kept_until,
    stops,
    take_back_kept_hooks,
)
from .loop_guards import (
    check_versions,
    find_changes,
    find_guards,
    guard_final_carry,
    refuse_changes,
)
from .loop_snapshots import disk_storage_for, measure_costs, same_numpy_state, snapshot_object_bytes
from .loop_steps import ReplayedSegment, TapedSegment, arrays_of
from .output_rows import OutputRows, join_rows
from .program_cache import Place, find
from .step_program import StepProgram, Trace

# what other modules import from here (defined in the loop_* modules some of them)
__all__ = ["PlannedLoop", "replay_forward", "snapshot_object_bytes", "stops"]


class PlannedLoop:
    """Runs a loop under a checkpointing plan: one tape entry for the whole loop."""

    def __init__(
        self,
        loop: StepLoop,
        strategy: LoopStrategy,
        until: Callable[[Any], Any] | None = None,
        limit: int | None = None,
        trace: bool = True,
        program: StepProgram | None = None,
        name: str | None = None,
        lead_rows: Sequence[list[Any]] = (),
        mode: str = "replayed",
        cached: bool = True,
        keeps_every_step: bool = False,
    ) -> None:
        """`until` (with at most `limit` steps, None for no limit) makes the loop's length
        known only as it runs: the plan then grows step by step (see the module's doc).
        `program` replays every step from the start: a step program traced from a step
        recorded on the tape just before (`scan` keeping every step), whose output is the
        initial carry here; `mode` says where it came from. `lead_rows`: the outputs (arrays)
        of steps recorded before the loop, which its output arrays make room for first (see
        `full_outputs`). `cached=False` neither reuses a program an earlier call kept nor
        keeps this one's (`program_cache`): a trial run that must leave the next call as a
        first call. `keeps_every_step` (with `until`): every step's tape is kept, one
        segment as long as the loop runs (`scan` keeping every step), nothing planned online."""
        self.loop = loop
        if loop.holders is not None:  # planned by a budget: it counts this loop's bytes
            loop.holders.append(weakref.ref(self))
        self.cached = cached
        self.lead_rows = lead_rows
        self.full_outputs: list[Any] | None = None  # after run(): lead and own rows per output
        self.strategy = strategy
        self.storage = (strategy.storage or KEEP).for_plan()
        self.disk_storage = disk_storage_for(self.storage)
        # the saved-value strategy in effect where the loop runs: its steps keep their values
        # with it, also when the backward re-runs them outside that `use` block
        self.step_packer = current_packer()
        self.quiet: bool | None = None  # `loop_snapshots.draws_nothing`, once there is a program
        self.until = until
        self.limit = limit
        self.keeps_every_step = keeps_every_step
        self.planner = (strategy.online_planner() if until is not None and not keeps_every_step
                        else None)
        # made in run(): a disk level may need the loop timed first; a growing plan is
        # complete when `until` stops the loop
        self.plan: Sequence[Action] | Any = None
        self.restore_at: np.ndarray | None = None
        self.name = name or f"scan[{type(strategy).__name__.lower()}]"
        self.same: dict[int, int] = {}
        self.externals: dict[tuple[int, int], Any] = {}
        self.discovered = False  # externals (and carry aliases) found
        self.keys_found: Any = None  # see `loop_pull_back.replay_keys`
        self.fixed_keys: Any = None  # see `loop_pull_back.segment_keys`
        # hooks a re-run registered on a segment's input carry, by its first step: they go
        # onto the earlier segment's output carry (`loop_pull_back.pull_back`)
        self.carry_hooks: dict[int, list[tuple[int, dict[int, Any]]]] = {}
        # while not None, the hooks the steps run now register (see `run_growing_plan`)
        self.step_hooks: list[Any] | None = None
        # (step, call) -> the `loop.HookSlot` of a hook its step registers on a tensor from
        # before the loop
        self.hook_slots: dict[tuple[int, int], Any] = {}
        self.state: ForwardState | None = None
        self.consumed = False
        self.reruns = True  # whether the backward runs steps again (found in run(): `loop_guards`)
        self.tracks_numpy = False  # set when the steps draw from numpy's global random state
        # the engine's state the latest snapshot holds (see `loop_snapshots.take_snapshot`)
        self.last_engine_state: random.GeneratorState | None = None
        # steps 0 and 1 are traced; when they give one program, later steps are replayed
        self.traces: dict[int, Trace] | None = {} if trace else None
        self.place: Place | None = None  # where an earlier call's program may wait (run())
        # version counters of the tensors from outside the loop that step 0 read (found by
        # its trace, also a refused one): what a re-run reads again (see `loop_guards`)
        self.outside: dict[int, tuple[Any, Any, Any]] | None = None
        self.step0_trace: Trace | None = None  # its changes in place (see `find_changes`)
        self.changes: str | None = None  # what the steps change in place that re-runs read
        self.step_deps: tuple[list[Deps], list[Deps]] | None = None  # a recorded step 0's
        self.program: StepProgram | None = None
        self.mode = "recorded: trace=False" if not trace else "recorded: not traced yet"
        self.carry_made = program is not None  # the carry is a recorded step's output
        # the loop's first forward runs now (its tensors are the caller's); the tensors its
        # steps called retain_grad() on, per step (see `PlannedStep`)
        self.first_run = True
        self.retained: dict[int, list[Any]] = {}
        # retained inputs of runs pulled back, made leaves by the plan (see `PlannedStep`),
        # and those a later segment's first step retained, by its start: they go onto the
        # earlier segment's output carry (`loop_pull_back.pull_back`)
        self.retained_leaves: dict[int, Any] = {}
        self.carry_retained: dict[int, list[tuple[int, list[Any]]]] = {}
        # id of a tensor from outside -> its history's keys (see `step_cuts.py`)
        self.histories: dict[tuple[int, int], Any] = {}
        # what the first run's recorded steps did with the carry (`loop_steps.note_carry`):
        # per leaf, whether each returned it unchanged; and the last one's (step, leaves
        # that are one tensor: leaf -> the first leaf it is)
        self.carry_passed: list[bool] | None = None
        self.last_carry: tuple[int, tuple[int, ...], dict[int, Any]] | None = None
        # the final carry's leaves that are the caller's tensors (`_final_carry_as_a_python_loop`)
        self.final_passed: list[bool] = []
        if program is not None:
            self.traces = None
            self.program = program
            self.mode = mode
            self.externals = dict(program.external_edges)
            self.same = program.carry_aliases()
            self.discovered = True

    # ------------------------------------------------------------- forward
    def run(self, carry_leaves: list[Any]) -> tuple[Any, Any]:
        loop = self.loop
        self.seq_started = next_sequence()  # what is older comes from outside the loop
        self.carry_inputs = carry_leaves
        self.carry_rg = [t is not None and t.requires_grad for t in carry_leaves]
        self.carry_meta = [None if t is None else (t.shape, t.dtype) for t in carry_leaves]
        self.initial = [None if t is None else t._data for t in carry_leaves]
        self.initial_engine_state = random.get_state()
        self.initial_numpy_state = np.random.get_state()
        if self.traces is not None and loop.n != 1 and self.cached:
            self.place = find(loop.step, "planned", carry_leaves, loop.xs_leaves)
        if self.until is None:
            self.plan = self.strategy.plan_for_loop(loop.n, partial(measure_costs, self))
            per_step = run_forward_prefix(self, discover=True)
        elif self.keeps_every_step:
            per_step = run_kept_until(self)
        else:
            self.plan = []
            per_step = run_growing_plan(self)
        state = self.state
        assert state is not None
        final = state.kept.carry_out if state.kept is not None else None
        if final is None:  # no taped end: run the remaining steps to hand the outputs over
            arrays = state.current
            for t in range(len(per_step), loop.n):
                arrays, ys = forward_step(self, t, arrays, discover=True)
                per_step.append(ys)
            final_arrays = arrays
        else:
            final_arrays = arrays_of(final)
        self.guards, self.input_guards = find_guards(self, carry_leaves)
        self.first_run = False
        loop.release_rows()
        self.changes = find_changes(self)
        if not same_numpy_state(np.random.get_state(), self.initial_numpy_state):
            # the steps draw from numpy's global state (rare, and costly to keep: 40 us a
            # get or set): take the forward part of the plan again, keeping it this time
            end_state = np.random.get_state()
            self.tracks_numpy = True
            take_back_kept_hooks(state)  # its tape is taken again
            run_forward_prefix(self, discover=False, rows=OutputRows(loop.n, keep=False))
            np.random.set_state(end_state)
            state = self.state
        outputs = list(final_arrays) + per_step.stacked(self.same)
        if per_step.lead:  # for the caller's join (the entry keeps no outputs otherwise)
            self.full_outputs = per_step.full()
        return self._record(carry_leaves, outputs, len(final_arrays), per_step)

    # ------------------------------------------------------------- the loop's entry
    @property
    def evaluations(self) -> int:
        """Step evaluations so far, recorded or replayed (the plan's count once done)."""
        return self.loop.evaluations

    def _snapshot_slots(self, entry: Entry, results: list[Any]) -> tuple[SavedSlot, ...]:
        """The snapshots held when the loop's entry is recorded, as its saved values."""
        assert self.state is not None
        return tuple(
            SavedSlot(f"snapshot{step}.{k}", buffer, None, None)
            for step, snapshot in sorted(self.state.snapshots.items())
            for k, buffer in enumerate(snapshot.buffers)
            if buffer is not None
        )

    def _record(self, carry_leaves: list[Any], outputs: list[Any], n_carry: int,
                rows: OutputRows) -> Any:
        loop = self.loop
        inputs = [*carry_leaves, *loop.xs_leaves]
        edges = [None if t is None else edge_of(t) for t in inputs] + list(self.externals.values())
        self.n_inputs = len(inputs)
        # the entry says how the loop ran ("replayed", or "recorded: <why>"), for inspection
        results = add_entry(self, tuple(edges), outputs, {"mode": self.mode},
                            self._snapshot_slots)
        results = self._detach_constant_outputs(results, n_carry)
        self._share_packed_carry(results[:n_carry])
        guard_final_carry(self, results[:n_carry])
        results[:n_carry] = self._final_carry_as_a_python_loop(carry_leaves, results[:n_carry])
        results = self._last_rows_from_carry(results, n_carry, rows)
        carry = unflatten(loop.carry_spec, iter(results[:n_carry]))
        ys = unflatten(loop.y_spec, iter(results[n_carry:])) if loop.y_spec is not None else None
        return carry, ys

    def _detach_constant_outputs(self, results: list[Any], n_carry: int) -> list[Any]:
        """The entry's outputs, those that depend on nothing requiring grad made tensors
        without history, as recording every step makes them (`grad_flow.py`); unchanged
        where the step's dependencies are not known (a step 0 not taped alone)."""
        program = self.program
        if program is not None:
            xs_rg = [x is not None and x.requires_grad for x in self.loop.xs_leaves]
            deps = deps_of_program(program, xs_rg)
        elif self.step_deps is not None:
            deps = self.step_deps
        else:
            return results
        carry_rg, ys_rg = outputs_requiring_grad(self.carry_rg, *deps, self.loop.n)
        flags = [*carry_rg, *ys_rg]
        if len(carry_rg) != n_carry or len(flags) != len(results):
            return results
        return [t if t is None or rg else make_tensor(t._data) for t, rg in zip(results, flags)]

    def _final_carry_as_a_python_loop(self, carry_leaves: list[Any],
                                      carry: list[Any]) -> list[Any]:
        """The final carry a Python loop (and `scan` recording every step) gives: a leaf
        every step returned unchanged is the caller's tensor itself, and leaves the last step
        returned as one tensor are one tensor (changing one in place changes the other, as
        it does there). The entry's outputs for them are left unused; their gradients reach
        the caller's tensor directly, or through the one tensor kept."""
        program, n = self.program, len(carry)
        passed = list(self.carry_passed or [True] * n)
        last = self.last_carry
        if program is not None:
            passed = [p and program.carry_out[k] == k for k, p in enumerate(passed)]
        outside: dict[int, Any] = {}  # leaves that are a tensor from outside the loop
        if last is not None and (program is None or last[0] == self.loop.n - 1):
            first, outside = last[1], last[2]  # the last step was recorded: its tensors said
        elif program is not None:
            slots = program.carry_out
            first = tuple(slots.index(s) if s >= 0 else k for k, s in enumerate(slots))
            outside = {k: program.constant_tensors[s] for k, s in enumerate(slots)
                       if isinstance(program.constant_tensors.get(s), Tensor)}
        else:
            first = tuple(range(n))
        self.final_passed = [p and c is not None for p, c in zip(passed, carry_leaves)]
        one: dict[int, Any] = {}  # the tensor of each group of leaves that are one tensor
        for k in range(n):  # (a caller's tensor, where a leaf of the group passed it on)
            if self.final_passed[k]:
                one.setdefault(first[k], carry_leaves[k])
        for k, tensor in outside.items():
            one.setdefault(first[k], tensor)
            # a re-run of the step returns it again: changed in place since, refused
            self.input_guards.append((tensor._version, tensor._version.value,
                                      "a tensor the step returns as its carry",
                                      tensor.dtype, tensor.shape))
        final = [one.get(first[k], carry[first[k]]) for k in range(n)]
        if program is not None and (last is None or last[0] != self.loop.n - 1):
            self._rows_of_xs_as_rows(final, program, {id(t) for t in one.values()})
        return final

    def _rows_of_xs_as_rows(self, final: list[Any], program: StepProgram,
                            callers: set[int]) -> None:
        """A final carry leaf a replayed last step returns as its row of `xs` (``return x,
        ...``) is that row, as recording every step gives it: its array is the row of the
        caller's `xs`, its version follows `xs`'s (`loop.as_row`: an in-place change of it
        changes `xs`, and raises while recording a gradient through it). A re-run of the
        last step reads that row again: changed in place since, it is refused."""
        n_carry, xs_leaves, t = len(program.carry_in), self.loop.xs_leaves, self.loop.n - 1
        done: set[int] = set()
        for k, slot in enumerate(program.carry_out):
            tensor, j = final[k], slot - n_carry
            if tensor is None or not 0 <= j < len(xs_leaves) or id(tensor) in done:
                continue
            x = xs_leaves[j]
            if x is None or id(tensor) in callers:
                continue  # (a caller's tensor: see above)
            done.add(id(tensor))
            if not np.shares_memory(tensor._data, x._data):
                tensor._data = row(x._data, t)
            as_row(tensor, x, t)
            counter = tensor._version
            self.input_guards.append((counter, counter.value,
                                      "its final carry, the last step's row of xs",
                                      tensor.dtype, tensor.shape))

    def _share_packed_carry(self, carry: list[Any]) -> None:
        """The final carry's tensors point at the buffers the last kept replayed step packed
        their arrays into, as the tensors a recorded last step returns do: an operation after
        the loop that saves the final carry (a loss on it) then shares that buffer, where it
        would pack the array again (a quantized carry stored twice, the peak one value high)."""
        kept = self.state.kept if self.state is not None else None
        if isinstance(kept, TapedSegment):  # recorded: its carry tensors know their buffers
            packed = [t._saved_ref() for t in kept.carry_out
                      if t is not None and t._saved_ref is not None]
        elif isinstance(kept, ReplayedSegment) and kept.steps:
            packed = [v for saved in kept.steps[-1][1].saved for v in saved or ()]
        else:
            return
        packed = [v for v in packed if isinstance(v, PackedBuffer)]
        for tensor in carry:
            if tensor is None:
                continue
            for buffer in packed:
                if buffer.holds(tensor._data):
                    tensor._saved_ref = weakref.ref(buffer)
                    break

    def _last_rows_from_carry(self, results: list[Any], n_carry: int,
                              rows: OutputRows) -> list[Any]:
        """An output that is the new carry itself (RNNs return h, h) leaves the entry without
        its last row, which is the loop's final carry: joined on here, after the entry, so a
        hook or `retain_grad` on that carry sees the gradient of the row too, as it would on
        a plain tape, where that row is the same tensor."""
        results = list(results)
        for k, j in self.same.items():
            part, carry = results[n_carry + k], results[j]
            if carry is None:
                continue
            whole = None if part is None else rows.whole(k)
            if whole is not None:  # the part is a view of `whole`, which holds that row too
                results[n_carry + k] = join_rows([part, carry], whole)
                continue
            row = expand_dims(carry, 0)
            # one step: the rows are a new array, as `torch.stack` makes (a view of the final
            # carry would see, and pass on, an in-place change of the other)
            results[n_carry + k] = concatenate([part, row] if part is not None else [row],
                                               axis=0)
        return results

    # ------------------------------------------------------------- backward
    def adds_onto(self, entry: Entry) -> list[bool]:
        """The inputs whose gradient sums the backward sweep may hand over (`onto`): the
        carry and the captured tensors, which a plain tape reaches once per use in the steps,
        each use added onto what arrived before (xs rows are stacked, never summed)."""
        n_xs = len(self.loop.xs_leaves)
        return [*self.carry_rg, *([False] * n_xs), *([True] * len(self.externals))]

    def backward(
        self, entry: Entry, grads: list[Any], create_graph: bool, retain_graph: bool = False,
        onto: list[Any] | None = None,
    ) -> list[Any]:
        """The loop's input gradients. With `onto` (see `adds_onto`), those of the carry and
        the captured tensors are added onto the sums given there, use by use, as a plain tape
        would add them: the results replace those sums, and are bitwise the plain tape's."""
        if self.consumed:
            raise freed_error(entry.describe())
        check_versions(entry, self.guards)
        if create_graph or self.state is None or self.reruns:
            check_versions(entry, self.input_guards)
            if self.changes is not None:
                refuse_changes(self, entry)
        outer_numpy_state = np.random.get_state()
        try:
            if create_graph:
                return backward_with_graph(self, entry, grads, onto)
            if self.state is None:  # an earlier backward broke off: rebuild the forward state
                # (the outputs were handed over: counted, not written into rows again)
                run_forward_prefix(self, discover=False, rows=OutputRows(self.loop.n, keep=False))
            return run_backward(self, entry, grads, retain_graph, onto)
        except BaseException:
            if self.state is not None:  # no snapshot (no file of a disk level) outlives it
                self.state.snapshots.clear()
            entry.slots = ()  # those snapshots, as the entry's saved values: stale now
            self.state = None  # perhaps half consumed: the next backward rebuilds it
            raise
        finally:
            np.random.set_state(outer_numpy_state)


