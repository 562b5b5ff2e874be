"""Eviction that scales (issue 37): a Python-loop heat equation under ``Budget("2MiB")`` from
1,000 to 20,000 steps against keep-all, and the 200-step RNN under 25% of its keep-all tape.

    python -m bench.dtr_scaling                  # 1k, 2k, 5k, 10k, 20k steps; RNN T=200
    python -m bench --only dtr                   # the same, as a suite job

Per length: keep-all's and the budget's time (one run each, gc frozen), their ratio, the
evictions, primitives re-run and candidates scored per eviction, and the budget's tracemalloc
(collector off): the forward sweep's peak (the run's: the tape's objects are all there at its
end), split at the end of the forward sweep into the array data (numpy's tracemalloc domain)
and the rest (the tape's and the pool's objects, O(steps) for any strategy, given per step);
and for the backward sweep an upper bound of its array data: the arrays held at the end of
the forward sweep plus the peak of what the backward allocates (traced afresh from there).
The whole run's tracemalloc peak (forward and backward, collector off) is measured
apart, over the limit: what a budget holds the process to. The fit of log(time) on
log(steps) gives the exponent. The RNN row: tracemalloc
peak over the limit under a pool that holds the process's memory (as a `Budget`'s does) and
under one that holds its saved arrays alone, and where the bytes are.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
import tracemalloc
import weakref
from typing import Any

import numpy as np

from checkpoint_ad import events

from .measure import pin_threads


def _heat(steps: int, strategy: Any, size: int, mark: Any = None) -> Any:
    import checkpoint_ad as cad

    rng = np.random.default_rng(0)
    kappa = cad.tensor(np.float32(0.2), requires_grad=True)
    q = cad.tensor((0.1 * rng.standard_normal(size)).astype(np.float32), requires_grad=True)
    u = cad.tensor(rng.standard_normal(size).astype(np.float32))
    with cad.use(strategy):
        for _ in range(steps):
            lap = cad.roll(u, 1) + cad.roll(u, -1) - 2.0 * u
            u = u + 0.1 * (kappa * lap + cad.sin(u) * q)
        if mark is not None:
            mark()
        (u * u).sum().backward()
    return [kappa.grad.numpy(), q.grad.numpy()]


def _timed(fn: Any) -> tuple[float, float, Any]:
    """(wall seconds, this process's CPU seconds, result) of `fn`, gc frozen."""
    gc.collect()
    gc.freeze()
    try:
        start, cpu = time.perf_counter(), time.process_time()
        out = fn()
        return time.perf_counter() - start, time.process_time() - cpu, out
    finally:
        gc.unfreeze()


def _traced(run: Any) -> tuple[int, int]:
    """(tracemalloc peak of `run` above the level before, with the collector off; array bytes
    traced when `run` calls its `mark` argument)."""
    arrays = [0]

    def mark() -> None:
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
        arrays[0] = sum(t.size for t in snap.traces)

    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        run(mark)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        gc.enable()
    return peak, arrays[0]


def _traced_split(run: Any, budget: Any, stride: int) -> dict[str, int]:
    """tracemalloc (collector off) of `run`, split at its `mark` between the forward and the
    backward sweep: the forward's peak above the level before; at the mark, numpy's array data
    (its tracemalloc domain) and the rest (the tape's and the pool's objects). Then tracing
    starts again, so that the backward's peak counts only what the backward allocates and
    still holds: the arrays at the mark plus that peak bound the backward's array data from
    above (its objects count in it too, and the pool's arrays it lets go stay counted). Every
    `stride`-th value the pool holds again, a snapshot of the array data gives a sample from
    below: the arrays at the mark less those the pool held then and has let go since, plus
    the array data the backward allocated and holds."""
    out: dict[str, int] = {}
    freed = [0]
    seen = [0]
    domain = [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)]

    def let_go(nbytes: int) -> None:
        freed[0] += nbytes

    def sample(kind: str, payload: Any) -> None:
        seen[0] += 1
        if payload is None or seen[0] % stride:
            return
        new = sum(t.size for t in tracemalloc.take_snapshot().filter_traces(domain).traces)
        out["backward_sampled"] = max(out["backward_sampled"],
                                      out["arrays_at_mark"] - freed[0] + new)

    def mark() -> None:
        out["forward_peak"] = tracemalloc.get_traced_memory()[1] - out["base"]
        snap = tracemalloc.take_snapshot()
        arrays = sum(t.size for t in snap.filter_traces(domain).traces)
        out["arrays_at_mark"] = out["backward_sampled"] = arrays
        out["objects_at_mark"] = sum(t.size for t in snap.traces) - arrays - out["base"]
        del snap
        pool = budget._pool()
        for holders in list(pool._holders.values()):
            handle = next(iter(holders.values()))()
            if handle is not None and handle.array is not None:
                weakref.finalize(handle.array, let_go, handle.nbytes)
        tracemalloc.stop()
        tracemalloc.start()
        stop.append(events.subscribe(sample, ["rematerialize"]))

    stop: list[Any] = []
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        out["base"] = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        run(mark)
        out["backward_peak"] = tracemalloc.get_traced_memory()[1]
    finally:
        for unsubscribe in stop:
            unsubscribe()
        tracemalloc.stop()
        gc.enable()
    return out


