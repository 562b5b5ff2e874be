"""What a recorder gathers while the program runs, kept raw until the profile is read.

Building a `SavedRecord` (a frozen dataclass) per saved value and three timeline appends per
event cost more than the bookkeeping itself; a profiled run appends plain tuples instead, and
the profile's `records` and `timeline_*` fields are filled from them the first time they are
read (`records._Filled`), during the block or after it.
"""

from __future__ import annotations

from typing import Any

from ..tape import origin_text
from .records import SavedRecord

# (op, role, shape, dtype, logical bytes, stored bytes, origin frame, serial, phase, owned)
RawRecord = tuple[str, str, tuple[int, ...], Any, int, int, tuple[Any, int], int, str, bool]


class Gathered:
    """Raw records and timeline points of one profile; called with the profile, moves them
    into its fields (and, once the recording has ended, stops being called)."""

    __slots__ = ("ended", "points", "records")

    def __init__(self) -> None:
        self.records: list[RawRecord] = []
        self.points: list[tuple[float, int, str]] = []  # (seconds, live bytes, phase)
        self.ended = False

    def __call__(self, profile: Any) -> None:
        fields = profile.__dict__
        if self.records:
            fields["_records"].extend([
                SavedRecord(op, role, shape, _dtype_name(dtype), logical, stored,
                            _origin(frame), serial, phase, owned)
                for op, role, shape, dtype, logical, stored, frame, serial, phase, owned
                in self.records
            ])
            self.records.clear()
        if self.points:
            seconds, live, phases = zip(*self.points)
            fields["_timeline_seconds"].extend(seconds)
            fields["_timeline_bytes"].extend(live)
            fields["_timeline_phase"].extend(phases)
            self.points.clear()
        if self.ended:
            fields.pop("_fill", None)


_dtype_names: dict[Any, str] = {}
_origins: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    """str(dtype), remembered: numpy's is slow."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype)
    return name


def _origin(frame: tuple[Any, int]) -> str:
    """An entry's origin ('file:line') from its `origin_frame`, remembered per source line."""
    text = _origins.get(frame)
    if text is None:
        text = _origins[frame] = origin_text(frame)
    return text
