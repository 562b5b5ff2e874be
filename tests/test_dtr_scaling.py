"""Rematerializing at scale: eviction costs O(sqrt n) scores whatever the program's length, a
long chain recomputes without recursion, and nothing outlives the backward sweep.

No test times anything: the bookkeeping is checked by counting (`Rematerializing.scored`),
memory by tracemalloc with the cyclic collector off.
"""

from __future__ import annotations

import gc
import math
import tracemalloc

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import KeepAll, Rematerializing

F32 = np.float32


def heat(steps: int, strategy, size: int = 64):
    """An explicit heat-equation loop in plain Python with a learnable diffusivity and source;
    returns the gradients of the final energy."""
    rng = np.random.default_rng(0)
    kappa = cad.tensor(F32(0.2), requires_grad=True)
    q = cad.tensor((0.1 * rng.standard_normal(size)).astype(F32), requires_grad=True)
    u = cad.tensor(rng.standard_normal(size).astype(F32))
    with cad.use(strategy):
        for _ in range(steps):
            lap = cad.roll(u, 1) + cad.roll(u, -1) - 2.0 * u
            u = u + 0.1 * (kappa * lap + cad.sin(u) * q)
        (u * u).sum().backward()
    return [kappa.grad.numpy().copy(), q.grad.numpy().copy()]


def test_a_long_loop_gives_the_gradients_of_keeping_everything_bitwise():
    pool = Rematerializing(64 * 256)  # 64 arrays of 256 bytes
    grads = heat(600, pool)
    assert pool.evictions > 1000 and pool.rematerializations > 1000
    assert all(np.array_equal(g, r) for g, r in zip(grads, heat(600, KeepAll())))
    assert pool.peak_bytes <= pool.limit_bytes


@pytest.mark.parametrize("limit_arrays", [16, 256])
def test_each_eviction_scores_about_sqrt_n_candidates_not_all_of_them(limit_arrays):
    """DTR's sampled search: the candidates scored per eviction are bounded by sqrt of the
    values held (at least 8), not by their number, and do not grow with the loop's length."""
    per_eviction = []
    for steps in (200, 800):
        pool = Rematerializing(limit_arrays * 256)
        heat(steps, pool)
        per_eviction.append(pool.scored / pool.evictions)
    bound = max(8, math.isqrt(limit_arrays) + 1)
    assert all(p <= bound for p in per_eviction)
    if limit_arrays > 64:
        assert max(per_eviction) < limit_arrays / 4  # a sample, not every held value
    assert per_eviction[1] <= per_eviction[0] * 1.25


def sines(steps: int, strategy) -> np.ndarray:
    """The cheapest long chain: u = sin(u), each step saving its input."""
    x = cad.tensor(np.linspace(0.1, 1.0, 8).astype(F32), requires_grad=True)
    with cad.use(strategy):
        u = x
        for _ in range(steps):
            u = cad.sin(u)
        u.sum().backward()
    return x.grad.numpy().copy()


def test_recompute_chains_of_20000_steps_do_not_recurse():
    """A tight limit over a 20,000-step chain: recomputes reach far back (explicit stacks, no
    RecursionError), and the gradients are still keep-all's."""
    pool = Rematerializing(16 * 32)  # 16 arrays of 8 float32
    grad = sines(20_000, pool)
    assert pool.evictions > 19_000 and pool.rematerializations > 20_000
    assert np.array_equal(grad, sines(20_000, KeepAll()))


def _left_after(steps: int, make) -> int:
    """tracemalloc bytes left once a program is over, with the collector off."""
    gc.collect()
    gc.disable()
    try:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        strategy = make()
        heat(steps, strategy)
        del strategy
        left = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
    finally:
        gc.enable()
    return left


def test_memory_returns_to_baseline_after_backward_without_the_cyclic_collector():
    """Nothing the pool made is freed only by the cyclic collector: what is left after the
    backward sweep grows with the loop no more than keeping everything leaves (the
    interpreter's free lists fill up with the objects of a longer run either way)."""
    def pool() -> Rematerializing:
        return Rematerializing(16 * 256)

    heat(150, pool())  # warm: imports, caches
    grown = {make: _left_after(600, make) - _left_after(150, make) for make in (pool, KeepAll)}
    # 450 more steps made ~5,000 more values (~500 bytes of bookkeeping each): 2 bytes
    # each left behind would pass this
    assert grown[pool] < grown[KeepAll] + 10_000, grown


def test_a_pool_reused_keeps_no_table_of_its_longest_program():
    """A `Budget` keeps one pool per thread across training steps: after a long program the
    pool's own tables are small again."""
    pool = Rematerializing(16 * 256)
    heat(400, pool)
    assert not pool._holders and not pool._evictable and not pool._shapes


def _tracked_per_step(steps: int, strategy, size: int = 64) -> float:
    """Objects the cyclic collector tracks per step of the heat loop at the end of its forward
    sweep (the tape's and the strategy's: each full collection scans them all)."""
    rng = np.random.default_rng(0)
    kappa = cad.tensor(F32(0.2), requires_grad=True)
    q = cad.tensor((0.1 * rng.standard_normal(size)).astype(F32), requires_grad=True)
    u = cad.tensor(rng.standard_normal(size).astype(F32))
    gc.collect()
    before = len(gc.get_objects())
    with cad.use(strategy):
        for _ in range(steps):
            lap = cad.roll(u, 1) + cad.roll(u, -1) - 2.0 * u
            u = u + 0.1 * (kappa * lap + cad.sin(u) * q)
        gc.collect()
        held = len(gc.get_objects()) - before
        (u * u).sum().backward()
    return held / steps


def test_a_recipe_adds_few_objects_for_the_cyclic_collector():
    """A Python loop's tape grows by its steps' objects, and every full collection scans
    them: the pool's recipes once added 7.3 tracked objects per recorded primitive to
    keep-all's 1.8 (a dead weak reference and a version counter per value, the entry's
    extras beside it, a neighbour tuple each, an array table's weak reference), most of the
    pool's time over keep-all's in a long loop. The heat step records 15 primitives."""
    heat(20, Rematerializing(64 * 256))  # warm: caches, tables
    keep = _tracked_per_step(300, KeepAll())
    pool = _tracked_per_step(300, Rematerializing(64 * 256))
    assert (pool - keep) / 15 < 4.25, (pool, keep)
