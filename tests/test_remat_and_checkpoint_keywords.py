"""PyTorch's checkpoint keywords and JAX's remat with its named policies."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.strategies import jax_policies

RNG = np.random.default_rng(0)


def test_checkpoint_takes_pytorch_keywords_and_never_passes_them_on() -> None:
    seen = {}

    def fn(x, **kwargs):
        seen.update(kwargs)
        return cad.tanh(x * 2.0)

    x = cad.tensor(RNG.standard_normal(3), requires_grad=True)
    for reentrant in (None, True, False):
        for preserve in (True, False):
            y = cad.checkpoint(fn, x, use_reentrant=reentrant, preserve_rng_state=preserve,
                               scale=1)
            (g,) = cad.grad(cad.sum(y), [x])
            np.testing.assert_allclose(g.numpy(), 2 * (1 - np.tanh(2 * x.numpy()) ** 2))
    assert seen == {"scale": 1}


def test_checkpoint_replays_dropout_masks() -> None:
    w = cad.tensor(RNG.standard_normal(50), requires_grad=True)
    x = cad.ones(50, dtype="float64")

    def region(v):
        return cad.nn.functional.dropout(v * w, 0.5)

    cad.manual_seed(1)
    (plain,) = cad.grad(cad.sum(region(x) * w), [w])
    cad.manual_seed(1)
    y = cad.checkpoint(region, x, preserve_rng_state=True)
    (again,) = cad.grad(cad.sum(y * w), [w])
    np.testing.assert_array_equal(plain.numpy(), again.numpy())
    # without the replay (PyTorch's preserve_rng_state=False) the re-run draws a new mask
    cad.manual_seed(1)
    y = cad.checkpoint(region, x, preserve_rng_state=False)
    (fresh,) = cad.grad(cad.sum(y * w), [w])
    assert not np.array_equal(plain.numpy(), fresh.numpy())


@pytest.mark.parametrize("preserve", [True, False])
def test_preserve_rng_state_false_lets_numpys_re_run_draw_the_next_numbers(preserve) -> None:
    """As documented (and as PyTorch's flag): True replays numpy's global state for the re-run
    and restores it after; False leaves it alone, so the re-run draws the next numbers."""
    x = cad.tensor(np.ones(4), requires_grad=True)
    region = lambda v: v * cad.tensor(np.random.standard_normal(4))
    np.random.seed(3)
    y = cad.checkpoint(region, x, preserve_rng_state=preserve)
    cad.sum(y).backward()
    drawn = np.random.standard_normal(4)
    np.random.seed(3)
    first, second = np.random.standard_normal(4), np.random.standard_normal(4)
    np.testing.assert_array_equal(x.grad.numpy(), first if preserve else second)
    assert np.array_equal(drawn, second if preserve else np.random.standard_normal(4))


POLICIES = {
    "default": None,
    "nothing_saveable": cad.checkpoint_policies.nothing_saveable,
    "everything_saveable": cad.checkpoint_policies.everything_saveable,
    "dots_saveable": cad.checkpoint_policies.dots_saveable,
    "callable": lambda prim: prim.name == "matmul",
    "strategy": cad.strategies.StoreOutputs(),
}
RERUNS = {"default": 1, "nothing_saveable": 1}


@pytest.mark.parametrize("name", list(POLICIES))
def test_remat_policies_keep_gradients_and_rerun_only_when_recomputing(name: str) -> None:
    w = cad.tensor(RNG.standard_normal((3, 3)), requires_grad=True)
    x = cad.tensor(RNG.standard_normal((2, 3)))
    calls = []

    def layer(h):
        calls.append(1)
        return cad.tanh(h @ w) * cad.sigmoid(h)

    (want,) = cad.grad(cad.sum(layer(x) ** 2), [w])
    calls.clear()
    (got,) = cad.grad(cad.sum(cad.remat(layer, policy=POLICIES[name])(x) ** 2), [w])
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-13)
    assert len(calls) == 1 + RERUNS.get(name, 0)


def test_dots_saveable_saves_products_and_recomputes_the_rest() -> None:
    w = cad.tensor(RNG.standard_normal((3, 3)), requires_grad=True)
    y = cad.remat(lambda h: cad.tanh(h @ w), policy=cad.checkpoint_policies.dots_saveable)(
        cad.tensor(RNG.standard_normal((2, 3))))
    forms = {e.op: e.form for e in cad.tape_of(y)}
    assert forms["tanh"] == "inputs"  # its output is recomputed inside the rule
    assert forms["matmul"] == "inputs"  # a product keeps what its rule needs
    assert jax_policies.save_products(cad.ops.linalg.MATMUL) == "save"
    assert jax_policies.save_products(cad.ops.elementwise.TANH) == "recompute"


def test_policy_objects_print_compare_and_refuse_nonsense() -> None:
    assert repr(cad.checkpoint_policies.dots_saveable) == "checkpoint_policies.dots_saveable"
    assert cad.checkpoint_policies.dots_saveable == jax_policies.NamedPolicy("dots_saveable")
    assert cad.checkpoint_policies.dots_saveable.strategy() == cad.strategies.Policy(
        jax_policies.save_products)
    with pytest.raises(TypeError, match="policy must be"):
        cad.remat(abs, policy=3)
    with pytest.raises(TypeError, match="remat needs a function"):
        cad.remat(3)


def test_checkpoint_takes_jax_policies_and_gives_remats_gradients() -> None:
    """JAX: `jax.checkpoint(f, policy=...)`; here `cad.checkpoint(f, *args, policy=...)`."""
    w = cad.tensor(RNG.standard_normal((3, 3)), requires_grad=True)
    x = cad.tensor(RNG.standard_normal((2, 3)))

    def layer(h):
        return cad.tanh(h @ w) * cad.sin(h @ w)

    for policy in (cad.checkpoint_policies.nothing_saveable,
                   cad.checkpoint_policies.dots_saveable,
                   cad.checkpoint_policies.everything_saveable):
        (want,) = cad.grad(cad.remat(layer, policy=policy)(x).sum(), [w])
        (got,) = cad.grad(cad.checkpoint(layer, x, policy=policy).sum(), [w])
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    with pytest.raises(TypeError, match="not both"):
        cad.checkpoint(layer, x, policy=cad.checkpoint_policies.dots_saveable,
                       strategy=cad.strategies.Recompute())
