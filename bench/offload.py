"""Workload 6, beyond RAM: binomial checkpointing of the heat model with snapshots on disk,
and a plain Python loop whose every saved value is offloaded (issue 37 item 4).

Rows: RAM-only binomial with few snapshots (many re-runs), the same RAM budget plus a disk level
(H-Revolve plan, write and read costs measured on the first step), and every snapshot written to
disk (``storage=Offload("disk")``). Each row reports the forward+backward time (median), the
backward time and the seconds the backward waited on disk I/O (from a profile of one extra
run), the stall as a fraction of the backward (target: at most 10%), bytes per storage level
and bytes written and read; gradients are checked bitwise against keep-all.

The Python loop (``python -m bench.offload``): the 1-D heat loop of `bench.dtr_scaling`
(3 saved values of 4 KiB a step) under keep-all, ``Offload("disk")`` and ``Offload("host")``;
per length the median time of each over rounds that alternate the order (the machine's speed
drifts on shared cores), each over keep-all's median, the backward seconds and the seconds it
waited on I/O (a profile of one extra run), files written, and a bitwise check.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import numpy as np

from .dtr_scaling import _heat
from .measure import pin_threads, time_median


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


def _heat_loop(steps: int, strategy: Any, size: int) -> tuple[list[np.ndarray], float]:
    """`bench.dtr_scaling`'s heat loop, its backward (and the loss's sum, microseconds)
    timed apart."""
    marks: list[float] = []
    grads = _heat(steps, strategy, size, mark=lambda: marks.append(time.perf_counter()))
    return grads, time.perf_counter() - marks[0]


def _round(fn: Any) -> float:
    gc.collect()
    gc.freeze()
    try:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    finally:
        gc.unfreeze()


def python_loop_rows(lengths: list[int], size: int, repeats: int) -> list[dict]:
    """Keep-all, disk and host offload of the Python heat loop, timed in alternating rounds."""
    import checkpoint_ad as cad
    from checkpoint_ad.strategies import KeepAll, Offload
    from checkpoint_ad.strategies.storage import disk_store

    strategies = {"keep-all": KeepAll(), "disk": Offload("disk"), "host": Offload("host")}
    _heat_loop(50, KeepAll(), size)  # warm
    rows = []
    for steps in lengths:
        reference, _ = _heat_loop(steps, KeepAll(), size)
        times: dict[str, list[float]] = {name: [] for name in strategies}
        for round_ in range(repeats):
            order = list(strategies) if round_ % 2 == 0 else list(reversed(strategies))
            for name in order:
                times[name].append(_round(
                    lambda s=strategies[name], n=steps: _heat_loop(n, s, size)))
        keep = statistics.median(times["keep-all"])
        for name, strategy in strategies.items():
            store = disk_store.store_for(None)
            files, values = store.files_written, store.values_written
            with cad.profile() as prof:
                grads, backward = _heat_loop(steps, strategy, size)
            seconds = statistics.median(times[name])
            rows.append({"name": f"heat {steps} steps, {name}", "seconds": seconds,
                         "spread": [min(times[name]), max(times[name])], "repeats": repeats,
                         "extras": {
                             "steps": steps, "over_keep_all": seconds / keep,
                             "backward_seconds": backward,
                             "stall_seconds": prof.io_stall_seconds,
                             "stall_fraction": prof.io_stall_seconds / backward,
                             "values_written": store.values_written - values,
                             "files_written": store.files_written - files,
                             "written_mib": prof.io_bytes_written / 2**20,
                             "bitwise_equal": all(np.array_equal(a, b)
                                                  for a, b in zip(grads, reference))}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="2000,20000")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    pin_threads(args.threads)
    for row in python_loop_rows([int(s) for s in args.steps.split(",")], args.size,
                                args.repeats):
        e = row["extras"]
        print(f"{row['name']:28s} {row['seconds']:7.3f} s ({row['spread'][0]:.3f}-"
              f"{row['spread'][1]:.3f})  x{e['over_keep_all']:.2f} keep-all  backward "
              f"{e['backward_seconds']:.3f} s, stalled {e['stall_seconds']:.3f} s "
              f"({e['stall_fraction']:.1%})  {e['values_written']} values in "
              f"{e['files_written']} files  bitwise={e['bitwise_equal']}", flush=True)


if __name__ == "__main__":
    main()
