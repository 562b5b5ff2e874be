"""What two profiles of the same work must share, for tests that compare a profile of one way
of running it (replayed steps, the profiler's bulk paths) with another (recording every step,
the general path): everything but what is measured anew each run."""

from __future__ import annotations

from typing import Any

MEASURED = ("timeline_seconds", "forward_seconds", "backward_seconds", "recompute_seconds",
            "rss_peak_bytes", "rss_start_bytes")


def comparable(prof: Any) -> dict[str, Any]:
    """`prof.to_dict()` less its measured fields, with its explanation as text."""
    data = prof.to_dict()
    for key in MEASURED:
        data.pop(key)
    data["explain"] = str(prof.explain())
    return data
