"""numba CPU kernels of the few-bit op and of bit packing (imported lazily: importing this module loads numba).

Terms (see :mod:`fewbit_design`): x is cut by sorted ``boundaries`` into intervals, interval m has code
``interval_codes[m]`` in [0, 2**bits), code c has level ``levels[c]``. Codes are stored packed: groups of 8
consecutive elements in ``bits`` bytes, element k of a group in bits [k*bits, (k+1)*bits) of the little-endian word
(:mod:`.packing`). All kernels take flat contiguous arrays.

Structure: ``prange`` over chunks of ``CHUNK`` elements (a multiple of 8, so chunks own whole groups); inside a chunk,
serial loops with *unsigned* 64-bit indices (numba adds a negative-index check to every signed index, which costs
more than the work here, and 64 bits address more than 2**31 elements). Every constant is a uint64 as well: numba
types uint64 (op) int64 as float64.

Forward (quantize + pack), fused per chunk: phase 1 writes the chunk's codes to a small buffer, phase 2 packs the
buffer 8 codes (one uint64 load) at a time with three SWAR steps. Phase 1 by input dtype:

* float32: a 65536-entry table indexed by the top 16 bits of x's bit pattern (sign, exponent, 7 mantissa bits):
  entry = t << 16 | A << 8 | B, code = B, or A when t > 0 and low16 >= t (t > 0 only in the few buckets that hold a
  boundary, so the branch is almost always predicted). Built by :func:`fewbit_design.runtime.ops.fewbit.build_lut32`
  from the exact float32 comparisons, when no bucket holds two code changes; otherwise the compare path runs.
* float16 / bfloat16: code = table[bit pattern] (every 16-bit pattern has its code).
* float64 (and float32 without a table): interval = len(boundaries) - #(x < boundary), NaN in the last interval.

Backward (``unpack_scale``): grad_input = grad * levels[code], fused unpack + lookup + multiply per group.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

__all__ = [
    "CHUNK",
    "quantize_pack_lut32",
    "quantize_pack_lut16",
    "quantize_pack_compare",
    "unpack_scale",
    "pack_codes",
    "unpack_codes",
    "warm_up",
]

CHUNK = 8192  # elements per parallel chunk (a multiple of 8)

_u64 = numba.uint64
_u8 = numba.uint8
_0 = np.uint64(0)
_1 = np.uint64(1)
_8 = np.uint64(8)
_16 = np.uint64(16)
_32 = np.uint64(32)
_FF = np.uint64(0xFF)
_FFFF = np.uint64(0xFFFF)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_LANES16 = np.uint64(0x0001000100010001)  # one in each 16-bit lane
_LANES32 = np.uint64(0x0000000100000001)  # one in each 32-bit lane


@numba.njit(cache=True, inline="always")
def _low_mask(width):
    # (1 << width) - 1 for width in [0, 64]
    return _ALL if width >= np.uint64(64) else (_1 << width) - _1


@numba.njit(cache=True, inline="always")
def _compress(word, bits):
    # 8 codes, one per byte of ``word`` -> the packed 8*bits-bit word (code k at bits [k*bits, (k+1)*bits)):
    # merge neighbours in 16-bit lanes, then 32-bit lanes, then the two halves (a SWAR "pext" by 0x..0707 masks)
    low = _low_mask(bits) * _LANES16
    word = (word & low) | ((word >> (_8 - bits)) & (low << bits))
    low = _low_mask(np.uint64(2) * bits) * _LANES32
    word = (word & low) | ((word >> (_16 - np.uint64(2) * bits)) & (low << (np.uint64(2) * bits)))
    low = _low_mask(np.uint64(4) * bits)
    return (word & low) | ((word >> (_32 - np.uint64(4) * bits)) & (low << (np.uint64(4) * bits)))


@numba.njit(cache=True, inline="always")
def _pack_buffer(buffer, count, bits, out, first_group):
    # pack ``count`` codes (buffer zero-padded to a multiple of 8) into out, starting at group ``first_group``
    words = buffer.view(np.uint64)
    for group in range((count + np.uint64(7)) // _8):
        word = _compress(words[group], bits)
        offset = (first_group + group) * bits
        for byte in range(bits):
            out[offset + byte] = _u8((word >> (_8 * byte)) & _FF)


@numba.njit(cache=True, inline="always")
def _chunk_bounds(chunk, n):
    start = chunk * np.uint64(CHUNK)
    stop = min(start + np.uint64(CHUNK), n)
    return start, stop


@numba.njit(cache=True, parallel=True)
def quantize_pack_lut32(x_bits, lut, bits, out):
    """Codes of float32 x (``x_bits``: its uint32 bit patterns) through ``lut`` (uint32[65536]), packed into ``out``."""
    n = _u64(x_bits.size)
    ubits = _u64(bits)
    for chunk in prange((n + np.uint64(CHUNK - 1)) // np.uint64(CHUNK)):
        start, stop = _chunk_bounds(_u64(chunk), n)
        buffer = np.zeros(CHUNK, dtype=np.uint8)
        for i in range(start, stop):
            pattern = _u64(x_bits[i])
            entry = _u64(lut[pattern >> _16])
            threshold = entry >> _16
            code = entry & _FF
            if threshold != _0 and (pattern & _FFFF) >= threshold:
                code = (entry >> _8) & _FF
            buffer[i - start] = _u8(code)
        _pack_buffer(buffer, stop - start, ubits, out, start // _8)


@numba.njit(cache=True, parallel=True)
def quantize_pack_lut16(x_bits, lut, bits, out):
    """Codes of 16-bit floats (``x_bits``: uint16 bit patterns): code = lut[pattern], packed into ``out``."""
    n = _u64(x_bits.size)
    ubits = _u64(bits)
    for chunk in prange((n + np.uint64(CHUNK - 1)) // np.uint64(CHUNK)):
        start, stop = _chunk_bounds(_u64(chunk), n)
        buffer = np.zeros(CHUNK, dtype=np.uint8)
        for i in range(start, stop):
            buffer[i - start] = lut[_u64(x_bits[i])]
        _pack_buffer(buffer, stop - start, ubits, out, start // _8)


@numba.njit(cache=True, parallel=True)
def quantize_pack_compare(x, boundaries, interval_codes, bits, out):
    """Codes of x (float32 or float64, compared in its own dtype with ``boundaries``), packed into ``out``."""
    n = _u64(x.size)
    ubits = _u64(bits)
    count = _u64(boundaries.size)
    for chunk in prange((n + np.uint64(CHUNK - 1)) // np.uint64(CHUNK)):
        start, stop = _chunk_bounds(_u64(chunk), n)
        buffer = np.zeros(CHUNK, dtype=np.uint8)
        for i in range(start, stop):
            # interval = number of boundaries <= x = len(boundaries) - #(x < boundary); NaN: the last interval
            value = x[i]
            interval = count
            for j in range(count):
                interval -= _u64(value < boundaries[j])
            buffer[i - start] = interval_codes[interval]
        _pack_buffer(buffer, stop - start, ubits, out, start // _8)


@numba.njit(cache=True, inline="always")
def _load_word(packed, group, bits):
    offset = group * bits
    word = _0
    for byte in range(bits):
        word |= _u64(packed[offset + byte]) << (_8 * byte)
    return word


@numba.njit(cache=True, parallel=True)
def unpack_scale(grad, packed, levels, bits, out):
    """out = grad * levels[code] (in the dtype of grad and levels), codes unpacked from ``packed``."""
    n = _u64(grad.size)
    ubits = _u64(bits)
    mask = _low_mask(ubits)
    for chunk in prange((n + np.uint64(CHUNK - 1)) // np.uint64(CHUNK)):
        start, stop = _chunk_bounds(_u64(chunk), n)
        full_stop = start + (stop - start) // _8 * _8
        for group in range(start // _8, full_stop // _8):
            word = _load_word(packed, group, ubits)
            base = group * _8
            for k in range(_8):
                out[base + k] = grad[base + k] * levels[(word >> (k * ubits)) & mask]
        if full_stop < stop:
            word = _load_word(packed, full_stop // _8, ubits)
            for k in range(stop - full_stop):
                out[full_stop + k] = grad[full_stop + k] * levels[(word >> (k * ubits)) & mask]


@numba.njit(cache=True, parallel=True)
def pack_codes(codes, bits, out):
    """Pack integer codes (any integer dtype; only the low ``bits`` bits are kept) into ``out``."""
    n = _u64(codes.size)
    ubits = _u64(bits)
    mask = _low_mask(ubits)
    for chunk in prange((n + np.uint64(CHUNK - 1)) // np.uint64(CHUNK)):
        start, stop = _chunk_bounds(_u64(chunk), n)
        buffer = np.zeros(CHUNK, dtype=np.uint8)
        for i in range(start, stop):
            buffer[i - start] = _u8(_u64(codes[i]) & mask)
        _pack_buffer(buffer, stop - start, ubits, out, start // _8)


@numba.njit(cache=True, parallel=True)
def unpack_codes(packed, bits, out):
    """Unpack ``out.size`` codes from ``packed`` into ``out`` (int64)."""
    n = _u64(out.size)
    ubits = _u64(bits)
    mask = _low_mask(ubits)
    for chunk in prange((n + np.uint64(CHUNK - 1)) // np.uint64(CHUNK)):
        start, stop = _chunk_bounds(_u64(chunk), n)
        for i in range(start, stop):
            word = _load_word(packed, i // _8, ubits)
            out[i] = numba.int64((word >> ((i % _8) * ubits)) & mask)


def warm_up() -> None:
    """Compile (or load from numba's cache) the float32 kernels, e.g. before timing."""
    x = np.zeros(9, np.float32)
    out = np.zeros(6, np.uint8)
    quantize_pack_lut32(x.view(np.uint32), np.zeros(65536, np.uint32), 3, out)
    unpack_scale(x, out, np.zeros(8, np.float32), 3, np.empty_like(x))
