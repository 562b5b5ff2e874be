"""Attention and the transformer building blocks: scaled_dot_product_attention,
MultiheadAttention, TransformerEncoderLayer/Encoder, and the gelu / layer_norm / erf primitives,
against numpy references, finite differences (float64) and, where torch is installed, PyTorch
on the same weights."""

from __future__ import annotations

import math

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.nn import MultiheadAttention, TransformerEncoder, TransformerEncoderLayer
from checkpoint_ad.nn import functional as F
from checkpoint_ad.ops.normalizing import attention_softmax
from checkpoint_ad.strategies import Selective

SEED = 7


def leaf(array):
    return cad.tensor(np.asarray(array, dtype=np.float64), requires_grad=True)


def np_attention(q, k, v, keep=None, added=None, scale=None):
    scores = q @ np.swapaxes(k, -1, -2) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)
    if added is not None:
        scores = scores + added
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def np_layer_norm(x, w, b, eps=1e-5):
    c = x - x.mean(axis=-1, keepdims=True)
    return c / np.sqrt((c * c).mean(axis=-1, keepdims=True) + eps) * w + b


# ================================================================= primitives
def test_gelu_and_erf_match_libm_in_float64():
    x = np.random.default_rng(SEED).standard_normal((4, 5)) * 3
    erf = np.vectorize(math.erf)
    np.testing.assert_allclose(cad.erf(cad.tensor(x)).numpy(), erf(x), rtol=1e-15, atol=1e-16)
    np.testing.assert_allclose(cad.gelu(cad.tensor(x)).numpy(),
                               0.5 * x * (1 + erf(x / math.sqrt(2))), rtol=1e-14, atol=1e-16)
    tanh_form = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(F.gelu(cad.tensor(x), approximate="tanh").numpy(), tanh_form,
                               rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_gradcheck_orders_1_and_2(approximate):
    x = leaf(np.random.default_rng(SEED).standard_normal((3, 4)) * 2)
    assert cad.testing.gradcheck(lambda t: cad.gelu(t, approximate), [x], order=2)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_one_primitive_saving_its_input_and_keeps_float32(approximate):
    x = cad.tensor(np.random.default_rng(SEED).standard_normal((3, 4)).astype(np.float32),
                   requires_grad=True)
    y = F.gelu(x, approximate)
    assert y.dtype == np.float32
    entries = list(cad.tape_of(y))
    assert [e.op for e in entries] == ["gelu"]
    assert [s.name for s in entries[0].saved] == ["x"]
    y.sum().backward()
    assert x.grad.dtype == np.float32


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate must be"):
        cad.gelu(cad.ones(2), "fast")


def test_layer_norm_matches_numpy_and_gradchecks_at_order_2():
    rng = np.random.default_rng(SEED)
    x, w, b = rng.standard_normal((2, 3, 5)), rng.standard_normal(5), rng.standard_normal(5)
    got = F.layer_norm(cad.tensor(x), 5, cad.tensor(w), cad.tensor(b)).numpy()
    np.testing.assert_allclose(got, np_layer_norm(x, w, b), rtol=1e-12, atol=1e-14)
    assert cad.testing.gradcheck(lambda t, w, b: F.layer_norm(t, 5, w, b),
                                 [leaf(x), leaf(w), leaf(b)], order=2)
    # several trailing axes, no affine parameters
    assert cad.testing.gradcheck(lambda t: F.layer_norm(t, (3, 5)), [leaf(x)], order=2)


def test_layer_norm_saves_its_input_and_row_statistics_in_float32():
    x = cad.tensor(np.random.default_rng(SEED).standard_normal((4, 6, 8)).astype(np.float32),
                   requires_grad=True)
    norm = cad.nn.LayerNorm(8)
    y = norm(x)
    assert y.dtype == np.float32
    (entry,) = [e for e in cad.tape_of(y) if e.op == "layer_norm"]
    saved = {s.name: s for s in entry.saved}
    assert set(saved) == {"x", "stats", "weight"}
    assert saved["stats"].shape == (2, 4, 6, 1)  # mean and 1/std per row: small
    y.sum().backward()
    assert x.grad.dtype == np.float32 and norm.weight.grad.dtype == np.float32


def test_tril_triu_match_numpy_and_pass_gradients_inside():
    x = np.random.default_rng(SEED).standard_normal((2, 3, 4))
    for k in (-1, 0, 2):
        np.testing.assert_array_equal(cad.tril(cad.tensor(x), k).numpy(), np.tril(x, k))
        np.testing.assert_array_equal(cad.tensor(x).triu(k).numpy(), np.triu(x, k))
    assert cad.testing.gradcheck(lambda t: cad.tril(t, 1) * t, [leaf(x)])
    with pytest.raises(cad.ShapeError, match="at least 2 axes"):
        cad.tril(cad.ones(3))


def test_pytorch_layout_chains_work():
    x = cad.randn(2, 5, 6, generator=0)
    y = x.view(2, 5, 2, 3).transpose(1, 2).contiguous().view(2, 2, 15)
    np.testing.assert_array_equal(
        y.numpy(), x.numpy().reshape(2, 5, 2, 3).transpose(0, 2, 1, 3).reshape(2, 2, 15))
    mask = cad.ones(5, 5).tril() == 0
    p = x[:, :, :5].masked_fill(mask.numpy(), -math.inf).softmax(-1)
    np.testing.assert_allclose(p.numpy().sum(-1), 1.0, rtol=1e-6)
    assert float(p.numpy()[0, 0, 1]) == 0.0


# ================================================================= scaled_dot_product_attention
def _qkv(shape=(2, 3, 5, 4), rng=None):
    rng = rng or np.random.default_rng(SEED)
    return [rng.standard_normal(shape) for _ in range(3)]


def test_sdpa_matches_numpy_plain_causal_and_masked():
    q, k, v = _qkv()
    t = [cad.tensor(a) for a in (q, k, v)]
    np.testing.assert_allclose(F.scaled_dot_product_attention(*t).numpy(), np_attention(q, k, v),
                               rtol=1e-12)
    causal = np.tril(np.ones((5, 5), dtype=bool))
    np.testing.assert_allclose(F.scaled_dot_product_attention(*t, is_causal=True).numpy(),
                               np_attention(q, k, v, keep=causal), rtol=1e-12)
    keep = np.random.default_rng(1).random((2, 1, 5, 5)) > 0.3
    keep[..., 0] = True  # every row sees something
    np.testing.assert_allclose(F.scaled_dot_product_attention(*t, attn_mask=keep).numpy(),
                               np_attention(q, k, v, keep=keep), rtol=1e-12)
    added = np.random.default_rng(2).standard_normal((5, 5))
    np.testing.assert_allclose(
        F.scaled_dot_product_attention(*t, attn_mask=cad.tensor(added), scale=0.3).numpy(),
        np_attention(q, k, v, added=added, scale=0.3), rtol=1e-12)


def test_sdpa_gradcheck_causal_with_other_lengths():
    rng = np.random.default_rng(SEED)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal(
        (2, 5, 3))
    assert cad.testing.gradcheck(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        [leaf(q), leaf(k), leaf(v)])


def _composed_weights(x, scale, causal):
    """The attention weights as the ops compose them: scale, masked_fill, softmax."""
    scores = x * scale
    if causal:
        rows, cols = x.shape[-2:]
        scores = cad.masked_fill(scores, np.triu(np.ones((rows, cols), bool), 1), -math.inf)
    return cad.softmax(scores, -1)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_softmax_is_bitwise_the_composed_ops_in_float32(causal):
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((2, 3, 5, 6)).astype(np.float32) * 4
    g = rng.standard_normal(x.shape).astype(np.float32)
    ours, composed = (cad.tensor(x.copy(), requires_grad=True) for _ in range(2))
    y = attention_softmax(ours, 0.3, causal)
    want = _composed_weights(composed, 0.3, causal)
    assert y.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(y.numpy(), want.numpy())
    (got_grad,) = cad.grad(cad.sum(y * cad.tensor(g)), [ours])
    (want_grad,) = cad.grad(cad.sum(want * cad.tensor(g)), [composed])
    assert got_grad.dtype == np.float32
    np.testing.assert_allclose(got_grad.numpy(), want_grad.numpy(), rtol=0, atol=0)
    if causal:  # a left-out position has weight 0 and passes no gradient
        upper = np.triu(np.ones((5, 6), bool), 1)
        assert not y.numpy()[..., upper].any() and not got_grad.numpy()[..., upper].any()


@pytest.mark.parametrize(("scale", "causal"), [(0.7, True), (-1.3, False), (1.0, True)])
def test_attention_softmax_gradcheck_orders_1_and_2(scale, causal):
    x = np.random.default_rng(SEED).standard_normal((2, 4, 5))
    assert cad.testing.gradcheck(lambda t: attention_softmax(t, scale, causal), [leaf(x)],
                                 order=2)
    np.testing.assert_allclose(attention_softmax(cad.tensor(x), scale, causal).numpy(),
                               _composed_weights(cad.tensor(x), scale, causal).numpy(),
                               rtol=1e-15, atol=0)


def test_attention_softmax_saves_its_output_once_and_shares_the_causal_mask():
    q = cad.tensor(np.random.default_rng(SEED).standard_normal((2, 3, 5, 4)), dtype="float32",
                   requires_grad=True)
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    entries = [e for e in cad.tape_of(out) if e.op == "attention_softmax"]
    assert len(entries) == 1 and {s.name for s in entries[0].saved} == {"out"}
    assert not [e for e in cad.tape_of(out) if e.op in {"where", "multiply", "softmax"}]
    from checkpoint_ad.ops.normalizing import _left_out
    assert _left_out(np, 5, 5) is _left_out(np, 5, 5)  # made once per shape
    with pytest.raises(cad.ShapeError, match="at least 2 axes"):
        attention_softmax(cad.ones(3), causal=True)


def test_sdpa_rejects_bad_arguments():
    q = cad.ones(2, 3, 4)
    with pytest.raises(cad.ShapeError, match="do not fit"):
        F.scaled_dot_product_attention(q, cad.ones(2, 3, 5), q)
    with pytest.raises(cad.ShapeError, match="not both"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((3, 3), bool), is_causal=True)
    with pytest.raises(ValueError, match="dropout_p"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=2.0)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_selective_recomputes_the_core_losslessly(dropout_p):
    q, k, v = (leaf(a) for a in _qkv())

    def run(strategy):
        cad.manual_seed(3)
        if strategy is None:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            with cad.use(strategy):
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p,
                                                     is_causal=True)
        saved = cad.tape_of(out).saved_nbytes
        return saved, cad.grad((out * out).sum(), [q, k, v])

    kept_bytes, kept = run(None)
    selective_bytes, selective = run(Selective())
    assert selective_bytes < kept_bytes
    for a, b in zip(kept, selective):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_selective_leaves_other_regions_alone_and_checks_its_names():
    q, k, v = (leaf(a) for a in _qkv())
    with cad.use(Selective(regions=("mlp",))):
        out = F.scaled_dot_product_attention(q, k, v)
    assert cad.tape_of(out).saved_nbytes == cad.tape_of(
        F.scaled_dot_product_attention(q, k, v)).saved_nbytes
    assert Selective("attention") == Selective()
    with pytest.raises(cad.StrategyConfigError, match="regions must be"):
        Selective(regions=())


