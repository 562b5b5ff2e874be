"""The profiler's model of the process's peak, to be held against tracemalloc (issue 37).

What a run allocates above the level before it, as the profiler sees it: the arrays made in
the run that the caller or the graph still holds (`explain`'s kept, packed originals, view
bases, cycles, loops' stacked outputs and the input gradients they fill), plus the larger
of the backward's and the forward's peaks: in the backward, the most the owned tape and the
gradients hold at once (the tape over its timeline; the gradients fill in proportion to the
backward's time) and its working arrays (`working_lines`: the adjoint in flight and the one
it makes, each at most the largest value the tape saved; a parameter's partial gradient,
and the new sum beside the running one where the sweep does not add in place); in the
forward, the values a traced loop step held as it returned and the owned tape then. Arrays
it never sees (a primitive's scratch beyond those, a strategy's unpacked copies) are not in
it: `bench.memory_truth` measures the difference per program style.
"""

from __future__ import annotations

from typing import Any

ADJOINTS = "an adjoint in flight and the one it makes (each the largest value saved)"
PARTIAL = "a parameter's partial gradient beside its running sum"
NEW_SUM = "the new sum of a parameter's gradient (made beside the running sum and the partial)"


def working_lines(profile: Any) -> dict[str, int]:
    """The backward's working arrays at its peak, beyond the tape and the gradients, by what
    each is: two adjoints of the largest value the tape owned (the caller's arrays saved by
    reference are no adjoint's size: a parameter's gradient is the partial below); the
    partial gradient of the largest parameter read more than once (its `.grad`'s size),
    and, unless a loop's pull-back summed it (in place), the new sum the sweep makes beside
    the running one."""
    lines: dict[str, int] = {}
    adjoint = max((r.logical_bytes for r in profile.records if r.owned), default=0)
    if adjoint:
        lines[ADJOINTS] = 2 * adjoint
    partial = getattr(profile, "largest_gradient_bytes", 0)
    if partial:
        lines[PARTIAL] = partial
        if not getattr(profile, "nested_sweeps", 0):
            lines[NEW_SUM] = partial
    return lines


def transient_bytes(profile: Any) -> int:
    """The backward's working arrays (`working_lines`), in all."""
    return sum(working_lines(profile).values())


def predicted_peak(profile: Any) -> int:
    """The profiler's model of the process's peak above the block's start (bytes)."""
    e = profile.explain()
    held = e.kept_by_caller + e.packed_originals + e.view_bases + e.cycles + e.loop_arrays
    backward = _tape_and_gradients(profile, e.gradients) + transient_bytes(profile)
    traced = getattr(profile, "traced_tape_bytes", 0) + e.traced  # a traced step, returning
    return held + max(backward, traced)


def _tape_and_gradients(profile: Any, gradients: int) -> int:
    """The most the owned tape and the gradients hold at once over the timeline: the tape's
    bytes at each point, and after the first backward point the gradients, grown in
    proportion to the backward's elapsed time (they fill as the tape empties)."""
    sizes, phases, times = (profile.timeline_bytes, profile.timeline_phase,
                            profile.timeline_seconds)
    began = next((i for i, phase in enumerate(phases) if phase != "forward"), None)
    if not sizes or began is None:
        return max(max(sizes, default=0), gradients)
    span = max(times[-1] - times[began], 1e-12)
    grown = (sizes[i] + gradients * (times[i] - times[began]) / span
             for i in range(began, len(sizes)))
    return int(max(max(sizes[:began], default=0), *grown, gradients))
