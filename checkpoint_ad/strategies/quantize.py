"""Per-group affine quantization of saved floating values into 8-, 4- or 2-bit codes.

Why: a saved activation is read once, by one backward rule, and that rule rarely needs more than a
few significant bits of it. Storing it as small integer codes plus a little per-group metadata
cuts its bytes by 4-16x for float32, at an error that is known in advance and can be checked.

Scheme. The array is flattened (C order) and cut into groups of ``group_size`` consecutive
elements; the last group is padded by repeating the last element, so padding never widens a
group's range. Per group, with ``L = 2**bits - 1``::

    m = min(group)          s = (max(group) - m) / L
    code = round((v - m) / s)            # or floor((v - m) / s + U[0, 1)) when stochastic
    dequantized v = m + code * s

Codes are packed densely into uint8 storage: 1 code per byte at 8 bits, 2 at 4 bits and 4 at
2 bits. Element ``i`` lives in byte ``i // (8 // bits)`` at bit offset
``(i % (8 // bits)) * bits`` (least significant first).

Group parameters are stored in float32 for float16 and float32 input, for accuracy: float16
parameters would put an error of up to 2**-11 * |m| into every value, far more than a step for
a narrow group away from zero. float64 input keeps float64 parameters, since float32 can hold
neither its range nor its precision; the cost relative to the data is the same. For float32
input at ``group_size`` 64 the stored fraction of bytes is therefore ``bits / 32 + 8 / 256``:
0.281, 0.156 and 0.094 at 8, 4 and 2 bits (0.266, 0.141 and 0.078 at ``group_size`` 128).

Error bound, per element of a group with stored ``m`` and ``s`` (see :func:`error_bound`)::

    |dequantize(quantize(x)) - x| <= h * s + 16 * eps * (|m| + L * s) + L * tiny

with ``h = 1/2`` for round-to-nearest and ``h = 1`` for stochastic rounding; ``eps`` and ``tiny``
are the machine epsilon and smallest normal number of the working dtype (float32, or float64
for float64 input). The middle term covers floating-point rounding in the arithmetic (about
1e-6 relative to the group's magnitude in float32); the last covers groups whose range is so
small (below ``L * tiny``) that their step would be subnormal: those store ``s = 0`` and come
back as their minimum. For float16 input the bound is doubled, since the final rounding to
float16 can at most double the distance to a float16 value. A group whose values are all equal
comes back exactly. Stochastic rounding is unbiased: E[dequantize] = x up to the rounding of
``t + noise`` in the working dtype (under 1e-5 of a step in float32).

Non-finite values. nan, +inf and -inf would poison a group's min and scale, so group ranges
are taken over the *ordinary* values only, and every other element is stored exactly on the
side (flat index, int32 or int64, plus its value in the input dtype) and put back by
:func:`dequantize`, nan payloads included. Finite values too large for the group arithmetic
(``|v| > max / 4`` of the working dtype) are treated the same way, so no intermediate can
overflow. This costs a second look at a block only when such values are present.

Portability: only array API standard functions are used on the array's own namespace, so numpy,
cupy and ``array_api_strict`` arrays all work and stay on their device. The work is done in
blocks of ``2**16`` elements on CPU namespaces so temporaries stay in cache; cupy gets one
block, and cupy arrays of ordinary values take one fused CUDA kernel each way instead
(`quantize_cupy`: the same bits, without twenty launches per value).

>>> import numpy as np
>>> x = np.linspace(-1.0, 1.0, 64_000, dtype=np.float32)
>>> q = quantize(x, bits=4)
>>> bool(np.all(np.abs(dequantize(q) - x) <= error_bound(q)))
True
>>> q.nbytes / x.nbytes
0.15625
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np

from ..backend import namespace
from ..errors import QuantizationError
from . import quantize_cupy

ALLOWED_BITS = (8, 4, 2)
MIN_WORTH_BYTES = 256  # below one float32 group of 64 the metadata and bookkeeping dominate
_BOUND_ROUNDING_ULPS = 16  # ~2x the worst-case rounding derived for the arithmetic below
_CPU_BLOCK_ELEMENTS = 2**16  # 256 KiB of float32 per temporary: stays in a core's L2 cache
_TRANSPOSE_MAX_COLUMNS = 128  # see _group_min_max

Array = Any


@dataclass(frozen=True, eq=False, repr=False, slots=True)  # slots: one per saved value
class QuantizedArray:
    """A floating array stored as packed codes plus per-group min and scale.

    ``codes`` is the packed uint8 storage; ``mins`` and ``scales`` hold one float32 (float64 for
    float64 input) per group. Equality is identity: comparing the arrays inside element-wise
    would be ambiguous.
    ``exception_indices`` / ``exception_values`` hold the elements stored exactly (non-finite
    or too large); they are empty arrays when there are none.
    """

    codes: Array
    mins: Array
    scales: Array
    exception_indices: Array
    exception_values: Array
    shape: tuple[int, ...]
    dtype: Any
    bits: int
    group_size: int
    stochastic: bool

    @property
    def size(self) -> int:
        """Number of elements of the original array."""
        return math.prod(self.shape)

    @property
    def num_groups(self) -> int:
        return self.mins.shape[0]

    @property
    def num_exceptions(self) -> int:
        return self.exception_indices.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes actually held, measured on every stored array (codes, parameters, exceptions)."""
        arrays = (self.codes, self.mins, self.scales, self.exception_indices, self.exception_values)
        return sum(_array_nbytes(a) for a in arrays)

    @property
    def logical_nbytes(self) -> int:
        """Bytes of the original array."""
        return self.size * _itemsize(namespace(self.codes), self.dtype)

    def __repr__(self) -> str:
        return (
            f"QuantizedArray(shape={self.shape}, dtype={_dtype_name(self.dtype)}, "
            f"bits={self.bits}, group_size={self.group_size}, stochastic={self.stochastic}, "
            f"groups={self.num_groups}, exceptions={self.num_exceptions}, "
            f"nbytes={self.nbytes}, logical_nbytes={self.logical_nbytes})"
        )