# ================================================================= MultiheadAttention
def np_mha(mha, q, k, v, additive=None):
    """PyTorch's documented computation, on (N, L, E) arrays."""
    W, b = mha.in_proj_weight.numpy(), mha.in_proj_bias.numpy()
    E, H = mha.embed_dim, mha.num_heads
    D = E // H

    def heads(x, i):
        y = x @ W[i * E:(i + 1) * E].T + b[i * E:(i + 1) * E]
        return y.reshape(x.shape[0], x.shape[1], H, D).transpose(0, 2, 1, 3)

    qh, kh, vh = heads(q, 0), heads(k, 1), heads(v, 2)
    scores = qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(D)
    if additive is not None:
        scores = scores + additive
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    o = (p @ vh).transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[1], E)
    return o @ mha.out_proj.weight.numpy().T + mha.out_proj.bias.numpy(), p.mean(axis=1)


def test_mha_parameters_and_state_dict_keys_are_pytorchs():
    mha = MultiheadAttention(8, 2, seed=0)
    assert list(mha.state_dict()) == ["in_proj_weight", "in_proj_bias", "out_proj.weight",
                                      "out_proj.bias"]
    assert mha.in_proj_weight.shape == (24, 8) and mha.out_proj.weight.shape == (8, 8)
    assert not mha.in_proj_bias.numpy().any() and not mha.out_proj.bias.numpy().any()
    assert list(MultiheadAttention(8, 2, bias=False, seed=0).state_dict()) == [
        "in_proj_weight", "out_proj.weight"]
    with pytest.raises(cad.nn.ModuleConfigError, match="divisible"):
        MultiheadAttention(8, 3)


