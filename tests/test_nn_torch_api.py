"""nn: PyTorch's names, layouts, state-dict keys and formulas.

numpy-reference tests always run (the formulas written out again with numpy); parity tests
load the same weights into PyTorch and compare outputs and gradients (skipped without torch).
"""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad import nn
from checkpoint_ad.nn import functional as F

RNG = np.random.default_rng(3)


def sig(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


# ----------------------------------------------------------------- numpy references
def np_rnn(kind: str, x: np.ndarray, weights: dict, layers: int, h0=None) -> tuple:
    """Every formula of PyTorch's RNN/GRU/LSTM docs, time-major x (T, B, in)."""
    out = x
    finals = []
    for k in range(layers):
        w_ih, w_hh = weights[f"weight_ih_l{k}"], weights[f"weight_hh_l{k}"]
        b_ih, b_hh = weights[f"bias_ih_l{k}"], weights[f"bias_hh_l{k}"]
        hidden = w_hh.shape[1]
        h = np.zeros((x.shape[1], hidden)) if h0 is None else h0[k]
        c = np.zeros_like(h)
        ys = []
        for x_t in out:
            gi, gh = x_t @ w_ih.T + b_ih, h @ w_hh.T + b_hh
            if kind == "RNN":
                h = np.tanh(gi + gh)
            elif kind == "GRU":
                r = sig(gi[:, :hidden] + gh[:, :hidden])
                z = sig(gi[:, hidden:2 * hidden] + gh[:, hidden:2 * hidden])
                n = np.tanh(gi[:, 2 * hidden:] + r * gh[:, 2 * hidden:])
                h = (1 - z) * n + z * h
            else:
                g = gi + gh
                i, f = sig(g[:, :hidden]), sig(g[:, hidden:2 * hidden])
                gg, o = np.tanh(g[:, 2 * hidden:3 * hidden]), sig(g[:, 3 * hidden:])
                c = f * c + i * gg
                h = o * np.tanh(c)
            ys.append(h)
        out = np.stack(ys)
        finals.append((h, c))
    return out, finals


def arrays(module: nn.Module) -> dict:
    return {k: v.numpy() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("layers", [1, 2])
def test_recurrent_matches_numpy_formulas(kind: str, layers: int) -> None:
    module = getattr(nn, kind)(3, 4, num_layers=layers, seed=1, dtype="float64")
    names = [f"{w}_l{k}" for k in range(layers) for w in
             ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    assert list(module.state_dict()) == names
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[kind]
    assert module.weight_ih_l0.shape == (gates * 4, 3)
    assert module.weight_hh_l0.shape == (gates * 4, 4)
    x = RNG.standard_normal((6, 2, 3))
    out, state = module(cad.tensor(x))
    want, finals = np_rnn(kind, x, arrays(module), layers)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-12, atol=1e-12)
    h_n = state[0] if kind == "LSTM" else state
    np.testing.assert_allclose(h_n.numpy(), np.stack([h for h, _ in finals]), atol=1e-12)
    if kind == "LSTM":
        np.testing.assert_allclose(state[1].numpy(), np.stack([c for _, c in finals]),
                                   atol=1e-12)


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_cells_match_the_multilayer_step(kind: str) -> None:
    cell = getattr(nn, f"{kind}Cell")(3, 4, seed=2, dtype="float64")
    x = RNG.standard_normal((2, 3))
    weights = {f"{k}_l0": v for k, v in arrays(cell).items()}
    _, finals = np_rnn(kind, x[None], weights, 1)
    got = cell(cad.tensor(x))
    h = got[0] if kind == "LSTM" else got
    np.testing.assert_allclose(h.numpy(), finals[0][0], atol=1e-12)


@pytest.mark.parametrize("strategy", [None, "binomial", "periodic", "recompute", "quantized"])
def test_gru_gradients_under_every_strategy(strategy: str | None) -> None:
    """The time loop runs through scan: every strategy applies, lossless ones change nothing."""
    strategies = {
        None: None, "binomial": cad.strategies.Binomial(2), "periodic":
        cad.strategies.Periodic(3), "recompute": cad.strategies.Recompute(),
        "quantized": cad.strategies.Quantized(bits=8),
    }
    x = cad.tensor(RNG.standard_normal((7, 2, 3)))

    def grads(chosen):
        gru = nn.GRU(3, 4, num_layers=2, seed=5, dtype="float64", strategy=chosen)
        out, h = gru(x)
        loss = cad.sum(out * out) + cad.sum(h)
        return [g.numpy() for g in cad.grad(loss, gru.parameters())]

    reference, got = grads(None), grads(strategies[strategy])
    tol = 5e-2 if strategy == "quantized" else 1e-12
    for g, r in zip(got, reference):
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol)


def test_recurrent_batch_first_unbatched_and_initial_state() -> None:
    lstm = nn.LSTM(3, 4, num_layers=2, batch_first=True, seed=0, dtype="float64")
    x = RNG.standard_normal((2, 5, 3))
    out, (h, c) = lstm(cad.tensor(x))
    time_major, finals = np_rnn("LSTM", x.swapaxes(0, 1), arrays(lstm), 2)
    np.testing.assert_allclose(out.numpy(), time_major.swapaxes(0, 1), atol=1e-12)
    np.testing.assert_allclose(h.numpy(), np.stack([f[0] for f in finals]), atol=1e-12)
    np.testing.assert_allclose(c.numpy(), np.stack([f[1] for f in finals]), atol=1e-12)
    single, (h1, _) = lstm.__class__(3, 4, num_layers=2, seed=0, dtype="float64")(
        cad.tensor(x[0]))
    assert single.shape == (5, 4) and h1.shape == (2, 4)
    gru = nn.GRU(3, 4, seed=0, dtype="float64")
    h0 = RNG.standard_normal((1, 2, 4))
    out, _ = gru(cad.tensor(x.swapaxes(0, 1)), cad.tensor(h0))
    want, _ = np_rnn("GRU", x.swapaxes(0, 1), arrays(gru), 1, h0=h0)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-12)
    with pytest.raises(cad.ShapeError, match="initial state must have shape"):
        gru(cad.tensor(x.swapaxes(0, 1)), cad.zeros(2, 2, 4))
    with pytest.raises(cad.ShapeError, match="input must be"):
        gru(cad.zeros(5, 2, 7))


