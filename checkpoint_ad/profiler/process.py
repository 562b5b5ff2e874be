"""The profiler's model of the process's peak, to be held against tracemalloc (issue 37).

What a run allocates above the level before it, as the profiler sees it: the arrays made in
the run that the caller or the graph still holds (`explain`'s kept, packed originals, view
bases, cycles, loops' stacked outputs and the input gradients they fill), plus the most the
owned tape and the gradients hold at once (the tape over its timeline; the gradients fill
in proportion to the backward's time), plus the transients it knows of: the backward
sweep's working pair (one adjoint in flight and the one it makes, each at most the largest
saved value). Arrays it never sees (a primitive's scratch, a strategy's unpacked copies)
are not in it: `bench.memory_truth` measures the difference per program style.
"""

from __future__ import annotations

from typing import Any


def transient_bytes(profile: Any) -> int:
    """The backward's working pair: twice the largest value the tape saved (logical)."""
    return 2 * max((r.logical_bytes for r in profile.records), default=0)


def predicted_peak(profile: Any) -> int:
    """The profiler's model of the process's peak above the block's start (bytes)."""
    e = profile.explain()
    held = e.kept_by_caller + e.packed_originals + e.view_bases + e.cycles + e.loop_arrays
    return held + _tape_and_gradients(profile, e.gradients) + transient_bytes(profile)


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
