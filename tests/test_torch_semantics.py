"""Autograd behaviours ported from PyTorch (`test/test_autograd.py`), HIPS autograd and JAX.

Each test names the library whose behaviour it matches. Expected values come from formulas
derived by hand or from central finite differences in float64, never from this engine.
"""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad


def leaf(values, dtype="float64"):
    return cad.tensor(np.asarray(values, dtype=dtype), requires_grad=True)


# ----------------------------------------------------------------- 1. power at zero
@pytest.mark.parametrize("c", [0, 1, 2, 3])
def test_power_at_zero_is_finite_and_right(c):
    """PyTorch `test_pow_zero_tensor_gradient` / HIPS autograd `test_pow`: d/dx x**c at
    x = 0 is c * 0**(c-1) for c >= 1 and 0 for c = 0 (never nan)."""
    x = leaf([0.0, 0.0])
    (x**c).sum().backward()
    expected = 0.0 if c != 1 else 1.0  # c * 0**(c - 1), with 0**0 = 1
    np.testing.assert_array_equal(x.grad.numpy(), [expected, expected])


@pytest.mark.parametrize("c", [0, 1, 2, 3])
def test_power_gradcheck_through_zero_up_to_third_order(c):
    """HIPS autograd `check_grads(order=3)` on `x ** c` with points at 0 and either side."""
    x = leaf([0.0, 0.7, -1.3])
    assert cad.testing.gradcheck(lambda t: t**c, [x], order=3)


def test_power_exponent_gradient_at_zero_base():
    """PyTorch: d/dc 0**c is 0 for c > 0 (0**c is constant 0 there), and the base rule stays
    exact elsewhere: c * a**(c-1) and a**c * log a."""
    a, c = leaf([0.0, 2.0]), leaf([2.0, 1.5])
    (a**c).sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), [0.0, 1.5 * 2.0**0.5], rtol=1e-12)
    np.testing.assert_allclose(c.grad.numpy(), [0.0, 2.0**1.5 * np.log(2.0)], rtol=1e-12)
