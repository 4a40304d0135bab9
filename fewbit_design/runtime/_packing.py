"""Bit packing of codes: b bits per element, the layout shared by every op that stores codes.

Layout: elements are taken in flattened (contiguous) order in groups of 8; a group is stored in ``bits`` bytes;
element k of a group occupies bits [k*bits, (k+1)*bits) of the little-endian ``bits``-byte word; the last
group is zero-padded. n elements therefore take exactly ceil(n / 8) * bits bytes.

``pack_reference`` / ``unpack_reference`` are the pure-torch reference (any device). ``pack`` / ``unpack`` have the
same signatures and results, and run the numba CPU kernels on CPU tensors (the reference elsewhere, or when numba
is not installed).
"""

from __future__ import annotations

import functools

import torch

from ..errors import FewBitError

__all__ = ["packed_nbytes", "pack_reference", "unpack_reference", "pack", "unpack"]


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes taken by ``numel`` codes of ``bits`` bits: ceil(numel / 8) * bits."""
    return -(-int(numel) // 8) * int(bits)


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise FewBitError(f"bits must be an integer from 1 to 8, got {bits!r}")


def pack_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) (any shape, flattened in contiguous order) into a uint8 tensor."""
    _check_bits(bits)
    flat = codes.reshape(-1).to(torch.int64)
    numel = flat.numel()
    groups = -(-numel // 8)
    padded = torch.zeros(groups * 8, dtype=torch.int64, device=codes.device)
    padded[:numel] = flat & ((1 << bits) - 1)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    # word = sum_k code_k << (k * bits); int64 wraps for bits = 8, the byte extraction below is still exact
    words = (padded.view(groups, 8) << shifts).sum(dim=1)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    packed = (words.unsqueeze(1) >> byte_shifts) & 0xFF
    return packed.to(torch.uint8).reshape(-1)


def unpack_reference(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_reference`: the first ``numel`` codes as an int64 tensor (flat)."""
    _check_bits(bits)
    groups = -(-int(numel) // 8)
    if packed.numel() != groups * bits:
        raise FewBitError(
            f"packed codes must have ceil({numel}/8)*{bits} = {groups * bits} bytes, got {packed.numel()}"
        )
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (packed.view(groups, bits).to(torch.int64) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel]


@functools.cache
def _numba_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("numba") is not None


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_reference` with a numba kernel on CPU: integer codes (any shape) -> uint8 flat.

    >>> pack(torch.tensor([1, 2, 3]), 2).tolist()   # 1 | 2 << 2 | 3 << 4
    [57, 0]
    """
    _check_bits(bits)
    if codes.device.type != "cpu" or not _numba_available():
        return pack_reference(codes, bits)
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise FewBitError(f"codes must be an integer tensor, got {codes.dtype}")
    from . import _numba_packing as kernels

    flat = codes.detach().reshape(-1).contiguous()
    out = torch.empty(packed_nbytes(flat.numel(), bits), dtype=torch.uint8)
    kernels.run(kernels.pack_codes, flat.numel(), flat.numpy(), bits, out.numpy())
    return out


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """:func:`unpack_reference` with a numba kernel on CPU: the first ``numel`` codes as int64 (flat)."""
    _check_bits(bits)
    if packed.device.type != "cpu" or not _numba_available():
        return unpack_reference(packed, bits, numel)
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(numel, bits):
        raise FewBitError(
            f"packed codes must be ceil({numel}/8)*{bits} = {packed_nbytes(numel, bits)} uint8 bytes, "
            f"got {packed.numel()} {packed.dtype}"
        )
    from . import _numba_packing as kernels

    out = torch.empty(int(numel), dtype=torch.int64)
    kernels.run(kernels.unpack_codes, int(numel), packed.detach().reshape(-1).contiguous().numpy(), bits, out.numpy())
    return out
