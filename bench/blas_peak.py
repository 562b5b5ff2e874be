"""What numpy's BLAS reaches on one core, against the core's nominal peak (issue 42, item 3).

    python -m bench.blas_peak              # float32 and float64, one thread

The RNN benchmark's floor and every engine run the same matrix products, so their speed is
bounded by what this BLAS does at the RNN's shapes: per step a (64, 256) @ (256, 256) product
forward and three of that size backward; batched over T steps, the weight gradients are one
(256, T*64) @ (T*64, 256) product. Each shape is timed (median of repeats, one thread pinned
by threadpoolctl) and reported in GFLOP/s and as a fraction of the nominal peak: FMA units x
SIMD lanes x 2 flops x the clock `/proc/cpuinfo` reports (Zen 3 and Haswell-class cores: 2
FMA units of 256 bits, so 16 float32 or 8 float64 flops a unit per cycle), and against the
largest product's rate (what the kernel reaches at its best here). The peak is nominal, not
measured: a virtual machine reports its base clock, and a core that boosts above it measures
more than 100% (quiet, 2026-11-29: 81-91 GF/s in float32 against 78 at the reported 2.45 GHz;
`--ghz` gives the clock to use instead).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from .measure import blas_info, pin_threads

# (m, k, n) of C = A (m, k) @ B (k, n): the RNN's per-step products, the batched weight
# gradient over 256 steps, and a large square product (the kernel's best case)
SHAPES = ((64, 256, 256), (256, 64 * 256, 256), (1024, 1024, 1024))


def clock_ghz() -> float | None:
    """The clock `/proc/cpuinfo` reports for the first core (None where it says none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return float(line.split(":")[1]) / 1000.0
    except OSError:
        return None
    return None


def peak_gflops(dtype: np.dtype, ghz: float | None, fma_units: int = 2,
                vector_bits: int = 256) -> float | None:
    """Nominal one-core peak: units x lanes x 2 (multiply and add) x GHz."""
    if ghz is None:
        return None
    lanes = vector_bits // (8 * np.dtype(dtype).itemsize)
    return fma_units * lanes * 2 * ghz


def gflops(m: int, k: int, n: int, dtype: np.dtype, repeats: int = 7) -> float:
    """Median GFLOP/s of an (m, k) @ (k, n) product into a preallocated output."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    out = np.empty((m, n), dtype)
    inner = max(1, int(2e9 / (2 * m * k * n)))  # about a second of work per repeat at 2 GF/s
    np.matmul(a, b, out=out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            np.matmul(a, b, out=out)
        times.append((time.perf_counter() - start) / inner)
    return 2 * m * k * n / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ghz", type=float, default=None,
                        help="the core's clock for the nominal peak (default: /proc/cpuinfo's)")
    args = parser.parse_args(argv)
    how = pin_threads(1)
    ghz = args.ghz if args.ghz is not None else clock_ghz()
    print(f"# python -m bench.blas_peak  threads: 1 ({how}); load average {os.getloadavg()}")
    for pool in blas_info():
        print(f"# pool: {pool}")
    clock = "unknown" if ghz is None else f"{ghz:.2f}"
    print(f"# clock {clock} GHz (/proc/cpuinfo); peak = 2 FMA units x 256-bit x 2 flops x clock")
    for dtype in (np.float32, np.float64):
        peak = peak_gflops(dtype, ghz)
        rates = [gflops(m, k, n, dtype, args.repeats) for m, k, n in SHAPES]
        for (m, k, n), got in zip(SHAPES, rates):
            share = "" if peak is None else f", {got / peak:.0%} of {peak:.0f} GF/s nominal"
            print(f"{np.dtype(dtype).name} ({m}, {k}) @ ({k}, {n}): {got:.1f} GF/s, "
                  f"{got / rates[-1]:.0%} of the largest product's rate{share}")


if __name__ == "__main__":
    main()
