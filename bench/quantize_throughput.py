"""Throughput of the quantization kernels on the numpy path, one thread.

Why one thread: the kernels run while the engine saves activations, often beside other work, so
the figure that matters is what a single core sustains. GB/s counts float32 *input* bytes (1e9),
pack = quantize, unpack = dequantize, round trip = both back to back. Median of the repeats
after one warm-up call (`bench.measure.time_median`, the collector frozen while timed).

Run from the repository root::

    python bench/quantize_throughput.py [--megabytes 64] [--repeats 5] [--group-size 64]

`python -m bench` runs it as workload 4 (`throughput`, in a worker process pinned to the
bench's thread count).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.measure import time_median
else:
    from .measure import time_median

from checkpoint_ad.strategies.quantize import ALLOWED_BITS, dequantize, quantize


def measure_throughput(
    megabytes: int, repeats: int, group_size: int, roundings: tuple[bool, ...] = (False, True)
) -> list[dict[str, Any]]:
    """One row per (rounding, bits): pack, unpack and round-trip GB/s and the stored fraction."""
    x = np.random.default_rng(0).standard_normal(megabytes * 2**20 // 4, dtype=np.float32)
    gigabytes = x.nbytes / 1e9
    rows = []
    for stochastic in roundings:
        for bits in ALLOWED_BITS:
            pack = time_median(
                lambda b=bits, s=stochastic: quantize(x, b, group_size, stochastic=s, seed=0),
                repeats,
            )
            q = quantize(x, bits, group_size, stochastic=stochastic, seed=0)
            unpack = time_median(lambda q=q: dequantize(q), repeats)
            rows.append({
                "bits": bits,
                "rounding": "stochastic" if stochastic else "nearest",
                "pack_seconds": pack.median,
                "unpack_seconds": unpack.median,
                "pack_gbps": gigabytes / pack.median,
                "unpack_gbps": gigabytes / unpack.median,
                "round_trip_gbps": gigabytes / (pack.median + unpack.median),
                "stored_fraction": q.nbytes / x.nbytes,
            })
    return rows


def throughput(params: dict, threads: int) -> dict[str, Any]:
    """The bench worker's task: one result row per bit width and rounding."""
    from checkpoint_ad.strategies import Quantized

    group_size = params.get("group_size") or Quantized().group_size
    rows = []
    for row in measure_throughput(params["megabytes"], params["repeats"], group_size):
        seconds = row["pack_seconds"] + row["unpack_seconds"]
        rows.append({
            "name": f"int{row['bits']} {row['rounding']}",
            "seconds": seconds,
            "repeats": params["repeats"],
            "rate": row["round_trip_gbps"],
            "rate_unit": "GB/s round trip",
            "extras": {k: row[k] for k in ("pack_gbps", "unpack_gbps", "stored_fraction")}
            | {"megabytes": params["megabytes"], "group_size": group_size, "dtype": "float32"},
        })
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=64, help="float32 input size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args()

    from threadpoolctl import threadpool_limits

    print(
        f"input: {args.megabytes} MiB float32, group_size {args.group_size}, 1 thread, "
        f"median of {args.repeats}"
    )
    print(
        f"{'bits':>4} {'rounding':>10} {'pack GB/s':>10} {'unpack GB/s':>12} "
        f"{'round trip GB/s':>16} {'stored':>7}"
    )
    with threadpool_limits(1):
        for row in measure_throughput(args.megabytes, args.repeats, args.group_size):
            print(
                f"{row['bits']:>4} {row['rounding']:>10} {row['pack_gbps']:>10.2f} "
                f"{row['unpack_gbps']:>12.2f} {row['round_trip_gbps']:>16.2f} "
                f"{row['stored_fraction']:>7.4f}"
            )


if __name__ == "__main__":
    main()
