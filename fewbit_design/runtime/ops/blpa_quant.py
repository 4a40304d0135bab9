"""Sign-preserving K-bit quantization of pre-ReLU activations for BLPA (Chakrabarti & Moseley, eqs. 9-10).

Terms (per channel c of a batch-normalized unit):

* ``A1`` the normalized input, ``A2 = gamma * A1 + beta`` the pre-ReLU activation, ``A3 = relu(A2)``.
* ``delta = 6 / 2**K`` the bin width in A1 units, i.e. ``Delta = 6 |gamma| / 2**K`` in A2 units (eq. 9).
* ``s = sign(gamma) * A1`` (``sign(0) = +1``), so ``A2 = |gamma| s + beta`` grows with ``s``.
* ``r = beta / Delta``: where beta sits in bin units; ``k = ceil(r + 1/2)`` and ``f = k - r`` in [0.5, 1.5).

Codes. ``raw = ceil(s / delta - f) + 2**(K-1)``: code ``c`` is the bin ``s / delta - f`` in ``(c - 2**(K-1) - 1,
c - 2**(K-1)]``, i.e. the paper's 2**K bins of width Delta, with bin edges aligned so that ``A2 = 0`` is always an
edge (there ``s / delta - f = -k``, an integer), and the window placed as close to centred on beta as that
alignment allows: in A1 units it is ``(-3 + delta (f - 1), 3 + delta (f - 1)]``, within half a bin of
``[-3, 3]`` (eq. 9 clips to about ``beta +- 3|gamma|`` the same way). Bins are open on the left and closed on the
right, so ``A2 == 0`` falls in a non-positive bin. ``z = 2**(K-1) + 1 - k`` is the first code whose bin is
positive. Clipping to the 2**K codes must not cross zero, so codes are clamped by sign:

* ``p = clamp(z, 1, 2**K - 1)`` is the first code that means "A2 > 0"; positive elements get codes in
  ``[p, 2**K)``, non-positive ones codes in ``[0, p)``. When the paper's window lies entirely on one side of zero
  (``|beta| > ~3|gamma|``), the code at the window's edge next to zero becomes a catch-all for the other sign
  (reconstructed at the centre of the bin next to zero, ``+-Delta/2``); otherwise the window straddles zero and
  plain clipping already keeps signs.
* ``gamma == 0``: then ``A2 = beta`` exactly, so the sign is constant per channel and needs no bits; all 2**K codes
  quantize A1 itself on ``(-3, 3]`` (``r = 0``, ``f = 1``), and ``p = 0`` (beta > 0, all positive) or
  ``p = 2**K`` (beta <= 0, none). This keeps the gradient to gamma finite and informative at gamma == 0 (A1 cannot
  be recovered from A2 = beta there).

Decoding gives ``mask = code >= p`` (equal to ``A2 > 0`` for every element, by construction) and
``A1~ = sign(gamma) * delta * (c - 2**(K-1) - 0.5 + f)`` (bin centre), or for a catch-all code
``A1~ = sign(gamma) * delta * (+-0.5 - r)``; then ``A2~ = gamma * A1~ + beta`` and
``A3~ = mask * max(A2~, 0)``.

Error bound: for elements inside the window (at least ``|A1| <= 3 - delta / 2``) ``|A1~ - A1| <= 3 / 2**K`` and
``|A2~ - A2|, |A3~ - A3| <= 3 |gamma| / 2**K`` (half a bin), so errors halve with every extra bit; clipped elements
add their distance to the window edge (this part does not shrink with K); a catch-all element has
``A3~ = A3 = 0`` (non-positive side) or ``A3~ = Delta / 2`` (positive side). The sign, hence the ReLU mask, is
always exact.
"""

from __future__ import annotations

import torch

from .packing import pack_reference, packed_nbytes, unpack_reference

__all__ = ["ChannelGrid", "channel_grid", "quantize", "dequantize", "pack_codes", "unpack_codes", "compute_dtype"]