def worth_quantizing(x: Array, group_size: int = 64) -> bool:
    """Whether quantizing ``x`` can pay off; otherwise a strategy should keep it exactly.

    False for integer and bool arrays (indices and masks must stay exact) and for arrays
    smaller than one group or than ``MIN_WORTH_BYTES``, where metadata and bookkeeping eat
    the saving.

    >>> import numpy as np
    >>> worth_quantizing(np.zeros(4096, np.float32)), worth_quantizing(np.zeros(8, np.float32))
    (True, False)
    >>> worth_quantizing(np.zeros(4096, np.int64))
    False
    """
    xp = _namespace(x)
    _check_group_size(group_size)
    if not _real_floating(xp, x.dtype):
        return False
    size = math.prod(x.shape)
    return size >= group_size and size * _itemsize(xp, x.dtype) >= MIN_WORTH_BYTES


def quantize(
    x: Array,
    bits: int,
    group_size: int = 64,
    stochastic: bool = False,
    seed: int | None = None,
) -> QuantizedArray:
    """Quantize a floating array of any shape to ``bits``-bit codes in groups of ``group_size``.

    ``stochastic=True`` rounds down or up at random with the probabilities that make the
    result unbiased, drawing noise from a generator seeded with ``seed`` (numpy's
    ``default_rng``, moved onto the array's device; cupy's own ``default_rng`` for cupy).
    ``seed`` is ignored for round-to-nearest. See the module docstring for the error bound.

    >>> import numpy as np
    >>> q = quantize(np.array([0.0, 1.0, 2.0, 3.0], np.float32), bits=2)
    >>> dequantize(q)
    array([0., 1., 2., 3.], dtype=float32)
    """
    xp = _namespace(x)
    _check_bits(bits)
    _check_group_size(group_size)
    _check_quantizable_dtype(xp, x.dtype)
    if type(x) is np.ndarray:
        fast = _quantize_small_numpy(x, bits, group_size, stochastic, seed)
        if fast is not None:
            return fast
    elif array_api_compat.is_cupy_namespace(xp):
        fused = _quantize_cupy(xp, x, bits, group_size, stochastic, seed)
        if fused is not None:
            return fused
    return _quantize_general(xp, x, bits, group_size, stochastic, seed)