def test_linear_embedding_layernorm_match_numpy() -> None:
    layer = nn.Linear(4, 3, seed=0, dtype="float64")
    x = RNG.standard_normal((2, 4))
    np.testing.assert_allclose(layer(cad.tensor(x)).numpy(),
                               x @ layer.weight.numpy().T + layer.bias.numpy())
    emb = nn.Embedding(5, 2, padding_idx=0, seed=0, dtype="float64")
    idx = np.array([[0, 3], [4, 0]])
    out = emb(idx)
    np.testing.assert_array_equal(out.numpy(), emb.weight.numpy()[idx])
    assert emb.weight.numpy()[0].tolist() == [0.0, 0.0]
    (g,) = cad.grad(cad.sum(out * 2.0), [emb.weight])
    assert g.numpy()[0].tolist() == [0.0, 0.0] and g.numpy()[3].tolist() == [2.0, 2.0]
    norm = nn.LayerNorm((2, 3), dtype="float64")
    y = RNG.standard_normal((4, 2, 3))
    mu = y.mean(axis=(1, 2), keepdims=True)
    ref = (y - mu) / np.sqrt(y.var(axis=(1, 2), keepdims=True) + 1e-5)
    np.testing.assert_allclose(norm(cad.tensor(y)).numpy(), ref, rtol=1e-12)
    assert cad.testing.gradcheck(lambda t: F.layer_norm(t, 3), [cad.tensor(
        y, requires_grad=True)])


def test_dropout_generators_train_eval_and_checkpoint_replay() -> None:
    x = cad.ones(200, dtype="float64")
    layer = nn.Dropout(0.3, generator=np.random.default_rng(0))
    a, b = layer(x), layer(x)
    assert not np.array_equal(a.numpy(), b.numpy())  # an owned generator advances
    assert set(np.round(a.numpy(), 6)) <= {0.0, round(1 / 0.7, 6)}
    assert F.dropout(x, 0.3, generator=4).tolist() == F.dropout(x, 0.3, generator=4).tolist()
    assert layer.eval()(x) is x and not layer.training
    assert layer.train().training
    # numpy's global state (the default) is replayed by cad.checkpoint's re-run
    w = cad.tensor(RNG.standard_normal(200), requires_grad=True)
    drop = nn.Dropout(0.5)
    cad.manual_seed(0)
    (g_plain,) = cad.grad(cad.sum(drop(x * w) * w), [w])
    cad.manual_seed(0)
    y = cad.checkpoint(lambda v: drop(v * w), x)
    (g_ckpt,) = cad.grad(cad.sum(y * w), [w])
    np.testing.assert_array_equal(g_plain.numpy(), g_ckpt.numpy())
    with pytest.raises(nn.ModuleConfigError, match=r"p must lie in \[0, 1\]"):
        nn.Dropout(1.5)


