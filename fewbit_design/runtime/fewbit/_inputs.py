"""What every backend of the few-bit op checks and shares: the dtypes it takes, the checks of its inputs, the
variable that forces a backend, and the flat views and non-finite positions that the kernels' launchers use.

Terms (see :mod:`fewbit_design`): sorted ``boundaries`` cut the real line into intervals, ``interval_codes`` gives
each interval its code, ``packed`` holds the codes of ``bits`` bits (layout in :mod:`.._packing`).
"""

from __future__ import annotations

import torch

from ...errors import FewBitError
from .._packing import packed_nbytes

__all__ = [
    "BACKEND_ENV",
    "SUPPORTED_DTYPES",
    "check_input",
    "check_packed",
    "flat_contiguous",
    "nonfinite_positions",
]

BACKEND_ENV = "FEWBIT_BACKEND"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_input(x: torch.Tensor, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int) -> None:
    """One FewBitError unless x, the boundaries, the interval codes and bits fit together (dtypes, sizes, 1-8 bits).

    Args:
        x: the input (float32, float16, bfloat16 or float64)
        boundaries: float64 for float64 x, else float32
        interval_codes: one code per interval, len(boundaries) + 1
        bits: bits per code, 1 to 8
    """
    if x.dtype not in SUPPORTED_DTYPES:
        raise FewBitError(f"few-bit activations take float32, float16, bfloat16 or float64 input, got {x.dtype}")
    expected = torch.float64 if x.dtype == torch.float64 else torch.float32
    if boundaries.dtype != expected:
        raise FewBitError(f"boundaries must be {expected} for {x.dtype} input, got {boundaries.dtype}")
    if interval_codes.numel() != boundaries.numel() + 1:
        raise FewBitError(
            f"interval_codes must have len(boundaries) + 1 = {boundaries.numel() + 1} entries, "
            f"got {interval_codes.numel()}"
        )
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise FewBitError(f"bits must be an integer from 1 to 8, got {bits!r}")


def check_packed(packed: torch.Tensor, bits: int, numel: int) -> None:
    """One FewBitError unless ``packed`` is the uint8 codes of ``numel`` elements at ``bits`` bits.

    Args:
        packed: the packed codes
        bits: bits per code
        numel: elements the codes are for
    """
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(numel, bits):
        raise FewBitError(
            f"packed codes must be {packed_nbytes(numel, bits)} uint8 bytes for {numel} elements at {bits} bits, "
            f"got {packed.numel()} {packed.dtype}"
        )


def flat_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, flattened in logical order, contiguous (a copy only where it is not).

    Args:
        tensor: any tensor
    """
    return tensor.detach().reshape(-1).contiguous()


def nonfinite_positions(flat: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions + offset, values) of the non-finite elements of the flat tensor ``flat``.

    Args:
        flat: a 1-D tensor
        offset: added to the positions (where ``flat`` is a block of a larger tensor)
    """
    mask = ~torch.isfinite(flat)
    return torch.nonzero(mask).reshape(-1) + offset, flat[mask]
