"""Step programs: a loop step traced once into primitive calls over numbered slots, replayed on
arrays for every later step, every recompute and every step's backward.

Why: a step of an unrolled loop is the same program every time, yet recording it again costs
a Tensor, a tape entry and a saved-slot object per operation, and a checkpointing plan pays
that again for every re-run. A replay runs each primitive's forward and backward rules on
arrays directly, in the order and with the additions a recorded tape would do, so its results
are bitwise those of recording. What a replay looks up per instruction (functions, slots,
saved values, where a gradient goes) is bound once when the program is made
(`compiled_step.py`), so a replayed step costs little more than its array operations.

A trace is refused (the loop then records every step) when the step does something a replay
cannot repeat: reads a value into Python (`bool`, `item`, `float`, `numpy()`), registers a
hook, modifies a tensor in place, uses a custom `Function` or a nested planned loop. Steps 0
and 1 are both traced and must give the same program with the same constants: a step that
makes new tensors from outside data on each call (``cad.tensor(np.random.rand(3))``, a mask
drawn per call) is caught there, as it would be frozen by a replay. A `Selective` region the
step opens (`selective.region`: the attention core) is noted in the trace (`TracedRegion`): a
taped replay keeps its inputs, not what its instructions save, and the backward re-runs it
(`step_pull_back.rerun_region`), as a recorded `checkpoint` keeps and re-runs it. A loop run
again may reuse the program an earlier call made, once its step 0 is checked against it
(`program_cache.py`).

The parts, each a module:
- `step_trace`: tracing a step (`Trace`, `traced_call`), and whether two traces are one program;
- this module: `StepProgram`, a trace frozen into the tables a replay reads (bound once), bound
  to the tensors a call captured, and its forward replay without saving (`run`); `program_of`;
- `compiled_step`: each instruction's forward call and backward rules, bound once;
- `step_tape`: the taped replay, a step keeping what its backward reads (`tape`, `tape_steps`);
- `step_profiled`: what a profiler hears of a replayed step (`DescribedStep`, `KeptLayout`);
- `replayed_step`: a taped step's values and saved values (`ReplayedStep`);
- `step_pull_back`: the backward over replayed steps (`pull_back_steps`).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from ... import events
from ...saved import Strategy
from ...tape import edge_of
from .compiled_step import (
    HOIST,
    PENDING,
    _saved_getter,
    compile_forward,
    compile_rules,
    compile_tape_as_is,
    delivery_kinds,
    namespace_of,
)
from .hoisted_rows import find_hoisted, find_summed
from .replayed_step import NO_BUFFERS, ReplayedStep
from .step_trace import (
    Draw,
    Instruction,
    Trace,
    same_operations,
    same_program,
    same_values,
    traced_call,
)

# what other modules import from here (the tracing names are defined in step_trace.py, a
# taped step's in replayed_step.py)
__all__ = [
    "NO_BUFFERS", "Draw", "Instruction", "ReplayedStep", "StepProgram", "Trace", "program_of",
    "same_operations", "same_values", "traced_call",
]

_MOST_ORIGIN_SETS = 8  # the source lines a cached program remembers its copies by


class StepProgram:
    """A traced step, frozen into the tables its replays read: forward (`run`), forward
    with saved values (`step_tape.tape_steps`) and backward (`step_pull_back.pull_back_steps`)."""

    def __init__(self, trace: Trace, n_carry: int) -> None:
        self.n_slots = trace.n_slots
        self.n_inputs = trace.n_inputs
        self.instructions = tuple(trace.instructions)
        self.carry_in = tuple(range(n_carry))
        self.x_in = tuple(range(n_carry, trace.n_inputs))
        self.carry_out, self.y_out = trace.outputs
        self._bind(trace.constants)
        # graph facts of every slot, as the recorded step had them
        self.requires_grad = [rg for rg, _, _, _ in trace.facts]
        self.leaf = [leaf for _, leaf, _, _ in trace.facts]  # of the step: from outside it
        self.dtype = [dtype for _, _, dtype, _ in trace.facts]
        # every slot's shape as traced (None: not a tensor), and what `kept_slabs` makes of it
        self.slot_shapes = list(trace.shapes) if trace.shapes else None
        self.slab_slots: tuple[Any, ...] | None = None
        # a leaf of the graph (no entry): what recording the step would hand a profiler as a
        # leaf edge; a value captured from before the loop (heat's diffusivity) is not one
        self.graph_leaf = [leaf for _, _, _, leaf in trace.facts]
        # free each value after its last use in a forward without saving
        last: dict[int, int] = {}
        for i, ins in enumerate(self.instructions):
            for s in ins.inputs:
                last[s] = i
        kept = set(self.carry_out) | set(self.y_out) | set(self.constants)
        frees: list[list[int]] = [[] for _ in self.instructions]
        for s, i in last.items():
            if s not in kept:
                frees[i].append(s)
        self.frees = tuple(tuple(f) for f in frees)
        # a selective region's instructions save nothing in a replay: its inputs are kept,
        # and the backward re-runs it from them (`step_pull_back.rerun_region`)
        self.regions = tuple(trace.regions)
        region_of = [-1] * len(self.instructions)
        for r, region in enumerate(self.regions):
            region_of[region.start:region.stop] = [r] * (region.stop - region.start)
        self.region_of = tuple(region_of)
        # the same in a forward that saves (`tape`), less what outlives the step there: the
        # values saved (the backward reads them; a profiler's buffers are made from them
        # after the step ran) and the leaves (a profiler reads those after it too). A step's
        # values all held to its end would add every unsaved intermediate to the peak of a
        # loop that tapes it (a planned backward re-tapes one step at its peak)
        saved = {ins.output if s.position < 0 else ins.inputs[s.position]
                 for i, ins in enumerate(self.instructions) if ins.taped and region_of[i] < 0
                 for s in ins.saved}
        saved.update(s for region in self.regions for s in region.inputs)
        self.region_inputs = tuple(_saved_getter(region.inputs) for region in self.regions)
        # per region, its taped instructions and the slots each saves (what a re-run keeps)
        self.region_saved = tuple(_region_saved(self.instructions, region)
                                  for region in self.regions)
        self.region_runs = tuple(_region_run(self.instructions, region)
                                 for region in self.regions)
        self.tape_frees = tuple(
            tuple(s for s in f if s not in saved and not trace.facts[s][1]) for f in frees)
        self.saved_slots = frozenset(saved)  # what a loop keeping every step guards
        self.backward_order = tuple(
            i for i in reversed(range(len(self.instructions))) if self.instructions[i].taped
        )
        # bound once, run every step (compiled_step.py): each instruction's forward call, the
        # primitive it announces (None: not one), and for a taped one the slots it saves when
        # every value is kept as it is (None where a packer may store it otherwise)
        self.forwards = tuple(compile_forward(ins, Draw) for ins in self.instructions)
        # whether a replay draws from the engine's generator (the caller must then say which)
        self.draws = any(type(ins.prim) is Draw for ins in self.instructions)
        announced = tuple(
            None if ins.prim is None or type(ins.prim) is Draw else ins.prim
            for ins in self.instructions)
        self.run_order = tuple(zip(self.forwards, (ins.output for ins in self.instructions),
                                   self.frees, announced))
        # `step_tape.tape_as_is`'s rows, where every taped instruction keeps its values as
        # they are (`KeepAll`); None where some may not
        self.tape_as_is = compile_tape_as_is(self.instructions, self.forwards, self.tape_frees,
                                             self.region_of)
        self.backward_rules = tuple(
            (i, self.instructions[i].output, compile_rules(self.instructions[i]))
            for i in self.backward_order)
        # `step_tape.tape_kept`'s layouts (`step_profiled.KeptLayout`), made when first
        # needed: first step, chained to a replayed step, chained to a recorded one (shared
        # with the copies `bound_to` makes)
        self.layouts: list[Any] = [None, None, None]
        # `step_profiled.step_begins`'s `DescribedStep`, likewise
        self.described: list[Any] = [None]
        # source lines -> (instructions, described) of the copies `bound_to` made naming
        # those lines (shared with them): a loop that runs now profiled, now not, names them
        # now and then not, and each run would otherwise re-make and re-describe its steps
        self.by_origins: dict[tuple[Any, ...], tuple[tuple[Instruction, ...], list[Any]]] = {}
        self.delivery = delivery_kinds(self.n_slots, self.carry_in, self.x_in, self.constants,
                                       self.requires_grad, self.leaf)
        # every output that takes a gradient is made in the step: a root (the gradient of a
        # step's output) then reaches that step's own sums only, so a pull-back may take
        # each step's roots as it reaches the step (`pull_back_steps`), not all of them first
        # (keys, carry positions, external positions) of the latest pull-back: a caller
        # that hands the same keys again (a binomial plan's one-step pull-backs) reuses them
        self.positions: tuple[Any, list[Any], dict[int, Any]] | None = None
        self.roots_per_step = all(
            self.delivery[s] == PENDING for s in (*self.carry_out, *self.y_out)
            if s >= 0 and self.requires_grad[s])
        self._compile_core(trace)

    def _compile_core(self, trace: Trace) -> None:
        """The tables of a step whose carry-independent products come batched from a chunk
        (`hoisted_rows.py`): given after its scanned rows (`_start`), those instructions read
        their output instead of computing it, save what they saved (a row and a captured
        matrix: no new memory), and their matrix's gradient is kept for the chunk's batched
        product (`HOIST` rules) instead of added per step; so is the gradient of every other
        captured matrix a product takes on the right, and of a captured vector an add
        broadcasts (`hoisted_rows.find_summed`)."""
        self.hoisted, self.row_bytes = find_hoisted(
            self.instructions, self.x_in, trace.constants, self.dtype,
            trace.shapes)
        if any(self.region_of[h.index] >= 0 for h in self.hoisted):  # a region re-runs its
            self.hoisted, self.row_bytes = (), 0  # own products: none batched
        # the captured tensors' gradients summed per chunk (the products' matrices and
        # biases, carry-dependent operands included), and what a step stacks for them
        self.summed, self.stack_row_bytes, stack_row = find_summed(
            self.instructions, self.hoisted, trace.constants, self.dtype,
            trace.shapes, self.region_of, {*self.carry_out, *self.y_out})
        self.row_bytes = max(self.row_bytes, stack_row)
        self.hoisted_outputs = tuple(h.output for h in self.hoisted)
        # whether no row of a product outlives its step: none is saved, returned, or read by
        # an operation whose result may be a view of it (a chunk may then reuse its buffers)
        outlive = self.saved_slots | set(self.carry_out) | set(self.y_out)
        rows = set(self.hoisted_outputs)
        self.rows_private = not (rows & outlive) and not any(
            rows.intersection(ins.inputs) and (
                ins.prim is None or type(ins.prim) is Draw or ins.prim.view)
            for ins in self.instructions)
        by_index = {h.index: j for j, h in enumerate(self.hoisted)}
        self.core_forwards = tuple(
            _read_slot(ins.output) if i in by_index else forward
            for i, (ins, forward) in enumerate(zip(self.instructions, self.forwards)))
        self.core_run_order = tuple(
            (self.core_forwards[i], *row[1:]) for i, row in enumerate(self.run_order))
        self.core_tape_as_is = None if self.tape_as_is is None else tuple(
            (i, self.core_forwards[i], *row[1:]) for i, *row in self.tape_as_is)
        summed_at = {(s.index, s.weight): j for j, s in enumerate(self.summed)}
        core_rules = []
        for i, output, rules in self.backward_rules:
            rules = tuple(
                rule if j is None else (HOIST, None, j, None, None, rule[5])
                for rule in rules for j in (summed_at.get((i, rule[5])),))
            core_rules.append((i, output, rules))
        self.core_backward_rules = tuple(core_rules)

    def _bind(self, constants: dict[int, Any]) -> None:
        """Read the tensors the step captured (slot -> tensor): what the program holds of them
        (their arrays, graph edges and hooks) is read here and nowhere else."""
        self.constants = {s: t._data for s, t in constants.items()}
        # every slot after the inputs (carry, then xs: slots 0, 1, ...) as a step starts:
        # the constants in place, the rest empty
        self.after_inputs = tuple(
            self.constants.get(s) for s in range(self.n_inputs, self.n_slots))
        # the tensors themselves: a value saved from one shares the buffer recorded entries
        # made of it (one stored copy, counted once), as recording every step would
        self.constant_tensors = dict(constants)
        self.external_keys: dict[int, tuple[int, int]] = {}
        self.external_edges: dict[tuple[int, int], Any] = {}  # key -> graph edge
        for slot, t in constants.items():
            edge = edge_of(t)
            if edge is not None:
                self.external_keys[slot] = (id(edge[0]), edge[1])
                self.external_edges[(id(edge[0]), edge[1])] = edge
        # captured leaves: a hook registered on one, even after the loop ran, makes the
        # backward record (a recorded pass runs leaf hooks on each segment's sum)
        self.has_hooks = [t for t in constants.values()
                          if t._entry is None and t._requires_grad]

    def bound_to(self, trace: Trace) -> StepProgram:
        """This program reading the tensors another trace of the same step captured (the same
        slots: see `program_cache.py`): a copy sharing everything compiled, whose constants
        are those tensors as they are now (a parameter an optimizer replaced is read anew),
        and whose source lines (what a profiler names) are the ones `trace` recorded from."""
        program = copy.copy(self)
        program._bind(trace.constants)
        if any(ins.origin != new.origin for ins, new in zip(self.instructions,
                                                            trace.instructions)):
            origins = tuple(new.origin for new in trace.instructions)
            known = self.by_origins.get(origins)
            if known is None:
                if len(self.by_origins) >= _MOST_ORIGIN_SETS:
                    self.by_origins.clear()
                known = self.by_origins[origins] = (tuple(
                    replace(ins, origin=origin)
                    for ins, origin in zip(self.instructions, origins)), [None])
            program.instructions, program.described = known  # described with these lines
        return program

    def unbound(self) -> StepProgram:
        """A copy that holds no captured tensor (nor their arrays or graph edges), to be kept
        beyond the loop that made it; `bound_to` gives a runnable one back."""
        program = copy.copy(self)
        program._bind({})
        return program

    def carry_aliases(self) -> dict[int, int]:
        """Outputs that are a new carry leaf itself (RNNs return h, h): output k -> leaf j."""
        return {k: j for k, y in enumerate(self.y_out) for j, c in enumerate(self.carry_out)
                if y >= 0 and y == c}

    def unreplayable_storage(self) -> str | None:
        """Why a replay could not keep the step's values as recording does, or None: a
        saved-value strategy that re-makes values itself (`Rematerializing`) learns how from
        each recorded entry, which a replay does not make."""
        for ins in self.instructions:
            for s in ins.saved:
                if type(s.packer).recorded is not Strategy.recorded:
                    return (f"its values are kept by {type(s.packer).__name__}, which re-makes "
                            "them from the recorded entries")
        return None

    # ------------------------------------------------------------- forward
    def _start(self, carry: list[Any], x: list[Any]) -> list[Any]:
        n_x = len(self.x_in)
        if len(carry) == len(self.carry_in) and len(x) == n_x:
            return [*carry, *x, *self.after_inputs]  # the usual case, in one go
        if len(carry) == len(self.carry_in) and len(x) == n_x + len(self.hoisted):
            # the scanned rows, then the rows of the batched products (`hoisted_rows.py`)
            values = [*carry, *x[:n_x], *self.after_inputs]
            for slot, value in zip(self.hoisted_outputs, x[n_x:]):
                values[slot] = value
            return values
        values: list[Any] = [None] * self.n_slots
        for s, a in zip(self.carry_in, carry):
            values[s] = a
        for s, a in zip(self.x_in, x):
            values[s] = a
        for s, a in self.constants.items():
            values[s] = a
        return values

    def run(self, carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        """One step without saving anything: (new carry arrays, output arrays)."""
        values = self._start(carry, x)
        xp = namespace_of(values)
        emit = events.hears("apply")
        order = self.run_order if len(x) == len(self.x_in) else self.core_run_order
        for forward, output, frees, prim in order:
            values[output] = forward(values, xp)
            if emit and prim is not None:
                events.emit("apply", prim)
            for s in frees:
                values[s] = None
        return ([None if s < 0 else values[s] for s in self.carry_out],
                [None if s < 0 else values[s] for s in self.y_out])


def _region_saved(instructions: tuple[Instruction, ...], region: Any,
                  ) -> tuple[tuple[int, Any], ...]:
    """A selective region's taped instructions, each with the getter of the slots it saves:
    what a re-run of the region hands their backward rules."""
    return tuple(
        (i, _saved_getter(tuple(ins.output if s.position < 0 else ins.inputs[s.position]
                                for s in ins.saved)))
        for i, ins in enumerate(instructions[region.start:region.stop], region.start)
        if ins.taped)


def _region_run(instructions: tuple[Instruction, ...], region: Any) -> tuple[int, ...]:
    """The instructions a re-run of a selective region runs, in order: those whose output
    a saved value of the region is, or is made from (a primitive is a function of its
    inputs: one whose output nothing saved needs, such as the core's last product, the
    region's output, is left out; a recorded `checkpoint` re-runs the whole function)."""
    needed: set[int] = set()
    for ins in instructions[region.start:region.stop]:
        if ins.taped:
            needed.update(ins.output if s.position < 0 else ins.inputs[s.position]
                          for s in ins.saved)
    run = []
    for i in range(region.stop - 1, region.start - 1, -1):
        ins = instructions[i]
        if ins.output in needed:
            run.append(i)
            needed.update(ins.inputs)
    return tuple(reversed(run))


def _read_slot(slot: int) -> Any:
    """The forward of a batched product in a step that was given its row: the row."""
    return lambda values, xp: values[slot]


def program_of(traces: dict[int, Trace], n_steps: int, n_carry: int, template: int = 0,
               ) -> tuple[StepProgram | None, str]:
    """The program steps 0 and 1 traced to, and how the loop runs: ("replayed"), or no
    program and "recorded: <why>". The program is made from trace `template`: step 1's
    where step 0's carry came from the caller (which need not require grad) and the steps
    to replay take a step's output as their carry."""
    if n_steps == 1:
        return None, "recorded: a loop of one step has nothing to replay"
    reason = same_program(traces[0], traces[1])
    if reason is not None:
        return None, f"recorded: the step {reason}"
    program = StepProgram(traces[template], n_carry)
    reason = program.unreplayable_storage()
    if reason is not None:
        return None, f"recorded: {reason}"
    return program, "replayed"


