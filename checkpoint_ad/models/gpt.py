"""A small GPT: decoder-only, pre-norm, causal self-attention, written as a scan over layers.

The per-layer parameters live in stacked arrays (layers, ...), and layer l is one step of a
`scan` whose xs are those stacks, so the checkpointing schemes for time (Binomial, Budget,
Quantized snapshots) apply over depth. The three recomputation granularities of Korthikanti et
al. 2022 are presets: ``keep-all`` (nothing recomputed), ``selective`` (the attention core,
from q, k, v to the heads' output, re-run in backward: `strategies.Selective`) and ``full``
(each layer checkpointed: the layer loop under `Recompute`).

One layer, with h the hidden width and a the heads, on (b, s, h) activations:
    a = LN1(x);  q, k, v = a @ W_qkv + b_qkv;  o = softmax(q k^T / sqrt(h/a) + causal) v
    x = x + o @ W_o + b_o;  x = x + gelu_tanh(LN2(x) @ W_fc + b_fc) @ W_proj + b_proj
and the loss is the mean next-token cross-entropy of LN_f(x_L) @ wte^T (tied embeddings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import ops
from ..errors import ModelConfigError
from ..nn import functional as F
from ..tensor import Tensor
from .base import UnrolledModel, check_config


@dataclass(frozen=True)
class GPTConfig:
    """Sizes: `seq` tokens per sequence, `hidden` width (divisible by `heads`), `layers`
    steps of the scan, `vocab` tokens."""

    layers: int = 2
    seq: int = 8
    batch: int = 2
    hidden: int = 16
    heads: int = 2
    vocab: int = 32
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_config(self, ("layers", "seq", "batch", "hidden", "heads", "vocab"), ("seed",))
        if self.hidden % self.heads:
            raise ModelConfigError(
                f"GPTConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})"
            )


LayerParams = tuple[Tensor, ...]


class GPT(UnrolledModel):
    """carry: the residual stream (batch, seq, hidden); x: layer l's parameters; y: the sum of
    the layer's output (a probe the loss leaves out; a sum saves nothing for backward).

    >>> from checkpoint_ad.models.gpt import GPTConfig, make_gpt
    >>> model = make_gpt(GPTConfig(dtype="float64"))
    >>> loss, grads = model.numpy_reference_loss_and_grads()
    >>> abs(model.run().item() - loss) < 1e-12
    True
    """

    def __init__(self, config: GPTConfig) -> None:
        self.config = config
        self.n_steps = config.layers
        rng = np.random.default_rng(config.seed)
        L, h, V = config.layers, config.hidden, config.vocab
        std = 0.02 * math.sqrt(64 / h)  # GPT-2's 0.02 at width 64 and up, wider when narrower
        normal = lambda *shape: std * rng.standard_normal(shape)
        self.wte = self._parameter(normal(V, h) * 10)
        self.wpe = self._parameter(normal(config.seq, h) * 10)
        self.ln1_w = self._parameter(1.0 + 0.1 * rng.standard_normal((L, h)))
        self.ln1_b = self._parameter(0.1 * rng.standard_normal((L, h)))
        self.w_qkv = self._parameter(normal(L, h, 3 * h) * 10)
        self.b_qkv = self._parameter(normal(L, 3 * h))
        self.w_o = self._parameter(normal(L, h, h) / math.sqrt(2 * L))
        self.b_o = self._parameter(normal(L, h))
        self.ln2_w = self._parameter(1.0 + 0.1 * rng.standard_normal((L, h)))
        self.ln2_b = self._parameter(0.1 * rng.standard_normal((L, h)))
        self.w_fc = self._parameter(normal(L, h, 4 * h))
        self.b_fc = self._parameter(normal(L, 4 * h))
        self.w_proj = self._parameter(normal(L, 4 * h, h) / math.sqrt(2 * L))
        self.b_proj = self._parameter(normal(L, h))
        self.lnf_w = self._parameter(np.ones(h))
        self.lnf_b = self._parameter(np.zeros(h))
        text = rng.integers(0, V, (config.batch, config.seq + 1))
        self.tokens, self.targets = text[:, :-1], text[:, 1:]

    def init_carry(self) -> Tensor:
        return F.embedding(self.tokens, self.wte) + self.wpe

    def inputs(self) -> LayerParams:
        return (self.ln1_w, self.ln1_b, self.w_qkv, self.b_qkv, self.w_o, self.b_o,
                self.ln2_w, self.ln2_b, self.w_fc, self.b_fc, self.w_proj, self.b_proj)

    def step(self, x: Tensor, p: LayerParams) -> tuple[Tensor, Tensor]:
        ln1_w, ln1_b, w_qkv, b_qkv, w_o, b_o, ln2_w, ln2_b, w_fc, b_fc, w_proj, b_proj = p
        b, s, h = x.shape
        heads = self.config.heads
        qkv = ops.layer_norm(x, -1, ln1_w, ln1_b) @ w_qkv + b_qkv
        q, k, v = (ops.swapaxes(ops.reshape(t, (b, s, heads, h // heads)), 1, 2)
                   for t in ops.split(qkv, 3, axis=-1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # Selective's region
        x = x + ops.reshape(ops.swapaxes(o, 1, 2), (b, s, h)) @ w_o + b_o
        m = ops.gelu(ops.layer_norm(x, -1, ln2_w, ln2_b) @ w_fc + b_fc, "tanh")
        x = x + (m @ w_proj + b_proj)
        return x, ops.sum(x)

    def loss(self, final_carry: Tensor, ys: Any) -> Tensor:
        logits = ops.layer_norm(final_carry, -1, self.lnf_w, self.lnf_b) @ self.wte.mT
        return F.cross_entropy(ops.reshape(logits, (-1, self.config.vocab)),
                               self.targets.reshape(-1))

    def numpy_reference_loss_and_grads(self) -> tuple[float, list[np.ndarray]]:
        """Forward and backward by hand in float64: grads in `params` order."""
        (wte, wpe, g1, c1, Wqkv, bqkv, Wo, bo, g2, c2, Wfc, bfc, Wpr, bpr, gf,
         cf) = (a.astype(np.float64) for a in self._host())
        B, S, C = self.config.batch, self.config.seq, self.config.hidden
        H = self.config.heads
        x = wte[self.tokens] + wpe
        saved = []
        for i in range(self.n_steps):
            a, ln1 = _ln(x, g1[i], c1[i])
            q, k, v = (t.reshape(B, S, H, C // H).transpose(0, 2, 1, 3)
                       for t in np.split(a @ Wqkv[i] + bqkv[i], 3, axis=-1))
            P = _causal_softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(C // H))
            o = (P @ v).transpose(0, 2, 1, 3).reshape(B, S, C)
            x1 = x + o @ Wo[i] + bo[i]
            a2, ln2 = _ln(x1, g2[i], c2[i])
            f = a2 @ Wfc[i] + bfc[i]
            u = _gelu_tanh(f)
            saved.append((a, ln1, q, k, v, P, o, a2, ln2, f, u))
            x = x1 + u @ Wpr[i] + bpr[i]
        z, lnf = _ln(x, gf, cf)
        logits = (z @ wte.T).reshape(B * S, -1)
        logp = logits - logits.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        labels = self.targets.reshape(-1)
        loss = float(-logp[np.arange(B * S), labels].mean())
        dlogits = np.exp(logp)
        dlogits[np.arange(B * S), labels] -= 1.0
        dlogits = (dlogits / (B * S)).reshape(B, S, -1)
        grads = {name: np.zeros_like(value) for name, value in (
            ("g1", g1), ("c1", c1), ("Wqkv", Wqkv), ("bqkv", bqkv), ("Wo", Wo), ("bo", bo),
            ("g2", g2), ("c2", c2), ("Wfc", Wfc), ("bfc", bfc), ("Wpr", Wpr), ("bpr", bpr))}
        dwte = _flat(dlogits).T @ _flat(z)
        dx, dgf, dcf = _ln_backward(dlogits @ wte, lnf, gf)
        for i in range(self.n_steps - 1, -1, -1):
            a, ln1, q, k, v, P, o, a2, ln2, f, u = saved[i]
            grads["Wpr"][i], grads["bpr"][i] = _flat(u).T @ _flat(dx), _flat(dx).sum(axis=0)
            df = (dx @ Wpr[i].T) * _gelu_tanh_slope(f)
            grads["Wfc"][i], grads["bfc"][i] = _flat(a2).T @ _flat(df), _flat(df).sum(axis=0)
            dx1, grads["g2"][i], grads["c2"][i] = _ln_backward(df @ Wfc[i].T, ln2, g2[i])
            dx1 = dx1 + dx
            grads["Wo"][i], grads["bo"][i] = _flat(o).T @ _flat(dx1), _flat(dx1).sum(axis=0)
            do = (dx1 @ Wo[i].T).reshape(B, S, H, C // H).transpose(0, 2, 1, 3)
            dP = do @ v.transpose(0, 1, 3, 2)
            dscores = P * (dP - (dP * P).sum(axis=-1, keepdims=True)) / math.sqrt(C // H)
            dq, dk = dscores @ k, dscores.transpose(0, 1, 3, 2) @ q
            dv = P.transpose(0, 1, 3, 2) @ do
            dqkv = np.concatenate([t.transpose(0, 2, 1, 3).reshape(B, S, C) for t in (dq, dk, dv)],
                                  axis=-1)
            grads["Wqkv"][i], grads["bqkv"][i] = _flat(a).T @ _flat(dqkv), _flat(dqkv).sum(axis=0)
            dx0, grads["g1"][i], grads["c1"][i] = _ln_backward(dqkv @ Wqkv[i].T, ln1, g1[i])
            dx = dx0 + dx1
        np.add.at(dwte, self.tokens, dx)
        dwpe = dx.sum(axis=0)
        return loss, [dwte, dwpe, *grads.values(), dgf, dcf]


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, a.shape[-1])


def _ln(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-5) -> tuple[Any, Any]:
    centred = x - x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + eps)
    xhat = centred * rstd
    return xhat * w + b, (xhat, rstd)


def _ln_backward(g: np.ndarray, saved: tuple[Any, Any], w: np.ndarray) -> tuple[Any, Any, Any]:
    xhat, rstd = saved
    gx = g * w
    dx = rstd * (gx - gx.mean(axis=-1, keepdims=True)
                 - xhat * (gx * xhat).mean(axis=-1, keepdims=True))
    return dx, _flat(g * xhat).sum(axis=0), _flat(g).sum(axis=0)


def _causal_softmax(scores: np.ndarray) -> np.ndarray:
    s = scores.shape[-1]
    scores = np.where(np.tril(np.ones((s, s), dtype=bool)), scores, -np.inf)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


_C = math.sqrt(2.0 / math.pi)


def _gelu_tanh(f: np.ndarray) -> np.ndarray:
    return 0.5 * f * (1.0 + np.tanh(_C * (f + 0.044715 * f**3)))


def _gelu_tanh_slope(f: np.ndarray) -> np.ndarray:
    t = np.tanh(_C * (f + 0.044715 * f**3))
    return 0.5 * (1.0 + t) + 0.5 * f * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * f * f)


def make_gpt(config: GPTConfig | None = None) -> GPT:
    """A GPT with weights and token data drawn from `config.seed`."""
    return GPT(config if config is not None else GPTConfig())
