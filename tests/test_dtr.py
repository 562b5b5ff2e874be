"""Rematerializing: DTR-style eviction under a byte limit, for code outside `scan`.

Every program is run twice, once keeping everything and once under a tight limit, and the
gradients must be bitwise equal; the tight limit must really evict and recompute.
"""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.errors import BudgetError, SavedValueModifiedError, StrategyConfigError
from checkpoint_ad.nn import functional as F
from checkpoint_ad.profiler.records import Profile
from checkpoint_ad.strategies import KeepAll, Rematerializing

F32 = np.float32


def params(seed: int = 0, hidden: int = 16, inputs: int = 3) -> dict[str, cad.Tensor]:
    rng = np.random.default_rng(seed)
    return {
        "W": cad.tensor((rng.standard_normal((hidden, hidden)) / 4).astype(F32),
                        requires_grad=True),
        "U": cad.tensor(rng.standard_normal((inputs, hidden)).astype(F32), requires_grad=True),
        "b": cad.tensor(rng.standard_normal(hidden).astype(F32), requires_grad=True),
        "xs": cad.tensor(rng.standard_normal((24, 8, inputs)).astype(F32)),
    }


def rnn(p: dict[str, cad.Tensor]) -> cad.Tensor:
    h = cad.zeros(8, p["W"].shape[0], dtype="float32")
    loss = cad.tensor(0.0, dtype="float32")
    for t in range(p["xs"].shape[0]):
        h = cad.tanh(h @ p["W"] + p["xs"][t] @ p["U"] + p["b"])
        loss = loss + h.sum()
    return loss


def chain(p: dict[str, cad.Tensor]) -> cad.Tensor:
    h = p["xs"][0] @ p["U"]
    for _ in range(20):
        h = cad.sin(cad.exp(cad.tanh(h) * 0.5) @ p["W"])
    return (h * h).sum()


def branching(p: dict[str, cad.Tensor]) -> cad.Tensor:
    """Values used by several later ops, and a shared input feeding every step."""
    a = cad.tanh(p["xs"][0] @ p["U"] + p["b"])
    outs = []
    for _ in range(8):
        s = cad.sigmoid(a @ p["W"])
        a = cad.tanh(s * a + cad.sin(s) * cad.exp(-a) + a @ p["W"])
        outs.append(a)
    return sum((o * o).mean() for o in outs) + (outs[0] * outs[-1]).sum()


def views(p: dict[str, cad.Tensor]) -> cad.Tensor:
    """Reshapes, transposes and slices between the saving ops."""
    h = cad.tanh(p["xs"][1] @ p["U"])
    for _ in range(10):
        v = cad.reshape(h, (16, 8))
        v = cad.transpose(v, (1, 0))
        h = cad.tanh(cad.reshape(v, (8, 16)) @ p["W"])[:, :] * h
        h = cad.exp(h[2:, :].sum() * 0.01) * h
    return h.sum()


def dropout_net(p: dict[str, cad.Tensor]) -> cad.Tensor:
    cad.random.manual_seed(3)
    h = p["xs"][0] @ p["U"]
    for _ in range(10):
        h = F.dropout(cad.tanh(h @ p["W"]), 0.3)
    return h.sum()


PROGRAMS = [rnn, chain, branching, views, dropout_net]


def gradients(program, strategy, **backward) -> tuple[list[np.ndarray], float]:
    p = params()
    with cad.use(strategy):
        loss = program(p)
        loss.backward(**backward)
    return [p[k].grad.numpy().copy() for k in ("W", "U", "b") if p[k].grad is not None], \
        float(loss.item())


