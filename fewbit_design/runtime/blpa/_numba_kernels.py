"""numba CPU kernels of the BLPA unit (imported lazily: importing this module loads numba).

They fuse the element-wise work of :mod:`.blpa_quant` and match its torch reference: the same operations in the
same dtypes (A1, A2, A3 in the compute dtype, bin arithmetic in float64), so codes and the forward output agree
bitwise; decoding reads per-channel tables (A1~ and A3~ of every code, built from the reference formula), so
gradients agree up to summation order.

Arrays are flat and contiguous, laid out as (N, C, inner) with ``inner`` = H * W (1 for Linear): plane
``q = n * C + c`` holds elements ``[q * inner, (q + 1) * inner)`` of channel ``c``. Every kernel is serial
(``nogil``) over a range of planes ``[plane_start, plane_stop)``; the caller splits planes over threads at plane
indices that are multiples of 8, so every range starts a packing group and threads share no byte. ``mode`` selects
what a unit stores: 0 = exact (A1 in the compute dtype), 1 = packed codes. Packed codes form one little-endian bit
stream (8 codes in ``bits`` bytes): code i sits at bits [i * bits, (i + 1) * bits).

Inner loops are branch-free selects over one plane (the per-channel constants hoisted), with codes going through a
uint8 scratch array and packed or unpacked in a separate tight loop, which keeps them vectorizable; calling a
helper ``njit`` function per element was 40x slower here.
"""

from __future__ import annotations

import numba
import numpy as np

# the project's packing (one copy for every technique): same bit stream, ranges start on a group of 8
from .._numba_packing import pack_codes as _pack
from .._numba_packing import unpack_codes as _unpack

__all__ = ["tables", "forward", "unpack", "decode_a3", "reduce_grads", "grad_input"]


@numba.njit(cache=True, nogil=True)
def tables(p, z, step, offset, r, gamma, beta, lut_a1, lut_a3, a1_table, mask_table):
    """Per channel and code: A1~ and A3~ in the compute dtype (``lut_a1``, ``lut_a3``), A1~ as float64
    (``a1_table``, after rounding to the compute dtype) and the mask (``mask_table``, 0 or 1); the formula of
    :func:`fewbit_design.runtime.blpa.quant.dequantize`, float64 arithmetic."""
    channels, levels = lut_a1.shape
    for c in range(channels):
        for k in range(levels):
            code = np.float64(k)
            positive = code >= p[c]
            regular = code >= z[c] if positive else code < z[c]
            if regular:
                a1 = (code + offset[c]) * step[c]
            else:
                a1 = ((0.5 if positive else -0.5) - r[c]) * step[c]
            a3 = 0.0
            if positive:
                a2 = a1 * gamma[c] + beta[c]
                a3 = a2 if a2 > 0.0 else 0.0
            lut_a1[c, k] = a1
            lut_a3[c, k] = a3
            a1_table[c, k] = lut_a1[c, k]
            mask_table[c, k] = 1.0 if positive else 0.0


@numba.njit(cache=True, nogil=True)
def forward(x, mean, invstd, gamma, beta, channels, inner, mode, naive, bits, scale, f, p, lut_a3, a3, codes,
            packed, stored, plane_start, plane_stop):  # fmt: skip
    """A1 = (x - mean) invstd, A2 = A1 gamma + beta, A3 = relu(A2) (relu(A2~) when naive) into ``a3``; the codes
    (via the uint8 scratch ``codes``) into the zeroed ``packed`` (mode 1), or A1 into ``stored`` (mode 0)."""
    half = np.float64((1 << bits) >> 1)
    top = np.float64((1 << bits) - 1)
    for plane in range(plane_start, plane_stop):
        c = plane % channels
        m = mean[c]
        s = invstd[c]
        g = gamma[c]
        b = beta[c]
        zero = m - m
        base = plane * inner
        if mode == 0:
            for i in range(base, base + inner):
                a1 = (x[i] - m) * s
                a2 = a1 * g + b
                stored[i] = a1
                a3[i] = zero if a2 <= 0 else a2
            continue
        sc = scale[c]
        ff = f[c]
        low_positive = p[c]
        high_negative = p[c] - 1.0
        for i in range(base, base + inner):
            a1 = (x[i] - m) * s
            a2 = a1 * g + b
            code = np.ceil(np.float64(a1) * sc - ff) + half
            positive = a2 > 0
            low = low_positive if positive else 0.0
            high = top if positive else high_negative
            code = code if code > low else low
            code = code if code < high else high
            code = code if code == code else 0.0  # NaN input: code 0, as the reference
            codes[i] = np.uint8(code)
            a3[i] = zero if a2 <= 0 else a2
        if naive:
            for i in range(base, base + inner):
                a3[i] = lut_a3[c, codes[i]]
    if mode == 1:
        _pack(codes, bits, packed, plane_start * inner, plane_stop * inner)


