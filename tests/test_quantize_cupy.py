"""The fused CUDA quantize and dequantize kernels give the same bits as the array-API path they
replace on cupy: codes, group minima and steps, and the values they come back as, for every
bit width, rounding, input dtype, group size and a partial last group; arrays the kernels do
not take (values stored exactly, groups that do not fill whole bytes) still round-trip."""

from __future__ import annotations

import numpy as np
import pytest

from checkpoint_ad.backend import cupy_or_none, namespace
from checkpoint_ad.strategies import quantize as qz
from checkpoint_ad.strategies import quantize_cupy

cp = cupy_or_none()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(cp is None, reason="needs cupy and a CUDA device")]


def _arrays(dtype):
    rng = np.random.default_rng(5)
    ties = np.array([0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.5] * 8)  # 2 bits: steps of 1, .5 ties
    constant = np.full(130, 7.25)  # zero range: step 0
    narrow = 1000.0 + rng.random(200) * 1e-3
    yield "normal (100003,)", rng.standard_normal(100_003).astype(dtype)
    yield "2-d (33, 65)", (rng.standard_normal((33, 65)) * 50).astype(dtype)
    yield "ties", ties.astype(dtype)
    yield "constant", constant.astype(dtype)
    yield "narrow", narrow.astype(dtype)
    yield "one value", np.array([3.5], dtype)


def _same(a, b) -> bool:
    return bool(cp.array_equal(a, b))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("bits", qz.ALLOWED_BITS)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("group_size", [64, 4, 12])
def test_fused_kernels_give_the_general_paths_bits(dtype, bits, stochastic, group_size):
    for label, host in _arrays(dtype):
        x = cp.asarray(host)
        xp = namespace(x)
        fused = qz.quantize(x, bits, group_size, stochastic=stochastic, seed=11)
        general = qz._quantize_general(xp, x, bits, group_size, stochastic, 11)
        for field in ("codes", "mins", "scales"):
            assert _same(getattr(fused, field), getattr(general, field)), (label, field)
        assert fused.num_exceptions == 0
        back = qz.dequantize(fused)
        assert back.dtype == x.dtype and back.shape == x.shape
        assert _same(back, qz._dequantize_general(xp, general)), label
        assert bool(cp.all(cp.abs(back.astype(cp.float64) - x.astype(cp.float64))
                           <= qz.error_bound(fused))), label


def test_the_fused_kernel_takes_ordinary_arrays_and_declines_the_others():
    work, (big, tiny) = np.float32, qz._finfo(np.float32)
    x = cp.linspace(-1, 1, 640, dtype=cp.float32)
    assert quantize_cupy.quantize_groups(x, 4, 64, work, big, tiny, None) is not None
    for bad in (np.nan, np.inf, -np.inf, 1e38):
        y = x.copy()
        y[100] = bad
        assert quantize_cupy.quantize_groups(y, 4, 64, work, big, tiny, None) is None
    # groups that split a byte of codes (7 values of 4 bits) are the general path's
    assert not quantize_cupy.takes(x.size, 7, 4) and quantize_cupy.takes(x.size, 8, 4)
    assert not quantize_cupy.takes(0, 64, 8)


@pytest.mark.parametrize("bits", qz.ALLOWED_BITS)
def test_values_stored_exactly_and_odd_groups_still_round_trip(bits):
    host = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    host[[3, 500, 999]] = [np.nan, np.inf, 3e38]
    x = cp.asarray(host)
    for group_size in (64, 7):
        q = qz.quantize(x, bits, group_size)
        back = cp.asnumpy(qz.dequantize(q))
        exact = np.isin(np.arange(host.size), [3, 500, 999])
        assert np.isnan(back[3]) and back[500] == np.inf and back[999] == host[999]
        error = np.abs(back[~exact] - host[~exact])
        assert np.all(error <= cp.asnumpy(qz.error_bound(q))[~exact])


def test_stochastic_rounding_is_unbiased_on_the_gpu():
    x = cp.full(64 * 4096, 0.3, dtype=cp.float32)
    x[::64] = 0.0
    x[1::64] = 1.0  # every group spans [0, 1]: 0.3 sits between two 2-bit levels
    means = []
    for seed in range(4):
        back = qz.dequantize(qz.quantize(x, 2, 64, stochastic=True, seed=seed))
        means.append(float(back[2::64].mean()))
    assert abs(np.mean(means) - 0.3) < 4e-3  # 5 standard errors
    assert len(set(means)) > 1  # different seeds draw different noise
