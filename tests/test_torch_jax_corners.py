"""The corners PyTorch and JAX users hit, each checked against what those libraries do.

Gradients at kinks and ties (norms at 0, binary cross-entropy at a logit of 0, max with ties),
`grad`'s return shape (PyTorch) and its function form (JAX), seeding of layer initialisation,
and the Tensor methods and einsum spellings a port needs. Differentiable additions are also
checked against finite differences in float64.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import nn
from checkpoint_ad.nn import functional as F

RNG = np.random.default_rng(38)


def leaf(a: Any) -> cad.Tensor:
    return cad.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)


def sigmoid(x: Any) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(np.asarray(x) >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


# ================================================================= BCE with logits at 0
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_bce_with_logits_gradient_is_sigmoid_minus_target_at_zero_like_pytorch(
        reduction: str) -> None:
    z = leaf(np.zeros(3))
    y = cad.tensor(np.array([1.0, 0.0, 0.5]))
    F.binary_cross_entropy_with_logits(z, y, reduction=reduction).backward()
    scale = 1.0 if reduction == "sum" else 1.0 / 3
    np.testing.assert_allclose(z.grad.numpy(), (sigmoid(np.zeros(3)) - y.numpy()) * scale)


def test_bce_with_logits_gradient_is_sigmoid_minus_target_everywhere_and_stable() -> None:
    logits = np.array([-800.0, -40.0, -1e-12, 0.0, 1e-12, 2.0, 40.0, 800.0])
    target = RNG.uniform(0.0, 1.0, logits.shape)
    z = leaf(logits)
    loss = F.binary_cross_entropy_with_logits(z, cad.tensor(target), reduction="sum")
    assert np.isfinite(loss.item())
    loss.backward()
    np.testing.assert_allclose(z.grad.numpy(), sigmoid(logits) - target, rtol=1e-12,
                               atol=1e-300)


def test_bce_with_logits_value_matches_pytorch_formula() -> None:
    logits, target = RNG.standard_normal(6) * 3, RNG.uniform(0.0, 1.0, 6)
    pos_weight = np.array(2.5)
    got = F.binary_cross_entropy_with_logits(cad.tensor(logits), cad.tensor(target),
                                             reduction="none", pos_weight=pos_weight)
    log_sig = -np.logaddexp(0.0, -logits)
    want = -(pos_weight * target * log_sig + (1 - target) * (log_sig - logits))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("pos_weight", [None, 1.7])
def test_bce_with_logits_gradcheck_across_zero(pos_weight: Any) -> None:
    logits = np.array([-3.0, -0.2, 0.0, 0.3, 4.0])
    target = cad.tensor(np.array([0.0, 1.0, 0.5, 0.2, 1.0]))
    assert cad.testing.gradcheck(
        lambda t: F.binary_cross_entropy_with_logits(t, target, "sum", pos_weight),
        [leaf(logits)], order=2)


def test_softplus_gradient_at_zero_is_one_half_like_pytorch() -> None:
    x = leaf([0.0])
    F.softplus(x).sum().backward()
    assert x.grad.tolist() == [0.5]


def test_softplus_threshold_is_linear_like_pytorch() -> None:
    x = leaf([25.0, 5.0])
    y = F.softplus(x, beta=2.0, threshold=20.0)
    assert y.tolist()[0] == 25.0  # 2 * 25 > 20: x itself
    np.testing.assert_allclose(y.tolist()[1], np.logaddexp(0.0, 10.0) / 2.0, rtol=1e-14)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [1.0, sigmoid(10.0)], rtol=1e-14)


# ================================================================= norms at zero
def test_norm_dim_of_a_zero_row_has_zero_gradient_like_pytorch() -> None:
    x = leaf([[0.0, 0.0], [3.0, 4.0]])
    x.norm(dim=1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[0.0, 0.0], [0.6, 0.8]])


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("ord", [None, 2, 1, 3, 0.5, float("inf"), float("-inf")], ids=str)
def test_linalg_norm_of_zero_vector_has_zero_gradient_like_pytorch(ord: Any,
                                                                    keepdim: bool) -> None:
    v = leaf(np.zeros(3))
    cad.linalg.norm(v, ord, keepdims=keepdim).sum().backward()
    assert np.array_equal(v.grad.numpy(), np.zeros(3))


@pytest.mark.parametrize("ord", [None, 2, 1, 3, 0.5, float("inf")], ids=str)
def test_norm_with_a_zero_row_has_finite_gradients(ord: Any) -> None:
    x = leaf([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    cad.linalg.norm(x, ord, dim=1, keepdim=True).sum().backward()
    g = x.grad.numpy()
    assert np.array_equal(g[0], np.zeros(3)) and np.all(np.isfinite(g))


@pytest.mark.parametrize("ord", [0.5, 3])
def test_p_norm_with_one_zero_entry_has_zero_gradient_there_like_pytorch(ord: float) -> None:
    x = leaf([0.0, 1.0, -2.0])
    cad.linalg.norm(x, ord).backward()
    g = x.grad.numpy()
    rest = np.array([1.0, -2.0])
    norm = np.sum(np.abs(rest) ** ord) ** (1 / ord)
    want = np.sign(rest) * np.abs(rest) ** (ord - 1) / norm ** (ord - 1)
    assert g[0] == 0.0
    np.testing.assert_allclose(g[1:], want)


def test_frobenius_norm_of_zero_matrix_has_zero_gradient_like_pytorch() -> None:
    x = leaf(np.zeros((2, 3)))
    cad.linalg.norm(x, "fro").backward()
    assert np.array_equal(x.grad.numpy(), np.zeros((2, 3)))


@pytest.mark.parametrize("ord", [None, 1, 3, 0.5, float("inf")], ids=str)
def test_norms_gradcheck_away_from_zero(ord: Any) -> None:
    x = RNG.uniform(0.5, 1.5, (3, 4)) * RNG.choice([-1.0, 1.0], (3, 4))
    if ord == float("inf"):
        x = np.arange(1.0, 13.0).reshape(3, 4) * np.sign(x) / 7.0  # no ties in |x|
    assert cad.testing.gradcheck(lambda t: cad.linalg.norm(t, ord, dim=1), [leaf(x)], order=2)


def test_forward_of_norms_is_unchanged() -> None:
    x = RNG.standard_normal((3, 4))
    for ord in (None, 1, 2, 3, 0.5, np.inf):
        np.testing.assert_allclose(cad.linalg.norm(cad.tensor(x), ord, dim=1).numpy(),
                                   np.linalg.norm(x, ord, axis=1), rtol=1e-13)
    assert cad.linalg.norm(cad.tensor(np.zeros(3))).item() == 0.0


def test_std_of_constant_has_zero_gradient_like_pytorch() -> None:
    x = leaf([[2.0, 2.0, 2.0], [1.0, 2.0, 3.0]])
    x.std(dim=1).sum().backward()
    g = x.grad.numpy()
    assert np.array_equal(g[0], np.zeros(3))
    np.testing.assert_allclose(g[1], [-0.5, 0.0, 0.5])  # d std / dx, n - 1 = 2, std = 1


# ================================================================= max / min with ties
@pytest.mark.parametrize("op", ["max", "min"])
def test_max_min_with_dim_send_the_gradient_to_the_returned_index_like_pytorch(op: str) -> None:
    values = [[1.0, 3.0, 3.0]] if op == "max" else [[3.0, 1.0, 1.0]]
    x = leaf(values)
    out, index = getattr(x, op)(dim=1)
    out.sum().backward()
    assert index.tolist() == [1]
    assert x.grad.tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("keepdim", [False, True])
def test_max_with_dim_keepdim_shapes_and_routing(keepdim: bool) -> None:
    x = leaf([[[5.0, 5.0], [1.0, 2.0]], [[0.0, 0.0], [7.0, 7.0]]])
    values, indices = cad.max(x, dim=1, keepdim=keepdim)
    assert values.shape == indices.shape == ((2, 1, 2) if keepdim else (2, 2))
    values.sum().backward()
    # each (batch, column) slice gives its whole gradient to the entry at its index
    g = x.grad.numpy()
    assert g.sum() == 4.0 and set(np.unique(g)) <= {0.0, 1.0}
    picked = np.take_along_axis(g, np.asarray(indices.numpy()).reshape(2, 1, 2), axis=1)
    assert np.array_equal(picked, np.ones((2, 1, 2)))


def test_whole_tensor_max_splits_ties_evenly_like_pytorch() -> None:
    x = leaf([[1.0, 3.0, 3.0]])
    x.max().backward()
    assert x.grad.tolist() == [[0.0, 0.5, 0.5]]


@pytest.mark.parametrize("op", ["amax", "amin"])
def test_amax_amin_split_ties_evenly_like_pytorch(op: str) -> None:
    values = [[1.0, 3.0, 3.0]] if op == "amax" else [[3.0, 1.0, 1.0]]
    x = leaf(values)
    getattr(x, op)(dim=1).sum().backward()
    assert x.grad.tolist() == [[0.0, 0.5, 0.5]]


def test_max_with_dim_gradcheck() -> None:
    x = RNG.permutation(12).reshape(3, 4) / 5.0
    assert cad.testing.gradcheck(lambda t: cad.max(t, dim=1).values, [leaf(x)], order=2)
    assert cad.testing.gradcheck(lambda t: t.min(dim=0, keepdim=True).values, [leaf(x)],
                                 order=2)


# ================================================================= grad's return (PyTorch)
def test_grad_unpacks_like_torch_autograd_grad() -> None:
    x = leaf(np.ones((1, 3)))
    (g,) = cad.grad((x * x).sum(), x)
    assert g.shape == (1, 3)
    gx, gy = cad.grad((x * 2.0).sum(), (x, x))
    assert gx.shape == gy.shape == (1, 3)


def test_grad_of_a_function_is_jax_grad() -> None:
    f = lambda x: (x ** 3).sum()
    x = np.array([1.0, 2.0])
    g = cad.grad(f)(x)
    assert isinstance(g, cad.Tensor) and g.dtype == np.float64
    np.testing.assert_allclose(g.numpy(), 3 * x ** 2)
    assert cad.func.grad is cad.grad


def test_grad_argnums_like_jax() -> None:
    f = lambda a, b, c: (a * b * c).sum()
    a, b, c = cad.tensor([1.0, 2.0]), cad.tensor([3.0, 4.0]), cad.tensor([5.0, 6.0])
    assert cad.grad(f, argnums=1)(a, b, c).tolist() == [5.0, 12.0]
    assert cad.grad(f, 2)(a, b, c).tolist() == [3.0, 8.0]  # argnums positionally, as jax.grad
    ga, gc = cad.grad(f, argnums=(0, 2))(a, b, c)
    assert ga.tolist() == [15.0, 24.0] and gc.tolist() == [3.0, 8.0]
    (only,) = cad.grad(f, argnums=(0,))(a, b, c)  # a tuple argnums gives a tuple
    assert only.tolist() == [15.0, 24.0]
    assert cad.grad(f, argnums=-1)(a, b, c).tolist() == [3.0, 8.0]


def test_grad_has_aux_and_value_and_grad_like_jax() -> None:
    def f(w, x):
        out = (w * x).sum()
        return out * out, {"out": out}

    w, x = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    g, aux = cad.grad(f, has_aux=True)(w, x)
    assert aux["out"].item() == 11.0
    np.testing.assert_allclose(g.numpy(), 2 * 11.0 * x)
    (value, aux), g2 = cad.value_and_grad(f, has_aux=True)(w, x)
    assert value.item() == 121.0 and not value.requires_grad
    np.testing.assert_array_equal(g.numpy(), g2.numpy())
    value, g3 = cad.func.value_and_grad(lambda w: (w * w).sum())(w)
    assert value.item() == 5.0 and g3.tolist() == [2.0, 4.0]


def test_grad_of_pytree_arguments_like_jax() -> None:
    def loss(params, x):
        return ((x @ params["w"] + params["b"][0]) ** 2).sum()

    params = {"w": np.array([[1.0], [2.0]]), "b": [np.array([0.5])]}
    x = np.array([[1.0, 1.0], [2.0, 0.0]])
    g = cad.grad(loss)(params, x)
    assert set(g) == {"w", "b"} and isinstance(g["b"], list)
    residual = x @ params["w"] + params["b"][0]
    np.testing.assert_allclose(g["w"].numpy(), 2 * x.T @ residual)
    np.testing.assert_allclose(g["b"][0].numpy(), [2 * residual.sum()])


def test_grad_of_grad_like_jax() -> None:
    f = lambda x: (x ** 3).sum()
    assert cad.grad(cad.grad(f))(cad.tensor(2.0, dtype="float64")).item() == 12.0
    # Hessian-vector product, JAX's grad(lambda x: grad(f)(x) @ v)
    v = cad.tensor([1.0, -1.0], dtype="float64")
    hvp = cad.grad(lambda x: (cad.grad(f)(x) * v).sum())(np.array([1.0, 2.0]))
    np.testing.assert_allclose(hvp.numpy(), 6 * np.array([1.0, 2.0]) * [1.0, -1.0])


def test_grad_of_function_leaves_arguments_alone() -> None:
    w = cad.tensor([1.0, 2.0], requires_grad=True)
    g = cad.grad(lambda a: (a * a).sum())(w)
    assert g.tolist() == [2.0, 4.0] and w.grad is None and not g.requires_grad
    with cad.no_grad():  # JAX's grad differentiates whatever the ambient mode
        assert cad.grad(lambda a: (a * a).sum())(w).tolist() == [2.0, 4.0]


def test_grad_of_a_history_carrying_argument_stays_differentiable() -> None:
    w = cad.tensor([1.0, 2.0], requires_grad=True, dtype="float64")
    g = cad.grad(lambda a: (a ** 3).sum())(w * 2.0)  # 3 (2w)^2
    assert g.requires_grad
    g.sum().backward()  # d/dw sum(12 w^2) = 24 w
    np.testing.assert_allclose(w.grad.numpy(), [24.0, 48.0])


def test_grad_of_unused_argument_is_zero_like_jax() -> None:
    g = cad.grad(lambda a, b: (b * b).sum())(cad.ones(2), cad.ones(2))
    assert g.tolist() == [0.0, 0.0]
    g = cad.grad(lambda a: cad.tensor(3.0))(cad.ones(2))
    assert g.tolist() == [0.0, 0.0]


def test_grad_of_function_refuses_what_jax_refuses() -> None:
    with pytest.raises(TypeError, match="scalar"):
        cad.grad(lambda a: a * 2.0)(cad.ones(2))
    with pytest.raises(TypeError, match="scalar Tensor"):
        cad.grad(lambda a: 3.0)(cad.ones(2))
    with pytest.raises(TypeError, match="pair"):
        cad.grad(lambda a: a.sum(), has_aux=True)(cad.ones(2))
    with pytest.raises(TypeError, match="out of range"):
        cad.grad(lambda a: a.sum(), argnums=1)(cad.ones(2))
    with pytest.raises(TypeError, match="argnums must be"):
        cad.grad(lambda a: a.sum(), argnums=())
    with pytest.raises(cad.DTypeError):
        cad.grad(lambda a: a.sum())(np.arange(3))
    with pytest.raises(TypeError, match="argnums= and has_aux="):
        cad.grad(leaf([1.0]).sum(), argnums=0)
    with pytest.raises(TypeError, match="inputs is missing"):
        cad.grad(leaf([1.0]).sum())
    with pytest.raises(TypeError, match="belong to grad"):
        cad.grad(lambda a: a.sum(), create_graph=True)
    with pytest.raises(TypeError, match="given twice"):
        cad.grad(lambda a: a.sum(), 0, argnums=0)
    with pytest.raises(TypeError, match="takes a function"):
        cad.value_and_grad(leaf([1.0]))


def test_gradient_tape_keeps_tensorflows_shape_of_sources() -> None:
    x = leaf([1.0, 2.0])
    with cad.GradientTape(persistent=True) as tape:
        y = (x * x).sum()
    assert isinstance(tape.gradient(y, x), cad.Tensor)
    assert isinstance(tape.gradient(y, [x]), list)
    assert isinstance(tape.gradient(y, (x,)), tuple)


# ================================================================= manual_seed
def _layers() -> dict[str, Any]:
    return {
        "Linear": lambda: nn.Linear(3, 4),
        "Embedding": lambda: nn.Embedding(5, 3),
        "LayerNorm": lambda: nn.LayerNorm(3),
        "RNNCell": lambda: nn.RNNCell(3, 4),
        "GRUCell": lambda: nn.GRUCell(3, 4),
        "LSTMCell": lambda: nn.LSTMCell(3, 4),
        "RNN": lambda: nn.RNN(3, 4, num_layers=2),
        "GRU": lambda: nn.GRU(3, 4),
        "LSTM": lambda: nn.LSTM(3, 4, num_layers=2),
        "Sequential": lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
        "MultiheadAttention": lambda: nn.MultiheadAttention(8, 2),
        "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16),
    }


def test_every_parameterised_layer_class_is_covered() -> None:
    covered = set(_layers())
    parameterised = {
        name for name, cls in vars(nn).items()
        if inspect.isclass(cls) and issubclass(cls, nn.Module)
        and "rng" in inspect.signature(cls.__init__).parameters
    }
    assert parameterised and parameterised <= covered


@pytest.mark.parametrize("name", list(_layers()))
def test_manual_seed_makes_layer_initialisation_repeatable_like_torch(name: str) -> None:
    make = _layers()[name]
    cad.manual_seed(0)
    first = {k: v.numpy() for k, v in make().state_dict().items()}
    cad.manual_seed(0)
    second = {k: v.numpy() for k, v in make().state_dict().items()}
    assert first.keys() == second.keys()
    for key in first:
        np.testing.assert_array_equal(first[key], second[key])


def test_layers_without_manual_seed_still_differ() -> None:
    cad.manual_seed(0)
    a, b = nn.Linear(3, 4), nn.Linear(3, 4)
    assert not np.array_equal(a.weight.numpy(), b.weight.numpy())


def test_explicit_seed_still_wins_over_manual_seed() -> None:
    cad.manual_seed(1)
    a = nn.Linear(3, 4, seed=7)
    cad.manual_seed(2)
    b = nn.Linear(3, 4, seed=7)
    np.testing.assert_array_equal(a.weight.numpy(), b.weight.numpy())


# ================================================================= detach_
def test_detach_in_place_makes_a_leaf_like_pytorch() -> None:
    x = leaf([1.0, 2.0])
    y = x * 2.0
    assert y.detach_() is y
    assert y.is_leaf and not y.requires_grad and y.grad_fn is None
    assert y.tolist() == [2.0, 4.0]
    z = (y * x).sum()
    z.backward()
    assert x.grad.tolist() == [2.0, 4.0]  # nothing flows through y any more


def test_detach_in_place_of_a_leaf_stops_requiring_grad_like_pytorch() -> None:
    x = leaf([1.0])
    x.detach_()
    assert not x.requires_grad and x.is_leaf


def test_detach_in_place_refuses_a_view_like_pytorch() -> None:
    base = leaf([1.0, 2.0, 3.0]) * 1.0
    with pytest.raises(cad.InplaceError, match=r"use \.detach\(\)"):
        base[1:].detach_()


def test_detach_in_place_drops_retain_grad() -> None:
    x = leaf([1.0])
    y = x * 3.0
    y.retain_grad()
    y.detach_()
    (x * 2.0).sum().backward()
    assert y.grad is None


# ================================================================= var / std methods
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [None, 0, 1, (0, 1)], ids=str)
def test_var_std_methods_default_to_pytorch_correction(dim: Any, keepdim: bool) -> None:
    x = RNG.standard_normal((3, 4))
    t = cad.tensor(x)
    for method, ref in (("var", np.var), ("std", np.std)):
        got = getattr(t, method)(dim, keepdim=keepdim).numpy()
        np.testing.assert_allclose(got, ref(x, axis=dim, ddof=1, keepdims=keepdim), rtol=1e-12)
        got = getattr(t, method)(dim=dim, correction=0, keepdim=keepdim).numpy()
        np.testing.assert_allclose(got, ref(x, axis=dim, keepdims=keepdim), rtol=1e-12)


def test_var_std_method_keywords_like_pytorch_and_numpy() -> None:
    x = RNG.standard_normal((3, 4))
    t = cad.tensor(x)
    np.testing.assert_allclose(t.var(1, False).numpy(), np.var(x, axis=1))  # (dim, unbiased)
    np.testing.assert_allclose(t.var(False).numpy(), np.var(x))  # x.var(unbiased)
    np.testing.assert_allclose(t.std(unbiased=True).numpy(), np.std(x, ddof=1))
    np.testing.assert_allclose(t.std(axis=0, ddof=0, keepdims=True).numpy(),
                               np.std(x, axis=0, keepdims=True))
    # the functions keep numpy's default (ddof 0)
    np.testing.assert_allclose(cad.var(t).numpy(), np.var(x))


def test_var_std_methods_gradcheck() -> None:
    x = RNG.standard_normal((3, 4))
    assert cad.testing.gradcheck(lambda t: t.var(dim=1), [leaf(x)], order=2)
    assert cad.testing.gradcheck(lambda t: t.std(dim=0, keepdim=True), [leaf(x)], order=2)


# ================================================================= einsum with ...
ELLIPSIS = [
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 2)]),  # broadcast, size 1 against 5
    ("...ij,jk->...ik", [(3, 4), (4, 5)]),  # '...' of no axes
    ("i...,i...->...", [(3, 2, 2), (3, 2, 2)]),
    ("i...,i...->...", [(3, 2), (3, 1)]),
    ("...i->...", [(2, 3, 4)]),
    ("...ij,...jk", [(2, 3, 4), (4, 5)]),  # implicit output: '...' then 'ik'
    ("b...a", [(3, 4, 2)]),  # implicit output puts '...' first, then the sorted indices
    ("a...b,...b->...a", [(2, 3, 4), (3, 4)]),
]


@pytest.mark.parametrize(("spec", "shapes"), ELLIPSIS, ids=[f"{s}-{len(v)}" for s, v in ELLIPSIS])
def test_einsum_ellipsis_forward_and_gradient_like_numpy(spec: str, shapes: list) -> None:
    arrays = [RNG.standard_normal(s) for s in shapes]
    got = cad.einsum(spec, *(cad.tensor(a) for a in arrays)).numpy()
    want = np.einsum(spec, *arrays)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert cad.testing.gradcheck(lambda *ts: cad.einsum(spec, *ts), [leaf(a) for a in arrays],
                                 order=2)


@pytest.mark.parametrize(("spec", "shapes", "match"), [
    ("...i->i", [(2, 3)], "leaves out"),
    ("....i", [(2, 3)], "one '...'"),
    ("...ij", [(2,)], "names 2 axes"),
    ("...i,...i", [(2, 3), (4, 3)], "do not broadcast"),
    ("...i,...i", [(2, 3)], "names 2 operands"),
])
def test_einsum_ellipsis_errors(spec: str, shapes: list, match: str) -> None:
    with pytest.raises(cad.ShapeError, match=match):
        cad.einsum(spec, *(cad.ones(s) for s in shapes))
