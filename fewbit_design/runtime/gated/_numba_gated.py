"""numba CPU kernels of the compressed gated-MLP backward (:mod:`.compressed`; imported lazily: importing this module
loads numba).

The backward reads gate and up as K-bit group codes (:mod:`fewbit_design.runtime.linear.quant`) and needs

    h~ = act(gate~) * up~                                   (for dW_down = g^T h~)
    d_up = dh * act(gate~),  d_gate = act'(gate~) * (dh * up~)   (dh = g W_down)

Done with torch ops that is seven passes over the (rows, I) tensors (decode gate, decode up, act, the product, two
products with dh, act's backward), each one memory-bound. Here it is two: :func:`product` decodes both code sets and
writes h~; :func:`gradients` decodes them again (the codes are 1 byte per value or less), reads dh and writes d_gate
and d_up, in the two halves of one (rows, 2I) tensor (the fused gate_up layout's gradient as it is, or two strided
views).

Arithmetic: every value in float32 (decode ``low + code * step`` as one fused multiply-add, as the group dequantizer),
one rounding to the output dtype at the end (bfloat16 outputs: nearest even, NaN -> 0x7FC0). The torch path rounds
gate~ and up~ to the dtype first and every intermediate product; so results agree with it within the rounding of the
dtype (float32: a few units of 2**-24 relative per element), not bitwise. exp is a vectorisable float32 exp (Cody and
Waite reduction, Cephes' degree-6 polynomial: within 2 ulp of the exact value over the whole range, subnormal results
included), so that LLVM vectorises the loops (numba's math.exp is a scalar libm call, 3x slower than torch's silu).

Activations: ``silu`` (``g / (1 + exp(-g))``; ``act' = s (1 + g (1 - s))``, ``s = 1 / (1 + exp(-g))``), ``gelu_tanh``
(``tanh`` via ``1 - 2 / (exp(2 z) + 1)``) and ``relu`` (``act' = 1`` where ``a > 0`` else 0, from the output as
torch's ``threshold_backward``). ``gelu`` (erf) runs the torch path. A NaN (a non-finite group decodes to NaN)
propagates as in the torch path.

Rows are processed in blocks whose element count is a multiple of 8 (a packing group), as the dequantizer's.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

from .._numba_packing import _0, _8, _fma, _u64, _unpack_buffer

__all__ = ["ACTIVATIONS", "product", "gradients"]

#: activation name -> kernel code
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "relu": 2}

BLOCK = 8192  # elements of a block's code buffers (at least 8 rows)

_f32 = numba.float32
_i32 = numba.int32
_ROUND = np.uint32(0x7FFF)
_ONE = np.float32(1.0)
_TWO = np.float32(2.0)
_HALF = np.float32(0.5)
_ZERO = np.float32(0.0)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LOW = np.float32(-104.0)
_EXP_HIGH = np.float32(89.0)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_SQRT_2_OVER_PI = np.float32(0.7978845608028654)
_GELU_C = np.float32(0.044715)
_GELU_3C = np.float32(3.0 * 0.044715)


@intrinsic
def _as_float(typingctx, bits):
    """The float32 whose bits are the int32 ``bits``."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _as_bits(typingctx, value):
    """The uint32 bits of the float32 ``value``."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@numba.njit(cache=True, inline="always", error_model="numpy")
def _exp(x):
    # exp(x) = 2**n * p(r), n = round(x / ln 2), r = x - n ln 2 (two-part ln 2, exact first product), |r| <= ln 2 / 2;
    # 2**n as two factors 2**(n // 2) * 2**(n - n // 2) so that underflow to subnormals and overflow to inf are exact
    x = min(max(x, _EXP_LOW), _EXP_HIGH)
    n = np.floor(_fma(x, _LOG2E, _HALF))
    r = _fma(n, -_LN2_LO, _fma(n, -_LN2_HI, x))
    p = _fma(_fma(_fma(_fma(_fma(_fma(_P0, r, _P1), r, _P2), r, _P3), r, _P4), r, _P5), r * r, r + _ONE)
    k = _i32(n)
    half = k >> _i32(1)
    return p * _as_float((half + _i32(127)) << _i32(23)) * _as_float((k - half + _i32(127)) << _i32(23))


@numba.njit(cache=True, inline="always", error_model="numpy")
def _activation(g, activation):
    """(act(g), act'(g)) in float32."""
    if activation == 0:  # silu
        e = _exp(-g)
        s = _ONE / (_ONE + e)
        return g / (_ONE + e), s * (_ONE + g * (_ONE - s))
    if activation == 1:  # gelu_tanh: 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + c g^3)
        g2 = g * g
        z = _SQRT_2_OVER_PI * (g + _GELU_C * g2 * g)
        t = _ONE - _TWO / (_exp(_TWO * z) + _ONE)
        dz = _SQRT_2_OVER_PI * (_ONE + _GELU_3C * g2)
        return _HALF * g * (_ONE + t), _HALF * (_ONE + t) + _HALF * g * (_ONE - t * t) * dz
    a = max(g, _ZERO) if g == g else g  # relu (NaN stays NaN, as torch's)
    return a, _ZERO if a <= _ZERO else _ONE


def _load(x, at):
    """Element ``at`` of float32 ``x``, or of bfloat16 bits (uint16 ``x``) widened to float32."""


@overload(_load, inline="always", jit_options={"cache": True, "error_model": "numpy"})
def _load_overload(x, at):
    if x.dtype == types.uint16:
        return lambda x, at: _as_float(_i32(np.uint32(x[at]) << np.uint32(16)))
    return lambda x, at: x[at]


def _store(out, at, value):
    """``value`` into float32 ``out``, or rounded to bfloat16 bits (nearest even; NaN -> 0x7FC0) into uint16 ``out``."""


@overload(_store, inline="always", jit_options={"cache": True, "error_model": "numpy"})
def _store_overload(out, at, value):
    if out.dtype == types.uint16:

        def to_bfloat16(out, at, value):
            word = _as_bits(value)
            rounded = (word + _ROUND + ((word >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            nan = np.uint32(value != value)  # branch-free, so that the loop vectorises
            out[at] = np.uint16(rounded * (np.uint32(1) - nan) + np.uint32(0x7FC0) * nan)

        return to_bfloat16

    def to_float32(out, at, value):
        out[at] = value

    return to_float32


@numba.njit(cache=True, inline="always", error_model="numpy")
def _rows(
    gate_packed, gate_scales, up_packed, up_scales, features, group_size, bits, activation, gradients, dh, out, stride,
    gate_at, up_at, row_start, row_stop,
):  # fmt: skip
    # gradients False (a constant at each call, so the loops specialise): out[row * stride + gate_at + i] = h~
    block_rows = _u64(max(8, (BLOCK // max(features, 1)) // 8 * 8))
    features = _u64(features)
    group_size = _u64(group_size)
    stride = _u64(stride)
    gate_at = _u64(gate_at)
    up_at = _u64(up_at)
    direct = bits == 8
    gate_buffer = np.empty(_8 if direct else block_rows * features + _8, dtype=np.uint8)
    up_buffer = np.empty(_8 if direct else block_rows * features + _8, dtype=np.uint8)
    for block in range(_u64(row_start), _u64(row_stop), block_rows):
        block_stop = min(block + block_rows, _u64(row_stop))
        if not direct:
            count = (block_stop - block) * features
            _unpack_buffer(gate_packed, block * features // _8, count, _u64(bits), gate_buffer)
            _unpack_buffer(up_packed, block * features // _8, count, _u64(bits), up_buffer)
        for row in range(block, block_stop):
            base = row * features
            code_at = base if direct else (row - block) * features
            gate_codes = gate_packed if direct else gate_buffer
            up_codes = up_packed if direct else up_buffer
            target = row * stride
            for start in range(_0, features, group_size):
                stop = min(start + group_size, features)
                group = start // group_size
                gate_low = gate_scales[row, group, 0]
                gate_step = gate_scales[row, group, 1]
                up_low = up_scales[row, group, 0]
                up_step = up_scales[row, group, 1]
                for i in range(start, stop):
                    g = _fma(_f32(gate_codes[code_at + i]), gate_step, gate_low)
                    u = _fma(_f32(up_codes[code_at + i]), up_step, up_low)
                    a, derivative = _activation(g, activation)
                    if gradients:
                        d = _load(dh, base + i)
                        _store(out, target + up_at + i, d * a)
                        _store(out, target + gate_at + i, derivative * (d * u))
                    else:
                        _store(out, target + gate_at + i, a * u)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def product(
    gate_packed, gate_scales, up_packed, up_scales, features, group_size, bits, activation, out, row_start, row_stop
):  # fmt: skip
    """h~ = act(gate~) * up~ of rows [row_start, row_stop) into the flat (rows, features) ``out`` (float32, or
    bfloat16 bits as uint16)."""
    empty = np.empty(0, dtype=np.float32)
    _rows(gate_packed, gate_scales, up_packed, up_scales, features, group_size, bits, activation, False, empty, out,
          features, 0, 0, row_start, row_stop)  # fmt: skip


@numba.njit(cache=True, nogil=True, error_model="numpy")
def gradients(
    gate_packed, gate_scales, up_packed, up_scales, features, group_size, bits, activation, dh, out, row_start,
    row_stop,
):  # fmt: skip
    """d_gate = act'(gate~) * (dh * up~) and d_up = dh * act(gate~) of rows [row_start, row_stop) into the flat
    (rows, 2 features) ``out``: d_gate in each row's first half, d_up in its second (float32, or bfloat16 bits as
    uint16, ``dh`` likewise)."""
    _rows(gate_packed, gate_scales, up_packed, up_scales, features, group_size, bits, activation, True, dh, out,
          2 * features, 0, features, row_start, row_stop)  # fmt: skip
