"""Listing a tape: what each entry computed, what it saved, how many bytes, and where; and
(`loops`, from `loop_log`) which loops ran and how, with or without gradients."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .loop_log import LoopInfo, loops
from .tape import Entry

__all__ = ["EntryInfo", "LoopInfo", "SavedInfo", "TapeView", "describe_entry", "loops",
           "tape_of"]


@dataclass(frozen=True)
class SavedInfo:
    """One saved value of an entry."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    logical_nbytes: int
    stored_nbytes: int
    buffer_id: int


@dataclass(frozen=True)
class EntryInfo:
    """A read-only description of one tape entry."""

    seq: int
    op: str
    output_shapes: tuple[tuple[int, ...], ...]
    form: str
    saved: tuple[SavedInfo, ...]
    origin: str
    released: bool
    mode: str = ""  # a loop's: "replayed" (or "replayed (program reused ...)"), "recorded: <why>"

    @property
    def saved_nbytes(self) -> int:
        return sum(s.stored_nbytes for s in self.saved)


def describe_entry(entry: Entry) -> EntryInfo:
    saved = tuple(
        SavedInfo(
            slot.name,
            slot.buffer.shape,
            str(slot.buffer.dtype),
            slot.buffer.logical_nbytes,
            slot.buffer.stored_nbytes,
            slot.buffer.stored_id,
        )
        for slot in entry.slots or ()
        if slot.buffer is not None
    )
    return EntryInfo(
        entry.seq,
        entry.name,
        tuple(shape for shape, _ in entry.out_meta),
        entry.form.kind if entry.form is not None else "custom",
        saved,
        entry.origin,
        entry.released,
        str(entry.attrs.get("mode", "")),
    )


class TapeView:
    """Entries in execution order, with totals that count a shared buffer once.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0, 2.0], requires_grad=True)
    >>> y = cad.tanh(x * x).sum()
    >>> [e.op for e in cad.tape_of(y)]
    ['multiply', 'tanh', 'sum']
    """

    def __init__(self, entries: Iterable[Entry]) -> None:
        self._entries = sorted(entries, key=lambda e: e.seq)

    def __iter__(self) -> Iterator[EntryInfo]:
        return (describe_entry(e) for e in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> EntryInfo:
        return describe_entry(self._entries[index])

    @property
    def saved_nbytes(self) -> int:
        """Stored bytes of all live saved values, each shared buffer counted once."""
        buffers: dict[int, int] = {}
        for entry in self._entries:
            for slot in entry.slots or ():
                if slot.buffer is not None:
                    buffers[slot.buffer.stored_id] = slot.buffer.stored_nbytes
        return sum(buffers.values())

    def table(self) -> str:
        """A readable listing, one line per entry."""
        lines = [f"{'#':>6}  {'op':<14} {'output':<18} {'form':<7} {'saved':<34} origin"]
        for info in self:
            saved = ", ".join(f"{s.name}:{s.dtype}{list(s.shape)}" for s in info.saved) or "-"
            if info.released:
                saved = "(freed)"
            shapes = ",".join(str(list(s)) for s in info.output_shapes)
            lines.append(
                f"{info.seq:>6}  {info.op:<14} {shapes:<18} {info.form:<7} {saved:<34} "
                f"{_short(info.origin)}" + (f"  ({info.mode})" if info.mode else "")
            )
        if any(e.origin_frame[0] is None for e in self._entries):
            lines.append("origins: record under cad.record_origins() to see each entry's line")
        total = f"{self.saved_nbytes:,} bytes saved (shared counted once)"
        lines.append(f"{len(self)} entries, {total}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()


def _short(origin: str) -> str:
    path, _, line = origin.rpartition(":")
    return f"{path.rsplit('/', 1)[-1]}:{line}" if path else origin


def tape_of(*outputs: Any) -> TapeView:
    """The recorded entries the given outputs depend on, in execution order."""
    seen: dict[int, Entry] = {}
    stack = [t._entry for t in outputs if getattr(t, "_entry", None) is not None]
    while stack:
        entry = stack.pop()
        if id(entry) in seen:
            continue
        seen[id(entry)] = entry
        stack.extend(e[0] for e in entry.edges if e is not None and type(e[0]) is Entry)
    return TapeView(seen.values())
