"""GELU's backward on arrays works in place in three arrays it makes, bitwise the expression.

Why it matters: at the peak of a GPT's backward the MLP's GELU rule held six or seven arrays
of the hidden activations' size beside the tape (issue 37's memory-truth row for the gpt model
measured 28.0 MiB against the profiler's 22.5). What must hold: the same values bit for bit as
the textbook expression, for both forms and every float dtype, and at most three new arrays
of the input's size alive at once.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.ops import elementwise

C = math.sqrt(2.0 / math.pi)
K = 0.044715


def _expression(g, x, approximate):
    if approximate == "tanh":
        t = np.tanh(C * (x + K * x * x * x))
        slope = C * (1.0 + 3.0 * K * x * x)
        return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * slope)
    erf = elementwise._erf_array(x * math.sqrt(0.5))
    return g * (0.5 * (1.0 + erf) + x * np.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi)))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_rule_on_arrays_is_bitwise_the_expression(approximate, dtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((33, 65)) * 3).astype(dtype)
    g = rng.standard_normal((33, 65)).astype(dtype)
    got = elementwise._gelu_rule(g, x, approximate=approximate)
    want = _expression(g, x, approximate)
    assert got.dtype == want.dtype
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_a_gelu_backward_makes_at_most_three_arrays_of_its_input(approximate):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((256, 1024)).astype(np.float32)
    g = rng.standard_normal((256, 1024)).astype(np.float32)
    elementwise._gelu_rule(g, x, approximate=approximate)  # warm
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = elementwise._gelu_rule(g, x, approximate=approximate)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert out.shape == x.shape
    assert peak <= 3 * x.nbytes + 64 * 1024  # the expression made 6 or 7


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_tensors_with_create_graph_keep_the_differentiable_expression(approximate):
    x = cad.tensor(np.linspace(-2, 2, 7), requires_grad=True)
    y = cad.nn.functional.gelu(x, approximate=approximate)
    (gx,) = cad.grad(y.sum(), [x], create_graph=True)
    (gxx,) = cad.grad(gx.sum(), [x])
    assert np.array_equal(gx.numpy(), elementwise._gelu_rule(
        np.ones(7), x.numpy(), approximate=approximate))
    assert np.all(np.isfinite(gxx.numpy()))


def test_erf_without_scipy_is_libms_per_element_and_holds_no_object_array():
    """Without scipy, erf goes through libm's per element: the same values as `math.erf`,
    made a chunk at a time (a whole array of Python floats was 8x a float32 array's bytes
    beside it, memory no profile sees: the fresh-venv failures of the memory-truth rows)."""
    from checkpoint_ad import backend

    x = np.random.default_rng(5).standard_normal((256, 1024)).astype(np.float32)
    want = np.array([math.erf(v) for v in x.ravel()[:4096]], dtype=np.float32)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        got = backend._erf_by_element(x)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert got.dtype == x.dtype and got.shape == x.shape
    assert np.array_equal(got.ravel()[:4096], want)
    assert peak <= x.nbytes + 64 * 1024
