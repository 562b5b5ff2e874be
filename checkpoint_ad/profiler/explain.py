"""`Profile.explain()`: why memory did not drop, as bytes by cause, largest first.

A strategy can only save memory that exists *because the tape keeps it*. When a run's memory
does not drop, the bytes usually sit somewhere a strategy cannot reach: arrays the caller
keeps alive anyway (a list of every hidden state), originals of values stored packed (the
caller holds the float32 array the tape keeps as int8), base arrays that small saved views
keep alive. Each saved buffer is put in exactly one cause, counted once, over the whole run:

- "kept alive by your references": saved by reference and released by the tape, or dropped
  to be recomputed, yet still alive at the end of the block: the caller holds them (or a
  tensor the caller holds does: a loss's graph keeps each checkpoint's inputs), so no
  strategy could have freed them.
- "originals of packed values you hold": the tape keeps a packed copy (quantized, offloaded);
  the original is still alive, so packing added the copy and freed nothing.
- "bases kept alive by saved views": a saved slice keeps its whole base array alive.
- "saved by <strategy> (owned)": what the tape alone keeps: what a strategy can save.
- "loop snapshots and region inputs": owned buffers no entry recorded (`scan`, `checkpoint`).
- "aliases of your live arrays": parameters and input slices saved by reference (free): each
  array once, those alive together at their peak (the lines sum to the total).
- "loops' stacked outputs and input gradients": a `scan`'s `ys` (the graph holds them while
  the loss lives) and the gradient of its `xs` its backward fills: arrays no entry saves.
- "held only by reference cycles": arrays alive at the block's end that only the cyclic
  collector frees (measured under tracemalloc, `profile(device_memory=True)`), by the line
  that allocated each: memory the process holds until `gc.collect()` runs.
- "the backward's working arrays": what the sweep holds at its peak beyond the saved values
  and the gradients: an adjoint in flight and the one it makes, a parameter's partial
  gradient and the new sum made beside its running one (`profiler.process.working_lines`;
  transient, and no strategy's to save).
- "a traced step's values": a planned `scan` traces its steps 0 and 1 to build its step
  program, and the trace holds every value such a step makes while it runs: the bytes of
  one step's values that no saved value is (transient, in the forward).

Then the memory no strategy touches: parameters (the leaves' arrays alive at the block's end),
their gradients (the `.grad` arrays then), and what the process's RSS grew beyond
tracemalloc's measure (the allocator, libraries). Figures are bytes; a cause lists the source
lines that saved the most of it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .process import working_lines

KEPT = "kept alive by your references"
ORIGINALS = "originals of packed values you hold"
VIEWS = "bases kept alive by saved views"
SNAPSHOTS = "loop snapshots and region inputs"
ALIASES = "aliases of your live arrays"
CYCLES = "held only by reference cycles"
LOOP_ARRAYS = "loops' stacked outputs and input gradients"
WORKING = "the backward's working arrays"
TRACED = "a traced step's values"
TRACED_LINE = "a scan's step traced for its step program (steps 0 and 1)"


@dataclass(frozen=True)
class Cause:
    """One reason memory is in use: its bytes and the source lines that saved the most."""

    name: str
    bytes: int
    lines: tuple[tuple[str, int], ...] = ()  # (origin 'file:line', bytes), largest first


@dataclass(frozen=True)
class Explanation:
    """Bytes by cause (`causes`, largest first) and the memory no strategy touches.

    >>> import checkpoint_ad as cad
    >>> x = cad.tensor([1.0, 2.0], requires_grad=True)
    >>> with cad.profile() as prof:
    ...     hs = [cad.tanh(x)]
    ...     hs[0].sum().backward()
    >>> [c.name for c in prof.explain().causes]  # tanh's adjoint and its input's; hs[0]
    ["the backward's working arrays", 'kept alive by your references']
    """

    causes: tuple[Cause, ...]
    kept_by_caller: int
    packed_originals: int
    view_bases: int
    owned_by_strategy: dict[str, int] = field(default_factory=dict)
    snapshots: int = 0
    aliases: int = 0
    cycles: int = 0  # arrays only reference cycles held at the block's end
    loop_arrays: int = 0  # scans' stacked outputs and filled input gradients
    working: int = 0  # the backward's working arrays (adjoints, a partial gradient)
    traced: int = 0  # a traced step's values no saved value is, held while it ran
    parameters: int = 0
    gradients: int = 0  # measured (the leaves' .grad arrays), or one per parameter in old files
    beyond_tracemalloc: int | None = None  # RSS growth not seen by tracemalloc
    peak_tape_bytes: int = 0

    @property
    def accounted_bytes(self) -> int:
        """What the causes made in the run add up to: every cause but the aliases (the
        caller's arrays, there before the run), and the gradients."""
        return sum(c.bytes for c in self.causes if c.name != ALIASES) + self.gradients

    @property
    def top(self) -> Cause | None:
        """The largest cause, or None if the tape saved nothing."""
        return self.causes[0] if self.causes else None

    def table(self) -> str:
        """The causes and the baseline as an aligned text table (bytes in MiB)."""
        mib = 2**20
        rows = [(c.name, c.bytes) for c in self.causes]
        rows += [("parameters (no strategy touches)", self.parameters),
                 ("gradients (your leaves' .grad arrays)", self.gradients)]
        if self.beyond_tracemalloc is not None:
            rows.append(("RSS growth beyond tracemalloc", self.beyond_tracemalloc))
        width = max(len(name) for name, _ in rows)
        lines = [f"{'cause':<{width}}  {'MiB':>10}"]
        lines += [f"{name:<{width}}  {size / mib:>10.3f}" for name, size in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        mib = 2**20
        if not self.causes:
            return "the tape saved nothing: memory in use is not the tape's\n" + self.table()
        lines = [f"why memory did not drop (peak owned tape {self.peak_tape_bytes / mib:.3f} "
                 "MiB):"]
        for i, cause in enumerate(self.causes, 1):
            lines.append(f"{i}. {cause.name}: {cause.bytes / mib:.3f} MiB")
            lines += [f"     {origin}  {size / mib:.3f} MiB" for origin, size in cause.lines]
        return "\n".join([*lines, "", self.table()])


def explain(profile: Any, top: int = 3) -> Explanation:
    """The `Explanation` of `profile` (a `Profile`), each cause naming its `top` lines."""
    kept, originals = set(profile.kept_by_caller), set(profile.originals_kept)
    also = set(profile.also_kept)
    at_peak = {int(k): v for k, v in profile.peak_buffers.items()}
    unrecorded = {int(k): v for k, v in profile.unrecorded_bytes.items()}
    view_bases = {int(k): v for k, v in profile.view_base_bytes.items()}
    first = {}
    for r in profile.records:
        first.setdefault(r.buffer, r)
    totals: dict[str, int] = defaultdict(int)
    lines: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    owned: dict[str, int] = defaultdict(int)

    def add(name: str, size: int, record: Any) -> None:
        totals[name] += size
        lines[name][record.origin if record is not None else "<no entry: loop or region>"] += size

    for serial in kept | originals:  # arrays the caller holds: alive at the end, together
        r = first.get(serial)
        if r is None:
            add(KEPT, unrecorded.get(serial, at_peak.get(serial, 0)), None)
        elif serial in kept or not r.stored_bytes:  # by reference, or dropped (recompute)
            add(KEPT, r.logical_bytes, r)
        else:  # a packed copy (owned, counted below) and the original as well
            add(ORIGINALS, r.logical_bytes, r)
    for serial, size in at_peak.items():  # what the tape alone kept at its peak
        r = first.get(serial)
        if serial in view_bases:
            add(VIEWS, view_bases[serial], r)
        if serial in kept or serial in also or (
                serial in originals and r is not None and not r.stored_bytes):
            continue
        if r is None:
            add(SNAPSHOTS, size, None)
        else:
            add(f"saved by {r.strategy or 'the tape'} (owned)", size, r)
            owned[r.strategy or "unknown"] += size
    for serial, size in profile.alias_buffers.items():  # aliases alive at their peak
        r = first.get(int(serial))
        lines[ALIASES][r.origin if r is not None else "<no entry: loop or region>"] += size
    if profile.aliased_bytes:
        totals[ALIASES] = profile.aliased_bytes
    for line, size in getattr(profile, "loop_arrays", {}).items():
        lines[LOOP_ARRAYS][line] += size
        totals[LOOP_ARRAYS] += size
    for line, size in getattr(profile, "cycle_lines", {}).items():
        lines[CYCLES][line] += size
        totals[CYCLES] += size
    if profile.gradient_bytes is not None:  # (files before version 3 measured no gradients)
        for line, size in working_lines(profile).items():
            lines[WORKING][line] += size
            totals[WORKING] += size
    traced = getattr(profile, "traced_step_bytes", 0)
    if traced:
        lines[TRACED][TRACED_LINE] += traced
        totals[TRACED] += traced
    snapshots = totals.get(SNAPSHOTS, 0)
    causes = tuple(sorted(
        (Cause(name, size, tuple(sorted(lines[name].items(), key=lambda kv: -kv[1])[:top]))
         for name, size in totals.items() if size > 0),
        key=lambda c: -c.bytes))
    beyond = None
    if (profile.device_peak_bytes is not None and profile.rss_peak_bytes is not None
            and profile.rss_start_bytes is not None):
        beyond = max(profile.rss_peak_bytes - profile.rss_start_bytes
                     - profile.device_peak_bytes, 0)
    return Explanation(
        causes=causes,
        kept_by_caller=totals.get(KEPT, 0),
        packed_originals=totals.get(ORIGINALS, 0),
        view_bases=totals.get(VIEWS, 0),
        owned_by_strategy=dict(owned),
        snapshots=snapshots,
        aliases=totals.get(ALIASES, 0),
        cycles=totals.get(CYCLES, 0),
        loop_arrays=totals.get(LOOP_ARRAYS, 0),
        working=totals.get(WORKING, 0),
        traced=totals.get(TRACED, 0),
        parameters=profile.leaf_bytes,
        gradients=(profile.leaf_bytes if profile.gradient_bytes is None
                   else profile.gradient_bytes),
        beyond_tracemalloc=beyond,
        peak_tape_bytes=profile.peak_tape_bytes,
    )
