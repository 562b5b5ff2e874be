"""What a profiler hears of a replayed step: its description, made once per program.

Replayed steps are announced one event per step, not per instruction: a 'replaying' event as
the step begins (`step_begins`: the values packed until its 'replayed' event are its own),
then a 'replayed' event carrying the step's description (`DescribedStep`, made once per
program), its saved buffers and its values. The profiler lists from them what recording the
step would have listed, in the same order; no entry, saved slot or leaf tensor is made just to
be announced. Where every value is kept as it is and a profiler listens alone, a step is taped
as if unheard and its buffers are made afterwards in one go (`step_tape.tape_kept`), in the
order a `KeptLayout` says, made once per kind of step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ... import events
from .step_trace import Draw, Instruction

if TYPE_CHECKING:
    from .step_program import StepProgram


@dataclass(frozen=True, slots=True)
class Described:
    """What a profiler counts of the entry that recording one instruction would make, the same
    for every replayed step: its op's name and origin, per saved value (role, slot, whether
    its recorded slot has a version counter but no graph edge), and the input slots that
    would be its leaf edges."""

    op: str
    origin: tuple[Any, int]
    saved: tuple[tuple[str, int, bool], ...]
    leaves: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DescribedStep:
    """A profiler's view of a replayed step, the same for every step: per instruction, what
    its entry would record (None where it records none), and how many primitives it runs
    (recorded or not: each a 'record' or an 'apply' when recorded)."""

    instructions: tuple[Described | None, ...]
    primitives: int


def step_begins(program: StepProgram) -> DescribedStep:
    """A profiler listens: say a replayed step begins (the values it packs until its
    'replayed' event are its own) and give the program's description, made when a profiler
    first hears one of its steps."""
    described = program.described[0]
    if described is None:
        described = program.described[0] = DescribedStep(
            tuple(_describe(program, ins) if ins.taped and r < 0 else None
                  for ins, r in zip(program.instructions, program.region_of)),
            sum(1 for ins in program.instructions
                if ins.prim is not None and type(ins.prim) is not Draw))
    events.emit("replaying", None)
    return described


def _describe(program: StepProgram, ins: Instruction) -> Described:
    return Described(
        ins.prim.name, ins.origin,
        tuple((s.name, ins.output if s.position < 0 else ins.inputs[s.position],
               s.counted and not s.leaf_edge) for s in ins.saved),
        tuple(slot for slot, needed in zip(ins.inputs, ins.mask)
              if needed and program.leaf[slot] and program.graph_leaf[slot]),
    )


@dataclass(frozen=True, slots=True)
class KeptLayout:
    """Where a step's buffers come from when every value is kept as it is, the same for every
    step of one kind (`StepProgram.layouts`): each distinct buffer once, in the order `tape`
    packs them, as (slot, key, packer) (key None: the buffer of a tensor's array, a constant
    or a recorded step's carry; else its key in the step's buffers), and per instruction the
    positions of the buffers it saves in that order."""

    sources: tuple[tuple[int, tuple[int, int] | None, Any], ...]
    held: tuple[tuple[int, tuple[int, ...]], ...]  # (instruction, positions) where it saves


def kept_layout(program: StepProgram, mode: int) -> KeptLayout:
    """`tape`'s choice of buffer for every saved value, made once: `mode` 0 for a step whose
    carry comes from arrays, 1 for one chained to a replayed step, 2 to a recorded one."""
    chained, tensors = mode > 0, set(program.constant_tensors)
    if mode == 2:
        tensors |= set(program.carry_in)
    sources: list[tuple[int, tuple[int, int] | None, Any]] = []
    position: dict[Any, int] = {}
    held: list[tuple[int, tuple[int, ...]]] = []
    for i, ins in enumerate(program.instructions):
        if ins.prim is None or type(ins.prim) is Draw or not ins.taped or not ins.saved \
                or program.region_of[i] >= 0:  # (a selective region's: re-run instead)
            continue
        at = []
        for s in ins.saved:
            slot = ins.output if s.position < 0 else ins.inputs[s.position]
            packer = s.chained if chained and slot in program.carry_in else s.packer
            key = None if slot in tensors else (slot, id(packer))
            found = ("tensor", slot) if key is None else key
            if found not in position:
                position[found] = len(sources)
                sources.append((slot, key, packer))
            at.append(position[found])
        held.append((i, tuple(at)))
    return KeptLayout(tuple(sources), tuple(held))
