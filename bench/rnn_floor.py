"""The floor of the RNN benchmark: hand-written numpy, forward and hand-derived backward, no tape.

    h_t = tanh(h_{t-1} @ W + x_t @ U + b),   loss = sum over t = 1..T of sum(h_t)

It stores exactly the activations the backward needs, the hidden states h_0..h_T in one
(T+1, batch, hidden) array, computes the same ops per step as the other columns, and reuses
buffers where numpy allows (``out=``, in-place updates), so no engine can do the same work with
less: it is the bound that the engine's overhead is measured against.

Backward, with g_t = dloss/dh_t:  g_T = 1,  a_t = g_t * (1 - h_t^2),  g_{t-1} = 1 + a_t @ W^T,
dW = sum_t h_{t-1}^T a_t,  dU = sum_t x_t^T a_t,  db = sum_t sum_batch a_t.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np


def array_module(array: Any) -> ModuleType:
    """numpy, or cupy for a cupy array (whose functions take the same ``out=`` buffers)."""
    if type(array).__module__.startswith("cupy"):
        return sys.modules["cupy"]
    return np


def loss_and_grads(W: Any, U: Any, b: Any, xs: Any, h0: Any) -> tuple[float, list[Any]]:
    """The loss and [dW, dU, db] for the inputs `xs` (T, batch, input) from state `h0`."""
    xp = array_module(W)
    steps = xs.shape[0]
    hs = xp.empty((steps + 1, *h0.shape), dtype=h0.dtype)
    hs[0] = h0
    pre = xp.empty_like(h0)
    for t in range(steps):
        xp.matmul(hs[t], W, out=pre)
        pre += xs[t] @ U
        pre += b
        xp.tanh(pre, out=hs[t + 1])
    loss = float(hs[1:].sum(dtype=np.float64))

    gW, gU, gb = xp.zeros_like(W), xp.zeros_like(U), xp.zeros_like(b)
    g = xp.ones_like(h0)  # dloss/dh_T
    a = pre  # reuse the buffer: a_t = g_t * (1 - h_t^2)
    for t in range(steps, 0, -1):
        xp.multiply(hs[t], hs[t], out=a)
        xp.subtract(1.0, a, out=a)
        a *= g
        gW += hs[t - 1].T @ a
        gU += xs[t - 1].T @ a
        gb += a.sum(axis=0)
        xp.matmul(a, W.T, out=g)
        g += 1.0
    return loss, [gW, gU, gb]


def stored_bytes(steps: int, batch: int, hidden: int, itemsize: int) -> int:
    """Bytes of the activations the floor keeps for its backward: h_0..h_T."""
    return (steps + 1) * batch * hidden * itemsize
