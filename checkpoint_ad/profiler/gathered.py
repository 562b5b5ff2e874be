"""Raw records and timeline points made profile fields, and what `explain` reads judged.

The accountant (accountant.py) keeps records and timeline points as flat lists
(`RECORD_FIELDS` items per saved value, `POINT_FIELDS` per point: no object per item); they
become `SavedRecord`s and the `timeline_*` lists here, when the profile is read.
"""

from __future__ import annotations

import dataclasses
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
    """Move raw records and timeline points (emptied) into `profile`'s fields. Each record
    is made as its dataclass would make it, its fields set straight into its `__dict__`: a
    frozen dataclass's `__init__` sets them one `object.__setattr__` call each, which made
    half the time a profile took to read."""
    fields = profile.__dict__
    if records:
        raw = iter(records)
        new, names = object.__new__, _RECORD_NAMES
        made = []
        for (op, role, shape, dtype, logical, stored, frame, serial, phase, owned, level,
             strategy) in zip(*(raw,) * RECORD_FIELDS):
            record = new(SavedRecord)
            record.__dict__.update(zip(names, (
                op, role, shape, _dtype_name(dtype), logical, stored, _origin(frame), serial,
                phase, owned, level, strategy)))
            made.append(record)
        fields["_records"].extend(made)
        records.clear()
    if points:
        fields["_timeline_seconds"].extend([t - started for t in points[0::POINT_FIELDS]])
        fields["_timeline_bytes"].extend(points[1::POINT_FIELDS])
        fields["_timeline_phase"].extend(points[2::POINT_FIELDS])
        points.clear()


# SavedRecord's fields in order: the raw items of a record, as RECORD_FIELDS lists them, with
# the origin frame and dtype made text (tests/test_profiler_deferred.py checks the order)
_RECORD_NAMES = tuple(f.name for f in dataclasses.fields(SavedRecord))
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


# the profile's fields `judge_buffers` fills (as `records._Filled` keeps them)
JUDGED = frozenset({"_peak_buffers", "_kept_by_caller", "_originals_kept", "_also_kept",
                    "_alias_buffers"})


def judge_buffers(originals: dict[int, Any], packed: set[int], released: set[int],
                  at_peak: list[tuple[int, int]], profile: Any) -> None:
    """Fill what `explain` reads once the recording has ended, when first asked (not while
    the program runs, nor when other fields are read: it collects garbage first, so that only
    arrays someone still holds count as held): the owned buffers alive at the tape's peak, and
    the forward's saved arrays that outlived the tape's hold on them, as of that moment:
    released values and originals of packed values."""
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
