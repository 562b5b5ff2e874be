"""Workload 6, beyond RAM: binomial checkpointing of the heat model with snapshots on disk.

Rows: RAM-only binomial with few snapshots (many re-runs), the same RAM budget plus a disk level
(H-Revolve plan, write and read costs measured on the first step), and every snapshot written to
disk (``storage=Offload("disk")``). Each row reports the forward+backward time (median), the
backward time and the seconds the backward waited on disk I/O (from a profile of one extra
run), the stall as a fraction of the backward (target: at most 10%), bytes per storage level
and bytes written and read; gradients are checked bitwise against keep-all.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .measure import time_median


def heat_disk(params: dict, threads: int) -> dict[str, Any]:
    import checkpoint_ad as cad
    from checkpoint_ad.models import build
    from checkpoint_ad.strategies import Binomial, Offload

    model = build("heat", **params["sizes"])
    s = params["snapshots"]
    columns = {
        f"binomial s={s} (RAM)": Binomial(s),
        f"binomial s={s} + disk (measured costs)": Binomial(s, disk=None),
        f"binomial s={s}, snapshots on disk": Binomial(s, storage=Offload("disk")),
    }

    def run(strategy: Any) -> list[np.ndarray]:
        for p in model.params:
            p.grad = None
        loop = None if strategy is None else (
            lambda step, carry, xs: cad.scan(step, carry, xs, strategy=strategy))
        model.run(loop).backward()
        return [p.grad.numpy().copy() for p in model.params]

    reference = run(None)
    rows = []
    for name, strategy in columns.items():
        timing = time_median(lambda strategy=strategy: run(strategy), params["repeats"])
        with cad.profile() as prof:
            grads = run(strategy)
        if not all(np.array_equal(g, r) for g, r in zip(grads, reference)):
            raise RuntimeError(f"{name}: gradients differ from keep-all")
        backward = prof.backward_seconds
        rows.append({
            "name": name,
            "seconds": timing.median,
            "spread": [timing.low, timing.high],
            "repeats": timing.repeats,
            "extras": {
                "backward_seconds": backward,
                "stall_seconds": prof.io_stall_seconds,
                "stall_fraction": prof.io_stall_seconds / backward if backward else 0.0,
                "ram_tape_mib": prof.peak_tape_bytes / 2**20,
                "disk_mib": prof.level_peak_bytes.get("disk", 0) / 2**20,
                "written_mib": prof.io_bytes_written / 2**20,
                "read_mib": prof.io_bytes_read / 2**20,
                "bitwise_equal": True,
                **params["sizes"],
            },
        })
    return {"rows": rows}
