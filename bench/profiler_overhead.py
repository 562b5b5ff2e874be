"""Workload 6, what profiling costs: the same program run plain, under `cad.profile()` (tape
accounting: records, timeline, peak tape bytes, recompute counts), the same then read (the
profile's accounting is done from its log at the first read, after the run: this variant
times both), and under `cad.profile(device_memory=True)` (tracemalloc on top).

Two programs: the imperative RNN (a Python loop of ``h = tanh(h @ W + x_t @ U + b)``, every
op recorded one by one, loss = sum of all hidden states), at two sizes, and one training step
of a small `nn.GRU` (forward, mean-square loss, backward, SGD). The variants of a program run
interleaved in one process, repeat by repeat, so a busy machine slows them alike; each ratio
is the median over repeats of (variant time / plain time of the same repeat). The profiled
run's gradients are checked bitwise equal to the plain run's: profiling must not change what
it measures.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

VARIANTS = ("plain", "profiled", "profiled, then read", "profiled + tracemalloc")


Program = tuple[Callable[..., None], Callable[[], list[np.ndarray]]]  # step(update), grads()


def _rnn(sizes: dict[str, int]) -> Program:
    import checkpoint_ad as cad

    rng = np.random.default_rng(0)
    h_size, i_size = sizes["hidden"], sizes["input"]
    W = cad.tensor((rng.standard_normal((h_size, h_size)) / np.sqrt(h_size)).astype(np.float32),
                   requires_grad=True)
    U = cad.tensor((rng.standard_normal((i_size, h_size)) / np.sqrt(i_size)).astype(np.float32),
                   requires_grad=True)
    b = cad.tensor((0.1 * rng.standard_normal(h_size)).astype(np.float32), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((sizes["steps"], sizes["batch"], i_size))
                    .astype(np.float32))
    params = (W, U, b)

    def step(update: bool = True) -> None:
        for p in params:
            p.grad = None
        h = cad.zeros(sizes["batch"], h_size, dtype="float32")
        loss = None
        for t in range(sizes["steps"]):
            h = cad.tanh(h @ W + xs[t] @ U + b)
            loss = h.sum() if loss is None else loss + h.sum()
        loss.backward()

    return step, lambda: [p.grad.numpy().copy() for p in params]


def _gru(sizes: dict[str, int]) -> Program:
    import checkpoint_ad as cad
    from checkpoint_ad import nn

    rng = np.random.default_rng(0)
    model = nn.GRU(sizes["input"], sizes["hidden"], seed=0)
    optimizer = cad.optim.SGD(model.parameters(), lr=1e-3)
    x = cad.tensor(rng.standard_normal((sizes["steps"], sizes["batch"], sizes["input"]))
                   .astype(np.float32))

    def step(update: bool = True) -> None:
        optimizer.zero_grad()
        out, _ = model(x)
        ((out * out).mean()).backward()
        if update:  # off when comparing the gradients of two runs
            optimizer.step()

    return step, lambda: [p.grad.numpy().copy() for p in model.parameters()]


# the RNN twice: at small sizes, where Python's cost per op weighs most, and at the sizes
# issue 10 measures the RNN at (T=256, B=64, H=256), a typical workload
WIDE_RNN = "imperative RNN, issue 10's sizes"
PROGRAMS = {"imperative RNN": _rnn, "GRU training step": _gru, WIDE_RNN: _rnn}


def _variants(step: Callable[[], None]) -> dict[str, Callable[[], None]]:
    import checkpoint_ad as cad

    def profiled() -> None:
        with cad.profile():
            step()

    def read() -> None:
        with cad.profile() as prof:
            step()
        prof.records  # noqa: B018 (the first read accounts for the whole log)

    def traced() -> None:
        with cad.profile(device_memory=True):
            step()

    return dict(zip(VARIANTS, (step, profiled, read, traced)))


def _timed(fn: Callable[[], None]) -> float:
    gc.collect()
    gc.freeze()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.unfreeze()


def interleaved(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each run, `repeats` times, the runs taking turns within each repeat (a busy
    machine slows them alike), after one warm-up call each."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(_timed(fn))
    return times


def variant_rows(program: str, times: dict[str, list[float]], extras: dict[str, Any],
                 ) -> list[dict[str, Any]]:
    """One row per variant of `program` (`times`, `interleaved`'s): median seconds, spread,
    and its ratio to plain, the median of per-repeat ratios; `extras` added to each row's."""
    rows = []
    for name, seconds in times.items():
        ratios = [t / p for t, p in zip(seconds, times["plain"])]
        rows.append({"name": f"{program} · {name}", "seconds": statistics.median(seconds),
                     "spread": [min(seconds), max(seconds)], "repeats": len(seconds),
                     "extras": {"program": program, "variant": name,
                                "overhead": statistics.median(ratios), **extras}})
    return rows


def overhead(params: dict, threads: int) -> dict[str, Any]:
    """One row per (program, variant): median seconds and the ratio to the plain run."""
    import checkpoint_ad as cad

    rows = []
    for program, make in PROGRAMS.items():
        if program not in params:
            continue
        sizes = params[program]
        step, grads = make(sizes)
        step(update=False)
        plain_grads = grads()
        with cad.profile() as prof:
            step(update=False)
        same = all(np.array_equal(a, b) for a, b in zip(plain_grads, grads()))
        times = interleaved(_variants(step), params["repeats"])
        rows.extend(variant_rows(program, times, {"records": len(prof.records),
                                                  "same_grads": same, **sizes}))
    return {"rows": rows}
