"""JAX's shape-dependent policies `dots_with_no_batch_dims_saveable` and
`offload_dot_with_no_batch_dims` (issue 38): decided per call from the operands' shapes, in
plain code, remat regions, traced scan steps and the step programs kept across calls.

Offloading to host memory moves nothing for numpy arrays (they are in host memory already), so
the offload tests here use the disk level, whose bytes the profiler shows apart."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.entry import Entry
from checkpoint_ad.ops.elementwise import TANH
from checkpoint_ad.ops.linalg import EINSUM, MATMUL
from checkpoint_ad.strategies import StoreInputs, jax_policies
from checkpoint_ad.strategies.loops import program_cache
from checkpoint_ad.strategies.storage.offload import Offload

P = cad.checkpoint_policies
RNG = np.random.default_rng(0)
NO_BATCH = P.dots_with_no_batch_dims_saveable
TO_DISK = P.offload_dot_with_no_batch_dims("device", "disk")


@pytest.mark.parametrize(("a", "b", "batched"), [
    ((5, 3), (3, 4), False),  # x @ W
    ((2, 7, 3), (3, 4), False),  # a (B, T, n) activation times a 2-D weight: no batch dims
    ((2, 7, 3), (1, 3, 4), False),  # a size-1 axis broadcast: squeezed, as jnp.matmul does
    ((2, 4, 3), (2, 3, 5), True),  # (b, n, k) @ (b, k, m)
    ((6, 2, 4, 3), (2, 3, 5), True),
])
def test_matmul_has_batch_dims_like_jax_dot_general(a, b, batched) -> None:
    assert jax_policies.has_batch_dims(MATMUL, (a, b), {}) is batched


@pytest.mark.parametrize(("subscripts", "shapes", "batched"), [
    ("ij,jk->ik", ((5, 3), (3, 4)), False),
    ("ij,jk", ((5, 3), (3, 4)), False),  # the implicit output keeps no shared index
    ("bij,jk->bik", ((2, 5, 3), (3, 4)), False),
    ("bij,bjk->bik", ((2, 5, 3), (2, 3, 4)), True),
    ("bij, bjk -> bik", ((2, 5, 3), (2, 3, 4)), True),
    ("bij,bjk->ik", ((2, 5, 3), (2, 3, 4)), False),  # b is contracted, not a batch dim
    ("ij,jk,kl->il", ((2, 3), (3, 4), (4, 5)), False),
])
def test_einsum_has_batch_dims_like_jax_dot_general(subscripts, shapes, batched) -> None:
    assert jax_policies.has_batch_dims(EINSUM, shapes, {"subscripts": subscripts}) is batched


def test_only_products_of_two_or_more_operands_are_dots() -> None:
    assert jax_policies.has_batch_dims(TANH, ((3,),), {}) is None
    assert jax_policies.has_batch_dims(EINSUM, ((3, 3),), {"subscripts": "ij->ji"}) is None
    assert jax_policies.has_batch_dims(MATMUL, None, {}) is None  # no call known


def test_the_policy_answers_per_call_from_shapes() -> None:
    policy = NO_BATCH.strategy()
    assert policy.per_call and policy == NO_BATCH.strategy()  # a value: step programs keep it
    assert type(policy.for_call(MATMUL, ((5, 3), (3, 4)), {})) is cad.strategies.KeepAll
    assert type(policy.for_call(MATMUL, ((2, 4, 3), (2, 3, 5)), {})) is StoreInputs
    assert type(policy.for_call(TANH, ((3,),), {})) is StoreInputs
    assert type(policy.for_primitive(MATMUL)) is StoreInputs  # shapes unknown: not a dot
    offload = TO_DISK.strategy().for_call(MATMUL, ((5, 3), (3, 4)), {})
    assert offload == Offload("disk")
    assert type(TO_DISK.strategy().for_call(MATMUL, ((2, 4, 3), (2, 3, 5)), {})) is StoreInputs
    # JAX's default destination, pinned host memory, is the host level
    pinned = P.offload_dot_with_no_batch_dims().strategy()
    assert pinned.for_call(MATMUL, ((5, 3), (3, 4)), {}) == Offload("host")


def _tensors():
    w = cad.tensor(RNG.standard_normal((3, 4)), requires_grad=True)
    a = cad.tensor(RNG.standard_normal((2, 4, 3)), requires_grad=True)
    x = cad.tensor(RNG.standard_normal((5, 3)), requires_grad=True)
    return w, a, x


def _layer(w, a, calls):
    def f(x):
        calls.append(1)
        h = cad.tanh(x) @ w  # x @ W: no batch dims
        b = cad.matmul(cad.sin(a), cad.cos(a).transpose(0, 2, 1))  # batched
        return cad.tanh(h).sum() + cad.tanh(b).sum()
    return f


def _saved_by_products(y):
    """{'x@W' or 'batched': the strategy classes of the product's saved operands}."""
    found: dict[str, set[str]] = {}
    stack, seen = [y._entry], set()
    while stack:
        entry = stack.pop()
        if id(entry) in seen:
            continue
        seen.add(id(entry))
        if entry.op is MATMUL:
            kind = "batched" if len(entry.in_shapes[0]) > 2 else "x@W"
            found[kind] = {type(s.buffer.packer).__name__ for s in entry.slots}
        stack.extend(e[0] for e in entry.edges if e is not None and type(e[0]) is Entry)
    return found


@pytest.mark.parametrize("policy", [NO_BATCH, TO_DISK], ids=repr)
def test_remat_with_no_batch_dims_policies_matches_jax_gradients_bitwise(policy) -> None:
    w, a, x = _tensors()
    calls: list[int] = []
    f = _layer(w, a, calls)
    want = cad.grad(f(x), [w, a, x])
    y = cad.remat(f, policy=policy)(x)
    got = cad.grad(y, [w, a, x], retain_graph=True)
    for g, r in zip(got, want):
        assert np.array_equal(g.numpy(), r.numpy())
    assert len(calls) == 2  # the region is not re-run: every value its backward reads is kept
    saved = _saved_by_products(y)
    # x @ W's call is saved (its operand x through the policy's storage), the batched
    # product's call is recomputed as the rest of the region: it keeps only what its rule needs
    assert saved["batched"] == {"StoreInputs"}
    assert saved["x@W"] >= ({"KeepAll"} if policy is NO_BATCH else {"Offload"})


def test_offload_dot_with_no_batch_dims_stores_those_values_through_offload() -> None:
    w, a, x = _tensors()
    f = _layer(w, a, [])
    with cad.profile() as kept:
        cad.remat(f, policy=NO_BATCH)(x).backward()
    with cad.profile() as moved:
        cad.remat(f, policy=TO_DISK)(x).backward()
    # tanh(x), x @ W's operand that the region made (W is a parameter: held anyway, not moved)
    assert moved.level_peak_bytes["disk"] == 5 * 3 * 8
    assert moved.io_bytes_written == 5 * 3 * 8
    assert moved.level_peak_bytes["device"] == kept.level_peak_bytes["device"] - 5 * 3 * 8
    with pytest.raises(ValueError, match="offload_dst"):
        P.offload_dot_with_no_batch_dims(offload_dst="gpu")
    assert repr(TO_DISK) == ("checkpoint_policies.offload_dot_with_no_batch_dims("
                             "offload_src='device', offload_dst='disk')")


def _body(h, x):
    v = h @ x  # the carry itself is an operand: a step program's chained values decide too
    return (cad.tanh(v) + h,) * 2


def _scan_grads(step, strategy=None, trace=True, n=6, rows=(3, 3), carry=(1, 3)):
    """Gradients, the loop's mode and the bytes written to disk, of a scan of `step` (over
    `h @ x`, x one row of xs)."""
    h0 = cad.tensor(RNG.standard_normal(carry), requires_grad=True)
    xs = cad.tensor(RNG.standard_normal((n, *rows)) * 0.5, requires_grad=True)
    with cad.inspect.loops() as ran, cad.profile() as prof:
        h, ys = cad.scan(step, h0, xs, strategy=strategy, trace=trace)
        (ys.sum() + h.sum()).backward()
    grads = [np.asarray(t.grad) for t in (h0, xs)]
    return grads, ran[0].mode, prof.io_bytes_written


@pytest.mark.parametrize("strategy", [None, cad.strategies.Binomial(2)], ids=repr)
@pytest.mark.parametrize("policy", [NO_BATCH, TO_DISK], ids=repr)
def test_scan_of_remat_with_no_batch_dims_policy_is_traced_and_matches_jax(policy,
                                                                             strategy) -> None:
    """JAX's `scan(remat(body, policy=...))`: traced into a step program, bitwise the
    gradients of keeping every step."""
    state = RNG.bit_generator.state
    want, _, _ = _scan_grads(_body, trace=False)
    RNG.bit_generator.state = state
    got, mode, on_disk = _scan_grads(cad.remat(_body, policy=policy), strategy)
    for g, r in zip(got, want):
        assert np.array_equal(g, r)
    assert "record" not in mode
    if strategy is None:
        # h @ x has no batch dims: its operands went to disk, in the steps the program
        # replays too: the six rows of xs and the carry each step but the first reads (made
        # by the step before: h0, a leaf, is held by the caller anyway). (A planned loop
        # re-taping its steps during backward stores none on the disk, with any policy.)
        assert on_disk == (6 * 3 * 3 * 8 + 5 * 3 * 8 if policy is TO_DISK else 0)


def test_a_kept_step_program_does_not_reuse_a_decision_made_for_other_shapes() -> None:
    """The same step code over rows (3, 3) (no batch dims: offloaded) and (2, 3, 3) with a
    (2, 1, 3) carry (batched: recomputed, nothing offloaded), twice each: the program cache
    keys the decisions by shape."""
    program_cache.clear()
    step = cad.remat(_body, policy=TO_DISK)
    for _ in range(2):
        for rows, carry, offloaded in (((3, 3), (1, 3), True), ((2, 3, 3), (2, 1, 3), False)):
            state = RNG.bit_generator.state
            want, _, _ = _scan_grads(_body, trace=False, rows=rows, carry=carry)
            RNG.bit_generator.state = state
            got, mode, on_disk = _scan_grads(step, rows=rows, carry=carry)
            for g, r in zip(got, want):
                assert np.array_equal(g, r)
            assert (on_disk > 0) is offloaded, (rows, mode)
    assert mode == program_cache.REUSED


def test_checkpoint_takes_the_no_batch_dims_policies() -> None:
    w, a, x = _tensors()
    f = _layer(w, a, [])
    for policy in (NO_BATCH, TO_DISK):
        (want,) = cad.grad(cad.remat(f, policy=policy)(x), [w])
        (got,) = cad.grad(cad.checkpoint(f, x, policy=policy), [w])
        assert np.array_equal(got.numpy(), want.numpy())