@numba.njit(cache=True, nogil=True)
def unpack(packed, bits, inner, codes, plane_start, plane_stop):
    """Codes of planes [plane_start, plane_stop) from the bit stream into uint8 ``codes``."""
    _unpack(packed, bits, codes, plane_start * inner, plane_stop * inner)


@numba.njit(cache=True, nogil=True)
def decode_a3(codes, stored, gamma, beta, channels, inner, mode, lut_a3, a3, plane_start, plane_stop):
    """A3~ = mask * max(gamma A1~ + beta, 0) into ``a3`` (compute dtype)."""
    for plane in range(plane_start, plane_stop):
        c = plane % channels
        base = plane * inner
        if mode == 0:
            g = gamma[c]
            b = beta[c]
            zero = g - g
            for i in range(base, base + inner):
                a2 = stored[i] * g + b
                a3[i] = zero if a2 <= 0 else a2
        else:
            for i in range(base, base + inner):
                a3[i] = lut_a3[c, codes[i]]


@numba.njit(cache=True, nogil=True, fastmath={"reassoc"})
def reduce_grads(codes, stored, grad, gamma, beta, channels, inner, mode, mask_table, a1_table, sum_beta, sum_gamma,
                 plane_start, plane_stop):  # fmt: skip
    """Per plane: the sums of grad_A2 = mask * grad_A3 and of A1~ * grad_A2 (float64, reassociated so the loop
    vectorizes), eq. (7). Mode 1 reads per-channel tables of the mask and of A1~ per code."""
    for plane in range(plane_start, plane_stop):
        c = plane % channels
        base = plane * inner
        total_beta = 0.0
        total_gamma = 0.0
        if mode == 0:
            g = gamma[c]
            b = beta[c]
            for i in range(base, base + inner):
                a1 = stored[i]
                value = np.float64(grad[i]) if a1 * g + b > 0 else 0.0
                total_beta += value
                total_gamma += np.float64(a1) * value
        else:
            for i in range(base, base + inner):
                k = codes[i]
                value = np.float64(grad[i]) if mask_table[c, k] != 0 else 0.0
                total_beta += value
                total_gamma += a1_table[c, k] * value
        sum_beta[plane] = total_beta
        sum_gamma[plane] = total_gamma


@numba.njit(cache=True, nogil=True)
def grad_input(codes, stored, grad, gamma, beta, invstd, mean_grad, mean_proj, channels, inner, mode, scale_table,
               offset_table, grad_x, plane_start, plane_stop):  # fmt: skip
    """eq. (8): grad_x = invstd * (gamma grad_A2 - mean(grad_A1) - A1~ mean(A1~ grad_A1)), in float64; mode 1 as
    grad_x = grad_A3 * scale_table[c, code] - offset_table[c, code] (the per-code factors precomputed)."""
    for plane in range(plane_start, plane_stop):
        c = plane % channels
        base = plane * inner
        if mode == 0:
            g = np.float64(gamma[c])
            gc = gamma[c]
            b = beta[c]
            s = np.float64(invstd[c])
            shift = mean_grad[c]
            proj = mean_proj[c]
            for i in range(base, base + inner):
                a1 = stored[i]
                value = np.float64(grad[i]) * g if a1 * gc + b > 0 else 0.0
                grad_x[i] = (value - shift - np.float64(a1) * proj) * s
        else:
            for i in range(base, base + inner):
                k = codes[i]
                grad_x[i] = np.float64(grad[i]) * scale_table[c, k] - offset_table[c, k]
