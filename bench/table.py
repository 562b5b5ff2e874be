"""Result rows, the ratios between the columns of one run, and their text and Markdown tables.

A *block* is one benchmark at one size (``bench`` and ``case``); its rows are the columns
compared (numpy floor, engine strategies, peers). Ratios are only ever taken between rows of the
same block, measured in the same run, since these machines are shared and noisy: a ratio is
``row.<field> / reference.<field>`` where the reference is the block's row with a given role.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MB = 2**20
TEXT_COLUMNS = ("note", "status", "detail")  # left-aligned; the first column always is


@dataclass
class Row:
    """One measured (or skipped) column of one block. Memory fields are bytes; None = not
    measured by this column (see bench/README.md for which measure each column uses)."""

    bench: str
    case: str
    name: str
    role: str = ""
    seconds: float | None = None
    spread: list[float] | None = None
    repeats: int = 0
    rate: float | None = None
    rate_unit: str = ""
    tracemalloc_bytes: int | None = None
    rss_bytes: int | None = None
    saved_bytes: int | None = None
    grad_error: float | None = None
    ratios: dict[str, float | None] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    @classmethod
    def from_result(cls, bench: str, case: str, name: str, role: str,
                    result: dict[str, Any]) -> Row:
        known = {f for f in cls.__dataclass_fields__ if f not in ("bench", "case", "name", "role")}
        values = {k: v for k, v in result.items() if k in known}
        extras = dict(values.pop("extras", {}) or {})
        if "rss_source" in result:
            extras["rss_source"] = result["rss_source"]
        return cls(bench, case, result.get("name", name), role, extras=extras, **values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Ratio:
    """A ratio column: ``row.<field> / (the block's row with role <role>).<field>``."""

    label: str
    role: str
    field: str


def blocks(rows: Iterable[Row]) -> dict[tuple[str, str], list[Row]]:
    """Rows grouped by (bench, case), in the order they first appear."""
    grouped: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        grouped.setdefault((row.bench, row.case), []).append(row)
    return grouped


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference, or None when either is missing or the reference is not positive."""
    if value is None or reference is None or not reference > 0:
        return None
    return value / reference


def add_ratios(rows: Sequence[Row], specs: dict[str, Sequence[Ratio]]) -> None:
    """Fill each row's `ratios` from the specs of its bench, within its own block."""
    for (bench, _), block in blocks(rows).items():
        by_role = {row.role: row for row in block if row.role}
        for spec in specs.get(bench, ()):
            reference = by_role.get(spec.role)
            for row in block:
                ref_value = getattr(reference, spec.field) if reference is not None else None
                row.ratios[spec.label] = ratio(getattr(row, spec.field), ref_value)


def add_model_ratios(rows: Sequence[Row]) -> None:
    """The checkpointing cost model, per row that recorded the inputs it needs.

    time: ``keep-all time + untaped step evaluations x one untaped step's time`` (the n taped
    steps cost what keep-all costs; the recomputation is the plan's extra forward steps; a
    replayed loop's untaped step is its step program's replay; a loop recorded step by step,
    ``trace=False``, is modelled from keep-all recorded so and its steps run so untaped).
    memory (binomial): ``snapshots x carry bytes + one step's forward+backward peak``.
    """
    for block in blocks(rows).values():
        keeps = {r.role: r for r in block if r.role in ("keep-all", "keep-all recorded")}
        for row in block:
            x = row.extras
            # a loop recorded step by step (``trace=False``) against keep-all recorded so
            keep = keeps.get("keep-all recorded" if x.get("recorded") else "keep-all")
            if "untaped_steps" in x and keep is not None and keep.seconds is not None:
                step = x.get("replayed_step_seconds", x["untaped_step_seconds"])
                predicted = keep.seconds + x["untaped_steps"] * step
                x["predicted_seconds"] = predicted
                # the same model timed in the row's own worker, round by round, where it was
                row.ratios["/model"] = x.get("paired_over_model") or ratio(row.seconds,
                                                                           predicted)
            if "snapshots" in x and "one_step_tracemalloc_bytes" in x:
                x["predicted_bytes"] = (x["snapshots"] * x["carry_bytes"]
                                        + x["one_step_tracemalloc_bytes"])
                row.ratios["mem/model"] = ratio(row.tracemalloc_bytes, x["predicted_bytes"])


# ------------------------------------------------------------------------------------ format
def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def _number(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if value != 0 and abs(value) < 10 ** (-digits):
        return f"{value:.1e}"
    return f"{value:.{digits}f}"


def _megabytes(value: int | None) -> str:
    return "—" if value is None else f"{value / MB:.1f}"


def block_table(block: Sequence[Row], extra: Sequence[tuple[str, str]] = ()) -> list[list[str]]:
    """Header and cells of one block: only the columns some row of the block has, then the
    `extra` columns, (title, key in the rows' extras), that some row has."""
    def has(attr: str) -> bool:
        return any(getattr(r, attr) is not None for r in block)

    labels = list(dict.fromkeys(label for r in block for label in r.ratios))
    labels = [lb for lb in labels if any(r.ratios.get(lb) is not None for r in block)]
    unit = next((r.rate_unit for r in block if r.rate_unit), "")
    columns: list[tuple[str, Any]] = [("column", lambda r: r.name),
                                      ("median", lambda r: format_seconds(r.seconds))]
    if any(r.spread for r in block):
        columns.append(("range %", lambda r: _spread(r)))
    if has("rate"):
        columns.append((unit, lambda r: _number(r.rate)))
    columns += [(label, lambda r, lb=label: _number(r.ratios.get(lb))) for label in labels]
    memory = (("tracemalloc MB", "tracemalloc_bytes"), ("RSS Δ MB", "rss_bytes"),
              ("saved MB", "saved_bytes"))
    columns += [(title, lambda r, a=attr: _megabytes(getattr(r, a)))
                for title, attr in memory if has(attr)]
    columns += [(title, lambda r, k=key: _extra(r.extras.get(k)))
                for title, key in extra if any(key in r.extras for r in block)]
    if has("grad_error"):
        columns.append(("grad err", lambda r: _number(r.grad_error, 1)))
    if any(r.note for r in block):
        columns.append(("note", lambda r: r.note))
    return [[title for title, _ in columns]] + [[cell(r) for _, cell in columns] for r in block]


def _extra(value: Any) -> str:
    if isinstance(value, float):
        return _number(value, 3 if abs(value) < 1 else 2)
    return "—" if value is None else str(value)


def _spread(row: Row) -> str:
    if not row.spread or not row.seconds:
        return "—"
    low, high = row.spread
    return f"{(high - low) / row.seconds * 100:.0f}"


def text_table(cells: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    left = {0} | {i for i, title in enumerate(cells[0]) if title in TEXT_COLUMNS}
    lines = []
    for k, r in enumerate(cells):
        parts = [c.ljust(w) if i in left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(cells: list[list[str]]) -> str:
    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in r) + " |"

    align = ["---" if i == 0 or h in TEXT_COLUMNS else "---:" for i, h in enumerate(cells[0])]
    return "\n".join([line(cells[0]), "| " + " | ".join(align) + " |", *map(line, cells[1:])])
