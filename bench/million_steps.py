"""The 10**6-step demo: the gradient of a 2-D heat equation run for a million time steps, with
respect to the diffusivity field and the initial condition, in a few hundred MB.

    python -m bench.million_steps                      # 10**6 steps, Binomial(32) in RAM
    python -m bench.million_steps --steps 10000 --snapshots 16 --out million.json
    python -m bench.million_steps --snapshots 32 --disk unlimited   # RAM + disk snapshots

The problem: ``u_{t+1} = u_t + dt * kappa * (D u_t + u_t D)`` on an N x N grid with zero
boundary values (D u + u D is the 5-point Laplacian), ``kappa = sigmoid(theta)`` a field in
(0, 1), simulated to a fixed final time, so ``dt = T / steps`` and every step count solves the
same physics; loss ``0.5 |u_T - target|^2``. Keeping every step's tape would take
``steps x (a few states)``: 10**6 x 8 KB x 4 = 32 GB. The loop strategy (one argument;
default ``Binomial(32)``, snapshots in RAM) keeps at most its snapshots and one step's tape.

It reports wall time (forward, backward), the recompute ratio (step evaluations / steps), the
peak RSS (psutil, sampled every 1,000 steps, and the process's high-water mark), shows a
progress bar over forward and backward (tqdm, on a terminal), and checks the gradient on a
shorter run of the same problem: bitwise against keeping every step, and against central
finite differences along a random direction.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil

import checkpoint_ad as cad
from checkpoint_ad.strategies import Binomial, LoopStrategy

FINAL_TIME = 0.02  # with kappa < 1 and N = 32, dt * kappa / h^2 < 1/4 down to 100 steps


@dataclass(frozen=True)
class Problem:
    """Grid, parameters and target, the same for every step count."""

    grid: int = 32
    seed: int = 0

    def arrays(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        n = self.grid
        h = 1.0 / (n + 1)
        x = np.linspace(0.0, 1.0, n + 2)[1:-1]
        bump = lambda a, b: np.exp(-30.0 * ((x[:, None] - a) ** 2 + (x[None, :] - b) ** 2))
        lap = (np.diag(-2.0 * np.ones(n)) + np.diag(np.ones(n - 1), 1)
               + np.diag(np.ones(n - 1), -1)) / (h * h)
        return {"theta": 0.3 * rng.standard_normal((n, n)), "u0": bump(0.4, 0.5),
                "target": 0.6 * bump(0.55, 0.45), "laplacian": lap}


def loss_and_grads(
    problem: Problem,
    steps: int,
    strategy: Any,
    on_step: Callable[[], None] = lambda: None,
    on_backward: Callable[[], None] = lambda: None,
) -> tuple[float, np.ndarray, np.ndarray, dict[str, float]]:
    """The loss after `steps` steps and its gradients for (theta, u0), with timings."""
    a = problem.arrays()
    theta = cad.tensor(a["theta"], requires_grad=True)
    u0 = cad.tensor(a["u0"], requires_grad=True)
    lap, target = cad.tensor(a["laplacian"]), cad.tensor(a["target"])
    dt = FINAL_TIME / steps
    started = time.perf_counter()
    kappa = cad.sigmoid(theta) * dt  # captured by every step, saved once

    def step(u: Any, _: Any) -> tuple[Any, None]:
        return u + kappa * (lap @ u + u @ lap), None

    # every step evaluation, replayed or not, is announced as a 'step' event
    unsubscribe = cad.events.subscribe(lambda kind, count: on_step(), kinds=("step",))
    try:
        u, _ = cad.scan(step, u0, length=steps, strategy=strategy)
        miss = u - target
        loss = 0.5 * (miss * miss).sum()
        forward = time.perf_counter() - started
        on_backward()
        g_theta, g_u0 = cad.grad(loss, [theta, u0])
    finally:
        unsubscribe()
    seconds = {"forward_s": forward, "backward_s": time.perf_counter() - started - forward}
    return loss.item(), g_theta.numpy(), g_u0.numpy(), seconds


def check(problem: Problem, steps: int, strategy: Any, eps: float = 1e-6) -> dict[str, Any]:
    """The strategy's gradient on a `steps`-step run: bitwise against keep-all, and against
    central finite differences of the loss along one random direction per argument."""
    loss, g_theta, g_u0, _ = loss_and_grads(problem, steps, strategy)
    _, k_theta, k_u0, _ = loss_and_grads(problem, steps, None)
    rng = np.random.default_rng(1)
    d_theta, d_u0 = rng.standard_normal(g_theta.shape), rng.standard_normal(g_u0.shape)
    base = problem.arrays()

    def loss_at(theta: np.ndarray, u0: np.ndarray) -> float:
        shifted = _Shifted(problem, theta, u0)
        return loss_and_grads(shifted, steps, None)[0]

    fd_theta = (loss_at(base["theta"] + eps * d_theta, base["u0"])
                - loss_at(base["theta"] - eps * d_theta, base["u0"])) / (2 * eps)
    fd_u0 = (loss_at(base["theta"], base["u0"] + eps * d_u0)
             - loss_at(base["theta"], base["u0"] - eps * d_u0)) / (2 * eps)
    ad_theta, ad_u0 = float((g_theta * d_theta).sum()), float((g_u0 * d_u0).sum())
    return {
        "check_steps": steps,
        "bitwise_equal_to_keep_all": bool(np.array_equal(g_theta, k_theta)
                                          and np.array_equal(g_u0, k_u0)),
        "fd_rel_error_theta": abs(ad_theta - fd_theta) / max(abs(fd_theta), 1e-300),
        "fd_rel_error_u0": abs(ad_u0 - fd_u0) / max(abs(fd_u0), 1e-300),
        "loss": loss,
    }


class _Shifted(Problem):
    """The problem with other parameter values (for finite differences)."""

    def __init__(self, base: Problem, theta: np.ndarray, u0: np.ndarray) -> None:
        object.__setattr__(self, "grid", base.grid)
        object.__setattr__(self, "seed", base.seed)
        object.__setattr__(self, "_values", (base, theta, u0))

    def arrays(self) -> dict[str, np.ndarray]:
        base, theta, u0 = self._values  # type: ignore[attr-defined]
        return {**base.arrays(), "theta": theta, "u0": u0}


def run(
    steps: int = 1_000_000,
    strategy: LoopStrategy | None = None,
    grid: int = 32,
    check_steps: int = 1_000,
    progress: bool = True,
) -> dict[str, Any]:
    """The demo: one run of `steps` steps under `strategy` (default ``Binomial(32)``, RAM
    snapshots), its costs, and the gradient check on `check_steps` steps."""
    strategy = Binomial(32) if strategy is None else strategy
    problem = Problem(grid=grid)
    expected = strategy.plan(steps).evaluations
    process = psutil.Process()
    rss_before = process.memory_info().rss
    counter = {"evaluations": 0, "peak_rss": rss_before}
    bar = _progress(expected, progress)

    def on_step() -> None:
        counter["evaluations"] += 1
        if counter["evaluations"] % 1000 == 0:
            counter["peak_rss"] = max(counter["peak_rss"], process.memory_info().rss)
            if bar is not None:
                bar.update(1000)

    def on_backward() -> None:
        if bar is not None:
            bar.set_description("backward")

    try:
        loss, g_theta, g_u0, seconds = loss_and_grads(problem, steps, strategy, on_step,
                                                      on_backward)
    finally:
        if bar is not None:
            bar.close()
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KB on Linux
    result: dict[str, Any] = {
        "steps": steps,
        "grid": grid,
        "strategy": repr(strategy),
        "loss": loss,
        **seconds,
        "wall_s": seconds["forward_s"] + seconds["backward_s"],
        "evaluations": counter["evaluations"],
        "planned_evaluations": expected,
        "recompute_ratio": counter["evaluations"] / steps,
        "peak_rss_mb": max(counter["peak_rss"], process.memory_info().rss) / 2**20,
        "rss_before_mb": rss_before / 2**20,
        "high_water_rss_mb": high_water / 2**20,
        "grad_theta_norm": float(np.linalg.norm(g_theta)),
        "grad_u0_norm": float(np.linalg.norm(g_u0)),
    }
    if check_steps:
        result.update(check(problem, check_steps, strategy))
    return result


def _progress(total: int, wanted: bool) -> Any:
    if not wanted:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience; the demo runs without it
        return None
    return tqdm(total=total, desc="forward", unit="step", unit_scale=True, disable=None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.million_steps",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--snapshots", type=int, default=32, help="Binomial(S), in RAM")
    parser.add_argument("--disk", default=None,
                        help="disk snapshots beside the RAM ones: an int, or 'unlimited' "
                             "(costs measured on the first steps)")
    parser.add_argument("--grid", type=int, default=32)
    parser.add_argument("--check-steps", type=int, default=1_000)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        disk = 0 if args.disk is None else None if args.disk == "unlimited" else int(args.disk)
        result = run(args.steps, Binomial(args.snapshots, disk=disk), args.grid, args.check_steps,
                     progress=not args.no_progress)
    width = max(map(len, result))
    for key, value in result.items():
        shown = f"{value:.6g}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)
    # the bound is on what the run adds (a caller's process, e.g. a test session, may hold
    # more before it starts; run alone, rss_before is the interpreter and numpy, ~40 MB)
    added = result["peak_rss_mb"] - result["rss_before_mb"]
    ok = result.get("bitwise_equal_to_keep_all", True) and added < 300
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
