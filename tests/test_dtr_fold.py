"""Folding periodic Python loops recorded under a budget's eviction pool (issue 37 item 3).

A loop whose steps repeat is folded, as it runs, into one loop entry (a step program and the
carry states an online plan keeps); its gradients must be bitwise those of keeping every
entry, like a `scan`'s. Anything unusual (a value kept, a hook, retain_grad, an in-place
change, code that does not repeat, a custom Function) must leave the loop recorded as before,
with the same gradients.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import Budget, KeepAll, Rematerializing

F32 = np.float32


class Twice(cad.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


def _heat_loss(steps: int, strategy, size: int = 64, body=None, kept: list | None = None,
               backward: bool = True):
    """(the heat loop's loss, kappa, q); with `backward`, the loss's backward ran inside
    the strategy's block."""
    rng = np.random.default_rng(0)
    kappa = cad.tensor(F32(0.2), requires_grad=True)
    q = cad.tensor((0.1 * rng.standard_normal(size)).astype(F32), requires_grad=True)
    u = cad.tensor(rng.standard_normal(size).astype(F32))
    with cad.use(strategy):
        for t in range(steps):
            lap = cad.roll(u, 1) + cad.roll(u, -1) - 2.0 * u
            if body is not None:
                lap = body(t, lap)
            u = u + 0.1 * (kappa * lap + cad.sin(u) * q)
            if kept is not None:
                kept.append(u)
        loss = (u * u).sum()
        if backward:
            loss.backward()
    return loss, kappa, q


def _heat(steps: int, strategy, size: int = 64, body=None, kept: list | None = None):
    _, kappa, q = _heat_loss(steps, strategy, size, body, kept)
    return [kappa.grad.numpy(), q.grad.numpy()]


def _pool(limit: int = 1 << 20) -> Rematerializing:
    return Rematerializing(limit, process=True, fold=True)


def _same(a: list, b: list) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_a_folded_heat_loop_has_keep_all_gradients_bitwise():
    reference = _heat(300, KeepAll())
    pool = _pool()
    assert _same(_heat(300, pool), reference)
    assert pool._folder.folds > 250  # folded, not recorded


def test_a_folded_loop_under_a_budget_that_evicts_has_keep_all_gradients():
    reference = _heat(400, KeepAll(), size=1024)
    budget = Budget("256KiB")
    assert _same(_heat(400, budget, size=1024), reference)
    assert budget._pool()._folder.folds > 300


def test_a_folded_rnn_with_a_running_loss_has_keep_all_gradients_bitwise():
    rng = np.random.default_rng(1)

    def run(strategy):
        W = cad.tensor((rng_w / 4).astype(F32), requires_grad=True)
        U = cad.tensor(rng_u.astype(F32), requires_grad=True)
        b = cad.tensor(rng_b.astype(F32), requires_grad=True)
        x = cad.tensor(rng_x.astype(F32))
        with cad.use(strategy):
            h = cad.zeros(8, 16, dtype="float32")
            loss = cad.tensor(0.0, dtype="float32")
            for _ in range(200):
                h = cad.tanh(h @ W + x @ U + b)
                loss = loss + h.sum()
            (loss * 2.0).backward()
        return [W.grad.numpy(), U.grad.numpy(), b.grad.numpy()]

    rng_w, rng_u = rng.standard_normal((16, 16)), rng.standard_normal((3, 16))
    rng_b, rng_x = rng.standard_normal(16), rng.standard_normal((8, 3))
    reference = run(KeepAll())
    pool = _pool()
    assert _same(run(pool), reference)
    assert pool._folder.folds > 150


def test_a_tight_pool_evicts_and_recomputes_around_a_folded_loop_bitwise():
    reference = _heat(400, KeepAll(), size=256)
    pool = Rematerializing(12 * 1024, fold=True)  # a dozen 1 KiB arrays
    assert _same(_heat(400, pool, size=256), reference)
    assert pool._folder.folds > 350 and pool.rematerializations > 1000
    assert pool.peak_bytes <= pool.limit_bytes


@pytest.mark.parametrize("how", ["plain", "leaf_hook", "retain_graph"])
def test_a_folded_lstm_with_two_carries_and_slices_has_keep_all_gradients(how):
    def run(strategy):
        rng = np.random.default_rng(3)
        W = cad.tensor(rng.standard_normal((8, 32)) / 4, requires_grad=True)
        b = cad.tensor(rng.standard_normal(32) / 4, requires_grad=True)
        if how == "leaf_hook":  # runs once, on the total
            W.register_hook(lambda g: g * 2.0)
        out = []
        with cad.use(strategy):
            h, c = cad.zeros(4, 8, dtype="float64"), cad.zeros(4, 8, dtype="float64")
            for _ in range(150):
                z = h @ W + b
                i, f = cad.sigmoid(z[:, :8]), cad.sigmoid(z[:, 8:16])
                o, g = cad.sigmoid(z[:, 16:24]), cad.tanh(z[:, 24:])
                c = f * c + i * g
                h = o * cad.tanh(c)
            loss = (h * h).sum() + (c.reshape(-1) * 2.0).sum() + (W * W).sum()
            if how == "retain_graph":
                loss.backward(retain_graph=True)
                out.append(W.grad.numpy().copy())
            loss.backward()
        return [*out, W.grad.numpy(), b.grad.numpy()]

    reference = run(KeepAll())
    pool = _pool()
    assert _same(run(pool), reference)
    assert pool._folder.folds > 100


def test_inner_loops_run_again_share_half_the_pool_and_keep_keep_all_gradients():
    def run(strategy):
        rng = np.random.default_rng(0)
        w = cad.tensor((0.1 * rng.standard_normal(256)).astype(F32), requires_grad=True)
        u = cad.tensor(rng.standard_normal(256).astype(F32))
        with cad.use(strategy):
            for _ in range(6):
                for _ in range(200):
                    u = cad.sin(u) * w + u
                u = u * 0.5
            (u * u).sum().backward()
        return [w.grad.numpy()]

    reference = run(KeepAll())
    pool = _pool(64 * 1024)
    assert _same(run(pool), reference)
    assert pool._folder.folds > 150  # the first inner loop; those after it find the room
    assert pool.fold_bytes == 0  # taken (half the pool, less four states each), given back


def test_a_loop_reading_a_weight_computed_before_it_folds_bitwise():
    def run(strategy):
        rng = np.random.default_rng(1)
        w0 = cad.tensor((rng.standard_normal((16, 16)) / 4).astype(F32), requires_grad=True)
        with cad.use(strategy):
            w = w0 * 1.5  # not a leaf: made under the pool, read by every step
            h = cad.ones(4, 16)
            for _ in range(100):
                h = cad.tanh(h @ w)
            (h.sum() + (w * w).sum()).backward()
        return [w0.grad.numpy()]

    reference = run(KeepAll())
    pool = _pool()
    assert _same(run(pool), reference)
    assert pool._folder.folds > 80


def test_a_loop_of_two_alternating_steps_folds_with_the_pair_as_its_period():
    def body(t, lap):
        return cad.sin(lap) if t % 2 else cad.cos(lap)

    reference = _heat(200, KeepAll(), body=body)
    pool = _pool()
    assert _same(_heat(200, pool, body=body), reference)
    assert pool._folder.folds > 0


def test_a_body_repeating_an_operation_folds_at_its_whole_period():
    def run(strategy):
        x = cad.tensor(np.linspace(0, 1, 16).astype(F32), requires_grad=True)
        with cad.use(strategy):
            u = x * 1.0
            for _ in range(150):
                for _ in range(4):
                    u = cad.sin(u)
                u = cad.cos(u) * x
            u.sum().backward()
        return [x.grad.numpy()]

    reference = run(KeepAll())
    pool = _pool()
    assert _same(run(pool), reference)
    assert pool._folder.period == 0 and pool._folder.folds > 100  # whole bodies, one loop


@pytest.mark.parametrize("case", ["kept", "hook", "retain_grad", "changing_attrs",
                                  "changing_constant", "function"])
def test_unusual_loops_are_recorded_as_before(case):
    def body(t, lap):
        if case == "hook" and lap.requires_grad:  # (step 0's does not)
            lap.register_hook(lambda g: g * 1.0)
        elif case == "retain_grad" and lap.requires_grad:
            lap.retain_grad()
        elif case == "changing_attrs":
            return cad.roll(lap, t + 2)
        elif case == "changing_constant":
            return lap * (1.0 + 0.001 * t)
        elif case == "function":
            return Twice.apply(lap)
        return lap

    reference = _heat(120, KeepAll(), body=body, kept=[] if case == "kept" else None)
    pool = _pool()
    got = _heat(120, pool, body=body, kept=[] if case == "kept" else None)
    assert _same(got, reference)
    assert pool._folder.folds == 0


def test_a_custom_function_reading_the_loop_keeps_it_recorded():
    def run(strategy):
        rng = np.random.default_rng(0)
        w = cad.tensor((0.1 * rng.standard_normal(32)).astype(F32), requires_grad=True)
        u = cad.tensor(rng.standard_normal(32).astype(F32))
        side = []
        with cad.use(strategy):
            for _ in range(150):
                lap = cad.sin(u) * w
                side.append(Twice.apply(lap))  # its entry, not a tensor, holds lap's entry
                u = lap + u
            loss = (u * u).sum()
            for s in side:
                loss = loss + s.sum()
            loss.backward()
        return [w.grad.numpy()]

    reference = run(KeepAll())
    pool = _pool()
    assert _same(run(pool), reference)
    assert pool._folder.folds == 0


def test_an_in_place_change_in_the_loop_records_it_as_before():
    def body(t, lap):
        lap.mul_(1.0)
        return lap

    reference = _heat(100, KeepAll(), body=body)
    pool = _pool()
    assert _same(_heat(100, pool, body=body), reference)


def test_a_backward_inside_the_loop_ends_the_loop_record():
    def run(strategy):
        rng = np.random.default_rng(0)
        w = cad.tensor((0.1 * rng.standard_normal(32)).astype(F32), requires_grad=True)
        u = cad.tensor(rng.standard_normal(32).astype(F32))
        grads = []
        with cad.use(strategy):
            for t in range(120):
                u = cad.sin(u) * w + u
                if t == 60:
                    u.sum().backward(retain_graph=True)
                    grads.append(w.grad.numpy().copy())
            (u * u).sum().backward()
        return [*grads, w.grad.numpy()]

    reference = run(KeepAll())
    assert _same(run(_pool()), reference)


def test_create_graph_through_a_folded_loop_gives_second_derivatives_as_a_scan_does():
    def run(strategy):
        x = cad.tensor(np.linspace(0, 1, 16).astype(F32), requires_grad=True)
        with cad.use(strategy):
            u = x * 1.0
            for _ in range(60):
                u = cad.sin(u) * x + u
            (g,) = cad.grad((u * u).sum(), [x], create_graph=True)
            (g * g).sum().backward()
        return [g.numpy(), x.grad.numpy()]

    (g_ref, hv_ref) = run(KeepAll())
    pool = _pool()
    g, hv = run(pool)
    assert pool._folder.folds > 40
    # as a scan's: the first-order gradient bitwise, the second to rounding (the loop's
    # steps are taped again during the first sweep: the second sums them in another order)
    np.testing.assert_array_equal(g, g_ref)
    np.testing.assert_allclose(hv, hv_ref, rtol=1e-5)


def test_a_budget_holds_the_tracemalloc_peak_of_a_long_folded_loop():
    limit = 1 << 20
    _heat(300, Budget(limit), size=1024)  # imports and the planner's tables, made once
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        budget = Budget(limit)
        _heat(3000, budget, size=1024)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        gc.enable()
    assert budget._pool()._folder.folds > 2900
    # the budget, 10%, and one step's transients (a dozen 4 KiB arrays)
    assert peak <= 1.1 * limit + 64 * 1024, peak


@pytest.mark.parametrize("backward", [True, False], ids=["after backward", "no backward"])
def test_a_folded_graph_let_go_is_freed_by_reference_counts(backward):
    """Dropping the loss frees the folded loop, its carry states and the graph with the
    collector off (the loop entry and its op made a cycle, and the pool's ring of recent
    entries held the newest one, and through its edges the whole graph, after the block);
    the states' reserved room comes back to the pool."""
    budget = Budget("1MiB")
    # warm: the pool, the planner's tables, the free lists
    _heat_loss(1500, budget, size=256, backward=False)
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        loss, _, _ = _heat_loss(1500, budget, size=256, backward=False)
        pool = budget._pool()
        assert pool._folder.folds > 1000 and pool.fold_bytes > 0
        if backward:
            loss.backward()
        del loss
        left = tracemalloc.get_traced_memory()[0] - base
        cycles = gc.collect()
    finally:
        tracemalloc.stop()
        gc.enable()
    assert pool.fold_bytes == 0
    assert cycles == 0
    # the graph recorded was ~15 MB; left: the planner's bounded caches, free lists
    assert left < 512 * 1024
