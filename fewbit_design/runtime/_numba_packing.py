"""numba CPU kernels shared by the runtime's techniques: bit packing and a thread pool that runs a kernel over
a range (imported lazily: importing this module loads numba).

Codes are stored packed: groups of 8 consecutive elements in ``bits`` bytes, element k of a group in bits
[k*bits, (k+1)*bits) of the little-endian word (:mod:`fewbit_design.runtime._packing`). All kernels take flat
contiguous arrays and an element range [start, stop) with ``start`` a multiple of 8, so that ranges own whole
groups.

Parallelism: the kernels are serial ``@njit(cache=True, nogil=True)`` functions and :func:`run` splits the range
over a thread pool (as many parts as ``torch.get_num_threads()``; small inputs run in the calling thread). numba's
own ``parallel=True`` launches go through an OpenMP (or TBB / workqueue) pool that competes with torch's OpenMP pool:
on a loaded 2-core machine a ``prange`` launch of 8192 elements took 11 ms with the OpenMP layer against 0.1 ms
with the workqueue layer, and the layer is a process-wide choice the runtime should not make for its host.

Inside a kernel: serial loops with *unsigned* 64-bit indices (numba adds a negative-index check to every signed
index, which costs more than the work here; 64 bits address more than 2**31 elements). Every constant is a uint64 as
well, because numba types uint64 (op) int64 as float64.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

__all__ = ["CHUNK", "MIN_TASK", "run", "split", "pack_codes", "unpack_codes"]

CHUNK = 4096  # elements per phase-1 buffer (a multiple of 8)
MIN_TASK = 1 << 16  # elements below which a part is not worth a thread

_u64 = numba.uint64
_u8 = numba.uint8
_0 = np.uint64(0)
_1 = np.uint64(1)
_2 = np.uint64(2)
_7 = np.uint64(7)
_8 = np.uint64(8)
_4 = np.uint64(4)
_3 = np.uint64(3)
_16 = np.uint64(16)
_32 = np.uint64(32)
_FF = np.uint64(0xFF)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_LANES16 = np.uint64(0x0001000100010001)  # one in each 16-bit lane
_LANES32 = np.uint64(0x0000000100000001)  # one in each 32-bit lane
_CHUNK = np.uint64(CHUNK)


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c rounded once (llvm.fma.f32), float32."""
    signature = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, sig, args):
        single = ir.FloatType()
        function = builder.module.declare_intrinsic(
            "llvm.fma", [single], ir.FunctionType(single, [single, single, single])
        )
        return builder.call(function, args)

    return signature, codegen


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
def _expand(word, bits):
    # the inverse of _compress: the packed 8*bits-bit word -> 8 codes, one per byte (the halves apart, then the
    # 16-bit lanes of each 32-bit lane, then the bytes of each 16-bit lane): about 12 operations per 8 codes
    low = _low_mask(np.uint64(4) * bits)
    word = (word & low) | ((word << (_32 - np.uint64(4) * bits)) & (low << _32))
    low = _low_mask(np.uint64(2) * bits) * _LANES32
    word = (word & low) | ((word << (_16 - np.uint64(2) * bits)) & (low << _16))
    low = _low_mask(bits) * _LANES16
    return (word & low) | ((word << (_8 - bits)) & (low << _8))