@pytest.mark.parametrize("batch_first", [False, True])
def test_mha_matches_numpy_in_both_layouts_self_and_cross(batch_first):
    rng = np.random.default_rng(SEED)
    mha = MultiheadAttention(8, 2, batch_first=batch_first, dtype="float64", seed=1)
    with cad.no_grad():
        mha.in_proj_bias.copy_(cad.tensor(rng.standard_normal(24)))
    q, k = rng.standard_normal((3, 5, 8)), rng.standard_normal((3, 6, 8))
    want, want_w = np_mha(mha, q, k, k)
    layout = (lambda a: a) if batch_first else (lambda a: np.swapaxes(a, 0, 1))
    out, weights = mha(cad.tensor(layout(q)), cad.tensor(layout(k)), cad.tensor(layout(k)))
    np.testing.assert_allclose(out.numpy(), layout(want), rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(weights.numpy(), want_w, rtol=1e-11)
    x = cad.tensor(layout(q))
    out, none = mha(x, x, x, need_weights=False)
    assert none is None
    np.testing.assert_allclose(out.numpy(), layout(np_mha(mha, q, q, q)[0]), rtol=1e-11,
                               atol=1e-13)


def test_mha_masks_follow_pytorchs_meaning():
    rng = np.random.default_rng(SEED)
    mha = MultiheadAttention(8, 2, batch_first=True, dtype="float64", seed=2)
    x = rng.standard_normal((2, 4, 8))
    blocked = np.triu(np.ones((4, 4), dtype=bool), 1)  # True: may NOT attend
    padding = np.array([[False, False, False, True], [False, False, False, False]])
    additive = np.where(blocked, -np.inf, 0.0)[None, None] + np.where(
        padding, -np.inf, 0.0)[:, None, None, :]
    want, _ = np_mha(mha, x, x, x, additive)
    t = cad.tensor(x)
    for need_weights in (True, False):
        out, _ = mha(t, t, t, key_padding_mask=padding, attn_mask=blocked, is_causal=True,
                     need_weights=need_weights)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-11, atol=1e-13)
    per_head = mha(t, t, t, attn_mask=blocked, average_attn_weights=False)[1]
    assert per_head.shape == (2, 2, 4, 4)
    with pytest.raises(cad.ShapeError, match="pass attn_mask too"):
        mha(t, t, t, is_causal=True)