def _quantize_general(xp: Any, x: Array, bits: int, group_size: int, stochastic: bool,
                      seed: int | None) -> QuantizedArray:
    """`quantize` in array API standard functions, block by block: every namespace, every
    value (non-finite and too large ones stored exactly)."""
    device = array_api_compat.device(x)
    work = _work_dtype(xp, x.dtype)
    levels = 2**bits - 1
    per_byte = 8 // bits
    big = float(xp.finfo(work).max) / 4
    tiny = float(xp.finfo(work).smallest_normal)
    rng = _make_rng(xp, seed) if stochastic else None

    flat = xp.reshape(x, (-1,))
    size = flat.shape[0]
    num_groups = -(-size // group_size)
    codes = xp.empty((-(-num_groups * group_size // per_byte),), dtype=xp.uint8, device=device)
    mins = xp.empty((num_groups,), dtype=work, device=device)
    scales = xp.empty((num_groups,), dtype=work, device=device)
    index_dtype = xp.int32 if size <= 2**31 - 1 else xp.int64
    exception_indices, exception_values = [], []

    rows_per_block = _rows_per_block(xp, num_groups, group_size)
    for row0 in range(0, num_groups, rows_per_block):
        row1 = min(row0 + rows_per_block, num_groups)
        start, stop = row0 * group_size, min(row1 * group_size, size)
        block = xp.astype(flat[start:stop], work, copy=False)
        padding = (row1 - row0) * group_size - (stop - start)
        if padding:
            block = xp.concat([block, xp.broadcast_to(block[-1:], (padding,))])
        grid = xp.reshape(block, (row1 - row0, group_size))

        lo, hi = _group_min_max(xp, grid)
        if not bool(xp.all((lo >= -big) & (hi <= big))):
            ordinary = xp.abs(grid) <= big
            lo, hi = _ordinary_range(xp, grid, ordinary)
            grid = xp.where(ordinary, grid, lo[:, None])
            local = xp.nonzero(~(xp.abs(block[: stop - start]) <= big))[0]
            exception_indices.append(xp.astype(local + start, index_dtype))
            exception_values.append(xp.take(flat[start:stop], local))

        step = (hi - lo) / levels
        normal = step >= tiny
        step = xp.where(normal, step, 0.0)
        inverse = xp.where(normal, 1.0 / xp.where(normal, step, 1.0), 0.0)

        t = grid - lo[:, None]
        t *= inverse[:, None]
        if rng is None:
            t = xp.round(t)
        else:
            t += _uniform_noise(xp, rng, (row1 - row0, group_size), work, device)
            t = xp.clip(xp.floor(t), 0.0, float(levels))
        block_codes = xp.reshape(xp.astype(t, xp.uint8), (-1,))

        byte0 = row0 * group_size // per_byte
        packed = _pack(xp, block_codes, bits)
        codes[byte0 : byte0 + packed.shape[0]] = packed
        mins[row0:row1] = lo
        scales[row0:row1] = step

    return QuantizedArray(
        codes=codes,
        mins=mins,
        scales=scales,
        exception_indices=_concat_or_empty(xp, exception_indices, index_dtype, device),
        exception_values=_concat_or_empty(xp, exception_values, x.dtype, device),
        shape=tuple(x.shape),
        dtype=x.dtype,
        bits=int(bits),
        group_size=int(group_size),
        stochastic=bool(stochastic),
    )


def _quantize_small_numpy(x: np.ndarray, bits: int, group_size: int, stochastic: bool = False,
                          seed: int | None = None) -> QuantizedArray | None:
    """`quantize` of a numpy array of whole groups that fits one block and holds no value
    stored exactly (else None: the general path takes it; stochastic rounding draws the same
    noise, from a generator made the same way, as the general path would). Why: a saved
    value of a small step (an RNN's 32 x 128 hidden state) paid ~150 us in the general path,
    7x a tanh of it, nearly all per-call cost of its ~30 numpy calls on 64-row arrays; this
    makes the same arrays, bit for bit, in about a third of the calls (`rint` is what `round`
    runs for 0 decimals; the min and max of a single block need no transposed copy at these
    sizes)."""
    size = x.size
    groups = size // group_size
    if not size or size % group_size or groups > _rows_per_block(np, groups, group_size):
        return None
    work = _work_dtype(np, x.dtype)
    big, tiny = _finfo(work)
    levels = 2**bits - 1
    grid = x.reshape(groups, group_size).astype(work, copy=False)
    lo, hi = grid.min(axis=1), grid.max(axis=1)
    if not (float(lo.min()) >= -big and float(hi.max()) <= big):  # (NaN fails too)
        return None
    step = (hi - lo) / levels
    normal = step >= tiny
    if normal.all():
        inverse = 1.0 / step
    else:
        step = np.where(normal, step, 0.0)
        inverse = np.where(normal, 1.0 / np.where(normal, step, 1.0), 0.0)
    t = grid - lo[:, None]
    t *= inverse[:, None]
    if stochastic:
        t += _uniform_noise(np, _make_rng(np, seed), t.shape, work, None)
        np.floor(t, out=t)
        np.clip(t, 0.0, float(levels), out=t)
    else:
        np.rint(t, out=t)
    codes = _pack(np, t.astype(np.uint8).reshape(-1), bits)
    return _without_exceptions(np, None, x, codes, lo, step, bits, group_size, stochastic)


def _quantize_cupy(xp: Any, x: Array, bits: int, group_size: int, stochastic: bool,
                   seed: int | None) -> QuantizedArray | None:
    """`quantize` of a cupy array in one fused kernel (`quantize_cupy`), the same bits as the
    general path; None where that path must take the array (see `quantize_groups`), its
    noise not drawn for an array the kernel does not take (`quantize_cupy.takes`)."""
    if not quantize_cupy.takes(x.size, group_size, bits):
        return None
    work = _work_dtype(np, np.dtype(x.dtype))
    big, tiny = _finfo(work)
    noise = None
    if stochastic:
        groups = -(-x.size // group_size)
        with x.device:  # the generator and its draws on the array's device
            noise = _make_rng(xp, seed).random((groups, group_size), dtype=work)
    found = quantize_cupy.quantize_groups(x, bits, group_size, work, big, tiny, noise)
    if found is None:
        return None
    codes, mins, scales = found
    return _without_exceptions(xp, array_api_compat.device(x), x, codes, mins, scales, bits,
                               group_size, stochastic)


def _without_exceptions(xp: Any, device: Any, x: Array, codes: Array, mins: Array,
                        scales: Array, bits: int, group_size: int,
                        stochastic: bool) -> QuantizedArray:
    """The `QuantizedArray` of `x` from a path that stores no value exactly."""
    index_dtype = xp.int32 if x.size <= 2**31 - 1 else xp.int64
    return QuantizedArray(
        codes=codes, mins=mins, scales=scales,
        exception_indices=_empty(xp, index_dtype, device),
        exception_values=_empty(xp, x.dtype, device),
        shape=tuple(x.shape), dtype=x.dtype, bits=int(bits), group_size=int(group_size),
        stochastic=bool(stochastic),
    )


_finfos: dict[Any, tuple[float, float]] = {}


def _finfo(work: Any) -> tuple[float, float]:
    """(the largest magnitude quantized as such, the smallest normal step) of a numpy
    working dtype, as `quantize` computes them, remembered."""
    found = _finfos.get(work)
    if found is None:
        info = np.finfo(work)
        found = _finfos[work] = (float(info.max) / 4, float(info.smallest_normal))
    return found


def dequantize(q: QuantizedArray) -> Array:
    """Rebuild an array of the original shape, dtype and namespace from ``q``.

    >>> import numpy as np
    >>> x = np.array([[1.0, np.nan], [-np.inf, 4.0]])
    >>> dequantize(quantize(x, bits=8))
    array([[  1.,  nan],
           [-inf,   4.]])
    """
    if not isinstance(q, QuantizedArray):
        raise QuantizationError(
            f"dequantize needs a QuantizedArray from quantize(); got {type(q).__name__}"
        )
    size, g = q.size, q.group_size
    if type(q.codes) is np.ndarray and size % g == 0 and not q.num_exceptions and (
            q.num_groups <= _rows_per_block(np, q.num_groups, g)):
        # one block of whole groups (`_quantize_small_numpy`'s kind): the general path's
        # arithmetic, without its output buffer and per-block copy
        values = _unpack(np, q.codes, q.bits, size).reshape(q.num_groups, g).astype(q.mins.dtype)
        values *= q.scales[:, None]
        values += q.mins[:, None]
        return values.astype(q.dtype, copy=False).reshape(q.shape)
    xp = namespace(q.codes)
    if array_api_compat.is_cupy_namespace(xp):
        fused = _dequantize_cupy(xp, q)
        if fused is not None:
            return fused
    return _dequantize_general(xp, q)


def _dequantize_cupy(xp: Any, q: QuantizedArray) -> Array | None:
    """`dequantize` of cupy codes in one fused kernel (`quantize_cupy`), the same bits as the
    general path; None where that path must take them (`quantize_cupy.takes`)."""
    if not quantize_cupy.takes(q.size, q.group_size, q.bits):
        return None
    out = quantize_cupy.dequantize_groups(q.codes, q.mins, q.scales, q.size, q.group_size,
                                          q.bits, q.dtype)
    if q.num_exceptions:
        out = _put_exact(xp, out, q.exception_indices, q.exception_values)
    return xp.reshape(out, q.shape)


def _dequantize_general(xp: Any, q: QuantizedArray) -> Array:
    """`dequantize` in array API standard functions, block by block."""
    size, g = q.size, q.group_size
    device = array_api_compat.device(q.codes)
    per_byte = 8 // q.bits
    out = xp.empty((size,), dtype=q.dtype, device=device)

    rows_per_block = _rows_per_block(xp, q.num_groups, g)
    for row0 in range(0, q.num_groups, rows_per_block):
        row1 = min(row0 + rows_per_block, q.num_groups)
        start, stop = row0 * g, min(row1 * g, size)
        count = (row1 - row0) * g
        byte0 = start // per_byte
        packed = q.codes[byte0 : byte0 + -(-count // per_byte)]
        values = xp.astype(
            xp.reshape(_unpack(xp, packed, q.bits, count), (row1 - row0, g)), q.mins.dtype
        )
        values *= q.scales[row0:row1, None]
        values += q.mins[row0:row1, None]
        values = xp.reshape(values, (-1,))[: stop - start]
        out[start:stop] = xp.astype(values, q.dtype, copy=False)

    if q.num_exceptions:
        out = _put_exact(xp, out, q.exception_indices, q.exception_values)
    return xp.reshape(out, q.shape)


def error_bound(q: QuantizedArray) -> Array:
    """Per-element bound on ``|dequantize(q) - x|``, shaped like ``x`` (0 where stored exactly).

    The bound is in the working dtype (float32, or float64 for float64 input); its formula is
    in the module docstring.

    >>> import numpy as np
    >>> x = np.array([0.0, 0.25, 1.0], np.float32)
    >>> bool(np.all(np.abs(dequantize(quantize(x, bits=2)) - x) <= error_bound(quantize(x, 2))))
    True
    """
    if not isinstance(q, QuantizedArray):
        raise QuantizationError(
            f"error_bound needs a QuantizedArray from quantize(); got {type(q).__name__}"
        )
    xp = namespace(q.mins)
    work = q.mins.dtype
    levels = 2**q.bits - 1
    half_steps = 1.0 if q.stochastic else 0.5
    eps = float(xp.finfo(work).eps)
    tiny = float(xp.finfo(work).smallest_normal)

    per_group = half_steps * q.scales
    per_group += _BOUND_ROUNDING_ULPS * eps * (xp.abs(q.mins) + levels * q.scales)
    per_group += levels * tiny
    if _itemsize(xp, q.dtype) < _itemsize(xp, work):
        per_group *= 2.0  # rounding to the narrower output dtype at most doubles the distance

    grid = xp.broadcast_to(per_group[:, None], (q.num_groups, q.group_size))
    bound = xp.reshape(grid, (-1,))[: q.size]
    if q.num_exceptions:
        device = array_api_compat.device(bound)
        zeros = xp.zeros(q.exception_indices.shape, dtype=work, device=device)
        bound = _put_exact(xp, bound, q.exception_indices, zeros)
    return xp.reshape(bound, q.shape)


def pack_codes(codes: Array, bits: int) -> Array:
    """Pack uint8 codes below ``2**bits`` densely, ``8 // bits`` to a byte, least significant first.

    A length that is not a multiple of ``8 // bits`` is padded with zero codes.

    >>> import numpy as np
    >>> pack_codes(np.array([1, 2, 3, 0, 1], np.uint8), bits=2)
    array([57,  1], dtype=uint8)
    """
    xp = _namespace(codes)
    _check_bits(bits)
    if codes.dtype != xp.uint8 or codes.ndim != 1:
        raise QuantizationError(
            f"pack_codes needs a 1-d uint8 array; got shape {tuple(codes.shape)} dtype "
            f"{_dtype_name(codes.dtype)}"
        )
    if codes.shape[0] and int(xp.max(codes)) >= 2**bits:
        raise QuantizationError(
            f"pack_codes at {bits} bits needs codes below {2**bits}; got a code "
            f"{int(xp.max(codes))}"
        )
    return _pack(xp, codes, bits)


def unpack_codes(packed: Array, bits: int, count: int) -> Array:
    """Unpack the first ``count`` codes written by :func:`pack_codes`.

    >>> import numpy as np
    >>> unpack_codes(np.array([57, 1], np.uint8), bits=2, count=5)
    array([1, 2, 3, 0, 1], dtype=uint8)
    """
    xp = _namespace(packed)
    _check_bits(bits)
    capacity = packed.shape[0] * (8 // bits) if packed.ndim == 1 else -1
    if packed.dtype != xp.uint8 or not 0 <= count <= capacity:
        raise QuantizationError(
            f"unpack_codes needs a 1-d uint8 array holding at least count={count} codes at "
            f"{bits} bits; got shape {tuple(packed.shape)} dtype {_dtype_name(packed.dtype)}"
        )
    return _unpack(xp, packed, bits, count)


# ---- packing -------------------------------------------------------------------------------


def _pack(xp: Any, codes: Array, bits: int) -> Array:
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    padding = -codes.shape[0] % per_byte
    if padding:
        codes = xp.concat(
            [codes, xp.zeros((padding,), dtype=xp.uint8, device=array_api_compat.device(codes))]
        )
    columns = xp.reshape(codes, (-1, per_byte))
    packed = columns[:, 0] | (columns[:, 1] << bits)
    for k in range(2, per_byte):
        packed |= columns[:, k] << (k * bits)
    return packed


def _unpack(xp: Any, packed: Array, bits: int, count: int) -> Array:
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[:count]
    mask = 2**bits - 1
    fields = [(packed >> (k * bits)) & mask for k in range(per_byte)]
    return xp.reshape(xp.stack(fields, axis=1), (-1,))[:count]


# ---- helpers -------------------------------------------------------------------------------


def _namespace(x: Array) -> Any:
    try:
        return namespace(x)  # numpy itself for numpy arrays: no wrapper layer
    except TypeError as err:
        raise QuantizationError(
            f"expected an array (numpy, cupy or another array API library); got {type(x).__name__}"
        ) from err


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or bits not in ALLOWED_BITS:
        raise QuantizationError(f"bits must be one of {ALLOWED_BITS}; got {bits!r}")


def _check_group_size(group_size: int) -> None:
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, numbers.Integral)
        or group_size < 1
    ):
        raise QuantizationError(f"group_size must be a positive int; got {group_size!r}")


_real_floatings: dict[tuple[Any, Any], bool] = {}


def _real_floating(xp: Any, dtype: Any) -> bool:
    """`xp.isdtype(dtype, "real floating")`, remembered: asked ~3 times per saved value, at
    ~2.5 us a call on numpy."""
    key = (xp, dtype)
    found = _real_floatings.get(key)
    if found is None:
        found = _real_floatings[key] = bool(xp.isdtype(dtype, "real floating"))
    return found


def _check_quantizable_dtype(xp: Any, dtype: Any) -> None:
    if _real_floating(xp, dtype):
        return
    if xp.isdtype(dtype, "complex floating"):
        raise QuantizationError(
            f"quantize takes real floating arrays (float16/32/64); got {_dtype_name(dtype)}: "
            "quantize the real and imaginary parts separately"
        )
    raise QuantizationError(
        f"quantize takes real floating arrays (float16/32/64); got {_dtype_name(dtype)}: "
        "integer and bool arrays are stored exactly by the strategy (see worth_quantizing)"
    )


def _work_dtype(xp: Any, dtype: Any) -> Any:
    return xp.float64 if dtype == xp.float64 else xp.float32


def _rows_per_block(xp: Any, num_groups: int, group_size: int) -> int:
    """Groups per block: a multiple of 4 so every block but the last packs into whole bytes."""
    if array_api_compat.is_cupy_namespace(xp):
        return max(num_groups, 1)
    return max(4, _CPU_BLOCK_ELEMENTS // group_size // 4 * 4)


def _group_min_max(xp: Any, grid: Array) -> tuple[Array, Array]:
    """Per-row min and max of a block.

    numpy spends ~60 ns per row reducing along a short last axis, which made this the slowest
    step at 64-element groups; transposing the block (one copy, in cache) and reducing across
    rows element-wise is 2x faster up to ~128 columns. cupy has no such per-row cost.
    """
    rows, columns = grid.shape
    if columns > _TRANSPOSE_MAX_COLUMNS or array_api_compat.is_cupy_namespace(xp):
        return xp.min(grid, axis=1), xp.max(grid, axis=1)
    flat_t = xp.reshape(xp.permute_dims(grid, (1, 0)), (-1,))  # reshape copies in C order
    by_column = xp.reshape(flat_t, (columns, rows))
    return xp.min(by_column, axis=0), xp.max(by_column, axis=0)


def _ordinary_range(xp: Any, grid: Array, ordinary: Array) -> tuple[Array, Array]:
    """Per-row min and max over the ordinary entries; rows with none get the range [0, 0]."""
    lo = xp.min(xp.where(ordinary, grid, math.inf), axis=1)
    hi = xp.max(xp.where(ordinary, grid, -math.inf), axis=1)
    empty = lo > hi
    return xp.where(empty, 0.0, lo), xp.where(empty, 0.0, hi)


def _put_exact(xp: Any, flat: Array, indices: Array, values: Array) -> Array:
    """``flat`` with ``values`` at sorted ``indices``, from standard functions only.

    The standard has no scatter, so each position looks itself up in the sorted index list.
    """
    positions = xp.arange(flat.shape[0], dtype=indices.dtype, device=array_api_compat.device(flat))
    slot = xp.searchsorted(indices, positions)
    slot = xp.clip(slot, 0, indices.shape[0] - 1)
    hit = xp.take(indices, slot) == positions
    return xp.where(hit, xp.take(values, slot), flat)


# generator per namespace and device for ``seed=None``: fresh noise needs no new generator
_unseeded: dict[Any, Any] = {}


def _make_rng(xp: Any, seed: int | None) -> Any:
    """A generator that draws `seed`'s noise from its start, or, for ``seed=None``, the next
    draws of one generator kept per device. Why kept: making one costs 14 us on numpy (OS
    entropy, seed hashing) and, by the timings of seeded calls on an H100, about 0.6 ms on
    cupy, per saved value, while fresh noise only needs draws no earlier value used. (On
    numpy a seeded one is kept too, per thread, and rewound: `_numpy_rng`.)"""
    if array_api_compat.is_cupy_namespace(xp):
        import cupy

        make: Any = cupy.random.default_rng
        key: Any = ("cupy", cupy.cuda.Device().id)
    else:
        make, key = _numpy_rng, "numpy"
    if seed is not None:
        return make(seed)
    rng = _unseeded.get(key)
    if rng is None:
        rng = _unseeded[key] = make(None)
    return rng


# per thread: seed -> (a generator of that seed, its state at the start): a seeded call
# rewinds it (3 us) rather than making one (14-28 us: seed hashing), per saved value
_seeded = threading.local()
_MOST_SEEDS = 64


def _numpy_rng(seed: int | None) -> np.random.Generator:
    """`default_rng(seed)`'s generator at its start: made directly (14 us rather than 22),
    and for a seed this thread asked for before, that generator rewound."""
    if seed is None:
        return np.random.Generator(np.random.PCG64(None))
    known = getattr(_seeded, "generators", None)
    if known is None:
        known = _seeded.generators = {}
    try:
        kept = known.get(seed)
    except TypeError:  # a seed that cannot be a key (a list of ints): made each time
        return np.random.Generator(np.random.PCG64(seed))
    if kept is not None:
        kept[0].bit_generator.state = kept[1]
        return kept[0]
    if len(known) >= _MOST_SEEDS:
        known.clear()
    rng = np.random.Generator(np.random.PCG64(seed))
    known[seed] = (rng, rng.bit_generator.state)
    return rng


def _uniform_noise(xp: Any, rng: Any, shape: tuple[int, int], dtype: Any, device: Any) -> Array:
    """U[0, 1) noise in ``dtype`` on ``device``: drawn in place on cupy, else by numpy and moved."""
    if array_api_compat.is_cupy_namespace(xp):
        return rng.random(shape, dtype=dtype)
    np_dtype = np.float64 if dtype == xp.float64 else np.float32
    return xp.asarray(rng.random(shape, dtype=np_dtype), device=device)


def _concat_or_empty(xp: Any, parts: list[Array], dtype: Any, device: Any) -> Array:
    if not parts:
        return _empty(xp, dtype, device)
    return parts[0] if len(parts) == 1 else xp.concat(parts)


_empties: dict[Any, Array] = {}


def _empty(xp: Any, dtype: Any, device: Any) -> Array:
    """An empty array: on numpy one shared read-only array per dtype, so that a saved value
    without exceptions (nearly all of them) holds no two arrays of its own."""
    if not array_api_compat.is_numpy_namespace(xp):
        return xp.empty((0,), dtype=dtype, device=device)
    empty = _empties.get(dtype)
    if empty is None:
        empty = _empties[dtype] = np.empty((0,), dtype=dtype)
        empty.flags.writeable = False
    return empty


def _itemsize(xp: Any, dtype: Any) -> int:
    if dtype == xp.bool:
        return 1
    info = xp.finfo(dtype) if _real_floating(xp, dtype) else xp.iinfo(dtype)
    return info.bits // 8


def _array_nbytes(a: Array) -> int:
    nbytes = getattr(a, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    return math.prod(a.shape) * _itemsize(namespace(a), a.dtype)


def _dtype_name(dtype: Any) -> str:
    return str(getattr(dtype, "name", dtype)).rsplit(".", 1)[-1]