def keep_all_peak(program) -> int:
    p = params()
    with cad.profile() as prof:
        program(p).backward()
    return prof.peak_tape_bytes


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda f: f.__name__)
def test_gradients_are_bitwise_those_of_keeping_everything(program):
    reference, loss = gradients(program, KeepAll())
    pool = Rematerializing(keep_all_peak(program) // 4)
    got, loss_again = gradients(program, pool)
    assert loss_again == loss
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        assert np.array_equal(a, b)
    assert pool.evictions > 0 and pool.rematerializations > 0
    assert pool.peak_bytes <= pool.limit_bytes
    assert pool.held_bytes == 0  # everything went back with the tape


def test_profile_counts_evictions_and_keeps_the_tape_under_the_limit():
    limit = keep_all_peak(rnn) // 4
    pool = Rematerializing(limit)
    p = params()
    with cad.profile() as prof, cad.use(pool):
        rnn(p).backward()
    assert prof.evictions == pool.evictions > 0
    assert prof.rematerializations == pool.rematerializations > 0
    assert prof.recomputed_primitives >= pool.rematerializations
    assert prof.recompute_seconds > 0
    # the pool's values stay under the limit; the zero initial state is saved by reference
    # outside the pool (it has no history), so the tape may hold that much more
    h0_bytes = 8 * 16 * 4
    assert prof.peak_tape_bytes <= limit + h0_bytes
    assert prof.timeline_bytes[-1] == 0
    again = Profile.from_json(prof.to_json())
    assert (again.evictions, again.rematerializations) == (prof.evictions,
                                                          prof.rematerializations)
    plain = prof.to_dict()
    del plain["evictions"], plain["rematerializations"]
    assert Profile.from_dict(plain).evictions == 0  # profiles written before still load


def test_a_roomy_limit_evicts_nothing():
    pool = Rematerializing(10**9)
    reference, _ = gradients(rnn, KeepAll())
    got, _ = gradients(rnn, pool)
    assert all(np.array_equal(a, b) for a, b in zip(got, reference))
    assert pool.evictions == pool.rematerializations == 0


def test_retain_graph_and_a_second_backward_stay_exact():
    reference, _ = gradients(rnn, KeepAll())
    pool = Rematerializing(keep_all_peak(rnn) // 4)
    p = params()
    with cad.use(pool):
        loss = rnn(p)
    loss.backward(retain_graph=True)
    first = [p[k].grad.numpy().copy() for k in ("W", "U", "b")]
    for k in ("W", "U", "b"):
        p[k].grad = None
    rematerialized = pool.rematerializations
    loss.backward()
    second = [p[k].grad.numpy() for k in ("W", "U", "b")]
    for a, b, c in zip(first, second, reference):
        assert np.array_equal(a, c) and np.array_equal(b, c)
    assert pool.rematerializations > rematerialized  # the second sweep recomputed again


def test_create_graph_gives_the_second_derivatives_of_keeping_everything():
    def second_order(strategy):
        p = params()
        with cad.use(strategy):
            loss = chain(p)
            (gw,) = cad.grad(loss, [p["W"]], create_graph=True)
            (gw * gw).sum().backward()
        return p["W"].grad.numpy().copy(), p["U"].grad.numpy().copy()

    reference = second_order(KeepAll())
    pool = Rematerializing(keep_all_peak(chain) // 4)
    got = second_order(pool)
    assert pool.evictions > 0
    assert all(np.array_equal(a, b) for a, b in zip(got, reference))


def test_an_evicted_value_changed_in_place_still_raises():
    p = params()
    pool = Rematerializing(keep_all_peak(chain) // 8)
    with cad.use(pool):
        first = cad.tanh(p["xs"][0] @ p["U"])  # saved by tanh (its output), then evicted
        h = first
        for _ in range(20):
            h = cad.sin(cad.exp(cad.tanh(h) * 0.5) @ p["W"])
        loss = h.sum() + first.sum()
    assert pool.evictions > 0
    with cad.no_grad():
        first.add_(1.0)
    with pytest.raises(SavedValueModifiedError, match="modified in place"):
        loss.backward()


def test_an_input_without_history_changed_after_eviction_cannot_be_recomputed():
    p = params()
    shift = cad.tensor(np.ones((8, 16), dtype=F32))  # no history; add does not save it
    pool = Rematerializing(2 * 8 * 16 * 4)
    with cad.use(pool):
        h = cad.tanh(p["xs"][0] @ p["U"] + shift)
        for _ in range(6):
            h = cad.tanh(h @ p["W"])
        loss = h.sum()
    assert pool.evictions > 0
    with cad.no_grad():
        shift.add_(1.0)
    with pytest.raises(SavedValueModifiedError, match="recomputing an evicted result"):
        loss.backward()


def test_a_limit_below_what_cannot_be_evicted_raises_budget_error():
    x = cad.tensor(np.ones((64, 64), dtype=F32), requires_grad=True)
    with cad.use(Rematerializing(1000)), pytest.raises(BudgetError) as info:
        cad.tanh(x)  # its 16384-byte output must be held at least while it is made
    assert isinstance(info.value, MemoryError)
    assert info.value.minimum_bytes == 64 * 64 * 4
    assert "at least 16384 bytes" in str(info.value)
    with cad.use(Rematerializing(info.value.minimum_bytes)):
        cad.tanh(x).sum().backward()  # the minimum it named is enough


def test_values_without_a_recipe_are_never_evicted():
    class Square(cad.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    x = cad.tensor(np.linspace(-1, 1, 256).astype(F32), requires_grad=True)
    pool = Rematerializing(3 * 1024)
    with cad.use(pool):
        squares = [Square.apply(x + float(i)) for i in range(4)]  # saves x + i: evictable
        kept = []
        with pytest.raises(BudgetError) as info:
            for square in squares:  # multiply saves each square, made by no primitive
                kept.append(square * x)
    assert len(kept) == 3 and pool.evictions == 4  # the squares' inputs, then no more
    assert info.value.minimum_bytes == 4 * 1024


@pytest.mark.parametrize("bad", [-1, 1.5, "8MiB", True])
def test_bad_limits_are_refused(bad):
    with pytest.raises(StrategyConfigError, match="limit_bytes"):
        Rematerializing(bad)


def test_repr_names_the_limit():
    assert repr(Rematerializing(4096)) == "Rematerializing(limit_bytes=4096)"


def test_budget_outside_scan_evicts_like_its_pool_and_stays_exact():
    """`use(Budget(limit))` on imperative code is the DTR pool of that limit."""
    rng = np.random.default_rng(4)
    w = cad.tensor(rng.standard_normal((16, 16)) * 0.3, requires_grad=True)
    x = cad.tensor(rng.standard_normal((8, 16)))

    def loss_of():
        h = x
        for _ in range(24):
            h = cad.tanh(h @ w + 0.1)
        return (h * h).sum()

    (reference,) = cad.grad(loss_of(), [w])
    budget = cad.strategies.Budget(6 * 8 * 16 * 8)
    with cad.profile() as prof, cad.use(budget):
        loss = loss_of()
    (got,) = cad.grad(loss, [w])
    np.testing.assert_array_equal(got.numpy(), reference.numpy())
    assert prof.evictions > 0
