"""Triton kernels of the few-bit op (CUDA; imported lazily: importing this module loads triton).

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when this module is imported: set
``TRITON_INTERPRET=1`` (environment, or ``triton.knobs.runtime.interpret = True``) before the first import to run
these kernels on CPU tensors through the interpreter, as the tests do.

Each program handles ``BLOCK_GROUPS`` groups of 8 consecutive elements (the layout of :mod:`.._packing`);
offsets are computed in int64 so tensors with more than 2**31 elements are addressed correctly.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_fewbit_forward_kernel", "_fewbit_backward_kernel", "_group_offsets_kernel", "BLOCK_GROUPS"]

BLOCK_GROUPS = 128


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
def _float32_to_bfloat16(value):
    # round to nearest even exactly as torch does (c10::BFloat16), also under the interpreter (which truncates):
    # bf16 = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, NaN -> 0x7FC0
    bits = value.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(value != value, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fewbit_forward_kernel(
    x_ptr,
    boundaries_ptr,
    interval_codes_ptr,
    packed_ptr,
    numel,
    num_boundaries,
    BITS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    IN_BF16: tl.constexpr = False,
):
    pid = tl.program_id(0)
    groups, elements = _group_offsets(pid, BLOCK_GROUPS)
    mask = elements < numel
    # compare in the dtype of the boundaries (float64 for float64 x, else float32; upcasts are exact)
    if IN_BF16:
        x = _bfloat16_bits_to_float32(tl.load(x_ptr + elements, mask=mask, other=0))
    else:
        x = tl.load(x_ptr + elements, mask=mask, other=0.0).to(boundaries_ptr.dtype.element_ty)
    # interval = number of boundaries <= x = len(boundaries) - #(x < boundary); NaN lands in the last interval
    interval = tl.zeros([BLOCK_GROUPS, 8], dtype=tl.int32) + num_boundaries
    for j in range(num_boundaries):
        boundary = tl.load(boundaries_ptr + j)
        interval -= (x < boundary).to(tl.int32)
    codes = tl.load(interval_codes_ptr + interval, mask=mask, other=0).to(tl.int64)
    # word = sum_k code_k << (k * BITS), the little-endian BITS-byte word of the group
    shifts = tl.arange(0, 8).to(tl.int64)[None, :] * BITS
    word = tl.sum(codes << shifts, axis=1)
    group_mask = groups * 8 < numel
    for byte in tl.static_range(BITS):
        value = ((word >> (8 * byte)) & 0xFF).to(tl.uint8)
        tl.store(packed_ptr + groups * BITS + byte, value, mask=group_mask)


@triton.jit
def _fewbit_backward_kernel(
    grad_ptr,
    packed_ptr,
    levels_ptr,
    out_ptr,
    numel,
    BITS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    OUT_BF16: tl.constexpr,  # bfloat16 grad (as its int16 bit pattern) and output
):
    pid = tl.program_id(0)
    groups, elements = _group_offsets(pid, BLOCK_GROUPS)
    mask = elements < numel
    group_mask = groups * 8 < numel
    word = tl.zeros([BLOCK_GROUPS], dtype=tl.int64)
    for byte in tl.static_range(BITS):
        value = tl.load(packed_ptr + groups * BITS + byte, mask=group_mask, other=0).to(tl.int64)
        word |= value << (8 * byte)
    shifts = tl.arange(0, 8).to(tl.int64)[None, :] * BITS
    codes = (word[:, None] >> shifts) & ((1 << BITS) - 1)
    levels = tl.load(levels_ptr + codes, mask=mask, other=0.0)
    if OUT_BF16:
        grad = _bfloat16_bits_to_float32(tl.load(grad_ptr + elements, mask=mask, other=0))
    else:
        grad = tl.load(grad_ptr + elements, mask=mask, other=0.0)
    # grad_input = grad * levels[code], computed in the dtype of the levels (float32, or float64 for float64 grads)
    result = grad.to(levels_ptr.dtype.element_ty) * levels
    # a zero level selects +0 (as torch's backward does), not grad * 0 (-0 for negative grad, NaN for inf / NaN)
    result = tl.where(levels == 0, 0.0, result)
    if OUT_BF16:
        tl.store(out_ptr + elements, _float32_to_bfloat16(result), mask=mask)
    else:
        tl.store(out_ptr + elements, result.to(out_ptr.dtype.element_ty), mask=mask)