def test_mha_unbatched_and_gradcheck():
    rng = np.random.default_rng(SEED)
    mha = MultiheadAttention(4, 2, dtype="float64", seed=3)
    x = rng.standard_normal((3, 4))
    out, w = mha(cad.tensor(x), cad.tensor(x), cad.tensor(x))
    batched, _ = mha(cad.tensor(x[:, None]), cad.tensor(x[:, None]), cad.tensor(x[:, None]))
    np.testing.assert_allclose(out.numpy(), batched.numpy()[:, 0], rtol=1e-13)
    assert w.shape == (3, 3)
    assert cad.testing.gradcheck(lambda t: mha(t, t, t)[0], [leaf(x)])


# ================================================================= encoder layers
def np_encoder_layer(layer, x, norm_first):
    """PyTorch's documented TransformerEncoderLayer, batch first, relu, no dropout."""
    norm = lambda n, y: np_layer_norm(y, n.weight.numpy(), n.bias.numpy())
    sa = lambda y: np_mha(layer.self_attn, y, y, y)[0]
    ff = lambda y: np.maximum(y @ layer.linear1.weight.numpy().T + layer.linear1.bias.numpy(),
                              0) @ layer.linear2.weight.numpy().T + layer.linear2.bias.numpy()
    if norm_first:
        x = x + sa(norm(layer.norm1, x))
        return x + ff(norm(layer.norm2, x))
    x = norm(layer.norm1, x + sa(x))
    return norm(layer.norm2, x + ff(x))


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_matches_numpy(norm_first):
    layer = TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                    norm_first=norm_first, dtype="float64", seed=4)
    x = np.random.default_rng(SEED).standard_normal((2, 5, 8))
    np.testing.assert_allclose(layer(cad.tensor(x)).numpy(), np_encoder_layer(layer, x,
                                                                               norm_first),
                               rtol=1e-11, atol=1e-12)
    assert [k for k in layer.state_dict()][:4] == [
        "self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight",
        "self_attn.out_proj.bias"]
    assert {"linear1.weight", "linear2.bias", "norm1.weight", "norm2.bias"} <= set(
        layer.state_dict())


