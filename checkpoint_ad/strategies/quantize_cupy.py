"""One CUDA kernel per `quantize` and one per `dequantize` of a cupy array.

Why: the array-API path of `quantize.py` runs about twenty cupy kernels per saved value (group
min and max, the range check, step, inverse, scaling, rounding, the cast, one shift-and-or per
packed field) and `dequantize` about ten. On a GPU each is a launch of a few microseconds over
memory the previous one just wrote, so int8 storage of a large RNN cost 3.06x keep-all's time on
an H200 (`profiles/gpu`). Here one thread handles one group: its min and max, its step, and its
codes packed straight into their bytes.

The arithmetic is the array-API path's, operation for operation, with every product and sum
rounded on its own (``__fmul_rn``, ``__fadd_rn`` and their double forms, so the compiler
cannot fuse them into an FMA): the codes, mins and scales are the same bits, and stochastic
rounding adds the same noise from the same generator. Arrays the fused kernel does not take
(a value stored exactly: non-finite or too large; a group that does not fill whole bytes) go
to the general path, which is told so by a ``None``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_PREAMBLE = r"""
__device__ __forceinline__ float cad_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double cad_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float cad_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double cad_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float cad_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double cad_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float cad_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double cad_div(double a, double b) { return __ddiv_rn(a, b); }
"""

# One "element" per group: ``lo`` and ``step`` are the per-group outputs, the input, noise
# and packed codes are indexed by hand. ``flag`` is raised when a group holds a value the
# general path stores exactly (|v| > big, or nan: the comparison fails for it).
_QUANTIZE_BODY = r"""
const long long first = (long long)i * group_size;
const long long last_index = n - 1;
W mn = (W)x[first < n ? first : last_index];
W mx = mn;
bool ordinary = true;
for (int k = 0; k < group_size; ++k) {
    long long j = first + k;
    const W v = (W)x[j < n ? j : last_index];
    if (!(fabs(v) <= big)) ordinary = false;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
}
if (!ordinary) {
    atomicOr(&flag[0], 1);
    lo = 0;
    step = 0;
} else {
    const W levels = (W)((1 << bits) - 1);
    W s = cad_div(cad_sub(mx, mn), levels);
    const bool normal = s >= tiny;
    const W inverse = normal ? cad_div((W)1, s) : (W)0;
    if (!normal) s = 0;
    lo = mn;
    step = s;
    const int per_byte = 8 / bits;
    for (int k = 0; k < group_size; k += per_byte) {
        unsigned int packed = 0;
        for (int f = 0; f < per_byte; ++f) {
            const long long j = first + k + f;
            W t = cad_mul(cad_sub((W)x[j < n ? j : last_index], mn), inverse);
            if (stochastic) {
                t = floor(cad_add(t, noise[j]));
                t = t < (W)0 ? (W)0 : (t > levels ? levels : t);
            } else {
                t = rint(t);
            }
            packed |= ((unsigned int)(unsigned char)t) << (f * bits);
        }
        codes[(first + k) / per_byte] = (unsigned char)packed;
    }
}
"""

_DEQUANTIZE_BODY = r"""
const int per_byte = 8 / bits;
const unsigned int packed_byte = codes[i / per_byte];
const unsigned int code = (packed_byte >> ((int)(i % per_byte) * bits)) & ((1u << bits) - 1u);
const long long group = i / group_size;
out = (T)cad_add(cad_mul((W)code, scales[group]), mins[group]);
"""

_kernels: dict[str, Any] = {}


def _kernel(name: str) -> Any:
    """The compiled kernel, made on first use (cupy compiles and caches it per dtype)."""
    found = _kernels.get(name)
    if found is None:
        import cupy

        if name == "quantize":
            found = cupy.ElementwiseKernel(
                "raw T x, raw W noise, int64 n, int32 group_size, int32 bits, W big, W tiny, "
                "bool stochastic",
                "W lo, W step, raw uint8 codes, raw int32 flag",
                _QUANTIZE_BODY, name="cad_quantize_groups", preamble=_PREAMBLE)
        else:
            found = cupy.ElementwiseKernel(
                "raw uint8 codes, raw W mins, raw W scales, int32 group_size, int32 bits",
                "T out", _DEQUANTIZE_BODY, name="cad_dequantize", preamble=_PREAMBLE)
        _kernels[name] = found
    return found


def takes(size: int, group_size: int, bits: int) -> bool:
    """Whether the kernels take an array of `size` values: some values, and groups that fill
    whole bytes of codes (else the general path packs them)."""
    return bool(size) and group_size % (8 // bits) == 0


def quantize_groups(x: Any, bits: int, group_size: int, work: Any, big: float, tiny: float,
                    noise: Any | None) -> tuple[Any, Any, Any] | None:
    """(packed codes, mins, scales) of a cupy array the kernels take (`takes`), or None when
    a value must be stored exactly (the general path's). ``noise`` is U[0, 1) of shape
    (groups, group_size) in ``work`` for stochastic rounding, else None."""
    import cupy

    per_byte = 8 // bits
    size = x.size
    groups = -(-size // group_size)
    work = np.dtype(work).type
    with x.device:
        flat = cupy.ravel(x)
        codes = cupy.empty(groups * group_size // per_byte, dtype=cupy.uint8)
        lo = cupy.empty(groups, dtype=work)
        step = cupy.empty(groups, dtype=work)
        flag = cupy.zeros(1, dtype=cupy.int32)
        stochastic = noise is not None
        noise = lo if noise is None else cupy.ravel(noise)  # (lo: never read)
        _kernel("quantize")(flat, noise, np.int64(size), np.int32(group_size), np.int32(bits),
                            work(big), work(tiny), np.bool_(stochastic), lo, step, codes, flag)
        if int(flag[0]):  # one read back, as the general path's range check makes
            return None
    return codes, lo, step


def dequantize_groups(codes: Any, mins: Any, scales: Any, size: int, group_size: int,
                      bits: int, dtype: Any) -> Any:
    """The flat dequantized values (exceptions not yet put back) in ``dtype``."""
    import cupy

    with codes.device:
        out = cupy.empty(size, dtype=dtype)
        _kernel("dequantize")(codes, mins, scales, np.int32(group_size), np.int32(bits), out)
    return out