@numba.njit(cache=True, inline="always")
def _pack_buffer(buffer, count, bits, out, first_group):
    # pack ``count`` codes of buffer into out from group ``first_group`` on; a partial last group is zero-padded.
    # 1, 2, 4 and 8 bits: whole codes per byte, loops LLVM vectorises (with ``bits`` a run-time value, as in the
    # group quantizer, the SWAR path's store loop does not: 4-bit group codes took 1.6x as long as 8-bit ones);
    # other widths: the SWAR compress of 8 codes (one uint64 load), stored byte by byte (an unaligned 8-byte store
    # per group measured 25% slower for 3-bit few-bit codes)
    for index in range(count, (count + _7) // _8 * _8):
        buffer[index] = 0
    groups = (count + _7) // _8
    if bits == _8:
        start = first_group * _8
        for index in range(groups * _8):
            out[start + index] = buffer[index]
    elif bits == _4:
        start = first_group * _4
        for byte in range(groups * _4):
            out[start + byte] = _u8(buffer[_2 * byte] | _u8(buffer[_2 * byte + _1] << _u8(4)))
    elif bits == _2:
        start = first_group * _2
        for byte in range(groups * _2):
            at = _4 * byte
            out[start + byte] = _u8(
                buffer[at]
                | _u8(buffer[at + _1] << _u8(2))
                | _u8(buffer[at + _2] << _u8(4))
                | _u8(buffer[at + _3] << _u8(6))
            )
    elif bits == _1:
        start = first_group
        for byte in range(groups):
            at = _8 * byte
            value = buffer[at]
            for k in range(1, 8):
                value |= _u8(buffer[at + _u64(k)] << _u8(k))
            out[start + byte] = value
    else:
        words = buffer.view(np.uint64)
        for group in range(groups):
            word = _compress(words[group], bits)
            offset = (first_group + group) * bits
            for byte in range(bits):
                out[offset + byte] = _u8((word >> (_8 * byte)) & _FF)


@numba.njit(cache=True, inline="always")
def _load_word(packed, group, bits):
    offset = group * bits
    word = _0
    for byte in range(bits):
        word |= _u64(packed[offset + byte]) << (_8 * byte)
    return word


@numba.njit(cache=True, inline="always")
def _unpack_buffer(packed, first_group, count, bits, buffer):
    # the inverse of _pack_buffer: ``count`` codes from group ``first_group`` on into buffer[0 .. count); 1, 2, 4 and
    # 8 bits byte by byte (loops LLVM vectorises, whole groups: ``buffer`` has room for the last group's padding)
    groups = (count + _7) // _8
    if bits == _8:
        start = first_group * _8
        for index in range(count):
            buffer[index] = packed[start + index]
    elif bits == _4:
        start = first_group * _4
        for byte in range(groups * _4):
            value = packed[start + byte]
            buffer[_2 * byte] = value & _u8(0xF)
            buffer[_2 * byte + _1] = value >> _u8(4)
    elif bits == _2:
        start = first_group * _2
        for byte in range(groups * _2):
            value = packed[start + byte]
            for k in range(4):
                buffer[_4 * byte + _u64(k)] = (value >> _u8(2 * k)) & _u8(3)
    elif bits == _1:
        for byte in range(groups):
            value = packed[first_group + byte]
            for k in range(8):
                buffer[_8 * byte + _u64(k)] = (value >> _u8(k)) & _u8(1)
    else:
        mask = _low_mask(bits)
        for group in range(groups):
            word = _load_word(packed, first_group + group, bits)
            base = group * _8
            for k in range(min(_8, count - base)):
                buffer[base + k] = _u8((word >> (_u64(k) * bits)) & mask)


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
    """Unpack codes [start, stop) from ``packed`` into ``out`` (any integer dtype): one word load per group."""
    ubits = _u64(bits)
    mask = _low_mask(ubits)
    begin = _u64(start)
    end = _u64(stop)
    for group in range(begin // _8, (end + _7) // _8):
        word = _load_word(packed, group, ubits)
        base = group * _8
        for i in range(max(base, begin), min(base + _8, end)):
            out[i] = (word >> ((i - base) * ubits)) & mask


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


def split(n: int, parts: int, grain: int = CHUNK) -> list[tuple[int, int]]:
    """[0, n) cut into ``parts`` ranges of nearly equal length whose starts are multiples of ``grain``."""
    chunks = -(-n // grain)
    parts = max(1, min(parts, chunks))
    edges = [min(n, (chunks * index // parts) * grain) for index in range(parts + 1)]
    return [(edges[index], edges[index + 1]) for index in range(parts) if edges[index] < edges[index + 1]]


def run(kernel, n: int, *args, threads: int | None = None, grain: int = CHUNK, min_task: int = MIN_TASK):
    """``kernel(*args, start, stop)`` over [0, n): in the calling thread for small n, else split over ``threads``
    (default ``torch.get_num_threads()``) ranges, one of them in the calling thread. Returns the sum of the parts'
    results for a kernel that returns a count (the quantize kernels count non-finite elements), else None.

    ``grain``: every range starts at a multiple of it; ``min_task``: the least n a part is worth a thread for (both
    in units of n: elements by default; the group quantizer of :mod:`.linear` runs over rows)."""
    if n <= 0:
        return None
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    if threads <= 1 or n < 2 * min_task:  # one part: no split, no pool (the fixed cost of a small call)
        return kernel(*args, 0, n)
    parts = split(n, min(threads, max(1, n // min_task)), grain)
    if len(parts) == 1:
        return kernel(*args, 0, n)
    futures = [_pool().submit(kernel, *args, start, stop) for start, stop in parts[1:]]
    results = [kernel(*args, *parts[0])] + [future.result() for future in futures]
    return None if results[0] is None else sum(results)
