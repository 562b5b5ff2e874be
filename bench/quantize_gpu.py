"""Quantize and dequantize on a GPU: the fused kernels against the array-API path, same run.

    python -m bench.quantize_gpu --out profiles/gpu

Each row times one call on a cupy float32 array (the mean over the repeats of the time from
issue until the device is done, by CUDA events: `cupyx.profiler.benchmark`) of the fused path that
`quantize` and `dequantize` take on cupy, and of the general array-API path the same functions
took before it (`_quantize_general`, `_dequantize_general`), and checks that both give the same
codes, group parameters and values. Sizes: one carry of the large GPU RNN (512 x 1024), a
small one (64 x 256, where launches decide) and 64 MiB (where bandwidth does).
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

SHAPES = {"carry 64x256": (64, 256), "carry 512x1024": (512, 1024), "64 MiB": (2**24,)}


def measure(repeats: int, group_size: int = 64) -> list[dict[str, Any]]:
    import cupy
    from cupyx.profiler import benchmark

    from checkpoint_ad.backend import namespace
    from checkpoint_ad.strategies import quantize as qz

    def timed(fn: Any) -> float:
        """Mean seconds per call from issue to the device being done (cupyx's benchmark: CUDA
        events around each call, after warm-up calls)."""
        return float(benchmark(fn, n_repeat=repeats, n_warmup=3, name="call").gpu_times.mean())

    rows = []
    for label, shape in SHAPES.items():
        x = cupy.random.default_rng(0).standard_normal(shape, dtype=cupy.float32)
        xp = namespace(x)
        for bits in qz.ALLOWED_BITS:
            for stochastic in (False, True):
                fused = qz.quantize(x, bits, group_size, stochastic=stochastic, seed=0)
                general = qz._quantize_general(xp, x, bits, group_size, stochastic, 0)
                same = all(bool(cupy.array_equal(getattr(fused, k), getattr(general, k)))
                           for k in ("codes", "mins", "scales"))
                same &= bool(cupy.array_equal(qz.dequantize(fused),
                                              qz._dequantize_general(xp, general)))
                row = {
                    "shape": label, "bits": bits,
                    "rounding": "stochastic" if stochastic else "nearest",
                    "same_bits": same,
                    "pack_fused_s": timed(partial(qz.quantize, x, bits, group_size,
                                                  stochastic=stochastic, seed=0)),
                    "pack_general_s": timed(partial(qz._quantize_general, xp, x, bits,
                                                    group_size, stochastic, 0)),
                    "unpack_fused_s": timed(partial(qz.dequantize, fused)),
                    "unpack_general_s": timed(partial(qz._dequantize_general, xp, general)),
                }
                row["pack_speedup"] = row["pack_general_s"] / row["pack_fused_s"]
                row["unpack_speedup"] = row["unpack_general_s"] / row["unpack_fused_s"]
                rows.append(row)
    return rows


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| array | bits | rounding | pack fused µs | pack general µs | speed-up | "
             "unpack fused µs | unpack general µs | speed-up | same bits |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['bits']} | {r['rounding']} | {r['pack_fused_s'] * 1e6:.1f} | "
            f"{r['pack_general_s'] * 1e6:.1f} | {r['pack_speedup']:.1f}x | "
            f"{r['unpack_fused_s'] * 1e6:.1f} | {r['unpack_general_s'] * 1e6:.1f} | "
            f"{r['unpack_speedup']:.1f}x | {r['same_bits']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quantize_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="profiles/gpu")
    args = parser.parse_args(argv)
    rows = measure(args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quantize-gpu.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = _markdown(rows)
    (out / "quantize-gpu.md").write_text(table)
    print(table, end="")
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
