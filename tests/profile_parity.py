"""What two profiles of the same work must share, for tests that compare a profile of one way
of running it (replayed steps, the profiler's bulk paths) with another (recording every step,
the general path): everything but what is measured anew each run, and what tracing holds (a
loop traces two steps, one when its program is cached, none recorded with ``trace=False``)."""

from __future__ import annotations

from typing import Any

MEASURED = ("timeline_seconds", "forward_seconds", "backward_seconds", "recompute_seconds",
            "rss_peak_bytes", "rss_start_bytes")
TRACING = ("traced_step_bytes", "traced_tape_bytes")


def comparable(prof: Any) -> dict[str, Any]:
    """`prof.to_dict()` less its measured and tracing fields, with its explanation (less a
    traced step's values) as text."""
    data = prof.to_dict()
    for key in MEASURED + TRACING:
        data.pop(key)
    traced = {key: getattr(prof, key) for key in TRACING}
    try:
        for key in TRACING:
            setattr(prof, key, 0)
        data["explain"] = str(prof.explain())
    finally:
        for key, value in traced.items():
            setattr(prof, key, value)
    return data
