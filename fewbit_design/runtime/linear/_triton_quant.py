"""Triton kernels of the group quantizer (:mod:`.quant`; CUDA; imported lazily: importing this module loads triton).

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when this module is imported: the tests set
``TRITON_INTERPRET=1`` first and run these kernels on CPU tensors through the interpreter.

The arithmetic is the reference's (:func:`.quant.quantize_groups_reference`, :func:`.quant.dequantize_groups_reference`)
in the same order and dtype (float32), so results agree bitwise: min and max by the integer keys of the numba kernel
(:mod:`._numba_quant`), correctly rounded divisions (``div_rn``), no FMA contraction in the quantizer (the launcher
compiles with ``enable_fp_fusion=False``: ``(x - low) * inverse + u`` rounds twice, as torch does) and one explicit
FMA in the decoder (``low + code * step``, as ``torch.addcmul``), the noise of :func:`.quant.noise_reference` in
uint32 arithmetic.

Layout: quantization group ``q`` is group ``q mod groups_per_row`` of row ``q // groups_per_row``; each program
handles ``BLOCK_GROUPS`` of them as a ``[BLOCK_GROUPS, WORDS, 8]`` block of elements (``WORDS * 8`` the group size
rounded up to a power of 2): 8 consecutive elements are one packing group of :mod:`.._packing`, whose codes are one
word of ``BITS`` bytes (the launcher passes the packed buffer as uint8 / int16 / int32 / int64 words for 1, 2, 4, 8
bits), else ``BITS`` bytes. The launcher runs these kernels only where every group starts at a multiple of 8
elements (features and group size multiples of 8), so a group's codes are whole words. Offsets are int64.

Memory access: a 16-byte aligned x whose row stride Triton specialises as a multiple of 16 (and a power-of-2 group
size of at least 16) moves in 16-byte accesses, as does the decoded output. Every element is read and written once:
the quantizer reads s bytes of x and writes BITS / 8 bytes of codes per element and 8 bytes of (low, step) per
group; the decoder reads the codes and the scales and writes s (s the element size; :mod:`..fewbit.traffic`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..fewbit._triton_kernels import _load_values, _store_values

__all__ = ["_group_quantize_forward_kernel", "_group_dequantize_forward_kernel"]

_INT32_MAX = tl.constexpr(0x7FFFFFFF)
_INT32_MIN = tl.constexpr(-(2**31))
_INF_BITS = tl.constexpr(0x7F800000)


@triton.jit
def _group_block(pid, num_groups, groups_per_row, features, GROUP_SIZE: tl.constexpr, WORDS: tl.constexpr,
                 BLOCK_GROUPS: tl.constexpr):  # fmt: skip
    # the program's groups q (int64), their rows, the column of each group's first element, and per element
    # (i, w, k) its column first + 8 w + k and whether it is a value of the tensor
    groups = pid.to(tl.int64) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS).to(tl.int64)
    rows = groups // groups_per_row
    # first = (q mod groups_per_row) * GROUP_SIZE
    first = (groups - rows * groups_per_row) * GROUP_SIZE
    within = tl.arange(0, WORDS)[:, None] * 8 + tl.arange(0, 8)[None, :]
    columns = first[:, None, None] + within[None, :, :]
    mask = (groups < num_groups)[:, None, None] & (columns < features) & (within < GROUP_SIZE)[None, :, :]
    return groups, rows, first, columns, mask


@triton.jit
def _word_offsets(groups, rows, first, num_groups, features, GROUP_SIZE: tl.constexpr, WORDS: tl.constexpr):
    # packing word of element (row, column): (row * features + column) / 8, a whole word per 8 elements of a group
    # (features and GROUP_SIZE are multiples of 8); a word is in the tensor where its first column is
    starts = tl.arange(0, WORDS)[None, :] * 8
    words = (rows * features + first)[:, None] // 8 + tl.arange(0, WORDS)[None, :]
    mask = (groups < num_groups)[:, None] & (first[:, None] + starts < features) & (starts < GROUP_SIZE)
    return words, mask


@triton.jit
def _mix32(x):
    # a 32-bit integer hash (Wellons' "lowbias32"), uint32: products wrap mod 2**32
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _noise(rows, columns, seed_low, seed_high):
    # key(row) = mix32((mix32((row mod 2**32) ^ seed_low) + seed_high + row // 2**32) mod 2**32)
    row_low = rows.to(tl.uint32)
    row_high = (rows >> 32).to(tl.uint32)
    key = _mix32(_mix32(row_low ^ seed_low.to(tl.uint32, bitcast=True)) + seed_high.to(tl.uint32, bitcast=True)
                 + row_high)  # fmt: skip
    # u = (mix32((column * 0x9E3779B9 + key(row)) mod 2**32) >> 8) * 2**-24, exact in float32
    hashed = _mix32(columns.to(tl.uint32) * 0x9E3779B9 + key[:, None, None])
    return (hashed >> 8).to(tl.float32) * (2.0**-24)


@triton.jit
def _group_range(x, mask):
    # (low, high) of each group: min and max of the keys b ^ ((b >> 31) & 0x7FFFFFFF) of the float32 bits b, which
    # order as the floats (-0 just below +0); NaN anywhere in the group (|b| > 0x7F800000) makes both NaN
    bits = x.to(tl.int32, bitcast=True)
    keys = bits ^ ((bits >> 31) & _INT32_MAX)
    low = tl.min(tl.min(tl.where(mask, keys, _INT32_MAX), axis=2), axis=1)
    high = tl.max(tl.max(tl.where(mask, keys, _INT32_MIN), axis=2), axis=1)
    nan = tl.max(tl.max(tl.where(mask, bits & _INT32_MAX, 0), axis=2), axis=1) > _INF_BITS
    low = (low ^ ((low >> 31) & _INT32_MAX)).to(tl.float32, bitcast=True)
    high = (high ^ ((high >> 31) & _INT32_MAX)).to(tl.float32, bitcast=True)
    return tl.where(nan, float("nan"), low), tl.where(nan, float("nan"), high)


@triton.jit
def _store_words(packed_ptr, words, mask, codes, BITS: tl.constexpr):
    # word = sum_k code_k << (k * BITS), the little-endian BITS-byte word of 8 codes
    shifts = tl.arange(0, 8).to(tl.int64)[None, None, :] * BITS
    word = tl.sum(codes.to(tl.int64) << shifts, axis=2)
    if (BITS & (BITS - 1)) == 0:  # 2, 4, 8: packed_ptr points to BITS-byte words
        tl.store(packed_ptr + words, word.to(packed_ptr.dtype.element_ty), mask=mask)
    else:
        for byte in tl.static_range(BITS):
            tl.store(packed_ptr + words * BITS + byte, ((word >> (8 * byte)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _load_words(packed_ptr, words, mask, BITS: tl.constexpr):
    # the 8 codes of each word, [.., .., 8] int64
    if (BITS & (BITS - 1)) == 0:
        # (a signed word sign-extends into bits >= 8 * BITS, which no code reads)
        word = tl.load(packed_ptr + words, mask=mask, other=0).to(tl.int64)
    else:
        word = tl.zeros(words.shape, dtype=tl.int64)
        for byte in tl.static_range(BITS):
            word |= tl.load(packed_ptr + words * BITS + byte, mask=mask, other=0).to(tl.int64) << (8 * byte)
    shifts = tl.arange(0, 8).to(tl.int64)[None, None, :] * BITS
    return (word[:, :, None] >> shifts) & ((1 << BITS) - 1)


# (Triton compiles a separate kernel for an integer argument equal to 1 unless told not to: the rounding, the seed
# and the dtype flag take any value at run time, so that one variant per dtype, BITS and group size serves them all)
@triton.jit(do_not_specialize=["stochastic", "seed_low", "seed_high", "bf16"])
def _group_quantize_forward_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    num_groups,
    groups_per_row,
    features,
    row_stride,
    stochastic,
    seed_low,  # the seed's low and high 32 bits, as int32 bit patterns
    seed_high,
    bf16,  # 16-bit x (int16 bit patterns): 1 for bfloat16, 0 for float16
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """Packed codes and (low, step) of ``BLOCK_GROUPS`` groups of x (rows of ``features`` values, ``row_stride``
    apart): one pass."""
    pid = tl.program_id(0)
    groups, rows, first, columns, mask = _group_block(pid, num_groups, groups_per_row, features, GROUP_SIZE, WORDS,
                                                      BLOCK_GROUPS)  # fmt: skip
    x = _load_values(x_ptr, rows[:, None, None] * row_stride + columns, mask, bf16)
    low, high = _group_range(x, mask)
    top = ((1 << BITS) - 1) * 1.0
    # step = (high - low) / (2**BITS - 1); inverse = 1 / step where step > 0, else 0 (correctly rounded divisions)
    step = tl.math.div_rn(high - low, top)
    inverse = tl.where(step > 0, tl.math.div_rn(tl.full(step.shape, 1.0, tl.float32), step), 0.0)
    # t = (x - low) / step in [0, 2**BITS - 1]; code = floor(t + u), u ~ U[0, 1) (stochastic) or u = 1/2 (nearest)
    position = (x - low[:, None, None]) * inverse[:, None, None]
    if stochastic != 0:
        position = position + _noise(rows, columns, seed_low, seed_high)
    else:
        position = position + 0.5
    # clamp to [0, top]; NaN fails position > 0 and becomes code 0
    position = tl.floor(position)
    position = tl.where(position > 0.0, position, 0.0)
    position = tl.where(position < top, position, top)
    words, word_mask = _word_offsets(groups, rows, first, num_groups, features, GROUP_SIZE, WORDS)
    _store_words(packed_ptr, words, word_mask, position.to(tl.int32), BITS)
    # (low, step): low = NaN where low or step is not finite, so the whole group decodes to NaN
    finite = (low == low) & (tl.abs(low) != float("inf")) & (step == step) & (tl.abs(step) != float("inf"))
    group_mask = groups < num_groups
    tl.store(scales_ptr + 2 * groups, tl.where(finite, low, float("nan")), mask=group_mask)
    tl.store(scales_ptr + 2 * groups + 1, step, mask=group_mask)


@triton.jit(do_not_specialize=["bf16"])
def _group_dequantize_forward_kernel(
    packed_ptr,
    scales_ptr,
    out_ptr,
    num_groups,
    groups_per_row,
    features,
    bf16,  # 16-bit output (int16 bit patterns): 1 for bfloat16, 0 for float16
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """``low + code * step`` of ``BLOCK_GROUPS`` groups into the contiguous rows of ``out``, rounded once to its
    dtype."""
    pid = tl.program_id(0)
    groups, rows, first, columns, mask = _group_block(pid, num_groups, groups_per_row, features, GROUP_SIZE, WORDS,
                                                      BLOCK_GROUPS)  # fmt: skip
    words, word_mask = _word_offsets(groups, rows, first, num_groups, features, GROUP_SIZE, WORDS)
    codes = _load_words(packed_ptr, words, word_mask, BITS)
    group_mask = groups < num_groups
    low = tl.load(scales_ptr + 2 * groups, mask=group_mask, other=0.0)
    step = tl.load(scales_ptr + 2 * groups + 1, mask=group_mask, other=0.0)
    # value = low + code * step, one rounding (as torch.addcmul)
    values = tl.fma(codes.to(tl.float32), step[:, None, None], low[:, None, None])
    _store_values(out_ptr, rows[:, None, None] * features + columns, mask, values, bf16)