def test_losses_match_numpy() -> None:
    logits = RNG.standard_normal((5, 4))
    labels = np.array([0, 3, -100, 1, 2])
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    kept = labels != -100
    want = -lp[np.arange(5)[kept], labels[kept]]
    got = nn.cross_entropy(cad.tensor(logits), labels, ignore_index=-100, reduction="none")
    np.testing.assert_allclose(got.numpy()[kept], want)
    assert got.numpy()[~kept].tolist() == [0.0]
    np.testing.assert_allclose(nn.cross_entropy(cad.tensor(logits), labels).item(), want.mean())
    np.testing.assert_allclose(nn.nll_loss(cad.tensor(lp), labels, reduction="sum").item(),
                               want.sum())
    seq = RNG.standard_normal((2, 4, 3))  # (N, C, L): classes on axis 1
    seq_labels = RNG.integers(0, 4, (2, 3))
    seq_lp = seq - np.log(np.exp(seq).sum(1, keepdims=True))
    want_seq = -np.take_along_axis(seq_lp, seq_labels[:, None], 1)[:, 0].mean()
    np.testing.assert_allclose(nn.cross_entropy(cad.tensor(seq), seq_labels).item(), want_seq)
    x, y = RNG.standard_normal(6), RNG.uniform(0, 1, 6)
    ref = -(y * np.log(sig(x)) + (1 - y) * np.log(1 - sig(x)))
    np.testing.assert_allclose(
        nn.binary_cross_entropy_with_logits(cad.tensor(x), cad.tensor(y)).item(), ref.mean())
    pw = 2.5
    ref_pw = -(pw * y * np.log(sig(x)) + (1 - y) * np.log(1 - sig(x)))
    np.testing.assert_allclose(nn.binary_cross_entropy_with_logits(
        cad.tensor(x), cad.tensor(y), reduction="sum", pos_weight=pw).item(), ref_pw.sum())
    t = cad.tensor(x, requires_grad=True)
    assert cad.testing.gradcheck(
        lambda v: nn.binary_cross_entropy_with_logits(v, cad.tensor(y), pos_weight=pw), [t])
    assert cad.testing.gradcheck(lambda v: nn.cross_entropy(v, labels), [cad.tensor(
        logits, requires_grad=True)])
    with pytest.raises(ValueError, match="reduction must be one of"):
        nn.mse_loss(cad.tensor(x), cad.tensor(y), reduction="avg")


def test_functional_activations_match_numpy() -> None:
    from math import erf

    x = RNG.standard_normal(50)
    exact = 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))
    np.testing.assert_allclose(F.gelu(cad.tensor(x)).numpy(), exact, atol=1e-6)
    approx = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(F.gelu(cad.tensor(x), "tanh").numpy(), approx, rtol=1e-12)
    np.testing.assert_allclose(F.silu(cad.tensor(x)).numpy(), x * sig(x), rtol=1e-12)
    assert cad.testing.gradcheck(F.gelu, [cad.tensor(x, requires_grad=True)])
    with pytest.raises(ValueError, match="approximate must be"):
        F.gelu(cad.tensor(x), "fast")


def test_module_state_dict_train_eval_to_and_npz(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(3, 4, seed=0), nn.Tanh(), nn.Dropout(0.1),
                          nn.Linear(4, 2, seed=1))
    assert list(model.state_dict()) == ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert all(m.training for m in model.modules())
    model.eval()
    assert not any(m.training for m in model.modules())
    other = nn.Sequential(nn.Linear(3, 4, seed=7), nn.Tanh(), nn.Dropout(0.1),
                          nn.Linear(4, 2, seed=8))
    other.load_state_dict({k: v.numpy() for k, v in model.state_dict().items()})
    x = cad.ones(1, 3)
    np.testing.assert_array_equal(other.eval()(x).numpy(), model(x).numpy())
    path = tmp_path / "model.npz"
    nn.utils.save_npz(model, path)
    third = nn.Sequential(nn.Linear(3, 4, seed=9), nn.Tanh(), nn.Dropout(0.1),
                          nn.Linear(4, 2, seed=9)).load_state_dict(nn.utils.load_npz(path))
    np.testing.assert_array_equal(third.eval()(x).numpy(), model(x).numpy())
    with pytest.raises(nn.StateDictError, match=r"missing \['3.bias'\]"):
        other.load_state_dict({k: v for k, v in model.state_dict().items() if k != "3.bias"})
    with pytest.raises(nn.StateDictError, match="has shape"):
        other.load_state_dict({**model.state_dict(), "0.bias": np.zeros(5)})
    other.load_state_dict({"0.bias": np.zeros(4)}, strict=False)
    assert other[0].bias.tolist() == [0.0] * 4
    model.double()
    assert all(p.dtype == np.float64 for p in model.parameters())
    assert "Linear(3, 4, bias=True)" in repr(model)
    layers = nn.ModuleList([nn.Linear(2, 2, seed=i) for i in range(2)])
    assert [n for n, _ in layers.named_parameters()] == ["0.weight", "0.bias", "1.weight",
                                                         "1.bias"]
    with pytest.raises(nn.ModuleConfigError, match="not a Module"):
        nn.Sequential(nn.Linear(2, 2), "relu")


