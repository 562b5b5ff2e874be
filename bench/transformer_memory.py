"""Workload 7, Korthikanti et al. 2022's table measured: a transformer layer's activation bytes
and time without recomputation, with selective recomputation of the attention core, and with
full recomputation of each layer, beside the formula derived for this engine.

The built-in GPT (pre-norm, float32, no dropout), heads 8, batch 4, over a sweep of sequence
lengths at one width per job. Per layer: tracemalloc's bytes held after the forward (garbage
collection off) and the profiler's peak tape, each the difference between a 3- and a 5-layer
model over 2, against `checkpoint_ad.models.gpt_memory.predicted_layer_bytes` (4·s·b·h·(16 +
a·s/h) + 16·s·b without recomputation; 4·s·b·h·16 + 16·s·b selective; 4·s·b·h full). Time:
one forward and backward of a `layers`-deep GPT, the three granularities interleaved round by
round, the median of the per-round ratios to no recomputation. The measuring code is the
library's (`gpt_memory.activation_table`), which the notebook
`notebooks/07-transformer-activation-memory.ipynb` runs too.
"""

from __future__ import annotations

from typing import Any


def table(params: dict, threads: int) -> dict[str, Any]:
    """One row per (seq, granularity) at ``params["hidden"]``."""
    from checkpoint_ad.models.gpt_memory import activation_table

    found = activation_table(params["seqs"], [params["hidden"]], heads=params["heads"],
                             batch=params["batch"], layers=params["layers"],
                             repeats=params["repeats"])
    rows = []
    for r in found:
        rows.append({
            "name": f"s={r['seq']} {r['granularity']}",
            "seconds": r["seconds"],
            "spread": r["spread"],
            "repeats": params["repeats"],
            "tracemalloc_bytes": round(r["tracemalloc_bytes"]),
            "saved_bytes": round(r["peak_tape_bytes"]),
            "extras": {k: r[k] for k in (
                "hidden", "seq", "heads", "batch", "granularity", "formula", "predicted_bytes",
                "predicted_arrays", "tracemalloc_arrays", "peak_tape_arrays",
                "tracemalloc_over_predicted", "peak_tape_over_predicted", "over_none")},
        })
    return {"rows": rows}
