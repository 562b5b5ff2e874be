"""NumPy interop: `np.asarray(t)` is the tensor's own array; tensors that require grad are
refused with our error (as PyTorch refuses); DLPack export goes through the underlying array."""

from __future__ import annotations

import numpy as np
import pytest

import checkpoint_ad as cad
from checkpoint_ad.errors import CheckpointADError, RequiresGradConversionError

VALUES = np.random.default_rng(0).standard_normal((256, 256))


def test_asarray_is_the_tensors_own_array_not_an_element_by_element_copy():
    """`np.asarray` takes the tensor's array as is (an object array of 65,536 0-d tensors,
    built element by element, once took about a second)."""
    t = cad.tensor(VALUES)
    array = np.asarray(t)
    assert type(array) is np.ndarray and array.dtype == np.float64 and array.shape == (256, 256)
    np.testing.assert_array_equal(array, VALUES)
    assert np.shares_memory(array, t.numpy())


def test_asarray_dtype_and_copy_follow_numpy():
    t = cad.tensor(VALUES)
    assert np.asarray(t, dtype=np.float32).dtype == np.float32
    copied = np.array(t, copy=True)
    copied[0, 0] = 42.0
    assert t.numpy()[0, 0] == VALUES[0, 0]
    with pytest.raises(ValueError, match="needs a copy"):
        np.asarray(t, dtype=np.float32, copy=False)


def test_a_tensor_that_requires_grad_is_refused_with_what_to_do():
    w = cad.tensor(VALUES, requires_grad=True)
    with pytest.raises(RequiresGradConversionError, match=r"t\.detach\(\)\.numpy\(\)") as info:
        np.asarray(w)
    assert isinstance(info.value, TypeError) and isinstance(info.value, CheckpointADError)
    assert "float64[256, 256]" in str(info.value)
    np.testing.assert_array_equal(np.asarray(w.detach()), VALUES)
    with pytest.raises(RequiresGradConversionError, match="DLPack"):
        np.from_dlpack(w)
    y = cad.tanh(w)  # a result with history requires grad too
    with pytest.raises(RequiresGradConversionError):
        np.asarray(y)


def test_numpy_operators_still_defer_to_tensors_that_require_grad():
    w = cad.tensor(np.ones(3), requires_grad=True)
    out = np.full(3, 2.0) * w  # numpy defers (__array_ufunc__ = None): stays in the graph
    out.sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), np.full(3, 2.0))


def test_from_dlpack_gives_the_values():
    t = cad.tensor(VALUES.astype(np.float32))
    array = np.from_dlpack(t)
    assert array.dtype == np.float32 and array.shape == (256, 256)
    np.testing.assert_array_equal(array, VALUES.astype(np.float32))
    assert t.__dlpack_device__() == VALUES.__dlpack_device__()
