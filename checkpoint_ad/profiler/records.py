"""What a profile holds, and its JSON form (schema documented in profiles/README.md)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types
import typing
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..errors import FileFormatError, ProfileFormatError
from ..safe_files import write_text
from .explain import Explanation, explain

__all__ = ["Profile", "ProfileFormatError", "SavedRecord", "from_plain"]

SCHEMA = "checkpoint-ad/profile"
VERSION = 3  # 3: storage levels and I/O, and what `explain` reads; 2: owned records
READS = (1, 2, 3)  # version 1 counted every saved value as owned: loaded as such
UNRECORDED = "(no entry: loop snapshots, region inputs)"  # `by_op_at_peak`'s unrecorded bytes
T = TypeVar("T")


@dataclass(frozen=True)
class SavedRecord:
    """One value saved for the backward sweep by one tape entry."""

    op: str
    role: str
    shape: tuple[int, ...]
    dtype: str
    logical_bytes: int
    stored_bytes: int
    origin: str
    buffer: int  # identifies the stored buffer: records sharing one count its bytes once
    phase: str  # "forward", "backward" or "recompute"
    owned: bool = True  # False: the caller's own memory (a parameter, input data) by reference
    level: str = "device"  # where the stored bytes live: "device", "host" or "disk"
    strategy: str = ""  # the class of the strategy that stored it ("" in files before version 3)


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(SavedRecord))


def _copied(value: Any) -> Any:
    """`value` with a list or dict copied one level (a profile's fields hold numbers and
    strings in them)."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


class _Filled:
    """A field of `Profile` filled on demand: a recorder logs raw facts while the program runs
    (cheap), and the profile's `_fill` (its `Accountant`) accounts for them the moment any such
    field is read. The dataclass sees a descriptor-typed field whose default is `default`; a
    value assigned to it is kept (a list or dict field converts it to its `kind`)."""

    def __init__(self, kind: type | None = list, default: Any = ()) -> None:
        self.kind = kind  # list, dict, or None: a number, kept as given
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.default
        fill = obj.__dict__.get("_fill")
        if fill is not None:
            fill(obj, self.key)
        return obj.__dict__[self.key]

    def __set__(self, obj: Any, value: Any) -> None:
        kind = self.kind
        obj.__dict__[self.key] = value if kind is None or type(value) is kind else kind(value)


