"""The `checkpoint-ad` command line: a thin face over the library."""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from collections.abc import Sequence

import numpy as np


def _rnn_example(steps: int, hidden: int, batch: int, strategy: object, storage: object) -> dict:
    import checkpoint_ad as cad

    rng = np.random.default_rng(0)
    scale = 1.0 / np.sqrt(hidden)
    W = cad.tensor((rng.standard_normal((hidden, hidden)) * scale).astype(np.float32),
                   requires_grad=True)
    U = cad.tensor((rng.standard_normal((hidden, hidden)) * scale).astype(np.float32),
                   requires_grad=True)
    xs = cad.tensor(rng.standard_normal((steps, batch, hidden)).astype(np.float32))
    h0 = cad.tensor(np.zeros((batch, hidden), dtype=np.float32))

    def step(h, x):
        h = cad.tanh(h @ W + x @ U)
        return h, h

    tracemalloc.start()
    start = time.perf_counter()
    if storage is not None:
        with cad.use(storage):
            _, ys = cad.scan(step, h0, xs, strategy=strategy)
    else:
        _, ys = cad.scan(step, h0, xs, strategy=strategy)
    loss = ys.sum()
    grads = cad.grad(loss, [W, U])
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"peak": peak, "seconds": seconds, "grads": [g.numpy() for g in grads]}


def example(args: argparse.Namespace) -> int:
    """Run the built-in RNN under each strategy: measured peak memory, time, gradient error."""
    from checkpoint_ad.strategies import Binomial, Periodic, Quantized, Recompute, StoreInputs

    steps = args.steps
    configs = [
        ("keep everything", None, None),
        ("store inputs", None, StoreInputs()),
        (f"every {round(steps ** 0.5)} steps", Periodic(max(1, round(steps ** 0.5))), None),
        ("recompute each step", Recompute(), None),
        ("binomial, 4 snapshots", Binomial(4), None),
        ("binomial, 16 snapshots", Binomial(16), None),
        ("int8 storage", None, Quantized(8)),
        ("int4 storage", None, Quantized(4)),
    ]
    print(f"RNN h = tanh(h @ W + x @ U): T={steps}, hidden={args.hidden}, batch={args.batch}, "
          "float32, loss = sum of all h_t")
    print(f"{'strategy':<24} {'peak MiB':>9} {'vs keep':>8} {'seconds':>8} {'grad rel. error':>16}")
    reference = None
    for name, loop, storage in configs:
        result = _rnn_example(steps, args.hidden, args.batch, loop, storage)
        if reference is None:
            reference = result
        error = max(
            float(np.linalg.norm(g - r) / np.linalg.norm(r))
            for g, r in zip(result["grads"], reference["grads"], strict=True)
        )
        print(f"{name:<24} {result['peak'] / 2**20:>9.2f} "
              f"{result['peak'] / reference['peak']:>8.2f} {result['seconds']:>8.3f} "
              f"{error:>16.2e}")
    print("peak: tracemalloc over forward+backward; error: max over W, U vs keeping everything")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="checkpoint-ad",
        description="Measure the memory/recomputation trade-off of reverse-mode AD strategies.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("example", help="the built-in RNN under each storage strategy")
    run.add_argument("--steps", type=int, default=256, help="sequence length T (default 256)")
    run.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    run.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    run.set_defaults(handler=example)
    args = parser.parse_args(argv)
    for name in ("steps", "hidden", "batch"):
        if getattr(args, name, 1) < 1:
            print(f"checkpoint-ad: --{name} must be a positive integer", file=sys.stderr)
            return 2
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