# |r| beyond this: f = k - r is meaningless in floating point; the grid offset is then arbitrary anyway
_HUGE_R = 2.0**40


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype quantization and gradient arithmetic run in: float64 stays, everything else uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ChannelGrid:
    """Per-channel constants of the quantizer (1-D tensors of length C in the compute dtype).

    Attributes:
        sign: sign(gamma) with sign(0) = +1.
        inv_delta: 2**K / 6, the scale from A1 to bin units (a Python float).
        f: k - r with k = ceil(r + 1/2), the grid offset in [0.5, 1.5) (1 where gamma == 0 or |r| is huge).
        r: beta / Delta (0 where gamma == 0; only used for catch-all codes).
        z: first code of a positive bin, unclamped (equals p where gamma == 0).
        p: first code meaning "A2 > 0", in [0, 2**K].
    """

    def __init__(self, gamma: torch.Tensor, beta: torch.Tensor, bits: int, dtype: torch.dtype):
        levels = 1 << bits
        half = levels >> 1
        g = gamma.detach().to(torch.float64)
        b = beta.detach().to(torch.float64)
        zero = g == 0
        self.bits = bits
        self.inv_delta = levels / 6.0
        self.sign = torch.where(g < 0, -1.0, 1.0).to(torch.float64)
        abs_g = torch.where(zero, 1.0, g.abs())
        r = b * self.inv_delta / abs_g
        r = torch.where(zero, 0.0, r)
        k = torch.ceil(r + 0.5)
        f = torch.where(r.abs() < _HUGE_R, k - r, 1.0)
        z = half + 1 - k
        p_nonzero = z.clamp(1, levels - 1)
        p_zero = torch.where(b > 0, 0.0, float(levels))
        self.r = r.to(dtype)
        self.f = f.to(dtype)
        self.z = torch.where(zero, p_zero, z).to(dtype)
        self.p = torch.where(zero, p_zero, p_nonzero).to(dtype)
        self.sign = self.sign.to(dtype)


def channel_grid(gamma: torch.Tensor, beta: torch.Tensor, bits: int, dtype: torch.dtype) -> ChannelGrid:
    """The per-channel quantizer constants for scale ``gamma`` and shift ``beta`` at ``bits`` bits."""
    return ChannelGrid(gamma, beta, bits, dtype)


def _per_channel(values: torch.Tensor, ndim: int) -> torch.Tensor:
    return values.view((1, -1) + (1,) * (ndim - 2))


def quantize(a1: torch.Tensor, a2: torch.Tensor, grid: ChannelGrid) -> torch.Tensor:
    """Codes (uint8, shape of ``a1``) of the normalized activations ``a1``; ``a2`` (same shape) gives the signs.

    Channels are along dim 1. ``a1`` and ``a2`` must be in the grid's dtype.
    """
    levels = 1 << grid.bits
    half = levels >> 1
    ndim = a1.dim()
    scale = _per_channel(grid.sign * grid.inv_delta, ndim)
    raw = torch.ceil(torch.addcmul(-_per_channel(grid.f, ndim), a1, scale)).add_(half)
    positive = a2 > 0
    p = _per_channel(grid.p, ndim)
    low = torch.where(positive, p, 0.0)
    high = torch.where(positive, float(levels - 1), p - 1)
    codes = torch.minimum(torch.maximum(raw, low), high)
    return codes.nan_to_num_(0.0).to(torch.uint8)


def dequantize(
    codes: torch.Tensor, grid: ChannelGrid, gamma: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mask, a1, a3)``: the ReLU mask (bool), the approximate A1 and A3 in the grid's dtype.

    ``codes`` has channels along dim 1; ``gamma`` and ``beta`` are the per-channel parameters.
    """
    dtype = grid.f.dtype
    ndim = codes.dim()
    half = (1 << grid.bits) >> 1
    c = codes.to(dtype)
    mask = c >= _per_channel(grid.p, ndim)
    z = _per_channel(grid.z, ndim)
    step = _per_channel(grid.sign / grid.inv_delta, ndim)
    a1 = (c + (_per_channel(grid.f, ndim) - half - 0.5)).mul_(step)
    catch = torch.where(mask, c < z, c >= z)
    if bool(catch.any()):
        r = _per_channel(grid.r, ndim)
        centre = torch.where(mask, 0.5, -0.5)
        a1 = torch.where(catch, (centre - r) * step, a1)
    g = _per_channel(gamma.detach().to(dtype), ndim)
    b = _per_channel(beta.detach().to(dtype), ndim)
    a2 = torch.addcmul(b, a1, g)
    a3 = torch.where(mask, a2.clamp_min_(0.0), 0.0)
    return mask, a1, a3


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (any shape, flattened in logical order) into the project's layout (``packing``)."""
    flat = codes.reshape(-1)
    numel = flat.numel()
    if bits in (2, 4, 8):
        per_byte = 8 // bits
        padded_len = -(-numel // 8) * 8
        if padded_len != numel:
            flat = torch.cat([flat, flat.new_zeros(padded_len - numel)])
        if bits == 8:
            return flat
        grouped = flat.view(-1, per_byte)
        packed = grouped[:, 0].clone()
        for k in range(1, per_byte):
            packed |= grouped[:, k] << (k * bits)
        return packed
    return pack_reference(flat, bits)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes, flat (uint8 or int64)."""
    assert packed.numel() == packed_nbytes(numel, bits)
    if bits in (2, 4, 8):
        if bits == 8:
            return packed[:numel]
        per_byte = 8 // bits
        mask = (1 << bits) - 1
        parts = [(packed >> (k * bits)) & mask for k in range(per_byte)]
        return torch.stack(parts, dim=1).reshape(-1)[:numel]
    return unpack_reference(packed, bits, numel)
