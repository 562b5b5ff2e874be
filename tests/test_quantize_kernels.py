"""Per-group quantization kernels: round-trip error within the documented bound, exact
storage of non-finite values, stochastic rounding, measured bytes, packing and every error."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from checkpoint_ad.strategies import quantize as quantize_module
from checkpoint_ad.strategies.quantize import (
    ALLOWED_BITS,
    QuantizationError,
    QuantizedArray,
    dequantize,
    error_bound,
    pack_codes,
    quantize,
    unpack_codes,
    worth_quantizing,
)

FLOAT_DTYPES = (np.float16, np.float32, np.float64)
SHAPES = [(), (0,), (0, 3), (1,), (5,), (63,), (64,), (65,), (3, 7, 11), (1000,)]


def random_array(shape, dtype, seed=0, offset=0.0, spread=3.0):
    rng = np.random.default_rng(seed)
    return (offset + spread * rng.standard_normal(shape)).astype(dtype)


def assert_within_bound(x, q):
    """Every element of dequantize(q) is within error_bound(q) of x; non-finite ones equal."""
    d = dequantize(q)
    assert d.shape == x.shape and d.dtype == x.dtype and isinstance(d, np.ndarray)
    bound = np.asarray(error_bound(q), dtype=np.float64)
    assert bound.shape == x.shape
    x64, d64 = x.astype(np.float64), d.astype(np.float64)
    same = (x64 == d64) | (np.isnan(x64) & np.isnan(d64))
    with np.errstate(invalid="ignore"):
        close = np.abs(d64 - x64) <= bound
    bad = ~(same | close)
    assert not bad.any(), (x[bad][:5], d[bad][:5], bound[bad][:5])
    return d


# ---- round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [1, 7, 64, 1024])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_round_trip_within_bound(bits, dtype, shape, group_size):
    x = random_array(shape, dtype, seed=bits + group_size)
    q = quantize(x, bits, group_size=group_size)
    assert (q.shape, q.dtype, q.bits, q.group_size) == (x.shape, x.dtype, bits, group_size)
    assert q.num_groups == -(-x.size // group_size)
    assert_within_bound(x, q)


@pytest.mark.parametrize("bits", ALLOWED_BITS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_stochastic_round_trip_within_bound(bits, dtype):
    x = random_array((513,), dtype, seed=4)
    assert_within_bound(x, quantize(x, bits, group_size=64, stochastic=True, seed=1))


@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_bound_is_half_a_step_for_nearest_and_a_step_for_stochastic(bits):
    x = np.linspace(0.0, 1.0, 64, dtype=np.float32)
    step = 1.0 / (2**bits - 1)
    nearest = error_bound(quantize(x, bits))
    stochastic = error_bound(quantize(x, bits, stochastic=True, seed=0))
    np.testing.assert_allclose(nearest, step / 2, rtol=0, atol=1e-5)
    np.testing.assert_allclose(stochastic, step, rtol=0, atol=1e-5)


def test_narrow_groups_far_from_zero_keep_their_resolution():
    # float32 parameters: the group min is stored exactly, so an offset costs no accuracy.
    x = random_array((4096,), np.float32, seed=5, offset=1000.0, spread=1e-2)
    q = quantize(x, 8)
    d = assert_within_bound(x, q)
    half_step = np.ptp(x) / 255 / 2  # each group's range is at most the array's
    assert np.max(np.abs(d - x)) <= half_step + 2 * np.spacing(np.float32(1001))


def test_blocks_boundaries_padding_and_exceptions_across_many_blocks():
    x = random_array((200_003,), np.float32, seed=6)
    x[[5, 70_000, 140_001, 200_002]] = [np.nan, np.inf, -np.inf, np.nan]
    for bits in ALLOWED_BITS:
        q = quantize(x, bits, group_size=7)
        assert q.num_exceptions == 4
        assert_within_bound(x, q)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", ALLOWED_BITS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_groups_are_coded_alike_in_a_small_array_and_inside_a_large_one(bits, dtype,
                                                                          stochastic):
    """Groups are independent: a small array's codes, mins and scales are those of the same
    groups at the head of an array of many blocks (with a non-finite value further on), and
    each comes back the same; with stochastic rounding and one seed, the head groups draw the
    same noise. Small arrays take a shorter path than large ones."""
    rng = np.random.default_rng(bits)
    head = rng.standard_normal((4, 64)).astype(dtype) * 3
    head[1] = 2.5  # a constant group: no step
    head[2] *= 1e-30 if dtype != np.float16 else 0  # a group too narrow for a normal step
    large = rng.standard_normal((3000, 64)).astype(dtype)
    large[:4] = head
    large[2500, 3] = np.nan
    small_q = quantize(head, bits, stochastic=stochastic, seed=11)
    large_q = quantize(large, bits, stochastic=stochastic, seed=11)
    codes_bytes = head.size * bits // 8
    np.testing.assert_array_equal(small_q.codes, large_q.codes[:codes_bytes])
    np.testing.assert_array_equal(small_q.mins, large_q.mins[:4])
    np.testing.assert_array_equal(small_q.scales, large_q.scales[:4])
    assert small_q.num_exceptions == 0 and large_q.num_exceptions == 1
    small_back, large_back = dequantize(small_q), dequantize(large_q)
    assert small_back.dtype == dtype and small_back.shape == head.shape
    np.testing.assert_array_equal(small_back, large_back[:4])


def test_quantize_leaves_input_untouched_and_accepts_views():
    base = random_array((40, 30), np.float32, seed=7)
    x = base.T  # not C-contiguous
    before = x.copy()
    q = quantize(x, 4, group_size=7)
    np.testing.assert_array_equal(x, before)
    assert_within_bound(x, q)


# ---- exactness ------------------------------------------------------------------------------


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_constant_groups_come_back_exactly(bits, dtype, stochastic):
    values = [0.1, -3.7e4, 0.0, 1e-30, 7.0]
    x = np.repeat(np.array(values, dtype=dtype), 64)
    q = quantize(x, bits, group_size=64, stochastic=stochastic, seed=0)
    np.testing.assert_array_equal(dequantize(q), x)
    np.testing.assert_array_equal(dequantize(quantize(x, bits, group_size=1)), x)
    np.testing.assert_array_equal(
        dequantize(quantize(np.full((3, 3), 2.5, dtype), bits)), np.full((3, 3), 2.5, dtype)
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_non_finite_values_stored_exactly_in_place(bits, dtype):
    x = random_array((300,), dtype, seed=8)
    special = {3: np.nan, 64: np.inf, 65: -np.inf, 200: np.nan, 299: np.inf}
    for i, v in special.items():
        x[i] = v
    q = quantize(x, bits, group_size=64)
    assert q.num_exceptions == len(special)
    assert q.exception_indices.dtype == np.int32
    assert q.exception_values.dtype == x.dtype
    d = assert_within_bound(x, q)
    np.testing.assert_array_equal(np.isnan(d), np.isnan(x))
    np.testing.assert_array_equal(d[[64, 65, 299]], x[[64, 65, 299]])
    bound = error_bound(q)
    assert np.all(bound[list(special)] == 0)
    # neighbours keep a bound from the ordinary values only: finite and about a step wide
    finite = np.isfinite(x)
    half_step = np.ptp(x[finite].astype(np.float64)) / (2**bits - 1) / 2
    widest = half_step * (2 if dtype == np.float16 else 1)  # float16 output doubles the bound
    assert np.all(np.isfinite(bound)) and np.max(bound) <= widest * 1.01


def test_nan_payload_and_sign_survive_bit_for_bit():
    x = random_array((100,), np.float32, seed=9)
    payload_nan = np.array([0x7FC01234], np.uint32).view(np.float32)[0]
    x[10], x[20] = payload_nan, -np.nan
    d = dequantize(quantize(x, 2))
    np.testing.assert_array_equal(d.view(np.uint32)[[10, 20]], x.view(np.uint32)[[10, 20]])


def test_values_too_large_for_group_arithmetic_are_exceptions():
    big = np.finfo(np.float32).max
    x = np.array([-big, big, 1.0, 2.0, 3.0e38, 0.5], np.float32)
    q = quantize(x, 8, group_size=3)
    assert q.num_exceptions == 3
    d = assert_within_bound(x, q)
    np.testing.assert_array_equal(d[[0, 1, 4]], x[[0, 1, 4]])


def test_all_non_finite_array_round_trips():
    x = np.array([np.nan, np.inf, -np.inf] * 30, np.float64)
    q = quantize(x, 4, group_size=7)
    assert q.num_exceptions == x.size
    np.testing.assert_array_equal(dequantize(q), x)


def test_finite_arrays_store_no_exceptions():
    q = quantize(random_array((1000,), np.float32), 4)
    assert q.num_exceptions == 0
    assert q.exception_indices.shape == (0,) and q.exception_values.shape == (0,)


# ---- stochastic rounding --------------------------------------------------------------------


def test_stochastic_same_seed_same_codes_other_seed_other_codes():
    x = random_array((5000,), np.float32, seed=10)
    a = quantize(x, 2, stochastic=True, seed=123)
    b = quantize(x, 2, stochastic=True, seed=123)
    c = quantize(x, 2, stochastic=True, seed=124)
    np.testing.assert_array_equal(a.codes, b.codes)
    assert not np.array_equal(a.codes, c.codes)
    np.testing.assert_array_equal(a.mins, c.mins)  # only the rounding is random


@pytest.mark.parametrize("size", [512, 200_003])  # the one-block path and the general one
def test_unseeded_stochastic_rounding_draws_fresh_unbiased_noise_each_call(size):
    x = random_array((size,), np.float32, seed=12)
    draws = [quantize(x, 2, stochastic=True) for _ in range(200)]
    assert len({d.codes.tobytes() for d in draws}) == len(draws)  # no two calls alike
    mean = np.mean([dequantize(d) for d in draws], axis=0, dtype=np.float64)
    step = np.repeat(quantize(x, 2).scales, 64)[:size]
    # Each draw lies within one step; Hoeffding puts 0.15 steps at ~1e-2 per element at 200
    # draws, so the mean over elements is the check, at a tenth of a step.
    assert np.mean(np.abs(mean - x) / np.maximum(step, 1e-30)) < 0.1


def test_stochastic_rounding_is_unbiased():
    x = random_array((512,), np.float32, seed=11)
    seeds = 400
    mean = np.mean(
        [dequantize(quantize(x, 2, stochastic=True, seed=s)) for s in range(seeds)],
        axis=0,
        dtype=np.float64,
    )
    q = quantize(x, 2)
    step = np.repeat(q.scales, 64)[: x.size]
    # Each draw lies within one step of x; Hoeffding puts 0.15 steps at ~3e-8 per element.
    np.testing.assert_array_less(np.abs(mean - x), 0.15 * step + 1e-6)
    nearest_error = np.abs(dequantize(q) - x)
    assert np.mean(np.abs(mean - x)) < 0.5 * np.mean(nearest_error)


# ---- bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("bits", "formula"), [(8, 0.28125), (4, 0.15625), (2, 0.09375)])
def test_stored_fraction_measured_on_a_million_floats(bits, formula):
    # bits/32 for the codes plus 8 bytes of float32 min and scale per 256-byte group.
    x = random_array((1 << 20,), np.float32, seed=12)
    q = quantize(x, bits, group_size=64)
    measured = q.nbytes / x.nbytes
    assert measured <= formula + 1e-12
    assert q.logical_nbytes == x.nbytes


@pytest.mark.parametrize(("bits", "target"), [(8, 0.27), (4, 0.15), (2, 0.09)])
def test_stored_fraction_targets_met_at_group_128(bits, target):
    x = random_array((1 << 20,), np.float32, seed=13)
    assert quantize(x, bits, group_size=128).nbytes / x.nbytes <= target


def test_nbytes_measures_every_held_array():
    x = random_array((1000,), np.float64, seed=14)
    x[[1, 2]] = np.nan
    q = quantize(x, 4, group_size=64)
    held = (q.codes, q.mins, q.scales, q.exception_indices, q.exception_values)
    assert q.nbytes == sum(a.nbytes for a in held)
    assert q.codes.nbytes == 512  # 1000 codes padded to 16 whole groups, 2 per byte
    assert q.mins.nbytes == q.scales.nbytes == 16 * 8  # float64 input keeps float64 parameters
    assert q.exception_indices.nbytes == 2 * 4 and q.exception_values.nbytes == 2 * 8
    assert q.logical_nbytes == x.nbytes == 8000


# ---- packing --------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 1001])
@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_pack_unpack_round_trip(bits, count):
    codes = np.random.default_rng(count).integers(0, 2**bits, count, dtype=np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (-(-count * bits // 8),)
    np.testing.assert_array_equal(unpack_codes(packed, bits, count), codes)


def test_pack_layout_is_least_significant_first():
    np.testing.assert_array_equal(pack_codes(np.array([1, 15], np.uint8), 4), [0xF1])
    np.testing.assert_array_equal(pack_codes(np.array([3, 0, 0, 2], np.uint8), 2), [0x83])


# ---- worth_quantizing -----------------------------------------------------------------------


def test_worth_quantizing():
    assert worth_quantizing(np.zeros(4096, np.float32))
    assert worth_quantizing(np.zeros(64, np.float32))
    assert not worth_quantizing(np.zeros(63, np.float32))  # less than a group
    assert not worth_quantizing(np.zeros(64, np.float16))  # less than 256 bytes
    assert not worth_quantizing(np.zeros(4096, np.int32))
    assert not worth_quantizing(np.zeros(4096, bool))
    assert not worth_quantizing(np.zeros((), np.float64))
    assert not worth_quantizing(np.zeros(100, np.float32), group_size=128)


# ---- errors and repr ------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [0, 1, 3, 16, 32, True, 8.0, "8"])
def test_bad_bits_says_what_is_allowed(bits):
    with pytest.raises(QuantizationError, match=r"bits must be one of \(8, 4, 2\); got"):
        quantize(np.zeros(10, np.float32), bits)


@pytest.mark.parametrize("group_size", [0, -1, 2.5, True, "64"])
def test_bad_group_size(group_size):
    with pytest.raises(QuantizationError, match="group_size must be a positive int; got"):
        quantize(np.zeros(10, np.float32), 8, group_size=group_size)
    with pytest.raises(QuantizationError, match="group_size must be a positive int"):
        worth_quantizing(np.zeros(10, np.float32), group_size=group_size)


@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.uint8, bool])
def test_integer_and_bool_arrays_are_left_to_the_strategy(dtype):
    with pytest.raises(QuantizationError, match="stored exactly by the strategy"):
        quantize(np.zeros(10, dtype), 8)


def test_complex_arrays_rejected():
    with pytest.raises(QuantizationError, match="real and imaginary parts separately"):
        quantize(np.zeros(10, np.complex64), 8)


def test_non_arrays_rejected():
    with pytest.raises(QuantizationError, match=r"expected an array .* got list"):
        quantize([1.0, 2.0], 8)
    with pytest.raises(QuantizationError, match="expected an array"):
        worth_quantizing([1.0])
    with pytest.raises(QuantizationError, match="needs a QuantizedArray from quantize"):
        dequantize(np.zeros(3))
    with pytest.raises(QuantizationError, match="needs a QuantizedArray from quantize"):
        error_bound("q")


def test_pack_and_unpack_errors():
    with pytest.raises(QuantizationError, match="1-d uint8 array; got shape \\(3,\\) dtype int32"):
        pack_codes(np.zeros(3, np.int32), 4)
    with pytest.raises(QuantizationError, match="1-d uint8"):
        pack_codes(np.zeros((2, 2), np.uint8), 4)
    with pytest.raises(QuantizationError, match="needs codes below 4; got a code 7"):
        pack_codes(np.array([0, 7], np.uint8), 2)
    with pytest.raises(QuantizationError, match="bits must be one of"):
        pack_codes(np.zeros(3, np.uint8), 3)
    with pytest.raises(QuantizationError, match="holding at least count=9 codes at 4 bits"):
        unpack_codes(np.zeros(4, np.uint8), 4, 9)
    with pytest.raises(QuantizationError, match="count=-1"):
        unpack_codes(np.zeros(4, np.uint8), 4, -1)
    with pytest.raises(QuantizationError, match="dtype float32"):
        unpack_codes(np.zeros(4, np.float32), 8, 2)
    with pytest.raises(QuantizationError, match="bits must be one of"):
        unpack_codes(np.zeros(4, np.uint8), 5, 2)


def test_repr_is_readable_and_hides_the_arrays():
    x = random_array((3, 100), np.float32)
    x[0, 0] = np.nan
    q = quantize(x, 4, group_size=64)
    text = repr(q)
    assert text == (
        "QuantizedArray(shape=(3, 100), dtype=float32, bits=4, group_size=64, stochastic=False, "
        f"groups=5, exceptions=1, nbytes={q.nbytes}, logical_nbytes=1200)"
    )
    assert "array" not in text
    assert isinstance(q, QuantizedArray) and q == q and q != quantize(x, 4, group_size=64)


def test_module_examples_run():
    result = doctest.testmod(quantize_module)
    assert result.attempted > 0 and result.failed == 0


# ---- other namespaces -----------------------------------------------------------------------


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", ALLOWED_BITS)
def test_array_api_strict_round_trip(bits, stochastic):
    xp = pytest.importorskip("array_api_strict")
    for shape, group_size in [((), 64), ((0,), 7), ((37, 5), 7), ((70_001,), 64), ((130,), 1)]:
        host = random_array(shape, np.float32, seed=bits)
        if host.size > 40:
            host.reshape(-1)[[3, 40]] = [np.nan, -np.inf]
        for dtype in (xp.float32, xp.float64):
            x = xp.asarray(host, dtype=dtype)
            q = quantize(x, bits, group_size=group_size, stochastic=stochastic, seed=5)
            d = dequantize(q)
            assert type(d) is type(x) and d.dtype == x.dtype and d.shape == x.shape
            bound = error_bound(q)
            same = (d == x) | (xp.isnan(d) & xp.isnan(x))
            with np.errstate(invalid="ignore"):  # inf - inf where exceptions sit
                close = xp.abs(d - x) <= bound
            assert bool(xp.all(same | close))
            assert q.nbytes > 0 or host.size == 0
    assert worth_quantizing(xp.zeros(4096, dtype=xp.float32))
    assert not worth_quantizing(xp.zeros(4096, dtype=xp.int16))


@pytest.mark.gpu
def test_cupy_round_trip_stays_on_device():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("cupy is installed but sees no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("cupy is installed but CUDA is not usable here")
    host = random_array((100_003,), np.float32, seed=15)
    host[[0, 99_999]] = [np.nan, np.inf]
    x = cp.asarray(host)
    for bits in ALLOWED_BITS:
        for stochastic in (False, True):
            q = quantize(x, bits, stochastic=stochastic, seed=3)
            assert isinstance(q.codes, cp.ndarray)
            d = dequantize(q)
            assert isinstance(d, cp.ndarray) and d.dtype == x.dtype
            host_d = cp.asnumpy(d)
            with np.errstate(invalid="ignore"):  # inf - inf where exceptions sit
                close = np.abs(host_d - host) <= cp.asnumpy(error_bound(q))
            assert np.all(close | (host_d == host) | (np.isnan(host) & np.isnan(host_d)))
    a = quantize(x, 2, stochastic=True, seed=9)
    b = quantize(x, 2, stochastic=True, seed=9)
    assert bool(cp.all(a.codes == b.codes))


# ---- property test --------------------------------------------------------------------------


def any_float_array(dtype):
    width = np.dtype(dtype).itemsize * 8
    shapes = hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=60)
    anything = st.floats(width=width)  # includes nan, infinities, subnormals and extremes
    narrow = st.floats(min_value=1000.0, max_value=1000.5, width=width)
    return hnp.arrays(dtype, shapes, elements=st.one_of(anything, narrow))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    dtype=st.sampled_from(FLOAT_DTYPES),
    bits=st.sampled_from(ALLOWED_BITS),
    group_size=st.integers(1, 100),
    stochastic=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_error_within_bound(data, dtype, bits, group_size, stochastic, seed):
    x = data.draw(any_float_array(dtype))
    q = quantize(x, bits, group_size=group_size, stochastic=stochastic, seed=seed)
    assert_within_bound(x, q)


def test_a_seed_asked_for_again_draws_its_noise_from_the_start_in_every_thread():
    """A seeded generator is kept per thread and rewound, not made per call: interleaved
    seeds, and threads quantizing with one seed at once, each draw that seed's noise from its
    start, as a generator made for the call would."""
    import threading

    x = random_array((5000,), np.float32, seed=13)
    fresh = np.random.Generator(np.random.PCG64(123))
    first = quantize(x, 2, stochastic=True, seed=123)
    quantize(x, 2, stochastic=True, seed=124)  # another seed between
    again = quantize(x, 2, stochastic=True, seed=123)
    np.testing.assert_array_equal(first.codes, again.codes)
    assert quantize_module._numpy_rng(123).random() == fresh.random()

    codes, errors = [], []

    def worker():
        try:
            for _ in range(20):
                codes.append(quantize(x, 2, stochastic=True, seed=123).codes.tobytes())
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and set(codes) == {first.codes.tobytes()}
