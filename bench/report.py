"""The run's report: the text printed at the end, and the JSON and Markdown files written."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from checkpoint_ad.safe_files import write_text

from .suite import DESCRIPTIONS, EXTRA_COLUMNS
from .table import Row, block_table, blocks, markdown_table, text_table
from .targets import Target

LEGEND = """\
- **median**: median wall time of one forward+backward (one unit of work for `quantize` and
  `plan`) over the repeats, after a warm-up call, with `gc.freeze()` around each timed call;
  **range %** is (slowest - fastest) / median, a gauge of the machine's noise.
- **/name** columns: this row's median time divided by the named row's, in the same run.
  **/model** (checkpointing rows): time / (keep-all time + the plan's untaped step evaluations
  x one untaped step's measured time). **mem/model** (binomial rows): tracemalloc peak /
  (s x carry bytes + the tracemalloc peak of one step's forward+backward).
- **tracemalloc MB** (numpy floor and this engine only): peak bytes traced by tracemalloc
  during one forward+backward, above the level before it; numpy reports every array buffer to
  tracemalloc, so this is arrays plus the tape's Python objects. **mem/floor** compares it.
  Torch and XLA allocate outside Python, so they have no such column.
- **RSS Δ MB** (every column; the only memory measure shared with torch and JAX): peak
  resident set during one forward+backward (Linux VmHWM, reset via /proc/self/clear_refs;
  psutil samples where that is unavailable) above the resident set measured by psutil just
  before it, after `malloc_trim`. Page-granular and allocator-dependent: coarser than
  tracemalloc, and unreliable below a few MB (quick sizes), where pages kept from the warm-up
  (XLA's especially) are reused. **rss/floor** compares it.
- **saved MB**, the tensors' own byte counts: the floor's stored activations h_0..h_T
  (exact); this engine's profiler `peak_tape_bytes` (keep-all and quantized rows); torch
  eager's distinct storages seen by a `saved_tensors_hooks` pack hook during the forward;
  JAX's `jax.vjp` residuals (leaves of the jitted vjp function, which may include inputs).
  Per-step input slices x_t count in the engine's and torch's figures although they are views.
- **grad err**: max |g - g_ref| / max |g_ref| over the parameters, against the numpy floor's
  hand-derived gradients (float32; int8/4/2 rows are lossy by design).
- Every column of every block runs in its own fresh worker process, with BLAS, OpenMP, torch
  and XLA pinned to the same thread count."""


def _header(meta: dict[str, Any]) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    pools = "; ".join(
        f"{p.get('internal_api', p.get('user_api'))} {p.get('version') or ''} "
        f"({p.get('library')}, {p.get('num_threads')} threads"
        + (f", {p['architecture']}" if p.get("architecture") else "") + ")"
        for p in meta.get("blas", []))
    coretype = meta.get("OPENBLAS_CORETYPE")
    return [
        f"date: {meta['date']}  host: {meta['host']}  mode: {meta['mode']}",
        f"machine: {meta['cpu']}, {meta['cpus']} CPUs, {meta['memory']}, {meta['platform']}; "
        f"load average at start: {meta.get('load_average_at_start')}",
        f"threads per column: {meta['threads']} (env vars, threadpoolctl, "
        "torch.set_num_threads, XLA_FLAGS)",
        f"thread pools seen in the workers: {pools or 'unknown (threadpoolctl missing)'}",
        f"OPENBLAS_CORETYPE: {coretype if coretype else 'not set'} (it may be set on this "
        "machine; it selects OpenBLAS's kernels)",
        f"versions: python {meta['python']}, {versions}",
        f"command: {meta['command']}  wall time: {meta.get('wall_seconds', 0):.0f} s",
    ]


def _targets_cells(targets: Sequence[Target]) -> list[list[str]]:
    cells = [["target", "measured", "limit", "status", "detail"]]
    for t in targets:
        measured = "—" if t.measured is None else f"{t.measured:.3g}"
        limit = "—" if t.limit is None else f"{t.relation} {t.limit:g}"
        cells.append([t.name, measured, limit, t.status, t.detail])
    return cells


def _skips(rows: Sequence[Row]) -> list[str]:
    return [f"{r.bench} {r.case} · {r.name}: {r.note}" for r in rows
            if r.note and r.seconds is None]


def render_text(meta: dict[str, Any], rows: Sequence[Row], targets: Sequence[Target]) -> str:
    out = [*_header(meta), ""]
    for (bench, case), block in blocks(rows).items():
        cells = block_table(block, EXTRA_COLUMNS.get(bench, ()))
        out += [f"== {bench} · {case} — {DESCRIPTIONS[bench]}", text_table(cells), ""]
    if targets:
        out += ["== targets (issue 5)", text_table(_targets_cells(targets)), ""]
    skips = _skips(rows)
    if skips:
        out += ["== skipped or failed", *skips, ""]
    return "\n".join(out)


def render_markdown(meta: dict[str, Any], rows: Sequence[Row], targets: Sequence[Target]) -> str:
    out = ["# checkpoint-ad benchmarks", ""]
    if meta["mode"] == "quick":
        out += ["> **Quick mode**: small sizes and few repeats, to check that the harness runs. "
                "Not figures to draw conclusions from.", ""]
    out += [f"- {line}" for line in _header(meta)] + [""]
    if targets:
        out += ["## Targets", "", markdown_table(_targets_cells(targets)), ""]
    for (bench, case), block in blocks(rows).items():
        out += [f"## {bench} · {case}", "", DESCRIPTIONS[bench] + ".", "",
                markdown_table(block_table(block, EXTRA_COLUMNS.get(bench, ()))), ""]
    skips = _skips(rows)
    if skips:
        out += ["## Skipped or failed", "", *(f"- {s}" for s in skips), ""]
    out += ["## What each column measures", "", LEGEND, ""]
    return "\n".join(out)


def write(folder: Path, stem: str, meta: dict[str, Any], rows: Sequence[Row],
          targets: Sequence[Target]) -> list[Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` into `folder` (atomically, never through a
    link: `checkpoint_ad.safe_files`); returns their paths."""
    data = {"meta": meta, "rows": [r.to_dict() for r in rows],
            "targets": [t.to_dict() for t in targets]}
    json_path = write_text(folder / f"{stem}.json", json.dumps(data, indent=1, default=str) + "\n")
    md_path = write_text(folder / f"{stem}.md", render_markdown(meta, rows, targets))
    return [json_path, md_path]