@dataclass
class Profile:
    """Measurements of one run: saved values, live tape bytes over time, times, memory.

    `peak_tape_bytes` is the most stored bytes of *owned* saved values alive at once (each
    shared buffer counted once): memory that exists because the tape keeps it, which is what a
    strategy can save. Values saved by reference that are the caller's own memory anyway
    (parameters, input data) are counted apart in `aliased_bytes` (the most alive at once;
    None in a version-1 file, which counted them in `peak_tape_bytes`). `device_peak_bytes`
    is what the device's allocator measured above the level at the start (tracemalloc for
    numpy, cupy's pool on GPU).
    """

    device: str = "cpu"
    meta: dict[str, Any] = field(default_factory=dict)
    records: list[SavedRecord] = _Filled()  # type: ignore[assignment]
    timeline_seconds: list[float] = _Filled()  # type: ignore[assignment]
    timeline_bytes: list[int] = _Filled()  # type: ignore[assignment]
    timeline_phase: list[str] = _Filled()  # type: ignore[assignment]
    peak_tape_bytes: int = _Filled(None, 0)  # type: ignore[assignment]
    aliased_bytes: int | None = _Filled(None, 0)  # type: ignore[assignment]
    primitives: int = _Filled(None, 0)  # type: ignore[assignment]
    recomputed_primitives: int = _Filled(None, 0)  # type: ignore[assignment]
    # saved values a rematerializing pool dropped to keep its budget
    evictions: int = _Filled(None, 0)  # type: ignore[assignment]
    # primitives it re-ran to bring evicted values back
    rematerializations: int = _Filled(None, 0)  # type: ignore[assignment]
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    recompute_seconds: float = 0.0
    device_peak_bytes: int | None = None
    rss_peak_bytes: int | None = None
    memory_source: str = "none"
    level_peak_bytes: dict[str, int] = _Filled(dict)  # type: ignore[assignment]
    """The most owned stored bytes alive at once per storage level ("device" is
    `peak_tape_bytes`; "host" and "disk" hold offloaded values, see `strategies.Offload`)."""
    io_bytes_written: int = 0
    io_bytes_read: int = 0
    io_stall_seconds: float = 0.0
    """Seconds the computation waited for a storage level (a read not done ahead, a full
    write queue)."""
    plan_seconds: float = 0.0
    """Seconds spent planning: the dry runs of `Budget` and `estimate` (the library pricing
    a loop by running some of its steps, once per loop). Their work is in no other figure:
    not in `forward_seconds` nor `backward_seconds`, their primitives not in `primitives`,
    their saved values not in `records` nor the tape's peak."""
    plans: int = 0
    """Dry runs in the block (a loop priced once is remembered: later calls plan again only
    after `forget_dry_runs`)."""
    plan_tape_bytes: int = 0
    """The most tape bytes a dry run held (owned saved values of the steps it ran, freed when
    it ended, before the loop began)."""
    # what `explain` reads (version 3): owned buffers alive at the tape's peak and the bytes
    # each counted there, by buffer number; stored bytes of owned buffers no entry recorded
    # (a loop's snapshots, a checkpointed region's inputs), by buffer number; bytes of base
    # arrays that saved views keep alive beyond the view, by buffer; buffers saved by
    # reference whose array outlived the tape's hold on it (the caller kept it); packed
    # buffers whose original array is still alive at the end; bytes of the arrays of leaves
    # that require grad (parameters, inputs); RSS when the block began
    peak_buffers: dict[str, int] = _Filled(dict)  # type: ignore[assignment]
    unrecorded_bytes: dict[str, int] = _Filled(dict)  # type: ignore[assignment]
    view_base_bytes: dict[str, int] = _Filled(dict)  # type: ignore[assignment]
    kept_by_caller: list[int] = _Filled()  # type: ignore[assignment]
    originals_kept: list[int] = _Filled()  # type: ignore[assignment]
    also_kept: list[int] = _Filled()  # type: ignore[assignment]  # more buffers of one array
    # the caller's arrays saved by reference alive at `aliased_bytes`'s peak: bytes counted
    # of each (an array saved by several buffers counts at one), by buffer number
    alias_buffers: dict[str, int] = _Filled(dict)  # type: ignore[assignment]
    leaf_bytes: int = 0
    rss_start_bytes: int | None = None
    gradient_bytes: int | None = None
    """Bytes of the `.grad` arrays of the leaves alive when the block ended (None in files
    written before it was measured: `explain` then estimates one gradient per parameter)."""
    cycle_bytes: int = 0
    """Bytes of the arrays only reference cycles held when the block ended (measured under
    tracemalloc, then freed: see `profiler.cycles`); `cycle_lines` splits them by the line
    that allocated each array."""
    cycle_lines: dict[str, int] = field(default_factory=dict)
    loop_arrays: dict[str, int] = field(default_factory=dict)
    """Bytes of the `scan`s' stacked outputs and of the input gradients their backwards
    fill (no saved value: the graph and the backward hold them), by the line of the loop."""
    largest_gradient_bytes: int = 0
    """Bytes of the largest `.grad` array, alive when the block ended, of a leaf more than one
    entry read: the size of the partial gradient (and of the new sum) the backward makes
    beside its running sum."""
    traced_step_bytes: int = 0
    """Bytes a loop step traced for its step program (steps 0 and 1 of a planned `scan`)
    held as it returned that no saved value is (the trace keeps every value the step makes
    until then), of the step that held the most with the owned tape beside it
    (`traced_tape_bytes`)."""
    traced_tape_bytes: int = 0
    nested_sweeps: int = 0
    """Backward sweeps run inside another (a planned loop's pull-back, a region's): a
    loop's pull-back adds a partial gradient into its running sum in place."""

    # ------------------------------------------------------------- queries
    def __getstate__(self) -> dict[str, Any]:
        """Pickled settled (a sweep's run comes back from a Dask worker): every filled field
        is filled first, and the filler, which holds weak references, stays behind."""
        fill = self.__dict__.get("_fill")
        if fill is not None:
            fill(self, None)
        state = dict(self.__dict__)
        state.pop("_fill", None)
        return state

    @property
    def total_seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    @property
    def saved_bytes(self) -> int:
        """Stored bytes of every owned buffer ever saved, each counted once (aliases of the
        caller's memory left out, as in `peak_tape_bytes`)."""
        return sum(self._buffers(r for r in self.records if r.owned).values())

    @staticmethod
    def _buffers(records: Iterable[SavedRecord]) -> dict[int, int]:
        return {r.buffer: r.stored_bytes for r in records}

    def _grouped(self, key: str) -> dict[str, dict[str, int]]:
        """Count, logical and stored bytes of the owned saved values, and stored bytes of the
        aliased ones (the caller's memory, saved by reference), per value of a record field;
        a buffer shared by several records counts its bytes at the first of them."""
        table: dict[str, dict[str, int]] = defaultdict(
            lambda: {"count": 0, "logical": 0, "stored": 0, "aliased": 0}
        )
        seen: set[int] = set()
        for r in self.records:
            row = table[getattr(r, key)]
            row["count"] += 1
            if r.buffer not in seen:
                seen.add(r.buffer)
                if r.owned:
                    row["logical"] += r.logical_bytes
                    row["stored"] += r.stored_bytes
                else:
                    row["aliased"] += r.stored_bytes
        return dict(table)

    @property
    def predicted_process_peak(self) -> int:
        """The profiler's model of the process's peak above the block's start: what the
        caller and graph hold, the owned tape or the gradients, the backward's working pair
        (see `profiler.process`); `bench.memory_truth` holds it against tracemalloc."""
        from .process import predicted_peak

        return predicted_peak(self)

    def explain(self, top: int = 3) -> Explanation:
        """Why memory did not drop: bytes by cause, the largest first, each with the source
        lines that saved the most of it (see `profiler.explain`)."""
        return explain(self, top)

    def by_op(self) -> dict[str, dict[str, int]]:
        """Count, logical and stored bytes of the saved values, per primitive."""
        return self._grouped("op")

    def by_op_at_peak(self) -> dict[str, dict[str, int]]:
        """Count (records), logical and stored bytes per primitive of the owned buffers alive
        at the tape's peak (`peak_buffers`, so the stored bytes add up to `peak_tape_bytes`):
        what made the peak, rather than what was ever saved. Buffers no entry recorded (loop
        snapshots, region inputs) are under ``UNRECORDED``. Empty for a profile without
        `peak_buffers` (version 1 and 2 files)."""
        at_peak = {int(k): v for k, v in self.peak_buffers.items()}
        table: dict[str, dict[str, int]] = defaultdict(
            lambda: {"count": 0, "logical": 0, "stored": 0})
        counted: set[int] = set()
        for r in self.records:
            stored = at_peak.get(r.buffer)
            if stored is None:
                continue
            row = table[r.op]
            row["count"] += 1
            if r.buffer not in counted:
                counted.add(r.buffer)
                row["stored"] += stored
                row["logical"] += (round(r.logical_bytes * stored / r.stored_bytes)
                                   if r.stored_bytes else stored)
        for buffer, stored in at_peak.items():
            if buffer not in counted:
                row = table[UNRECORDED]
                row["count"] += 1
                row["stored"] += stored
                row["logical"] += stored
        return dict(table)

    def by_origin(self) -> dict[str, dict[str, int]]:
        """The same totals per line of user code."""
        return self._grouped("origin")

    def summary(self, top: int = 12) -> str:
        """A readable report: headline figures, then saved bytes by op and by origin."""
        mib = 2**20
        lines = [
            f"device {self.device}  forward {self.forward_seconds:.4f}s  backward "
            f"{self.backward_seconds:.4f}s  (recompute {self.recompute_seconds:.4f}s, "
            f"{self.recomputed_primitives} primitives re-run of {self.primitives})"
            + (f"  evictions {self.evictions}, rematerializations {self.rematerializations}"
               if self.evictions else "")
            + (f"  planning {self.plan_seconds:.4f}s ({self.plans} dry run"
               f"{'s' if self.plans != 1 else ''}, tape {self.plan_tape_bytes / mib:.3f} MiB)"
               if self.plans else ""),
            f"peak tape {self.peak_tape_bytes / mib:.3f} MiB owned"
            + (f" (+{self.aliased_bytes / mib:.3f} MiB the caller's, saved by reference)"
               if self.aliased_bytes else "")
            + f"   saved in all "
            f"{self.saved_bytes / mib:.3f} MiB   device peak "
            + (f"{self.device_peak_bytes / mib:.3f} MiB ({self.memory_source})"
               if self.device_peak_bytes is not None else "not measured")
            + (f"   RSS peak {self.rss_peak_bytes / mib:.1f} MiB" if self.rss_peak_bytes else ""),
        ]
        if set(self.level_peak_bytes) - {"device"} or self.io_bytes_written:
            lines.append(
                "levels " + "  ".join(f"{k} {v / mib:.3f} MiB"
                                      for k, v in sorted(self.level_peak_bytes.items()))
                + f"   written {self.io_bytes_written / mib:.3f} MiB  read "
                f"{self.io_bytes_read / mib:.3f} MiB  stalled {self.io_stall_seconds:.4f}s"
            )
        lines += [
            "",
            f"{'op':<16}{'saved':>7}{'logical MiB':>13}{'stored MiB':>12}",
        ]
        ops = sorted(self.by_op().items(), key=lambda kv: -kv[1]["stored"])
        for op, row in ops[:top]:
            lines.append(f"{op:<16}{row['count']:>7}{row['logical'] / mib:>13.3f}"
                         f"{row['stored'] / mib:>12.3f}")
        lines += ["", f"{'origin':<44}{'saved':>7}{'stored MiB':>12}"]
        origins = sorted(self.by_origin().items(), key=lambda kv: -kv[1]["stored"])
        for origin, row in origins[:top]:
            short = origin if len(origin) <= 43 else "..." + origin[-40:]
            lines.append(f"{short:<44}{row['count']:>7}{row['stored'] / mib:>12.3f}")
        return "\n".join(lines)

    # ------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The JSON form: every field, each record an object. Built field by field, lists and
        dicts copied one level (their items are numbers and strings; `meta` is copied whole):
        `dataclasses.asdict` deep-copied every record, twice, about a second per profile of
        a default sweep, which saves ten of them."""
        data = {f.name: _copied(getattr(self, f.name)) for f in dataclasses.fields(self)}
        data["meta"] = copy.deepcopy(self.meta)
        names = _RECORD_FIELDS
        data["records"] = [{**{k: getattr(r, k) for k in names}, "shape": list(r.shape)}
                           for r in self.records]
        return {"schema": SCHEMA, "version": VERSION, **data}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """A profile from its `to_dict` form, every key and type checked: a file that is not
        one fails here with the key and what was expected, not later inside a plot."""
        if not isinstance(data, dict):
            raise ProfileFormatError(f"a profile must be a JSON object; got {_kind(data)}")
        if data.get("schema") != SCHEMA:
            raise ProfileFormatError(
                f"not a checkpoint-ad profile (schema {data.get('schema')!r}); expected {SCHEMA!r}"
            )
        version = data.get("version")
        if version not in READS or isinstance(version, bool):
            raise ProfileFormatError(
                f"profile version {version!r} is not readable by this version "
                f"(reads {', '.join(map(str, READS))}); re-record it with this version of "
                "checkpoint-ad"
            )
        fields = {k: v for k, v in data.items() if k not in ("schema", "version")}
        if version in (1, 2):  # nothing `explain` reads beyond the records
            fields.setdefault("level_peak_bytes", {})
            fields.setdefault("io_bytes_written", 0)
            fields.setdefault("io_bytes_read", 0)
            fields.setdefault("io_stall_seconds", 0.0)
            fields = {"peak_buffers": {}, "unrecorded_bytes": {}, "view_base_bytes": {},
                      "kept_by_caller": [], "originals_kept": [], "also_kept": [],
                      "leaf_bytes": 0, "rss_start_bytes": None, **fields}
            if isinstance(fields.get("records"), list):
                fields["records"] = [{"level": "device", "strategy": "", **r}
                                     if isinstance(r, dict) else r
                                     for r in fields["records"]]
        if version == 1:  # every saved value counted as owned; aliases not told apart
            fields.setdefault("aliased_bytes", None)
            if isinstance(fields.get("records"), list):
                fields["records"] = [{**r, "owned": True} if isinstance(r, dict) else r
                                     for r in fields["records"]]
        fields.setdefault("evictions", 0)  # added within version 2: absent means none
        fields.setdefault("rematerializations", 0)
        fields.setdefault("plan_seconds", 0.0)  # added within version 3: absent means none
        fields.setdefault("plans", 0)
        fields.setdefault("plan_tape_bytes", 0)
        fields.setdefault("gradient_bytes", None)
        fields.setdefault("largest_gradient_bytes", 0)  # added within version 3: unmeasured
        fields.setdefault("nested_sweeps", 0)
        fields.setdefault("traced_step_bytes", 0)
        fields.setdefault("traced_tape_bytes", 0)
        fields.setdefault("alias_buffers", {})
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ProfileFormatError(f"unknown profile fields {sorted(unknown)}; this version "
                                     "writes none of them: was the file made by another tool?")
        return _counted(from_plain(cls, fields, "profile", ProfileFormatError))

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileFormatError(f"profile JSON is malformed: {exc}") from exc
        except RecursionError:  # a profile nests a few levels; this is not one
            raise ProfileFormatError("profile JSON is nested too deeply to read; a profile "
                                     "nests a few levels: was the file made by another "
                                     "tool?") from None
        if not isinstance(data, dict):
            raise ProfileFormatError("profile JSON must be an object")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> Path:
        """Write the JSON to `path` atomically, never through a symlink (`safe_files`)."""
        return write_text(path, self.to_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileFormatError(f"cannot read profile {str(path)!r}: {exc}") from exc
        try:
            return cls.from_json(text)
        except ProfileFormatError as exc:
            raise ProfileFormatError(f"{path}: {exc}") from exc


# ------------------------------------------------------------- checked loading
COUNTS = frozenset({"primitives", "recomputed_primitives", "evictions", "rematerializations",
                    "plans", "kept_by_caller", "originals_kept", "also_kept"})
"""Profile fields besides the ``*_bytes`` and ``*_seconds`` ones that count something."""


def _counted(profile: Profile) -> Profile:
    """`profile`, once every byte count, second count and count in it is a finite number not
    below zero (a file with ``peak_tape_bytes: -5`` is not one this version wrote)."""
    for f in dataclasses.fields(profile):
        if f.name.endswith(("_bytes", "_seconds")) or f.name in COUNTS:
            _not_negative(getattr(profile, f.name), f"profile.{f.name}")
    for i, record in enumerate(profile.records):
        for name in ("logical_bytes", "stored_bytes", "buffer"):
            _not_negative(getattr(record, name), f"profile.records[{i}].{name}")
    return profile


def _not_negative(value: Any, where: str) -> None:
    values = (value.values() if isinstance(value, dict)
              else value if isinstance(value, (list, tuple)) else [value])
    for item in values:
        if item is not None and not (math.isfinite(item) and item >= 0):
            raise ProfileFormatError(f"{where} must not be negative (it counts bytes, seconds "
                                     f"or things); got {item!r}: the file is damaged or was "
                                     "written by another tool")


def _kind(value: Any) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 40 else shown[:37] + '...'}"


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is list or origin is tuple:
        return f"a list, each item {_describe(args[0])}"
    if origin is dict:
        return "an object"
    if dataclasses.is_dataclass(hint):
        return f"an object with keys {', '.join(f.name for f in dataclasses.fields(hint))}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        hint, str(hint))


def _check(value: Any, hint: Any, where: str, error: type[FileFormatError]) -> Any:
    """`value` as `hint` asks (lists become tuples where a tuple is declared), or `error`."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _check(value, option, where, error)
            except FileFormatError:
                continue
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return from_plain(hint, value, where, error)
    elif origin in (list, tuple) and isinstance(value, list):
        items = [_check(v, args[0], f"{where}[{i}]", error) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    elif origin is dict and isinstance(value, dict):
        return {k: _check(v, args[1], f"{where}.{k}", error) for k, v in value.items()}
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif hint in (int, str, bool) and type(value) is hint:
        return value
    raise error(f"{where} must be {_describe(hint)}; got {_kind(value)}")


def from_plain(cls: type[T], data: Any, where: str, error: type[FileFormatError]) -> T:
    """Build the dataclass `cls` from parsed JSON, checking that every field is present, has
    its declared type (nested dataclasses, lists and optionals included) and nothing else is
    there; `error` names the first key that is wrong and what it should be."""
    if not isinstance(data, dict):
        raise error(f"{where} must be {_describe(cls)}; got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    missing = [n for n in names if n not in data]
    if missing:
        raise error(f"{where} is missing key {missing[0]!r} ({_describe(hints[missing[0]])}); "
                    "the file is incomplete or was written by another tool")
    extra = sorted(set(data) - set(names))
    if extra:
        raise error(f"{where} has unknown key {extra[0]!r}; expected only {', '.join(names)}")
    return cls(**{n: _check(data[n], hints[n], f"{where}.{n}", error) for n in names})
