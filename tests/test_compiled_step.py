"""A replayed step runs its instructions through calls bound once (`compiled_step.py`): every
way of calling a forward or a backward rule, and every place a gradient is delivered to, must
give gradients bitwise equal to recording the loop step by step (``trace=False``).
"""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.ops.shape import matrix_transpose, unreduce
from checkpoint_ad.strategies import Binomial, Periodic


def _inputs(seed=0, T=7, B=3, H=4):
    rng = np.random.default_rng(seed)
    return {
        "w": cad.tensor(rng.standard_normal((H, H)) * 0.4, requires_grad=True),
        "b": cad.tensor(rng.standard_normal(H) * 0.1, requires_grad=True),  # broadcast
        "v": cad.tensor(rng.standard_normal((H, 2)).astype(np.float32), requires_grad=True),
        "h0": cad.tensor(rng.standard_normal((B, H)), requires_grad=True),
        "xs": cad.tensor(rng.standard_normal((T, B, H)), requires_grad=True),
    }


def _step(p):
    """One step touching every kind of call: two-argument, one-argument and keyword
    (axis) forwards; rules that take only g, one saved value, or attributes; variadic
    primitives with and without saved values; a broadcast bias summed back; a float32
    parameter whose gradients arrive in float64 (cast back); a 0-d output; a carry passed
    through unchanged; a scanned input and captured tensors taking gradients."""

    def step(carry, x):
        h, keep = carry
        pre = h @ p["w"] + x + p["b"]
        h_new = cad.tanh(pre) * 0.9
        both = cad.concatenate([h_new, x], axis=1)
        mixed = cad.einsum("bi,ij->bj", h_new, p["v"])
        y = cad.sum(both * both, axis=1) + cad.sum(mixed, axis=1) + cad.sum(keep)
        return (h_new, keep), (y, cad.sum(h_new))

    return step


def _run(strategy, trace):
    p = _inputs()
    keep = p["h0"] * 0.5
    (h, k), (ys, totals) = cad.scan(_step(p), (p["h0"], keep), p["xs"], strategy=strategy,
                                    trace=trace)
    loss = (h * h).sum() + ys.sum() + totals.sum() + k.sum()
    targets = [p["w"], p["b"], p["v"], p["h0"], p["xs"]]
    mode = h.grad_fn.op.mode if h.grad_fn is not None and hasattr(h.grad_fn.op, "mode") else None
    return [g.numpy() for g in cad.grad(loss, targets)], loss.item(), mode


@pytest.mark.parametrize("strategy", [None, Binomial(2), Periodic(3)],
                         ids=["keep-all", "binomial-2", "periodic-3"])
def test_every_call_kind_replays_bitwise(strategy):
    got, loss, mode = _run(strategy, trace=True)
    ref, ref_loss, _ = _run(strategy, trace=False)
    assert mode == "replayed"
    assert loss == ref_loss
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype
        np.testing.assert_array_equal(g, r)
    assert got[2].dtype == np.float32  # float64 gradients cast back to the parameter's dtype


def test_a_replayed_backward_can_run_twice_with_retain_graph():
    p = _inputs()
    (h, _), (ys, _) = cad.scan(_step(p), (p["h0"], p["h0"] * 0.5), p["xs"])
    loss = ys.sum() + (h * h).sum()
    first = [g.numpy() for g in cad.grad(loss, [p["w"], p["b"]], retain_graph=True)]
    second = [g.numpy() for g in cad.grad(loss, [p["w"], p["b"]])]
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_array_rules_make_the_views_the_primitives_make():
    """matrix_transpose and unreduce on arrays skip the primitives' dispatch: same values,
    same shapes, still a view (no copy), and the same error for a 1-d operand."""
    a = np.arange(24.0).reshape(2, 3, 4)
    t = matrix_transpose(a)
    assert t.shape == (2, 4, 3) and np.shares_memory(t, a)
    np.testing.assert_array_equal(t, matrix_transpose(cad.tensor(a)).numpy())
    with pytest.raises(cad.errors.ShapeError, match="at least 2 dimensions"):
        matrix_transpose(np.ones(3))
    g = np.float64(2.0)
    spread = unreduce(g, (2, 3), (0, 1))
    np.testing.assert_array_equal(spread, np.full((2, 3), 2.0))
    np.testing.assert_array_equal(spread, unreduce(cad.tensor(g), (2, 3), (0, 1)).numpy())
    row = np.array([1.0, 2.0, 3.0])
    kept = unreduce(row, (3,), ())  # nothing reduced: the array itself, reshaped
    np.testing.assert_array_equal(kept, row)


@pytest.mark.parametrize("source, shape", [((1, 1), (3, 4)), ((3, 1), (3, 4)), ((1, 4), (3, 4)),
                                           ((2, 1, 1), (2, 3, 5)), ((2, 3), (2, 3))])
def test_a_broadcast_view_is_what_numpy_broadcasts(source, shape):
    """`broadcast_view` (a spread gradient, made in one call) gives numpy's broadcast: same
    values, shape and strides, a read-only view of the source; a non-contiguous source takes
    numpy's own path."""
    from checkpoint_ad.backend import broadcast_view

    a = np.arange(float(np.prod(source))).reshape(source)
    view, ref = broadcast_view(a, shape), np.broadcast_to(a, shape)
    assert view.shape == ref.shape and view.strides == ref.strides
    np.testing.assert_array_equal(view, ref)
    assert np.shares_memory(view, a) and not view.flags.writeable
    strided = np.arange(12.0).reshape(3, 4)[:, :1]
    np.testing.assert_array_equal(broadcast_view(strided, (3, 4)),
                                  np.broadcast_to(strided, (3, 4)))


def test_a_spread_gradient_is_read_only():
    """Nothing may add into a gradient that is one value seen many times."""
    spread = unreduce(np.float32(2.0), (2, 3), (0, 1))
    with pytest.raises(ValueError):
        spread += 1