def test_encoder_copies_the_layer_and_gradients_survive_selective():
    layer = TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", dtype="float64",
                                    norm_first=True, seed=5)
    encoder = TransformerEncoder(layer, num_layers=2)
    names = list(encoder.state_dict())
    assert names[0] == "layers.0.self_attn.in_proj_weight" and len(names) == 2 * len(
        layer.state_dict())
    assert encoder.layers[0].linear1.weight is not encoder.layers[1].linear1.weight
    x = cad.tensor(np.random.default_rng(SEED).standard_normal((5, 2, 8)))
    mask = np.triu(np.ones((5, 5), dtype=bool), 1)

    def grads(strategy):
        encoder.zero_grad()
        if strategy is None:
            loss = (encoder(x, mask=mask, is_causal=True) ** 2).sum()
        else:
            with cad.use(strategy):
                loss = (encoder(x, mask=mask, is_causal=True) ** 2).sum()
        loss.backward()
        return [p.grad.numpy().copy() for p in encoder.parameters()]

    for a, b in zip(grads(None), grads(Selective())):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(cad.nn.ModuleConfigError, match="activation"):
        TransformerEncoderLayer(8, 2, activation="swish")


# ================================================================= PyTorch on the same weights
def test_same_numbers_as_pytorch_on_the_same_weights():
    torch = pytest.importorskip("torch")
    layer = TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True,
                                    activation="gelu", dtype="float64", seed=6)
    theirs = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                              norm_first=True, activation="gelu",
                                              dtype=torch.float64)
    theirs.load_state_dict({k: torch.from_numpy(v.numpy()) for k, v in
                            layer.state_dict().items()})
    x = np.random.default_rng(SEED).standard_normal((2, 5, 8))
    mask = np.triu(np.ones((5, 5), dtype=bool), 1)
    tx = torch.from_numpy(x).requires_grad_()
    want = theirs(tx, src_mask=torch.from_numpy(mask))
    ours_x = leaf(x)
    got = layer(ours_x, src_mask=mask)
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-10, atol=1e-12)
    (want**2).sum().backward()
    (got**2).sum().backward()
    np.testing.assert_allclose(ours_x.grad.numpy(), tx.grad.numpy(), rtol=1e-9, atol=1e-11)
    q, k, v = _qkv()
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), is_causal=True)
    got = F.scaled_dot_product_attention(*(cad.tensor(a) for a in (q, k, v)), is_causal=True)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)
