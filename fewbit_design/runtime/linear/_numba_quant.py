"""numba CPU kernels of the group quantizer (:mod:`.quant`; imported lazily: importing this module loads numba).

One pass per direction, the arithmetic of the torch reference in the same order and dtype (float32), so results
agree bitwise:

* :func:`quantize_float32` / :func:`quantize_bfloat16`: per row and group, min and max (NaN-propagating, like
  ``torch.aminmax``), ``step = (high - low) / top``, ``inverse = 1 / step`` (0 where ``step`` is not > 0), then
  ``code = floor((x - low) * inverse + u)`` clamped to [0, top] (NaN -> 0) with ``u = 1/2`` (nearest) or the
  counter-based noise of :func:`noise` (stochastic), packed in the project's layout, and ``(low, step)`` stored
  (``low = NaN`` for a non-finite group). bfloat16 is read as its uint16 bits (``bits << 16`` is the float32
  value), a row at a time through a small float32 buffer: no float32 copy of the tensor.
* :func:`dequantize_float32` / :func:`dequantize_bfloat16`: ``low + code * step`` as one fused multiply-add (what
  ``torch.addcmul`` computes on the CPU), written as float32, or rounded to bfloat16 bits (nearest even; NaN ->
  0x7FC0, as torch's scalar conversion).

Rows are processed in blocks of whole rows whose element count is a multiple of 8 (a packing group): the codes of a
block go through a uint8 buffer of about :data:`BLOCK` elements (allocated once per call and thread) and are packed
or unpacked as whole groups (8-bit codes are the packed bytes themselves and skip the buffer). Every range of rows
that :func:`fewbit_design.runtime._numba_packing.run` gives a thread starts at a multiple of 8 rows, so it starts a
packing group and threads share no byte.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

from .._numba_packing import _fma, _pack_buffer, _unpack_buffer

__all__ = ["BLOCK", "noise", "quantize_float32", "quantize_bfloat16", "dequantize_float32", "dequantize_bfloat16"]

BLOCK = 8192  # elements of a block's code buffer (at least 8 rows)

_u64 = numba.uint64
_f32 = numba.float32
_0 = np.uint64(0)
_1 = np.uint64(1)
_8 = np.uint64(8)
_15 = np.uint64(15)
_16 = np.uint64(16)
_32 = np.uint64(32)
_M32 = np.uint64(0xFFFFFFFF)
_C1 = np.uint64(0x7FEB352D)
_C2 = np.uint64(0x846CA68B)
_GOLDEN = np.uint64(0x9E3779B9)
_u32 = numba.uint32
_GOLDEN_32 = np.uint32(0x9E3779B9)
_GROUP = np.uint64(64)  # quant.GROUP_SIZE
_ROUND = np.uint64(0x7FFF)
_SCALE24 = np.float32(2.0**-24)
_HALF = np.float32(0.5)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_31 = np.int32(31)
_I32_MAX = np.int32(0x7FFFFFFF)
_I32_MIN = np.int32(-0x80000000)
_INF_BITS = np.int32(0x7F800000)


def _row_values(x, base, features, row_bits, row_values):
    """``(values, ints, offset)``: where the float32 values of the row starting at element ``base`` are, and their
    int32 view: float32 ``x`` itself, or bfloat16 bits (uint16 ``x``) widened into ``row_values`` (whose uint32 view
    is ``row_bits``), offset 0."""


@overload(_row_values, inline="always", jit_options={"cache": True})
def _row_values_overload(x, base, features, row_bits, row_values):
    if x.dtype == types.uint16:

        def widen(x, base, features, row_bits, row_values):
            for i in range(features):
                row_bits[i] = np.uint32(x[base + i]) << np.uint32(16)
            return row_values, row_bits.view(np.int32), _0

        return widen

    return lambda x, base, features, row_bits, row_values: (x, x.view(np.int32), base)


def _row_target(out, base, row_values):
    """``(array, offset)``: where a decoded row is computed: float32 ``out`` itself, else the float32 buffer
    ``row_values`` (offset 0)."""


@overload(_row_target, inline="always", jit_options={"cache": True})
def _row_target_overload(out, base, row_values):
    if out.dtype == types.uint16:
        return lambda out, base, row_values: (row_values, _0)
    return lambda out, base, row_values: (out, base)


@numba.njit(cache=True, inline="always")
def _mix32(x):
    # a 32-bit integer hash (Wellons' "lowbias32"), on uint64 values below 2**32
    x ^= x >> _16
    x = (x * _C1) & _M32
    x ^= x >> _15
    x = (x * _C2) & _M32
    return x ^ (x >> _16)


@numba.njit(cache=True, inline="always")
def _row_key(seed, row):
    seed = _u64(seed)
    row = _u64(row)
    first = _mix32((row & _M32) ^ (seed & _M32))
    return _mix32((first + ((seed >> _32) & _M32) + (row >> _32)) & _M32)


@numba.njit(cache=True, nogil=True)
def noise(seed, rows, columns, out):
    """The stochastic-rounding noise u in [0, 1) of element (row, column) into ``out`` (float32, rows x columns):
    ``u = (h >> 8) * 2**-24`` with ``h = mix32(column * 0x9E3779B9 + key(seed, row))`` (32-bit arithmetic). The
    torch reference (:func:`.quant.noise_reference`) computes the same values; this is its oracle in the tests."""
    for row in range(rows):
        key = _row_key(seed, row)
        for column in range(columns):
            h = _mix32((_u64(column) * _GOLDEN + key) & _M32)
            out[row, column] = _f32(h >> _8) * _SCALE24


@numba.njit(cache=True, inline="always")
def _min_max(ints, start, stop, pair):
    # (min, max, any NaN) of the float32 values whose int32 bits are ints[start:stop]. The key b ^ ((b >> 31) &
    # 0x7FFFFFFF) orders the bits as the floats (-0.0 just below 0.0): an integer min/max vectorizes, a float one
    # written as selects does not (it needs fast-math); NaN bits have |b| > 0x7F800000. Every intermediate is cast
    # back to int32 (numba widens int32 arithmetic to int64, which halves the lanes of the vectorized loop)
    low = _I32_MAX
    high = _I32_MIN
    magnitude = np.int32(0)
    for i in range(start, stop):
        value = ints[i]
        key = np.int32(value ^ np.int32(np.int32(value >> _31) & _I32_MAX))
        low = np.int32(min(low, key))
        high = np.int32(max(high, key))
        magnitude = np.int32(max(magnitude, np.int32(value & _I32_MAX)))
    pair[0] = np.int32(low ^ np.int32(np.int32(low >> _31) & _I32_MAX))
    pair[1] = np.int32(high ^ np.int32(np.int32(high >> _31) & _I32_MAX))
    floats = pair.view(np.float32)
    return floats[0], floats[1], magnitude > _INF_BITS


@intrinsic
def _noise_at(typingctx, base, i):
    """The noise u of column ``start + i`` from ``base = (start * 0x9E3779B9 + key) mod 2**32`` (uint32):
    ``(mix32(base + i * 0x9E3779B9) >> 8) * 2**-24``, float32, :func:`_mix32` in 32-bit arithmetic written as LLVM
    IR: numba types uint32 products as uint64, and the vectorized loop then multiplies in 64-bit lanes (half as many
    per register, and a slower instruction); ``i * 0x9E3779B9`` is an induction the loop steps by one addition."""
    signature = types.float32(types.uint32, types.uint64)

    def codegen(context, builder, sig, args):
        base, i = args
        word = ir.IntType(32)

        def constant(value):
            return ir.Constant(word, value)

        x = builder.add(builder.mul(builder.trunc(i, word), constant(0x9E3779B9)), base)
        x = builder.xor(x, builder.lshr(x, constant(16)))
        x = builder.mul(x, constant(0x7FEB352D))
        x = builder.xor(x, builder.lshr(x, constant(15)))
        x = builder.mul(x, constant(0x846CA68B))
        x = builder.xor(x, builder.lshr(x, constant(16)))
        # h >> 8 < 2**24: exact in float32 (signed conversion: the value is non-negative), times 2**-24 exact
        value = builder.sitofp(builder.lshr(x, constant(8)), ir.FloatType())
        return builder.fmul(value, ir.Constant(ir.FloatType(), 2.0**-24))

    return signature, codegen


@numba.njit(cache=True, inline="always")
def _group_codes(values, at, low, inverse, top, stochastic, key, codes, code_at, start, count):
    # codes of values[at + i] (column start + i, i < count) into codes[code_at + i]:
    # t = (x - low) / step; code = floor(t + u), u ~ U[0, 1) (stochastic) or u = 1/2 (nearest)
    # NaN fails position > 0 and becomes code 0
    if stochastic:
        base = _u32(_u32(_u32(start) * _GOLDEN_32) + _u32(key))
        for i in range(count):
            position = np.floor((values[at + i] - low) * inverse + _noise_at(base, i))
            position = position if position > _ZERO else _ZERO
            position = position if position < top else top
            codes[code_at + i] = np.uint8(np.int32(position))
    else:
        for i in range(count):
            position = np.floor((values[at + i] - low) * inverse + _HALF)
            position = position if position > _ZERO else _ZERO
            position = position if position < top else top
            codes[code_at + i] = np.uint8(np.int32(position))


@numba.njit(cache=True, inline="always")
def _quantize_row(
    values, ints, at, features, group_size, top, stochastic, key, codes, code_at, scales, row, pair, grid
):  # fmt: skip
    # codes of the float32 row values[at : at + features] into codes[code_at ...], (low, step) per group into
    # scales[row]; unsigned indices (numba checks signed ones for wraparound, which stops vectorization). Two
    # phases: every group's (low, 1 / step) into ``grid`` first, then the codes: the divisions of the groups are
    # independent of each other and of the code loops (one phase per group waited for its own two divisions)
    group = _0
    for start in range(_0, features, group_size):
        stop = min(start + group_size, features)
        low, high, nan = _min_max(ints, at + start, at + stop, pair)
        if nan:
            low = np.float32(np.nan)
            high = low
        step = (high - low) / top
        grid[group, 0] = low
        grid[group, 1] = _ONE / step if step > _ZERO else _ZERO
        finite = np.isfinite(low) and np.isfinite(step)
        scales[row, group, 0] = low if finite else np.float32(np.nan)
        scales[row, group, 1] = step
        group += _1
    group = _0
    for start in range(_0, features, group_size):
        stop = min(start + group_size, features)
        low = grid[group, 0]
        inverse = grid[group, 1]
        if stop - start == _GROUP:  # the default group size as a constant trip count: no remainder loop
            _group_codes(values, at + start, low, inverse, top, stochastic, key, codes, code_at + start, start, _GROUP)
        else:
            _group_codes(values, at + start, low, inverse, top, stochastic, key, codes, code_at + start, start,
                         stop - start)  # fmt: skip
        group += _1


@numba.njit(cache=True, inline="always")
def _quantize_rows(x, features, group_size, bits, stochastic, seed, packed, scales, row_start, row_stop):
    block_rows = _u64(max(8, (BLOCK // max(features, 1)) // 8 * 8))
    features = _u64(features)
    group_size = _u64(group_size)
    top = _f32((1 << bits) - 1)
    direct = bits == 8
    buffer = np.empty(_8 if direct else block_rows * features + _8, dtype=np.uint8)
    row_bits = np.empty(features, dtype=np.uint32)
    row_values = row_bits.view(np.float32)
    pair = np.empty(2, dtype=np.int32)
    grid = np.empty(((features + group_size - _1) // group_size, 2), dtype=np.float32)
    for block in range(_u64(row_start), _u64(row_stop), block_rows):
        block_stop = min(block + block_rows, _u64(row_stop))
        for row in range(block, block_stop):
            base = row * features
            key = _row_key(seed, row) if stochastic else _0
            values, ints, at = _row_values(x, base, features, row_bits, row_values)
            codes, code_at = (packed, base) if direct else (buffer, (row - block) * features)
            _quantize_row(
                values, ints, at, features, group_size, top, stochastic, key, codes, code_at, scales, row, pair, grid
            )
        if not direct:
            _pack_buffer(buffer, (block_stop - block) * features, _u64(bits), packed, block * features // _8)


@numba.njit(cache=True, nogil=True)
def quantize_float32(x, features, group_size, bits, stochastic, seed, packed, scales, row_start, row_stop):
    """Codes of rows [row_start, row_stop) of the flat float32 ``x`` into ``packed`` (uint8), and their (low, step)
    into ``scales`` (float32, rows x groups x 2)."""
    _quantize_rows(x, features, group_size, bits, stochastic, seed, packed, scales, row_start, row_stop)


@numba.njit(cache=True, nogil=True)
def quantize_bfloat16(x, features, group_size, bits, stochastic, seed, packed, scales, row_start, row_stop):
    """:func:`quantize_float32` for bfloat16 given as its uint16 bits."""
    _quantize_rows(x, features, group_size, bits, stochastic, seed, packed, scales, row_start, row_stop)


@numba.njit(cache=True, inline="always")
def _dequantize_rows(packed, scales, features, group_size, bits, out, bfloat16, row_start, row_stop):
    block_rows = _u64(max(8, (BLOCK // max(features, 1)) // 8 * 8))
    features = _u64(features)
    group_size = _u64(group_size)
    direct = bits == 8
    buffer = np.empty(_8 if direct else block_rows * features + _8, dtype=np.uint8)
    row_values = np.empty(features, dtype=np.float32)
    row_bits = row_values.view(np.uint32)
    for block in range(_u64(row_start), _u64(row_stop), block_rows):
        block_stop = min(block + block_rows, _u64(row_stop))
        if not direct:
            _unpack_buffer(packed, block * features // _8, (block_stop - block) * features, _u64(bits), buffer)
        for row in range(block, block_stop):
            base = row * features
            codes, code_at = (packed, base) if direct else (buffer, (row - block) * features)
            target, at = _row_target(out, base, row_values)
            for start in range(_0, features, group_size):
                stop = min(start + group_size, features)
                group = start // group_size
                low = scales[row, group, 0]
                step = scales[row, group, 1]
                # value = low + code * step (one rounding, as torch.addcmul)
                for i in range(start, stop):
                    target[at + i] = _fma(_f32(codes[code_at + i]), step, low)
            if bfloat16:
                # float32 -> bfloat16, round to nearest even (NaN -> 0x7FC0)
                for i in range(features):
                    word = _u64(row_bits[i])
                    rounded = (word + _ROUND + ((word >> _16) & _1)) >> _16
                    nan = row_values[i] != row_values[i]
                    out[base + i] = np.uint16(0x7FC0) if nan else np.uint16(rounded)


@numba.njit(cache=True, nogil=True)
def dequantize_float32(packed, scales, features, group_size, bits, out, row_start, row_stop):
    """``low + code * step`` of rows [row_start, row_stop) into the flat float32 ``out``."""
    _dequantize_rows(packed, scales, features, group_size, bits, out, False, row_start, row_stop)


@numba.njit(cache=True, nogil=True)
def dequantize_bfloat16(packed, scales, features, group_size, bits, out, row_start, row_stop):
    """:func:`dequantize_float32` into bfloat16 bits (uint16 ``out``)."""
    _dequantize_rows(packed, scales, features, group_size, bits, out, True, row_start, row_stop)
