"""numba CPU kernels of the few-bit op and of bit packing (imported lazily: importing this module loads numba).

Terms (see :mod:`fewbit_design`): x is cut by sorted ``boundaries`` into intervals, interval m has code
``interval_codes[m]`` in [0, 2**bits), code c has level ``levels[c]``. Codes are stored packed: groups of 8
consecutive elements in ``bits`` bytes, element k of a group in bits [k*bits, (k+1)*bits) of the little-endian word
(:mod:`.packing`). Every kernel works on flat contiguous arrays, loops over groups with ``prange`` (int64 indices
throughout, so more than 2**31 elements are fine) and handles the last, partial group separately.

Quantizers (forward), all exact (they agree bitwise with ``torch.searchsorted(boundaries, x, right=True)``, NaN in
the last interval):

* ``quantize_pack_lut32``: float32 x. A 65536-entry table indexed by the top 16 bits of x's bit pattern (sign,
  exponent, 7 mantissa bits) holds, per bucket of floats, two codes and a threshold on the low 16 bits:
  code = A if low16 >= t else B. Built by :func:`fewbit_design.runtime.ops.fewbit.build_lut32` whenever no bucket
  holds more than one code change (else the compare kernel runs). About 10 scalar instructions per element.
* ``quantize_pack_lut16``: float16 / bfloat16 x: every 16-bit pattern has its code in a 65536-entry table.
* ``quantize_pack_compare``: any float x (float64, or float32 when the table has no LUT):
  interval = len(boundaries) - #(x < boundary).

Backward: ``unpack_scale``: grad_input = grad * levels[code], fused unpack + lookup + multiply.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

__all__ = [
    "quantize_pack_lut32",
    "quantize_pack_lut16",
    "quantize_pack_compare",
    "unpack_scale",
    "pack_codes",
    "unpack_codes",
]

_int64 = numba.int64
_uint8 = numba.uint8


@numba.njit(cache=True, inline="always")
def _store_word(out, group, bits, word):
    # byte i of the group = bits [8i, 8i+8) of the little-endian word
    offset = group * bits
    for byte in range(bits):
        out[offset + byte] = _uint8((word >> (8 * byte)) & 0xFF)


@numba.njit(cache=True, inline="always")
def _load_word(packed, group, bits):
    offset = group * bits
    word = _int64(0)
    for byte in range(bits):
        word |= _int64(packed[offset + byte]) << (8 * byte)
    return word


@numba.njit(cache=True, inline="always")
def _lut32_code(x_bits, index, lut):
    # bucket = top 16 bits of the pattern; code = A if low16 >= t else B, entry = t << 16 | A << 8 | B
    pattern = _int64(x_bits[index]) & 0xFFFFFFFF
    entry = _int64(lut[pattern >> 16]) & 0xFFFFFFFF
    return (entry >> (((pattern & 0xFFFF) >= (entry >> 16)) * 8)) & 0xFF


@numba.njit(cache=True, parallel=True)
def quantize_pack_lut32(x_bits, lut, bits, out):
    """Codes of float32 x (given as its int32 bit patterns) through ``lut``, packed into ``out``."""
    n = x_bits.size
    full = n // 8
    for group in prange(full):
        base = group * 8
        word = _int64(0)
        for k in range(8):
            word |= _lut32_code(x_bits, base + k, lut) << (k * bits)
        _store_word(out, group, bits, word)
    if full * 8 < n:
        word = _int64(0)
        for k in range(n - full * 8):
            word |= _lut32_code(x_bits, full * 8 + k, lut) << (k * bits)
        _store_word(out, full, bits, word)


@numba.njit(cache=True, parallel=True)
def quantize_pack_lut16(x_bits, lut, bits, out):
    """Codes of 16-bit floats (given as uint16 bit patterns): code = lut[pattern], packed into ``out``."""
    n = x_bits.size
    full = n // 8
    for group in prange(full):
        base = group * 8
        word = _int64(0)
        for k in range(8):
            word |= _int64(lut[x_bits[base + k]]) << (k * bits)
        _store_word(out, group, bits, word)
    if full * 8 < n:
        word = _int64(0)
        for k in range(n - full * 8):
            word |= _int64(lut[x_bits[full * 8 + k]]) << (k * bits)
        _store_word(out, full, bits, word)


@numba.njit(cache=True, inline="always")
def _compare_code(x, index, boundaries, interval_codes):
    # interval = number of boundaries <= x = len(boundaries) - #(x < boundary); NaN lands in the last interval
    value = x[index]
    interval = boundaries.size
    for j in range(boundaries.size):
        interval -= value < boundaries[j]
    return _int64(interval_codes[interval])


@numba.njit(cache=True, parallel=True)
def quantize_pack_compare(x, boundaries, interval_codes, bits, out):
    """Codes of x (float32 or float64, compared in its own dtype with ``boundaries``), packed into ``out``."""
    n = x.size
    full = n // 8
    for group in prange(full):
        base = group * 8
        word = _int64(0)
        for k in range(8):
            word |= _compare_code(x, base + k, boundaries, interval_codes) << (k * bits)
        _store_word(out, group, bits, word)
    if full * 8 < n:
        word = _int64(0)
        for k in range(n - full * 8):
            word |= _compare_code(x, full * 8 + k, boundaries, interval_codes) << (k * bits)
        _store_word(out, full, bits, word)


@numba.njit(cache=True, parallel=True)
def unpack_scale(grad, packed, levels, bits, out):
    """out = grad * levels[code] (in the dtype of grad and levels), codes unpacked from ``packed``."""
    n = grad.size
    full = n // 8
    mask = (1 << bits) - 1
    for group in prange(full):
        word = _load_word(packed, group, bits)
        base = group * 8
        for k in range(8):
            out[base + k] = grad[base + k] * levels[(word >> (k * bits)) & mask]
    if full * 8 < n:
        word = _load_word(packed, full, bits)
        for k in range(n - full * 8):
            out[full * 8 + k] = grad[full * 8 + k] * levels[(word >> (k * bits)) & mask]


@numba.njit(cache=True, parallel=True)
def pack_codes(codes, bits, out):
    """Pack integer codes (any integer dtype, values masked to ``bits`` bits) into ``out``."""
    n = codes.size
    groups = (n + 7) // 8
    mask = (1 << bits) - 1
    for group in prange(groups):
        base = group * 8
        word = _int64(0)
        for k in range(min(8, n - base)):
            word |= (_int64(codes[base + k]) & mask) << (k * bits)
        _store_word(out, group, bits, word)


@numba.njit(cache=True, parallel=True)
def unpack_codes(packed, bits, out):
    """Unpack ``out.size`` codes from ``packed`` into ``out`` (int64)."""
    n = out.size
    groups = (n + 7) // 8
    mask = (1 << bits) - 1
    for group in prange(groups):
        word = _load_word(packed, group, bits)
        base = group * 8
        for k in range(min(8, n - base)):
            out[base + k] = (word >> (k * bits)) & mask


def warm_up() -> None:
    """Compile (or load from the cache) the float32 kernels once, e.g. before timing."""
    x = np.zeros(9, np.float32)
    out = np.zeros(6, np.uint8)
    quantize_pack_lut32(x.view(np.int32), np.zeros(65536, np.int32), 3, out)
    quantize_pack_compare(x, np.zeros(1, np.float32), np.zeros(2, np.uint8), 3, out)
    unpack_scale(x, out, np.zeros(8, np.float32), 3, np.empty_like(x))
