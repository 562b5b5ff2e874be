"""Raw records and timeline points made profile fields, and what `explain` reads judged.

The accountant (accountant.py) keeps records and timeline points as flat lists
(`RECORD_FIELDS` items per saved value, `POINT_FIELDS` per point: no object per item); they
become `SavedRecord`s and the `timeline_*` lists here, when the profile is read.
"""

from __future__ import annotations

import gc
from typing import Any

from ..origins import origin_text
from .records import SavedRecord

# one saved value, as `Accountant.records` holds it: (op, role, shape, dtype, logical bytes,
# stored bytes, origin frame, serial, phase, owned, storage level, strategy class name)
RECORD_FIELDS = 12
# one timeline point, as `Accountant.points` holds it: (perf_counter() then, live bytes, phase)
POINT_FIELDS = 3


def settle_raw(profile: Any, records: list[Any], points: list[Any], started: float) -> None:
    """Move raw records and timeline points (emptied) into `profile`'s fields."""
    fields = profile.__dict__
    if records:
        raw = iter(records)
        fields["_records"].extend([
            SavedRecord(op, role, shape, _dtype_name(dtype), logical, stored,
                        _origin(frame), serial, phase, owned=owned, level=level,
                        strategy=strategy)
            for op, role, shape, dtype, logical, stored, frame, serial, phase, owned,
            level, strategy in zip(*(raw,) * RECORD_FIELDS)
        ])
        records.clear()
    if points:
        fields["_timeline_seconds"].extend([t - started for t in points[0::POINT_FIELDS]])
        fields["_timeline_bytes"].extend(points[1::POINT_FIELDS])
        fields["_timeline_phase"].extend(points[2::POINT_FIELDS])
        points.clear()


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


def judge_buffers(originals: dict[int, Any], packed: set[int], released: set[int],
                  at_peak: list[tuple[int, int]], profile: Any) -> None:
    """Fill what `explain` reads once the recording has ended, when first asked (not while
    the program runs: it collects garbage first, so that only arrays someone still holds count
    as held): the owned buffers alive at the tape's peak, and the forward's saved arrays that
    outlived the tape's hold on them: released values and originals of packed values."""
    gc.collect()
    fields = profile.__dict__
    fields["_peak_buffers"].update((str(serial), size) for serial, size in at_peak)
    named: dict[int, int] = {}  # id(array the caller holds) -> the serial naming it
    for serial, ref in originals.items():
        array = ref()
        if array is None or id(array) in named:
            continue
        if serial in packed:
            fields["_originals_kept"].append(serial)
        elif serial in released:
            fields["_kept_by_caller"].append(serial)
        else:  # the tape still holds it: not known to be the caller's
            continue
        named[id(array)] = serial
    for serial, ref in originals.items():  # its other buffers: named once
        array = ref()
        if array is not None and named.get(id(array), serial) != serial:
            fields["_also_kept"].append(serial)
