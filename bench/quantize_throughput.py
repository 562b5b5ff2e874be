"""Throughput of the quantization kernels on the numpy path, one thread.

Why one thread: the kernels run while the engine saves activations, often beside other work, so
the figure that matters is what a single core sustains. GB/s counts float32 *input* bytes (1e9),
pack = quantize, unpack = dequantize, round trip = both back to back. Median of the repeats
after one warm-up call.

Run from the repository root::

    python bench/quantize_throughput.py [--megabytes 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run without installing

from checkpoint_ad.strategies.quantize import ALLOWED_BITS, dequantize, quantize


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=64, help="float32 input size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    x = np.random.default_rng(0).standard_normal(args.megabytes * 2**20 // 4, dtype=np.float32)
    gigabytes = x.nbytes / 1e9
    print(
        f"input: {x.nbytes / 2**20:.0f} MiB float32, group_size 64, 1 thread, "
        f"median of {args.repeats}"
    )
    print(
        f"{'bits':>4} {'rounding':>10} {'pack GB/s':>10} {'unpack GB/s':>12} "
        f"{'round trip GB/s':>16} {'stored':>7}"
    )
    with threadpool_limits(1):
        for stochastic in (False, True):
            for bits in ALLOWED_BITS:
                pack = median_seconds(
                    lambda b=bits, s=stochastic: quantize(x, b, stochastic=s, seed=0),
                    args.repeats,
                )
                q = quantize(x, bits, stochastic=stochastic, seed=0)
                unpack = median_seconds(lambda q=q: dequantize(q), args.repeats)
                rounding = "stochastic" if stochastic else "nearest"
                print(
                    f"{bits:>4} {rounding:>10} {gigabytes / pack:>10.2f} "
                    f"{gigabytes / unpack:>12.2f} {gigabytes / (pack + unpack):>16.2f} "
                    f"{q.nbytes / x.nbytes:>7.4f}"
                )


if __name__ == "__main__":
    main()
