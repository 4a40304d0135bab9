"""Triton kernels of the few-bit op (CUDA; imported lazily: importing this module loads triton).

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when this module is imported: set
``TRITON_INTERPRET=1`` (environment, or ``triton.knobs.runtime.interpret = True``) before the first import to run
these kernels on CPU tensors through the interpreter, as the tests do.

Each program handles ``BLOCK_GROUPS`` groups of 8 consecutive elements (the layout of :mod:`.._packing`);
offsets are computed in int64 so tensors with more than 2**31 elements are addressed correctly.

Memory access: x, y, the gradient and the gradient's result are read and written as ``[BLOCK_GROUPS, 8]`` blocks, so
that a 16-byte aligned tensor whose size Triton specialises as a multiple of 16 moves in 16-byte accesses
(``ld.global.v4`` / ``st.global.v4``: 4 float32, 8 float16 / bfloat16, 2 float64); the packed codes of a group are
one word when ``BITS`` is 1, 2, 4 or 8 (the launcher passes the packed buffer as uint8 / int16 / int32 / int64
words), else ``BITS`` bytes. Every element is read and written once: per element the forward reads s bytes of x
and writes s bytes of y and BITS / 8 bytes of codes, the backward reads s + BITS / 8 bytes and writes s (s the
element size; :mod:`.traffic`). The table (boundaries, codes per interval, levels) and the non-finite flag are a
few hundred bytes, read through the cache.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import one_pass
from ._triton_math import erf, exp, tanh

__all__ = ["_fewbit_forward_kernel", "_fewbit_backward_kernel", "_group_offsets_kernel"]

_CODES_ONLY = tl.constexpr(one_pass.CODES_ONLY)
_RELU = tl.constexpr(one_pass.RELU)
_HARDTANH = tl.constexpr(one_pass.HARDTANH)
_LEAKY_RELU = tl.constexpr(one_pass.LEAKY_RELU)
_GELU = tl.constexpr(one_pass.GELU)
_GELU_TANH = tl.constexpr(one_pass.GELU_TANH)
_SILU = tl.constexpr(one_pass.SILU)
_SIGMOID = tl.constexpr(one_pass.SIGMOID)
_GELU_ALPHA = tl.constexpr(one_pass.GELU_ALPHA)
_GELU_BETA = tl.constexpr(one_pass.GELU_BETA)
_GELU_KAPPA = tl.constexpr(one_pass.GELU_KAPPA)


@triton.jit
def _group_offsets(pid, BLOCK_GROUPS: tl.constexpr):
    # group g = pid * BLOCK_GROUPS + i (int64), element = 8 * g + k: a [BLOCK_GROUPS, 8] block of int64 offsets
    groups = pid.to(tl.int64) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS).to(tl.int64)
    elements = groups[:, None] * 8 + tl.arange(0, 8).to(tl.int64)[None, :]
    return groups, elements


@triton.jit
def _group_offsets_kernel(out_ptr, pid, BLOCK_GROUPS: tl.constexpr):
    """Test hook: writes the element offsets that program ``pid`` would use (checks the int64 arithmetic)."""
    _, elements = _group_offsets(pid, BLOCK_GROUPS)
    local = tl.arange(0, BLOCK_GROUPS)[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(out_ptr + local, elements)


@triton.jit
def _bfloat16_bits_to_float32(pattern):
    # a bfloat16 arrives as its int16 bit pattern: float32 = pattern << 16, exact for subnormals too (the
    # interpreter's bfloat16 conversion flushes them to zero)
    return (pattern.to(tl.uint16).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _float32_to_bfloat16_bits(value):
    # round to nearest even exactly as torch does (c10::BFloat16), also under the interpreter (which truncates):
    # bf16 = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, NaN -> 0x7FC0; returned as the int16 bit pattern
    bits = value.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(value != value, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _load_values(ptr, elements, mask, bf16):
    # float32 / float64 as stored; 16-bit floats arrive as int16 bit patterns (bf16: bfloat16, else float16) and
    # are widened exactly to float32
    values = tl.load(ptr + elements, mask=mask, other=0)
    if values.dtype == tl.int16:
        half = values.to(tl.float16, bitcast=True).to(tl.float32)
        values = tl.where(bf16 != 0, _bfloat16_bits_to_float32(values), half)
    return values


@triton.jit
def _store_values(ptr, elements, mask, values, bf16):
    # values (float32, or float64) rounded once to the tensor's dtype (16-bit floats: int16 bit patterns)
    if ptr.dtype.element_ty == tl.int16:
        half = values.to(tl.float16).to(tl.int16, bitcast=True)
        tl.store(ptr + elements, tl.where(bf16 != 0, _float32_to_bfloat16_bits(values), half), mask=mask)
    else:
        tl.store(ptr + elements, values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_codes(packed_ptr, groups, codes, num_groups, BITS: tl.constexpr):
    # word = sum_k code_k << (k * BITS), the little-endian BITS-byte word of the group
    shifts = tl.arange(0, 8).to(tl.int64)[None, :] * BITS
    word = tl.sum(codes.to(tl.int64) << shifts, axis=1)
    group_mask = groups < num_groups
    if (BITS & (BITS - 1)) == 0:  # 1, 2, 4, 8: packed_ptr points to BITS-byte words, one per group
        tl.store(packed_ptr + groups, word.to(packed_ptr.dtype.element_ty), mask=group_mask)
    else:
        for byte in tl.static_range(BITS):
            value = ((word >> (8 * byte)) & 0xFF).to(tl.uint8)
            tl.store(packed_ptr + groups * BITS + byte, value, mask=group_mask)


@triton.jit
def _load_codes(packed_ptr, groups, num_groups, BITS: tl.constexpr):
    group_mask = groups < num_groups
    if (BITS & (BITS - 1)) == 0:
        # (a signed word sign-extends into bits >= 8 * BITS, which no code reads)
        word = tl.load(packed_ptr + groups, mask=group_mask, other=0).to(tl.int64)
    else:
        word = tl.zeros(groups.shape, dtype=tl.int64)
        for byte in tl.static_range(BITS):
            value = tl.load(packed_ptr + groups * BITS + byte, mask=group_mask, other=0).to(tl.int64)
            word |= value << (8 * byte)
    shifts = tl.arange(0, 8).to(tl.int64)[None, :] * BITS
    return (word[:, None] >> shifts) & ((1 << BITS) - 1)


@triton.jit
def _activation(x, activation, low, high):
    # y = f(x) in float32 by the formula of torch's CUDA kernel (see one_pass.py for the ATen file of each); the
    # branch is uniform (a kernel argument), so each launch runs one formula
    if activation == _RELU:
        # isnan(x) ? x : max(x, 0)
        y = tl.where(x != x, x, tl.maximum(x, 0.0))
    elif activation == _HARDTANH:
        # isnan(x) ? x : min(max(x, low), high)
        y = tl.where(x != x, x, tl.minimum(tl.maximum(x, low), high))
    elif activation == _LEAKY_RELU:
        # x > 0 ? x : x * slope
        y = tl.where(x > 0, x, x * low)
    elif activation == _GELU:
        # x * 0.5 * (1 + erf(x * M_SQRT1_2))
        y = x * 0.5 * (1.0 + erf(x * _GELU_ALPHA))
    elif activation == _GELU_TANH:
        # 0.5 * x * (1 + tanh(kBeta * (x + kKappa * x^3)))
        cube = x * x * x
        y = 0.5 * x * (1.0 + tanh(_GELU_BETA * (x + _GELU_KAPPA * cube)))
    elif activation == _SILU:
        # x / (1 + exp(-x)), correctly rounded division as nvcc's default (-prec-div=true)
        y = tl.math.div_rn(x, 1.0 + exp(-x))
    elif activation == _SIGMOID:
        # 1 / (1 + exp(-x))
        y = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp(-x))
    else:
        # tanh(x)
        y = tanh(x)
    return y


# (Triton compiles a separate kernel for an integer argument equal to 1 unless told not to: the activation, the flag
# and the table size take any value at run time, so that one variant per dtype and BITS serves every launch)
@triton.jit(do_not_specialize=["num_boundaries", "activation", "bf16"])
def _fewbit_forward_kernel(
    x_ptr,
    y_ptr,
    boundaries_ptr,
    interval_codes_ptr,
    packed_ptr,
    nonfinite_ptr,
    numel,
    num_groups,
    num_boundaries,
    activation,
    low,
    high,
    bf16,  # 16-bit x and y (int16 bit patterns): 1 for bfloat16, 0 for float16
    BITS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """Packed codes of x, its non-finite flag and, unless ``activation`` is CODES_ONLY, y = f(x): one pass."""
    pid = tl.program_id(0)
    groups, elements = _group_offsets(pid, BLOCK_GROUPS)
    mask = elements < numel
    # compare in the dtype of the boundaries (float64 for float64 x, else float32; upcasts are exact)
    x = _load_values(x_ptr, elements, mask, bf16)
    # interval = number of boundaries <= x = len(boundaries) - #(x < boundary); NaN lands in the last interval
    interval = tl.zeros([BLOCK_GROUPS, 8], dtype=tl.int32) + num_boundaries
    for j in range(num_boundaries):
        boundary = tl.load(boundaries_ptr + j)
        interval -= (x < boundary).to(tl.int32)
    codes = tl.load(interval_codes_ptr + interval, mask=mask, other=0)
    _store_codes(packed_ptr, groups, codes, num_groups, BITS)
    # the flag "x has a NaN or an infinity" (masked elements are 0): one atomic per program
    nonfinite = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32))
    tl.atomic_max(nonfinite_ptr, nonfinite, mask=nonfinite > 0)
    if x.dtype == tl.float32:  # (float64 x: codes only, the formulas are float32)
        if activation != _CODES_ONLY:
            _store_values(y_ptr, elements, mask, _activation(x, activation, low, high), bf16)


@triton.jit(do_not_specialize=["bf16"])
def _fewbit_backward_kernel(
    grad_ptr,
    packed_ptr,
    levels_ptr,
    out_ptr,
    numel,
    num_groups,
    bf16,  # 16-bit grad and output (int16 bit patterns): 1 for bfloat16, 0 for float16
    BITS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """grad_input = grad * levels[code], computed in the dtype of the levels, rounded once to grad's dtype."""
    pid = tl.program_id(0)
    groups, elements = _group_offsets(pid, BLOCK_GROUPS)
    mask = elements < numel
    codes = _load_codes(packed_ptr, groups, num_groups, BITS)
    levels = tl.load(levels_ptr + codes, mask=mask, other=0.0)
    grad = _load_values(grad_ptr, elements, mask, bf16)
    # float32 levels, or float64 for float64 grads
    result = grad.to(levels_ptr.dtype.element_ty) * levels
    # a zero level selects +0 (as torch's backward does), not grad * 0 (-0 for negative grad, NaN for inf / NaN)
    result = tl.where(levels == 0, 0.0, result)
    _store_values(out_ptr, elements, mask, result, bf16)
