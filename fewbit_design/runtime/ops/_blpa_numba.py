"""numba CPU kernels of the BLPA unit (imported lazily: importing this module loads numba).

They fuse the element-wise work of :mod:`.blpa_quant` into one pass per step and match its torch reference: the
same operations in the same dtypes (A1, A2, A3 in the compute dtype, bin arithmetic in float64), so codes and the
forward output agree bitwise; decoding reads per-channel tables (A1~ and A3~ of every code, built from the
reference formula), so gradients agree up to summation order.

Arrays are flat and contiguous, laid out as (N, C, inner) with ``inner`` = H * W (1 for Linear): plane
``q = n * C + c`` holds elements ``[q * inner, (q + 1) * inner)`` of channel ``c``. Every kernel is serial
(``nogil``) over a range of planes ``[plane_start, plane_stop)``; the caller splits planes over threads at plane
indices that are multiples of 8, so every range starts a packing group. ``mode`` selects what a unit stores:
0 = exact (A1 in the compute dtype), 1 = packed codes (8 codes in ``bits`` bytes, little-endian).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["forward", "decode_a3", "reduce_grads", "grad_input"]


@numba.njit(cache=True, inline="always")
def _code_at(packed, i, bits):
    # groups of 8 codes in ``bits`` little-endian bytes make one bit stream: element i sits at bit i * bits
    bit = i * bits
    byte = bit >> 3
    shift = bit & 7
    value = np.int64(packed[byte]) >> shift
    if shift + bits > 8:
        value |= np.int64(packed[byte + 1]) << (8 - shift)
    return value & ((1 << bits) - 1)


@numba.njit(cache=True, nogil=True)
def forward(x, mean, invstd, gamma, beta, channels, inner, mode, naive, bits, scale, f, p, lut_a3, a3, packed,
            stored, plane_start, plane_stop):  # fmt: skip
    """A1 = (x - mean) invstd, A2 = A1 gamma + beta, A3 = relu(A2) (relu(A2~) when naive) into ``a3``; the codes
    OR-ed into the zeroed ``packed`` (mode 1) or A1 into ``stored`` (mode 0)."""
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
            raw = np.float64(a1) * sc - ff
            if raw != raw:  # NaN input: code 0, as the reference
                k = 0
            else:
                code = np.ceil(raw) + half
                if a2 > 0:
                    code = min(max(code, low_positive), top)
                else:
                    code = min(max(code, 0.0), high_negative)
                k = np.int64(code)
            if naive:
                a3[i] = lut_a3[c, k]
            else:
                a3[i] = zero if a2 <= 0 else a2
            # ``packed`` starts zeroed; ranges start at multiples of 8 elements, so threads share no byte
            bit = i * bits
            byte = bit >> 3
            value = k << (bit & 7)
            packed[byte] |= np.uint8(value & 0xFF)
            if value > 0xFF:
                packed[byte + 1] |= np.uint8(value >> 8)


@numba.njit(cache=True, nogil=True)
def decode_a3(packed, stored, gamma, beta, channels, inner, mode, bits, lut_a3, a3, plane_start, plane_stop):
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
                a3[i] = lut_a3[c, _code_at(packed, i, bits)]


@numba.njit(cache=True, nogil=True)
def reduce_grads(packed, stored, grad, gamma, beta, channels, inner, mode, bits, p, lut_a1, sum_beta, sum_gamma,
                 plane_start, plane_stop):  # fmt: skip
    """Per plane: the sums of grad_A2 = mask * grad_A3 and of A1~ * grad_A2 (float64), eq. (7)."""
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
                if a1 * g + b > 0:
                    value = np.float64(grad[i])
                    total_beta += value
                    total_gamma += np.float64(a1) * value
        else:
            first = p[c]
            for i in range(base, base + inner):
                k = _code_at(packed, i, bits)
                if k >= first:
                    value = np.float64(grad[i])
                    total_beta += value
                    total_gamma += np.float64(lut_a1[c, k]) * value
        sum_beta[plane] = total_beta
        sum_gamma[plane] = total_gamma


@numba.njit(cache=True, nogil=True)
def grad_input(packed, stored, grad, gamma, beta, invstd, mean_grad, mean_proj, channels, inner, mode, bits, p,
               lut_a1, grad_x, plane_start, plane_stop):  # fmt: skip
    """eq. (8): grad_x = invstd * (gamma grad_A2 - mean(grad_A1) - A1~ mean(A1~ grad_A1)), in float64."""
    for plane in range(plane_start, plane_stop):
        c = plane % channels
        base = plane * inner
        g = np.float64(gamma[c])
        b = beta[c]
        s = np.float64(invstd[c])
        shift = mean_grad[c]
        proj = mean_proj[c]
        first = p[c]
        for i in range(base, base + inner):
            if mode == 0:
                a1 = np.float64(stored[i])
                positive = stored[i] * gamma[c] + b > 0
            else:
                k = _code_at(packed, i, bits)
                a1 = np.float64(lut_a1[c, k])
                positive = k >= first
            value = np.float64(grad[i]) * g if positive else 0.0
            grad_x[i] = (value - shift - a1 * proj) * s
