"""The profiler's model of the process's peak, to be held against tracemalloc (issue 37).

What a run allocates above the level before it, as the profiler sees it: the arrays made in
the run that the caller or the graph still holds (`explain`'s kept, packed originals, view
bases, cycles), plus the owned tape at its peak and the gradients (where the tape peaks in
the forward, the larger of the two: the tape empties as the gradients fill; where it peaks
in the backward sweep, a region re-run, both, an upper bound), plus the
transients it knows of: the backward sweep's working pair (one adjoint in flight and the
one it makes, each at most the largest saved value). Arrays it never sees (a loop's
stacked outputs, an input gradient the sweep zero-fills, a primitive's scratch) are not in
it: `bench.memory_truth` measures the difference per program style.
"""

from __future__ import annotations

from typing import Any


def transient_bytes(profile: Any) -> int:
    """The backward's working pair: twice the largest value the tape saved (logical)."""
    return 2 * max((r.logical_bytes for r in profile.records), default=0)


def predicted_peak(profile: Any) -> int:
    """The profiler's model of the process's peak above the block's start (bytes)."""
    e = profile.explain()
    held = e.kept_by_caller + e.packed_originals + e.view_bases + e.cycles
    owned = sum(e.owned_by_strategy.values()) + e.snapshots
    if _peak_phase(profile) == "forward":  # the gradients come after the tape's peak
        return held + max(owned, e.gradients) + transient_bytes(profile)
    return held + owned + e.gradients + transient_bytes(profile)


def _peak_phase(profile: Any) -> str:
    """The phase ("forward", "backward", "recompute") the owned tape peaked in."""
    sizes = profile.timeline_bytes
    if not sizes:
        return "forward"
    return profile.timeline_phase[max(range(len(sizes)), key=sizes.__getitem__)]