def _median_time(fn: Any, repeats: int) -> tuple[float, float, Any]:
    runs = [_timed(fn) for _ in range(repeats)]
    return (float(np.median([t for t, _, _ in runs])), float(np.median([c for _, c, _ in runs])),
            runs[-1][2])


def heat_rows(lengths: list[int], size: int, limit: str, traced_up_to: int,
              repeats: int = 1, repeated_up_to: int = 5000) -> list[dict]:
    """Median of `repeats` runs for lengths up to `repeated_up_to`, one run beyond."""
    from checkpoint_ad.strategies import Budget, KeepAll
    from checkpoint_ad.strategies.budget import parse_bytes

    rows = []
    _heat(50, KeepAll(), size)  # warm
    for steps in lengths:
        n = repeats if steps <= repeated_up_to else 1
        keep_s, keep_cpu, reference = _median_time(lambda s=steps: _heat(s, KeepAll(), size), n)
        budget = Budget(limit)
        seconds, cpu, grads = _median_time(lambda s=steps, b=budget: _heat(s, b, size), n)
        pool = budget._pool()  # the thread's eviction pool
        row = {"name": f"heat {steps} steps", "seconds": seconds, "repeats": n, "extras": {
            "steps": steps, "keep_all_seconds": keep_s, "over_keep_all": seconds / keep_s,
            "cpu_seconds": cpu, "keep_all_cpu_seconds": keep_cpu,
            "cpu_over_keep_all": cpu / keep_cpu,
            "same_grads": all(np.array_equal(a, b) for a, b in zip(grads, reference))}}
        if pool is not None:
            row["extras"].update(evictions=pool.evictions, rematerializations=pool.
                                 rematerializations, scored_per_eviction=pool.scored / max(
                                     pool.evictions, 1), pool_peak_bytes=pool.peak_bytes)
        if steps <= traced_up_to:
            traced_budget = Budget(limit)
            split = _traced_split(lambda mark, s=steps, b=traced_budget: _heat(s, b, size, mark),
                                  traced_budget, max(1, steps // 10))
            arrays = split["arrays_at_mark"]
            backward_arrays = arrays + split["backward_peak"]
            row["extras"].update(
                forward_traced_peak_bytes=split["forward_peak"],
                forward_traced_peak_over_limit=split["forward_peak"] / parse_bytes(limit),
                arrays_at_end_of_forward=arrays,
                arrays_at_end_of_forward_over_limit=arrays / parse_bytes(limit),
                backward_arrays_at_most=backward_arrays,
                backward_arrays_at_most_over_limit=backward_arrays / parse_bytes(limit),
                backward_arrays_sampled=split["backward_sampled"],
                backward_arrays_sampled_over_limit=split["backward_sampled"] / parse_bytes(limit),
                objects_per_step_at_end_of_forward=split["objects_at_mark"] / steps)
            # the whole run's peak as tracemalloc sees it (forward and backward, every
            # object and array, the collector off): what issue 37 holds to the budget
            whole_budget = Budget(limit)
            whole, _ = _traced(lambda mark, s=steps, b=whole_budget: _heat(s, b, size, mark))
            row["extras"].update(run_traced_peak_bytes=whole,
                                 run_traced_peak_over_limit=whole / parse_bytes(limit))
        rows.append(row)
    xs = [math.log(r["extras"]["steps"]) for r in rows]
    ys = [math.log(r["seconds"]) for r in rows]
    if len(rows) > 1:
        slope = float(np.polyfit(xs, ys, 1)[0])
        keep_slope = float(np.polyfit(xs, [math.log(r["extras"]["keep_all_seconds"])
                                           for r in rows], 1)[0])
        cpu_slope = float(np.polyfit(xs, [math.log(r["extras"]["cpu_seconds"])
                                          for r in rows], 1)[0])
        for r in rows:
            r["extras"].update(time_exponent=slope, keep_all_time_exponent=keep_slope,
                               cpu_time_exponent=cpu_slope)
    return rows


def rnn_row(steps: int, batch: int, hidden: int, fraction: float) -> dict:
    import checkpoint_ad as cad
    from checkpoint_ad.strategies import KeepAll, Rematerializing

    rng = np.random.default_rng(0)
    f32 = np.float32
    W = cad.tensor((rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(f32),
                   requires_grad=True)
    U = cad.tensor((rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(f32),
                   requires_grad=True)
    b = cad.tensor((0.1 * rng.standard_normal(hidden)).astype(f32), requires_grad=True)
    xs = cad.tensor(rng.standard_normal((steps, batch, hidden)).astype(f32))
    h0 = cad.tensor(np.zeros((batch, hidden), dtype=f32))

    def run(strategy: Any, mark: Any = None) -> list[np.ndarray]:
        for p in (W, U, b):
            p.grad = None
        with cad.use(strategy):
            h, loss = h0, None
            for t in range(steps):
                h = cad.tanh(h @ W + xs[t] @ U + b)
                loss = h.sum() if loss is None else loss + h.sum()
            if mark is not None:
                mark()
            loss.backward()
        return [p.grad.numpy().copy() for p in (W, U, b)]

    with cad.profile() as prof:
        reference = run(KeepAll())
    keep_tape = prof.peak_tape_bytes
    keep_peak, keep_arrays = _traced(lambda mark: run(KeepAll(), mark))
    limit = int(keep_tape * fraction)
    # as a Budget's pool: the limit holds the process's memory (`process`)
    pool = Rematerializing(limit, process=True)
    peak, arrays = _traced(lambda mark: run(pool, mark))
    arrays_only = Rematerializing(limit)  # the limit holds its saved arrays alone
    arrays_only_peak, _ = _traced(lambda mark: run(arrays_only, mark))
    with cad.profile() as prof:
        grads = run(Rematerializing(limit, process=True))
    return {"name": f"RNN T={steps} B={batch} H={hidden} at {fraction:.0%}", "seconds": None,
            "extras": {
                "limit_bytes": limit, "keep_all_tape_bytes": keep_tape,
                "traced_peak_bytes": peak, "traced_peak_over_limit": peak / limit,
                "arrays_only_traced_peak_over_limit": arrays_only_peak / limit,
                "arrays_at_end_of_forward": arrays,
                "keep_all_traced_peak_bytes": keep_peak,
                "keep_all_arrays_at_end_of_forward": keep_arrays,
                "keep_all_beyond_tape_bytes": keep_peak - keep_tape,
                "profiled_peak_tape_over_limit": prof.peak_tape_bytes / limit,
                "pool_peak_over_limit": pool.peak_bytes / limit,
                "evictions": pool.evictions, "rematerializations": pool.rematerializations,
                "same_grads": all(np.array_equal(g, r) for g, r in zip(grads, reference))}}


def scaling(params: dict, threads: int) -> dict[str, Any]:
    """The suite's job: the heat rows, then the RNN row."""
    rows = heat_rows(list(params["steps"]), params["size"], params["limit"],
                     params["traced_up_to"], params.get("repeats", 1),
                     params.get("repeated_up_to", 5000))
    rnn = params["rnn"]
    rows.append(rnn_row(rnn["steps"], rnn["batch"], rnn["hidden"], rnn["fraction"]))
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,2000,5000,10000,20000")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--limit", default="2MiB")
    parser.add_argument("--traced-up-to", type=int, default=20000)
    args = parser.parse_args()
    print(f"threads: {pin_threads(1)}")
    params = {"steps": [int(s) for s in args.steps.split(",")], "size": args.size,
              "limit": args.limit, "traced_up_to": args.traced_up_to,
              "rnn": {"steps": 200, "batch": 64, "hidden": 256, "fraction": 0.25}}
    for row in scaling(params, 1)["rows"]:
        seconds = f"{row['seconds']:.2f} s, " if row["seconds"] is not None else ""
        print(f"{row['name']}: {seconds}" + ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in row["extras"].items()))


if __name__ == "__main__":
    main()
