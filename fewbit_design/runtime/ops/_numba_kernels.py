"""numba CPU kernels of the few-bit op and of bit packing (imported lazily: importing this module loads numba).

Terms (see :mod:`fewbit_design`): x is cut by sorted ``boundaries`` into intervals, interval m has code
``interval_codes[m]`` in [0, 2**bits), code c has level ``levels[c]``. Codes are stored packed: groups of 8
consecutive elements in ``bits`` bytes, element k of a group in bits [k*bits, (k+1)*bits) of the little-endian word
(:mod:`.packing`). All kernels take flat contiguous arrays and an element range [start, stop) with ``start`` a
multiple of 8, so that ranges own whole groups.

Parallelism: the kernels are serial ``@njit(cache=True, nogil=True)`` functions and :func:`run` splits the range
over a thread pool (as many parts as ``torch.get_num_threads()``; small inputs run in the calling thread). numba's
own ``parallel=True`` launches go through an OpenMP (or TBB / workqueue) pool that competes with torch's OpenMP pool:
on a loaded 2-core machine a ``prange`` launch of 8192 elements took 11 ms with the OpenMP layer against 0.1 ms
with the workqueue layer, and the layer is a process-wide choice the runtime should not make for its host.

Inside a kernel: serial loops with *unsigned* 64-bit indices (numba adds a negative-index check to every signed
index, which costs more than the work here; 64 bits address more than 2**31 elements). Every constant is a uint64 as
well, because numba types uint64 (op) int64 as float64.

Forward (quantize + pack), per chunk of ``CHUNK`` elements: phase 1 writes the codes to a small buffer, phase 2
packs the buffer 8 codes (one uint64 load) at a time with three SWAR steps. Phase 1 by input dtype:

* float32: a 65536-entry table indexed by the top 16 bits of x's bit pattern (sign, exponent, 7 mantissa bits)
  gives the code of the whole bucket; the few buckets that hold a boundary are marked and resolved by a second
  table entry t << 16 | A << 8 | B: code = A if low16 >= t else B. Built by
  :func:`fewbit_design.runtime.ops.fewbit.build_lut32` from the exact float32 comparisons when no bucket holds two
  code changes; otherwise the compare path runs. About 6 instructions per element, branch almost always predicted.
* float16 / bfloat16: code = table[bit pattern] (every 16-bit pattern has its code).
* float64 (and float32 without a table): interval = len(boundaries) - #(x < boundary), NaN in the last interval.

Backward (``unpack_scale``): grad_input = grad * levels[code], fused unpack + lookup + multiply per group.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

__all__ = [
    "CHUNK",
    "MIN_TASK",
    "SPLIT",
    "run",
    "quantize_pack_lut32",
    "quantize_pack_lut16",
    "quantize_pack_compare",
    "unpack_scale",
    "pack_codes",
    "unpack_codes",
    "warm_up",
]

CHUNK = 4096  # elements per phase-1 buffer (a multiple of 8)
MIN_TASK = 1 << 16  # elements below which a part is not worth a thread

_u64 = numba.uint64
_u8 = numba.uint8
_0 = np.uint64(0)
_1 = np.uint64(1)
_2 = np.uint64(2)
_7 = np.uint64(7)
_8 = np.uint64(8)
_16 = np.uint64(16)
_32 = np.uint64(32)
_FF = np.uint64(0xFF)
_FFFF = np.uint64(0xFFFF)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_LANES16 = np.uint64(0x0001000100010001)  # one in each 16-bit lane
_LANES32 = np.uint64(0x0000000100000001)  # one in each 32-bit lane
_CHUNK = np.uint64(CHUNK)
SPLIT = 0x100  # marks a bucket of the direct float32 table that holds a boundary
_SPLIT = np.uint64(SPLIT)


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
    # pack ``count`` codes of buffer into out from group ``first_group`` on; a partial last group is zero-padded
    for index in range(count, (count + _7) // _8 * _8):
        buffer[index] = 0
    words = buffer.view(np.uint64)
    for group in range((count + _7) // _8):
        word = _compress(words[group], bits)
        offset = (first_group + group) * bits
        for byte in range(bits):
            out[offset + byte] = _u8((word >> (_8 * byte)) & _FF)


def _make_quantize_pack_lut32(bits: int):
    BITS = np.uint64(bits)  # a closure constant: numba compiles (and caches) one kernel per bit width

    @numba.njit(cache=True, nogil=True)
    def quantize_pack_lut32(x_halves, direct, lut, out, start, stop):
        # x_halves: float32 x as uint16 pairs (low, high) per element, so the bucket (top 16 bits) is one load
        buffer = np.empty(CHUNK, dtype=np.uint8)
        for chunk in range(_u64(start), _u64(stop), _CHUNK):
            count = min(_CHUNK, _u64(stop) - chunk)
            base = chunk * _2
            for i in range(count):
                bucket = _u64(x_halves[base + _2 * i + _1])
                code = _u64(direct[bucket])
                if code == _SPLIT:
                    entry = _u64(lut[bucket])
                    low = _u64(x_halves[base + _2 * i])
                    code = ((entry >> _8) & _FF) if low >= (entry >> _16) else (entry & _FF)
                buffer[i] = _u8(code)
            _pack_buffer(buffer, count, BITS, out, chunk // _8)

    return quantize_pack_lut32


@functools.cache
def quantize_pack_lut32(bits: int):
    """The float32 kernel for ``bits``: ``kernel(x_halves, direct, lut, out, start, stop)``.

    ``x_halves`` is x viewed as uint16 (two per element, little-endian: the high half holds sign, exponent and 7
    mantissa bits, the bucket). ``direct`` (uint16[65536]) holds each bucket's code, or ``SPLIT`` for the few buckets
    that hold a boundary, whose ``lut`` (uint32[65536]) entry t << 16 | A << 8 | B gives code = A if low16 >= t else B.
    """
    return _make_quantize_pack_lut32(bits)


@numba.njit(cache=True, nogil=True)
def quantize_pack_lut16(x_bits, lut, bits, out, start, stop):
    """Codes of 16-bit floats (``x_bits``: uint16 bit patterns): code = lut[pattern], packed into ``out``."""
    ubits = _u64(bits)
    buffer = np.empty(CHUNK, dtype=np.uint8)
    for chunk in range(_u64(start), _u64(stop), _CHUNK):
        count = min(_CHUNK, _u64(stop) - chunk)
        for i in range(count):
            buffer[i] = lut[_u64(x_bits[chunk + i])]
        _pack_buffer(buffer, count, ubits, out, chunk // _8)


@numba.njit(cache=True, nogil=True)
def quantize_pack_compare(x, boundaries, interval_codes, bits, out, start, stop):
    """Codes of x (float32 or float64, compared in its own dtype with ``boundaries``), packed into ``out``."""
    ubits = _u64(bits)
    count_boundaries = _u64(boundaries.size)
    buffer = np.empty(CHUNK, dtype=np.uint8)
    for chunk in range(_u64(start), _u64(stop), _CHUNK):
        count = min(_CHUNK, _u64(stop) - chunk)
        for i in range(count):
            # interval = number of boundaries <= x = len(boundaries) - #(x < boundary); NaN: the last interval
            value = x[chunk + i]
            interval = count_boundaries
            for j in range(count_boundaries):
                interval -= _u64(value < boundaries[j])
            buffer[i] = interval_codes[interval]
        _pack_buffer(buffer, count, ubits, out, chunk // _8)


@numba.njit(cache=True, inline="always")
def _load_word(packed, group, bits):
    offset = group * bits
    word = _0
    for byte in range(bits):
        word |= _u64(packed[offset + byte]) << (_8 * byte)
    return word


def _make_unpack_scale(bits: int):
    BITS = np.uint64(bits)  # a closure constant: numba compiles (and caches) one kernel per bit width
    MASK = np.uint64((1 << bits) - 1)

    @numba.njit(cache=True, nogil=True)
    def unpack_scale(grad, packed, levels, out, start, stop):
        begin = _u64(start)
        end = _u64(stop)
        full_end = begin + (end - begin) // _8 * _8
        for group in range(begin // _8, full_end // _8):
            word = _load_word(packed, group, BITS)
            base = group * _8
            for k in range(_8):
                out[base + k] = grad[base + k] * levels[(word >> (k * BITS)) & MASK]
        if full_end < end:
            word = _load_word(packed, full_end // _8, BITS)
            for k in range(end - full_end):
                out[full_end + k] = grad[full_end + k] * levels[(word >> (k * BITS)) & MASK]

    return unpack_scale


@functools.cache
def unpack_scale(bits: int):
    """The backward kernel for ``bits``: ``kernel(grad, packed, levels, out, start, stop)`` writes
    out = grad * levels[code] (in the dtype of grad and levels), codes unpacked from ``packed``."""
    return _make_unpack_scale(bits)


@numba.njit(cache=True, nogil=True)
def pack_codes(codes, bits, out, start, stop):
    """Pack integer codes (any integer dtype; only the low ``bits`` bits are kept) into ``out``."""
    ubits = _u64(bits)
    mask = _low_mask(ubits)
    buffer = np.empty(CHUNK, dtype=np.uint8)
    for chunk in range(_u64(start), _u64(stop), _CHUNK):
        count = min(_CHUNK, _u64(stop) - chunk)
        for i in range(count):
            buffer[i] = _u8(_u64(codes[chunk + i]) & mask)
        _pack_buffer(buffer, count, ubits, out, chunk // _8)


@numba.njit(cache=True, nogil=True)
def unpack_codes(packed, bits, out, start, stop):
    """Unpack codes [start, stop) from ``packed`` into ``out`` (int64)."""
    ubits = _u64(bits)
    mask = _low_mask(ubits)
    for i in range(_u64(start), _u64(stop)):
        word = _load_word(packed, i // _8, ubits)
        out[i] = numba.int64((word >> ((i % _8) * ubits)) & mask)


# ----------------------------------------------------------------------------------------------------------------------
# Running a kernel over [0, n) in parallel


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 1) - 1), thread_name_prefix="fewbit")
        return _POOL


def _forget_pool() -> None:
    # a forked child inherits the pool object but not its threads
    global _POOL
    _POOL = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) cut into ``parts`` ranges of nearly equal length whose starts are multiples of ``CHUNK``."""
    chunks = -(-n // CHUNK)
    parts = max(1, min(parts, chunks))
    edges = [min(n, (chunks * index // parts) * CHUNK) for index in range(parts + 1)]
    return [(edges[index], edges[index + 1]) for index in range(parts) if edges[index] < edges[index + 1]]


def run(kernel, n: int, *args, threads: int | None = None) -> None:
    """``kernel(*args, start, stop)`` over [0, n): in the calling thread for small n, else split over ``threads``
    (default ``torch.get_num_threads()``) ranges, one of them in the calling thread."""
    if n <= 0:
        return
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    parts = split(n, min(threads, max(1, n // MIN_TASK)))
    if len(parts) == 1:
        kernel(*args, 0, n)
        return
    futures = [_pool().submit(kernel, *args, start, stop) for start, stop in parts[1:]]
    kernel(*args, *parts[0])
    for future in futures:
        future.result()


def warm_up(bits: int = 3) -> None:
    """Compile (or load from numba's cache) the float32 kernels for ``bits``, e.g. before timing."""
    x = np.zeros(9, np.float32)
    out = np.zeros(2 * bits, np.uint8)
    quantize_pack_lut32(bits)(x.view(np.uint16), np.zeros(65536, np.uint16), np.zeros(65536, np.uint32), out, 0, 9)
    unpack_scale(bits)(x, out, np.zeros(2**bits, np.float32), np.empty_like(x), 0, 9)
