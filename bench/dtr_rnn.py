"""The RNN as a plain Python loop under `Rematerializing` at a fraction of keep-all's saved
bytes: time against keep-all, the pool's and the profiler's peak tape against the limit, the
tracemalloc peak, and bitwise equality of the gradients.

    python -m bench.dtr_rnn                      # T=128, B=32, H=128, float32, limit 25%
    python -m bench.dtr_rnn --fractions 0.25,0.5 --steps 256

Figures are indicative (one machine, BLAS pinned to one thread); targets of issue 11: time
within 2x keep-all (aim 1.5x) and peak tape within 5% of the limit at 25%.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from .measure import paired_ratio, pin_threads, time_median, tracemalloc_peak


class _Loop:
    """One forward+backward of ``h = tanh(h @ W + x_t @ U + b)``, loss = sum of every h_t."""

    def __init__(self, steps: int, batch: int, hidden: int, strategy: Any) -> None:
        import checkpoint_ad as cad

        rng = np.random.default_rng(0)
        f32 = np.float32
        self.cad = cad
        self.W = cad.tensor((rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(f32),
                            requires_grad=True)
        self.U = cad.tensor((rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(f32),
                            requires_grad=True)
        self.b = cad.tensor((0.1 * rng.standard_normal(hidden)).astype(f32), requires_grad=True)
        self.xs = cad.tensor(rng.standard_normal((steps, batch, hidden)).astype(f32))
        self.h0 = cad.tensor(np.zeros((batch, hidden), dtype=f32))
        self.make_strategy = strategy

    def run(self) -> None:
        cad = self.cad
        for p in (self.W, self.U, self.b):
            p.grad = None
        self.strategy = self.make_strategy()
        with cad.use(self.strategy):
            h, loss = self.h0, None
            for t in range(self.xs.shape[0]):
                h = cad.tanh(h @ self.W + self.xs[t] @ self.U + self.b)
                loss = h.sum() if loss is None else loss + h.sum()
            loss.backward()

    def clear(self) -> None:
        for p in (self.W, self.U, self.b):
            p.grad = None

    def grads(self) -> list[np.ndarray]:
        return [p.grad.numpy().copy() for p in (self.W, self.U, self.b)]


def run(steps: int, batch: int, hidden: int, fractions: list[float], repeats: int) -> None:
    import checkpoint_ad as cad
    from checkpoint_ad.strategies import KeepAll, Rematerializing

    print(f"threads: {pin_threads(1)}; RNN T={steps} B={batch} H={hidden} float32")
    keep = _Loop(steps, batch, hidden, KeepAll)
    with cad.profile() as prof:
        keep.run()
    saved = prof.peak_tape_bytes
    reference = keep.grads()
    keep_time = time_median(keep.run, repeats).median
    keep_traced = tracemalloc_peak(keep)
    print(f"keep-all: {keep_time * 1e3:.1f} ms, peak tape {saved / 2**20:.3f} MiB, "
          f"tracemalloc peak {keep_traced / 2**20:.3f} MiB")
    for fraction in fractions:
        limit = int(saved * fraction)
        loop = _Loop(steps, batch, hidden, lambda limit=limit: Rematerializing(limit))
        with cad.profile() as prof:
            loop.run()
        exact = all(np.array_equal(a, b) for a, b in zip(loop.grads(), reference))
        pool = loop.strategy
        seconds = time_median(loop.run, repeats).median
        # over keep-all's time in the same round, alternating (the machine's speed drifts by
        # tens of percent over a minute: two medians taken apart measure that too)
        ratio = paired_ratio(loop.run, keep.run, repeats)
        traced = tracemalloc_peak(loop)
        print(
            f"limit {fraction:.0%} = {limit / 2**20:.3f} MiB: {seconds * 1e3:.1f} ms "
            f"({ratio.median:.2f}x keep-all, paired; {ratio.low:.2f}-{ratio.high:.2f} over "
            f"{repeats} rounds), pool peak {pool.peak_bytes / limit:.3f}"
            f" of the limit, profiled peak tape {prof.peak_tape_bytes / limit:.3f} of it, "
            f"tracemalloc peak {traced / 2**20:.3f} MiB ({traced / keep_traced:.2f}x keep-all's)"
            f", evictions {pool.evictions}, primitives re-run {pool.rematerializations}, "
            f"bitwise equal {exact}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--fractions", default="0.25,0.5")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    run(args.steps, args.batch, args.hidden, fractions, args.repeats)


if __name__ == "__main__":
    main()
