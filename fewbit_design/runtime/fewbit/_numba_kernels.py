"""numba CPU kernels of the few-bit op (imported lazily: importing this module loads numba).

Terms (see :mod:`fewbit_design`): x is cut by sorted ``boundaries`` into intervals, interval m has code
``interval_codes[m]`` in [0, 2**bits), code c has level ``levels[c]``. Codes are stored packed: groups of 8
consecutive elements in ``bits`` bytes, element k of a group in bits [k*bits, (k+1)*bits) of the little-endian word
(:mod:`.._packing`). All kernels take flat contiguous arrays and an element range [start, stop) with ``start`` a
multiple of 8, so that ranges own whole groups.

Packing and the thread pool that runs a kernel over a range are shared with the other techniques and live in
:mod:`fewbit_design.runtime._numba_packing`.

Forward (quantize + pack), per chunk of ``CHUNK`` elements: phase 1 writes the codes to a small buffer, phase 2
packs the buffer 8 codes (one uint64 load) at a time with three SWAR steps. Phase 1 by input dtype:

* float32: a 65536-entry table indexed by the top 16 bits of x's bit pattern (sign, exponent, 7 mantissa bits)
  gives the code of the whole bucket; the few buckets that hold a boundary are marked and resolved by a second
  table entry t << 16 | A << 8 | B: code = A if low16 >= t else B. Built by
  :func:`~.backends.build_lut32` from the exact float32 comparisons; the rare buckets that hold
  several code changes are resolved by a binary search over the boundaries. About 6 instructions per element, branch
  almost always predicted.
  Tables with many boundaries (more than ``backends.BRANCHLESS_SPLITS`` split buckets: 5-8 bits) use
  :func:`quantize_pack_lut32_branchless` instead, which resolves every element through the second table without a
  branch (the branch would be mispredicted on a large share of the elements).
  Tables with few boundaries at 1-7 bits use :func:`quantize_pack_lut32_fixup`: a uint8 table gives every element
  its bucket's code without a branch and lists the rare elements of marked buckets (boundaries, NaN, +-inf) for a
  second pass (28% faster on 2^14-2^18 elements). Tables with at most ``STEPS_BOUNDARIES`` boundaries
  (:mod:`._cpu_tables`) use :func:`quantize_pack_steps32`: a vectorised compare-and-add per boundary, no lookup.
* float16 / bfloat16: code = table[bit pattern] (every 16-bit pattern has its code); tables with at most
  ``STEPS_BOUNDARIES`` boundaries use :func:`quantize_pack_steps16`, a vectorised integer compare-and-add per
  boundary on the pattern's order-preserving key.
* float64 (and float32 without a table): interval = len(boundaries) - #(x < boundary), NaN in the last interval.
* a table with one boundary (relu's, and every 1-bit table of a monotone derivative): one comparison per element
  (:func:`threshold_pack32`, :func:`threshold_pack16`: 16-bit patterns compared as integers), a loop LLVM
  vectorises; with ``relu`` the same pass writes y = relu(x), so few-bit relu reads x once.

Every quantize kernel returns the number of non-finite elements (NaN, +-inf) of its range, read from the same
loads (the exponent bits), so the forward's non-finite record (:func:`~.ops.nonfinite_record`) needs no pass of its
own over x in the common, all-finite case.

Backward (``unpack_scale``): grad_input = grad * levels[code] (+0 where the level is 0, as torch selects), fused
unpack + lookup + multiply per group.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from .._numba_packing import (
    _CHUNK,
    _FF,
    CHUNK,
    MIN_TASK,
    _1,
    _2,
    _7,
    _8,
    _16,
    _expand,
    _load_word,
    _pack_buffer,
    _u8,
    _u64,
    run,
    split,
)

__all__ = [
    "CHUNK",
    "MIN_TASK",
    "SPLIT",
    "SPLIT_MULTI",
    "MULTI",
    "run",
    "split",
    "quantize_pack_lut32",
    "quantize_pack_lut32_branchless",
    "quantize_pack_lut32_fixup",
    "quantize_pack_steps32",
    "RESOLVE",
    "quantize_pack_lut16",
    "quantize_pack_steps16",
    "quantize_pack_compare",
    "threshold_pack32",
    "threshold_pack16",
    "unpack_scale",
    "unpack_scale16",
    "float32_to_16",
    "warm_up",
]

SPLIT = 0x100  # marks a bucket of the direct float32 table that holds a boundary
_SPLIT = np.uint64(SPLIT)
SPLIT_MULTI = 0x200  # ... that holds several (resolved by a binary search)
_SPLIT_MULTI = np.uint64(SPLIT_MULTI)
MULTI = 0xFF00  # the lut entry of such a bucket (backends.MULTI)
_MULTI = np.uint64(MULTI)
_u32 = numba.uint32
_i16 = numba.int16
RESOLVE = 0xFF  # marks a bucket of quantize_pack_lut32_fixup's uint8 table that the second pass resolves
_RESOLVE = np.uint8(RESOLVE)
_EXPONENT32 = np.uint64(0x7F80)  # the exponent bits of a float32's high half: all set for NaN and +-inf


@numba.njit(cache=True, nogil=True, inline="always")
def _search_code(value, boundaries, interval_codes):
    """interval_codes[number of boundaries <= value] by binary search; NaN: the last interval (as the compare
    kernel: ``value < boundary`` is false for NaN)."""
    low = _u64(0)
    high = _u64(boundaries.size)
    while low < high:
        middle = (low + high) >> _1
        if value < boundaries[middle]:
            high = middle
        else:
            low = middle + _1
    return _u64(interval_codes[low])


@numba.njit(cache=True, nogil=True)
def _resolve_chunk(buffer, positions, count, x_halves, x, chunk, direct, lut, boundaries, interval_codes):
    """Writes to ``buffer`` the codes of the chunk's elements ``positions[:count]`` (None: all ``count``) of float32
    x from ``chunk`` on (``x_halves``: its uint16 halves), read from the direct table: ``SPLIT``, a bucket that holds
    a boundary, resolved by its ``lut`` entry; ``SPLIT_MULTI``, several, resolved by a binary search. Returns how
    many of them are non-finite (the exponent bits of the high half, all set). One call per chunk: sharing the
    element step as a function (numba ``inline="always"`` or a call) made quantize_pack_lut32 11x slower."""
    base = chunk * _2
    nonfinite = _u64(0)
    for j in range(count):
        if positions is None:  # numba compiles one kernel for None, one for an array: no branch per element
            i = _u64(j)
        else:
            i = _u64(positions[j])
        bucket = _u64(x_halves[base + _2 * i + _1])
        nonfinite += _u64((bucket & _EXPONENT32) == _EXPONENT32)
        code = _u64(direct[bucket])
        if code == _SPLIT:
            entry = _u64(lut[bucket])
            low = _u64(x_halves[base + _2 * i])
            code = ((entry >> _8) & _FF) if low >= (entry >> _16) else (entry & _FF)
        elif code == _SPLIT_MULTI:
            code = _search_code(x[chunk + i], boundaries, interval_codes)
        buffer[i] = _u8(code)
    return nonfinite


def _make_quantize_pack_lut32(bits: int):
    BITS = np.uint64(bits)  # a closure constant: numba compiles (and caches) one kernel per bit width

    @numba.njit(cache=True, nogil=True)
    def quantize_pack_lut32(x_halves, direct, lut, x, boundaries, interval_codes, out, start, stop):
        # x_halves: float32 x as uint16 pairs (low, high) per element, so the bucket (top 16 bits) is one load
        buffer = np.empty(CHUNK, dtype=np.uint8)
        nonfinite = _u64(0)
        for chunk in range(_u64(start), _u64(stop), _CHUNK):
            count = min(_CHUNK, _u64(stop) - chunk)
            nonfinite += _resolve_chunk(
                buffer, None, count, x_halves, x, chunk, direct, lut, boundaries, interval_codes
            )
            _pack_buffer(buffer, count, BITS, out, chunk // _8)
        return nonfinite

    return quantize_pack_lut32


@functools.cache
def quantize_pack_lut32(bits: int):
    """The float32 kernel for ``bits``: ``kernel(x_halves, direct, lut, x, boundaries, interval_codes, out, start,
    stop)``.

    ``x_halves`` is x viewed as uint16 (two per element, little-endian: the high half holds sign, exponent and 7
    mantissa bits, the bucket). ``direct`` (uint16[65536]) holds each bucket's code, or ``SPLIT`` for the few buckets
    that hold a boundary, whose ``lut`` (uint32[65536]) entry t << 16 | A << 8 | B gives code = A if low16 >= t else B,
    or ``SPLIT_MULTI`` for the rare buckets holding several boundaries, resolved by a binary search of x (float32) in
    ``boundaries`` (the float32 boundaries, rounded up) giving ``interval_codes``.
    """
    return _make_quantize_pack_lut32(bits)


def _make_quantize_pack_lut32_fixup(bits: int):
    BITS = np.uint64(bits)

    @numba.njit(cache=True, nogil=True)
    def quantize_pack_lut32_fixup(x_halves, direct8, direct, lut, x, boundaries, interval_codes, out, start, stop):
        # pass 1: code = direct8[bucket] for every element, with no branch; the positions of the elements whose
        # bucket is marked RESOLVE (it holds a boundary, or it is NaN / +-inf, which are counted here) are listed
        # branch-free. Pass 2 resolves those few (under 1% of N(0, 1) input for 3-bit tables) as
        # quantize_pack_lut32 does. 2^18 float32, 3 bits, one thread: 160 us against 225 us.
        buffer = np.empty(CHUNK, dtype=np.uint8)
        positions = np.empty(CHUNK, dtype=np.uint32)
        nonfinite = _u64(0)
        for chunk in range(_u64(start), _u64(stop), _CHUNK):
            count = min(_CHUNK, _u64(stop) - chunk)
            base = chunk * _2
            listed = 0
            for i in range(count):
                code = direct8[x_halves[base + _2 * i + _1]]
                buffer[i] = code
                positions[listed] = i
                listed += code == _RESOLVE
            nonfinite += _resolve_chunk(
                buffer, positions, listed, x_halves, x, chunk, direct, lut, boundaries, interval_codes
            )
            _pack_buffer(buffer, count, BITS, out, chunk // _8)
        return nonfinite

    return quantize_pack_lut32_fixup


@functools.cache
def quantize_pack_lut32_fixup(bits: int):
    """The float32 kernel of tables with few boundaries at 1-7 bits: ``kernel(x_halves, direct8, direct, lut, x,
    boundaries, interval_codes, out, start, stop)``, the result of :func:`quantize_pack_lut32`. ``direct8``
    (uint8[65536]) is ``direct`` with ``RESOLVE`` (0xFF: no code below 8 bits) at the buckets that hold a boundary
    and at the NaN / +-inf buckets, whose elements a second pass resolves (and counts, for the non-finite ones)."""
    if bits >= 8:
        raise ValueError("quantize_pack_lut32_fixup marks buckets with 0xFF, a code at 8 bits")
    return _make_quantize_pack_lut32_fixup(bits)


def _make_quantize_pack_steps32(bits: int):
    BITS = np.uint64(bits)

    @numba.njit(cache=True, nogil=True)
    def quantize_pack_steps32(x, boundaries, steps, first, last, out, start, stop):
        # code = first + sum of steps[j] over the boundaries j <= x (mod 256; steps[j] = code after boundary j minus
        # code before it), NaN: last. One loop per boundary over the chunk, each a compare and an add that LLVM
        # vectorises (no gather): with 9 boundaries 35% faster than quantize_pack_lut32_fixup (2^18 float32).
        buffer = np.empty(CHUNK, dtype=np.uint8)
        nonfinite = _u64(0)
        for chunk in range(_u64(start), _u64(stop), _CHUNK):
            count = min(_CHUNK, _u64(stop) - chunk)
            block = x[chunk : chunk + count]
            for i in range(count):
                buffer[i] = first
            for j in range(boundaries.size):
                boundary = boundaries[j]
                step = steps[j]
                for i in range(count):
                    buffer[i] += step if block[i] >= boundary else _u8(0)
            for i in range(count):
                value = block[i]
                difference = value - value  # NaN exactly when value is NaN or +-inf
                nonfinite += _u64(difference != difference)
                buffer[i] = last if value != value else buffer[i]
            _pack_buffer(buffer, count, BITS, out, chunk // _8)
        return nonfinite

    return quantize_pack_steps32


@functools.cache
def quantize_pack_steps32(bits: int):
    """The float32 kernel of tables with a few boundaries: ``kernel(x, boundaries, steps, first, last, out, start,
    stop)``: code = ``first`` + the ``steps`` (uint8, mod 256) of the ``boundaries`` (float32, rounded up) <= x,
    ``last`` for NaN; the result of :func:`quantize_pack_lut32`, computed without table lookups."""
    return _make_quantize_pack_steps32(bits)


def _make_quantize_pack_lut32_branchless(bits: int):
    BITS = np.uint64(bits)

    @numba.njit(cache=True, nogil=True)
    def quantize_pack_lut32_branchless(x_halves, lut, x, boundaries, interval_codes, out, start, stop):
        # every element reads its bucket's entry t << 16 | A << 8 | B (t = 0, A = B for buckets without a boundary)
        # and picks A or B with arithmetic, not a branch: code = A * above + B * (1 - above), above = low16 >= t.
        # The only branch, for the rare buckets holding several boundaries (entry MULTI), is almost never taken.
        buffer = np.empty(CHUNK, dtype=np.uint8)
        nonfinite = _u64(0)
        for chunk in range(_u64(start), _u64(stop), _CHUNK):
            count = min(_CHUNK, _u64(stop) - chunk)
            base = chunk * _2
            # 8 bits: one code per byte, written in place (no buffer, no packing); BITS is a compile-time constant
            target = out[chunk : chunk + count] if BITS == _8 else buffer
            for i in range(count):
                bucket = _u64(x_halves[base + _2 * i + _1])
                nonfinite += _u64((bucket & _EXPONENT32) == _EXPONENT32)
                entry = _u64(lut[bucket])
                if entry == _MULTI:
                    target[i] = _u8(_search_code(x[chunk + i], boundaries, interval_codes))
                    continue
                above = _u64(_u64(x_halves[base + _2 * i]) >= (entry >> _16))
                target[i] = _u8((((entry >> _8) & _FF) * above) | ((entry & _FF) * (_1 - above)))
            if BITS != _8:
                _pack_buffer(buffer, count, BITS, out, chunk // _8)
        return nonfinite

    return quantize_pack_lut32_branchless


@functools.cache
def quantize_pack_lut32_branchless(bits: int):
    """The float32 kernel for tables with many boundaries: ``kernel(x_halves, lut, x, boundaries, interval_codes, out,
    start, stop)``.

    Same result as :func:`quantize_pack_lut32`, reading only ``lut``. With many boundaries (5-8 bits) a large share
    of typical inputs falls in buckets that hold a boundary (28% of N(0, 1) samples for the 8-bit GELU table), where
    :func:`quantize_pack_lut32`'s branch is mispredicted: on 2^22 float32, 21.2 ms against 6.2 ms here, while 3-bit
    tables run 5.4 ms there against 6.3 ms here (2-core dev machine, one thread).
    """
    return _make_quantize_pack_lut32_branchless(bits)


def _make_quantize_pack_steps16(bits: int):
    BITS = np.uint64(bits)

    @numba.njit(cache=True, nogil=True)
    def quantize_pack_steps16(x_bits, keys, steps, first, last, exponent, out, start, stop):
        # quantize_pack_steps32 for 16-bit floats compared as integers: the signed key of a pattern (the pattern for
        # positives, its magnitude bits flipped for negatives) grows with the value, so x >= boundary j exactly when
        # key >= keys[j] (for non-NaN x; checked on every pattern where the kernel is chosen). Signed 16-bit lanes
        # have a vector compare in AVX2, so each boundary's loop vectorises: 2^18 bfloat16, 9 boundaries, one
        # thread: 79 us against 119 us for the 65536-entry table (a scalar gather per element).
        buffer = np.empty(CHUNK, dtype=np.uint8)
        key = np.empty(CHUNK, dtype=np.int16)
        nonfinite = _u64(0)
        mask = numba.uint16(exponent)
        for chunk in range(_u64(start), _u64(stop), _CHUNK):
            count = min(_CHUNK, _u64(stop) - chunk)
            for i in range(count):
                pattern = _i16(x_bits[chunk + i])
                key[i] = _i16(pattern ^ _i16(_i16(pattern >> _i16(15)) & _i16(0x7FFF)))
                buffer[i] = first
            for j in range(keys.size):
                threshold = keys[j]
                step = steps[j]
                for i in range(count):
                    buffer[i] += step if key[i] >= threshold else _u8(0)
            found = _u32(0)
            for i in range(count):  # NaN (exponent all ones, mantissa non-zero): the last interval's code
                pattern = x_bits[chunk + i]
                buffer[i] = last if numba.uint16(pattern & numba.uint16(0x7FFF)) > mask else buffer[i]
                found += _u32(numba.uint16(pattern & mask) == mask)
            nonfinite += _u64(found)
            _pack_buffer(buffer, count, BITS, out, chunk // _8)
        return nonfinite

    return quantize_pack_steps16


@functools.cache
def quantize_pack_steps16(bits: int):
    """The float16 / bfloat16 kernel of tables with a few boundaries: ``kernel(x_bits, keys, steps, first, last,
    exponent, out, start, stop)`` with x as uint16 bit patterns: code = ``first`` + the ``steps`` (uint8, mod 256) of
    the boundaries whose signed key (int16 ``keys``) is <= x's, ``last`` for NaN (``exponent``: the exponent mask);
    the result of :func:`quantize_pack_lut16`, without its table lookups. Returns the number of non-finite
    elements."""
    return _make_quantize_pack_steps16(bits)


def _make_quantize_pack_lut16(bits: int):
    BITS = np.uint64(bits)  # a closure constant: packing with a run-time bit width cost a third of the kernel

    @numba.njit(cache=True, nogil=True)
    def quantize_pack_lut16(x_bits, lut, exponent, out, start, stop):
        mask = _u64(exponent)
        buffer = np.empty(CHUNK, dtype=np.uint8)
        nonfinite = _u64(0)
        for chunk in range(_u64(start), _u64(stop), _CHUNK):
            count = min(_CHUNK, _u64(stop) - chunk)
            for i in range(count):
                buffer[i] = lut[x_bits[chunk + i]]
            # counted in a loop of its own, which LLVM vectorises (inside the lookup loop it cost as much as the
            # lookup: 2^18 bfloat16 elements, 3 bits, one thread: 200 us there, 116 us here)
            for i in range(count):
                nonfinite += _u64((_u64(x_bits[chunk + i]) & mask) == mask)
            _pack_buffer(buffer, count, BITS, out, chunk // _8)
        return nonfinite

    return quantize_pack_lut16


@functools.cache
def quantize_pack_lut16(bits: int):
    """The 16-bit kernel for ``bits``: ``kernel(x_bits, lut, exponent, out, start, stop)``: codes of 16-bit floats
    (``x_bits``: uint16 bit patterns), code = lut[pattern], packed into ``out``; returns the number of non-finite
    elements (``exponent``: the exponent mask, 0x7C00 for float16, 0x7F80 for bfloat16)."""
    return _make_quantize_pack_lut16(bits)


@numba.njit(cache=True, nogil=True)
def quantize_pack_compare(x, boundaries, interval_codes, bits, out, start, stop):
    """Codes of x (float32 or float64, compared in its own dtype with ``boundaries``), packed into ``out``; returns
    the number of non-finite elements."""
    ubits = _u64(bits)
    count_boundaries = _u64(boundaries.size)
    buffer = np.empty(CHUNK, dtype=np.uint8)
    nonfinite = _u64(0)
    for chunk in range(_u64(start), _u64(stop), _CHUNK):
        count = min(_CHUNK, _u64(stop) - chunk)
        for i in range(count):
            # interval = number of boundaries <= x = len(boundaries) - #(x < boundary); NaN: the last interval
            value = x[chunk + i]
            difference = value - value  # NaN exactly when value is NaN or +-inf
            nonfinite += _u64(difference != difference)
            interval = count_boundaries
            for j in range(count_boundaries):
                interval -= _u64(value < boundaries[j])
            buffer[i] = interval_codes[interval]
        _pack_buffer(buffer, count, ubits, out, chunk // _8)
    return nonfinite


def _make_threshold_pack32(bits: int, relu: bool):
    BITS = np.uint64(bits)
    RELU = relu  # also write y = relu(x) (a compile-time constant: one kernel per bit width and flag)

    @numba.njit(cache=True, nogil=True)
    def threshold_pack32(x, boundary, below, above, y, out, start, stop):
        # one boundary: code = above if x >= boundary or x is NaN, else below; branch-free selects, so LLVM
        # vectorises the loop (the 65536-entry LUT is a scalar gather: 4x slower here)
        buffer = np.empty(CHUNK, dtype=np.uint8)
        nonfinite = _u64(0)
        zero = np.float32(0)
        for chunk in range(_u64(start), _u64(stop), _CHUNK):
            count = min(_CHUNK, _u64(stop) - chunk)
            for i in range(count):
                value = x[chunk + i]
                buffer[i] = above if (value >= boundary) | (value != value) else below
                difference = value - value  # NaN exactly when value is NaN or +-inf
                nonfinite += _u64(difference != difference)
                if RELU:
                    # torch's relu of a finite x: +0 below 0, else x itself (-0 stays -0); non-finite elements make
                    # the caller run torch's relu instead (its NaN payloads depend on the tensor's size)
                    y[chunk + i] = zero if value < zero else value
            _pack_buffer(buffer, count, BITS, out, chunk // _8)
        return nonfinite

    return threshold_pack32


@functools.cache
def threshold_pack32(bits: int, relu: bool):
    """The float32 kernel of a table with one boundary: ``kernel(x, boundary, below, above, y, out, start, stop)``
    packs code = ``above`` where x >= ``boundary`` (float32, rounded up) or x is NaN, else ``below``, and with
    ``relu`` writes y = relu(x) for finite x (torch's result; y of a non-finite x is left for the caller); returns
    the number of non-finite elements."""
    return _make_threshold_pack32(bits, relu)


def _make_threshold_pack16(bits: int, relu: bool):
    BITS = np.uint64(bits)
    RELU = relu

    @numba.njit(cache=True, nogil=True)
    def threshold_pack16(x_bits, key, exponent, below, above, y_bits, out, start, stop):
        # 16-bit floats compared as integers: the key of a pattern (sign flipped for positives, all bits flipped for
        # negatives) grows with the value, so x >= boundary exactly when key(x) >= ``key`` (checked on all patterns
        # where the kernel is chosen); NaN (exponent all ones, mantissa non-zero) takes ``above``
        buffer = np.empty(CHUNK, dtype=np.uint8)
        nonfinite = _u64(0)
        mask = _u32(exponent)
        threshold = _u32(key)
        for chunk in range(_u64(start), _u64(stop), _CHUNK):
            count = min(_CHUNK, _u64(stop) - chunk)
            for i in range(count):
                pattern = _u32(x_bits[chunk + i])
                flip = _u32(_u32(_u32(pattern >> _u32(15)) * _u32(0x7FFF)) | _u32(0x8000))
                nan = _u32(pattern & _u32(0x7FFF)) > mask
                buffer[i] = above if (_u32(pattern ^ flip) >= threshold) | nan else below
                nonfinite += _u64(_u32(pattern & mask) == mask)
                if RELU:  # finite x: +0 for a negative x other than -0, else x
                    y_bits[chunk + i] = numba.uint16(_u32(0) if pattern > _u32(0x8000) else pattern)
            _pack_buffer(buffer, count, BITS, out, chunk // _8)
        return nonfinite

    return threshold_pack16


@functools.cache
def threshold_pack16(bits: int, relu: bool):
    """The float16 / bfloat16 kernel of a table with one boundary: ``kernel(x_bits, key, exponent, below, above,
    y_bits, out, start, stop)`` with x and y as uint16 bit patterns: code = ``above`` where key(x) >= ``key`` or x is
    NaN (``exponent``: the exponent mask), else ``below``; with ``relu`` y = relu(x) for finite x; returns the
    number of non-finite elements."""
    return _make_threshold_pack16(bits, relu)


@numba.njit(cache=True, inline="always")
def _eight_levels(levels):
    """The first 8 levels as scalars (zeros past the table's end: codes of 1-2 bits never select them)."""
    padded = np.zeros(8, dtype=levels.dtype)
    for code in range(min(8, levels.size)):
        padded[code] = levels[code]
    return padded[0], padded[1], padded[2], padded[3], padded[4], padded[5], padded[6], padded[7]


@numba.njit(cache=True, inline="always")
def _select8(code, l0, l1, l2, l3, l4, l5, l6, l7):
    """levels[code] for a code of at most 3 bits (uint32) by a tree of selects on its bits: no table load, so that
    LLVM vectorises the loop around it (the backward kernels at 1-3 bits)."""
    odd = (code & _u32(1)) != _u32(0)
    low = (l1 if odd else l0) if (code & _u32(2)) == _u32(0) else (l3 if odd else l2)
    high = (l5 if odd else l4) if (code & _u32(2)) == _u32(0) else (l7 if odd else l6)
    return high if (code & _u32(4)) != _u32(0) else low


def _make_unpack_scale(bits: int):
    BITS = np.uint64(bits)  # a closure constant: numba compiles (and caches) one kernel per bit width
    MASK = np.uint64((1 << bits) - 1)

    SELECT = bits <= 3

    @numba.njit(cache=True, nogil=True)
    def unpack_scale(grad, packed, levels, out, start, stop):
        begin = _u64(start)
        end = _u64(stop)
        zero = out.dtype.type(0)
        if SELECT:
            # 1-3 bits: as unpack_scale16, the codes expanded to bytes per chunk, the level picked by a vectorised
            # tree of selects instead of a scalar table load per element
            codes = np.empty(CHUNK, dtype=np.uint8)
            codes64 = codes.view(np.uint64)
            l0, l1, l2, l3, l4, l5, l6, l7 = _eight_levels(levels)
            for chunk in range(begin, end, _CHUNK):
                count = min(_CHUNK, end - chunk)
                for group in range((count + _7) // _8):
                    codes64[group] = _expand(_load_word(packed, chunk // _8 + group, BITS), BITS)
                for i in range(count):
                    level = _select8(_u32(codes[i]), l0, l1, l2, l3, l4, l5, l6, l7)
                    product = grad[chunk + i] * level
                    out[chunk + i] = product if level != 0 else zero
            return
        full_end = begin + (end - begin) // _8 * _8
        for group in range(begin // _8, full_end // _8):
            word = _load_word(packed, group, BITS)
            base = group * _8
            for k in range(_8):
                # a zero level selects +0 (as torch's backward does), not grad * 0 (-0 or NaN); product first so
                # that LLVM emits a branch-free select (a branch costs up to 10x on random codes)
                level = levels[(word >> (k * BITS)) & MASK]
                product = grad[base + k] * level
                out[base + k] = product if level != 0 else zero
        if full_end < end:
            word = _load_word(packed, full_end // _8, BITS)
            for k in range(end - full_end):
                level = levels[(word >> (k * BITS)) & MASK]
                product = grad[full_end + k] * level
                out[full_end + k] = product if level != 0 else zero

    return unpack_scale


@functools.cache
def unpack_scale(bits: int):
    """The backward kernel for ``bits``: ``kernel(grad, packed, levels, out, start, stop)`` writes
    out = grad * levels[code] (in the dtype of grad and levels), codes unpacked from ``packed``."""
    return _make_unpack_scale(bits)


_2_24 = np.float32(2.0**-24)


@numba.njit(cache=True, inline="always")
def _to_bfloat16(word):
    """The bfloat16 bit pattern of the float32 bit pattern ``word`` (uint32): round to nearest even, every NaN ->
    0xFFFF (what torch's conversion gives). Branch-free and in 32-bit lanes, so that LLVM vectorises the loop."""
    rounded = _u32(word + _u32(0x7FFF) + (_u32(word >> _u32(16)) & _u32(1))) >> _u32(16)
    return _u32(0xFFFF) if (word & _u32(0x7FFFFFFF)) > _u32(0x7F800000) else rounded


@numba.njit(cache=True, inline="always")
def _to_float16(word, shifted):
    """The float16 bit pattern of the float32 bit pattern ``word`` (uint32): round to nearest even, overflow to
    infinity, NaN quieted with the top of its payload kept (torch's conversion, F16C). ``shifted``: the bit pattern of
    |x| + 0.5 in float32, which is x rounded to float16's subnormal step (2^-24) where |x| < 2^-14. Branch-free
    (selects) and in 32-bit lanes: numba's uint64 arithmetic runs 1.7x slower here."""
    sign = _u32(word >> _u32(16)) & _u32(0x8000)
    absolute = word & _u32(0x7FFFFFFF)
    # (127 - 15) << 23 takes the exponent to float16's bias, 0xFFF + the kept bit's parity rounds to nearest even
    normal = _u32(_u32(absolute - _u32(0x38000000 - 0xFFF)) + (_u32(absolute >> _u32(13)) & _u32(1))) >> _u32(13)
    subnormal = _u32(shifted - _u32(0x3F000000))  # minus the bits of 0.5
    payload = _u32(_u32(0x7E00) | (_u32(absolute >> _u32(13)) & _u32(0x3FF)))
    special = payload if absolute > _u32(0x7F800000) else _u32(0x7C00)
    small = subnormal if absolute < _u32(0x38800000) else normal  # below 2^-14: subnormal
    return sign | (special if absolute >= _u32(0x47800000) else small)  # from 2^16 on: infinity or NaN


def _make_unpack_scale16(bits: int, bfloat: bool):
    BITS = np.uint64(bits)
    MASK = np.uint64((1 << bits) - 1)
    BFLOAT = bfloat
    SELECT = bits <= 3

    @numba.njit(cache=True, nogil=True)
    def unpack_scale16(grad_bits, packed, levels, decode, out_bits, start, stop):
        # per chunk: grad -> float32 (bfloat16: the pattern << 16; float16: the table ``decode``), times the level
        # (+0 at a zero level), rounded back to 16 bits; the chunk's float32 buffers stay in L1
        buffer = np.empty(CHUNK, dtype=np.float32)
        words = buffer.view(np.uint32)
        shifted = np.empty(CHUNK, dtype=np.float32)
        shifted_words = shifted.view(np.uint32)
        zero = np.float32(0)
        half = np.float32(0.5)
        codes = np.empty(CHUNK, dtype=np.uint8)
        codes64 = codes.view(np.uint64)
        l0, l1, l2, l3, l4, l5, l6, l7 = _eight_levels(levels)
        for chunk in range(_u64(start), _u64(stop), _CHUNK):
            count = min(_CHUNK, _u64(stop) - chunk)
            if BFLOAT:
                for i in range(count):
                    words[i] = numba.uint32(_u64(grad_bits[chunk + i]) << _16)
            else:
                # float16 -> float32 by bits (vectorised): normal numbers rebias the exponent by 112, infinities and
                # NaN keep their payload; zeros and subnormals (exponent 0) are m * 2^-24, exact in float32
                for i in range(count):
                    half_bits = _u32(grad_bits[chunk + i])
                    exponent = _u32(half_bits >> _u32(10)) & _u32(0x1F)
                    mantissa = _u32(_u32(half_bits & _u32(0x3FF)) << _u32(13))
                    rest = _u32(_u32(exponent + _u32(112)) << _u32(23)) | mantissa
                    rest = _u32(_u32(0x7F800000) | mantissa) if exponent == _u32(0x1F) else rest
                    words[i] = _u32(_u32(half_bits & _u32(0x8000)) << _u32(16)) | rest
                for i in range(count):
                    half_bits = _u32(grad_bits[chunk + i])
                    tiny = np.float32(half_bits & _u32(0x3FF)) * _2_24
                    tiny = -tiny if half_bits & _u32(0x8000) else tiny
                    buffer[i] = tiny if (half_bits & _u32(0x7C00)) == _u32(0) else buffer[i]
            full = count // _8
            if SELECT:
                # 1-3 bits: the codes expanded to bytes (SWAR), then the level picked by a tree of selects on the
                # code's bits (vectorised; the table lookup is a scalar load per element): 2^18 bfloat16, 3 bits,
                # one thread: 102 us against 130 us
                for group in range((count + _7) // _8):
                    codes64[group] = _expand(_load_word(packed, chunk // _8 + group, BITS), BITS)
                for i in range(count):
                    level = _select8(_u32(codes[i]), l0, l1, l2, l3, l4, l5, l6, l7)
                    product = buffer[i] * level
                    buffer[i] = product if level != 0 else zero
            for group in range(0 if SELECT else full):  # whole groups: a fixed trip count, unrolled
                word = _load_word(packed, chunk // _8 + group, BITS)
                base = group * _8
                for k in range(_8):
                    level = levels[(word >> (k * BITS)) & MASK]
                    product = buffer[base + k] * level
                    buffer[base + k] = product if level != 0 else zero
            if not SELECT and full * _8 < count:
                word = _load_word(packed, chunk // _8 + full, BITS)
                base = full * _8
                for k in range(count - base):
                    level = levels[(word >> (k * BITS)) & MASK]
                    product = buffer[base + k] * level
                    buffer[base + k] = product if level != 0 else zero
            if BFLOAT:
                for i in range(count):
                    out_bits[chunk + i] = numba.uint16(_to_bfloat16(words[i]))
            else:
                for i in range(count):
                    shifted[i] = abs(buffer[i]) + half
                for i in range(count):
                    out_bits[chunk + i] = numba.uint16(_to_float16(words[i], shifted_words[i]))

    return unpack_scale16


@functools.cache
def unpack_scale16(bits: int, bfloat: bool):
    """The backward kernel for float16 (``bfloat`` False) or bfloat16 gradients: ``kernel(grad_bits, packed, levels,
    decode, out_bits, start, stop)`` with the gradient and the result as uint16 bit patterns, float32 ``levels``, and
    ``decode`` the float32 value of every float16 pattern (unused for bfloat16, whose value is the pattern << 16).
    Computes in float32 and rounds once, as :func:`unpack_scale` on the float32 copy did, without the copies."""
    return _make_unpack_scale16(bits, bfloat)


@numba.njit(cache=True)
def float32_to_16(words, bfloat, out):
    """The 16-bit patterns of float32 patterns ``words`` (uint32) as the backward rounds them (for tests)."""
    values = words.view(np.float32)
    for i in range(words.size):
        if bfloat:
            out[i] = numba.uint16(_to_bfloat16(words[i]))
        else:
            shifted = np.empty(1, dtype=np.float32)
            shifted[0] = abs(values[i]) + np.float32(0.5)
            out[i] = numba.uint16(_to_float16(words[i], shifted.view(np.uint32)[0]))


def warm_up(bits: int = 3) -> None:
    """Compile (or load from numba's cache) the float32 kernels for ``bits``, e.g. before timing."""
    x = np.zeros(9, np.float32)
    out = np.zeros(2 * bits, np.uint8)
    luts = (np.zeros(65536, np.uint16), np.zeros(65536, np.uint32))
    search = (x, np.zeros(1, np.float32), np.zeros(2, np.uint8))
    quantize_pack_lut32(bits)(x.view(np.uint16), *luts, *search, out, 0, 9)
    unpack_scale(bits)(x, out, np.zeros(2**bits, np.float32), np.empty_like(x), 0, 9)