def test_clip_grad_norm() -> None:
    a = cad.tensor([3.0, 0.0], requires_grad=True, dtype="float64")
    b = cad.tensor([4.0], requires_grad=True, dtype="float64")
    a.grad, b.grad = cad.tensor([3.0, 0.0], dtype="float64"), cad.tensor([4.0], dtype="float64")
    total = nn.utils.clip_grad_norm_([a, b], 2.5)
    assert total.item() == pytest.approx(5.0)
    scale = 2.5 / (5.0 + 1e-6)
    np.testing.assert_allclose(a.grad.numpy(), [3.0 * scale, 0.0])
    assert nn.utils.clip_grad_norm_([a, b], 100.0).item() == pytest.approx(2.5, rel=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), [4.0 * scale])  # under the limit: unchanged


# ----------------------------------------------------------------- PyTorch parity
@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_recurrent_parity_with_pytorch(kind: str) -> None:
    torch = pytest.importorskip("torch")
    ours = getattr(nn, kind)(3, 5, num_layers=2, batch_first=True, seed=0, dtype="float64",
                             strategy=cad.strategies.Binomial(2))
    theirs = getattr(torch.nn, kind)(3, 5, num_layers=2, batch_first=True).double()
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in arrays(ours).items()})
    x = RNG.standard_normal((2, 7, 3))
    out, _ = ours(cad.tensor(x))
    ref, _ = theirs(torch.from_numpy(x))
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=1e-10, atol=1e-12)
    grads = cad.grad(cad.sum(out * out), ours.parameters())
    (ref * ref).sum().backward()
    for (name, p), g in zip(theirs.named_parameters(), grads):
        np.testing.assert_allclose(g.numpy(), p.grad.numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=name)


def test_layers_and_losses_parity_with_pytorch() -> None:
    torch = pytest.importorskip("torch")
    tF = torch.nn.functional
    lin = nn.Linear(4, 3, seed=0, dtype="float64")
    tlin = torch.nn.Linear(4, 3).double()
    tlin.load_state_dict({k: torch.from_numpy(v) for k, v in arrays(lin).items()})
    x = RNG.standard_normal((5, 4))
    np.testing.assert_allclose(lin(cad.tensor(x)).numpy(),
                               tlin(torch.from_numpy(x)).detach().numpy(), rtol=1e-12)
    logits, labels = RNG.standard_normal((6, 4)), np.array([0, 3, 1, -100, 2, 2])
    for reduction in ("mean", "sum", "none"):
        np.testing.assert_allclose(
            nn.cross_entropy(cad.tensor(logits), labels, reduction=reduction).numpy(),
            tF.cross_entropy(torch.from_numpy(logits), torch.from_numpy(labels),
                             reduction=reduction).numpy(), rtol=1e-12)
    y = RNG.uniform(0, 1, 6)
    np.testing.assert_allclose(
        nn.binary_cross_entropy_with_logits(cad.tensor(logits[:, 0]), cad.tensor(y),
                                            pos_weight=1.7).item(),
        tF.binary_cross_entropy_with_logits(torch.from_numpy(logits[:, 0]), torch.from_numpy(y),
                                            pos_weight=torch.tensor(1.7,
                                                                    dtype=torch.float64)).item(),
        rtol=1e-12)
    np.testing.assert_allclose(F.gelu(cad.tensor(x)).numpy(),
                               tF.gelu(torch.from_numpy(x)).numpy(), atol=1e-6)
    np.testing.assert_allclose(F.layer_norm(cad.tensor(x), 4).numpy(),
                               tF.layer_norm(torch.from_numpy(x), (4,)).numpy(), rtol=1e-10)


@pytest.mark.parametrize(("beta", "threshold"), [(1.0, 20.0), (2.0, 5.0), (0.5, 1.0)])
def test_softplus_module_matches_torch_formula_and_threshold(beta: float, threshold: float) -> None:
    """PyTorch's nn.Softplus(beta, threshold): log(1 + exp(beta x)) / beta, and x itself
    where beta x > threshold; its gradient sigmoid(beta x) below the threshold, 1 above."""
    x = np.array([-30.0, -2.0, 0.0, 0.7, 2.4, 3.0, 12.0, 40.0])
    module = nn.Softplus(beta=beta, threshold=threshold)
    t = cad.tensor(x, requires_grad=True)
    out = module(t)
    above = beta * x > threshold
    want = np.where(above, x, np.log1p(np.exp(beta * x)) / beta)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12)
    out.sum().backward()
    np.testing.assert_allclose(t.grad.numpy(), np.where(above, 1.0, sig(beta * x)), rtol=1e-12)
    assert "beta=" in repr(module)
