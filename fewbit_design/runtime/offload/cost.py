"""The cost model the planner reads: bytes an offload saves and the time it may add (pure Python).

Offloading moves every saved byte twice (out in forward, back in backward) and pays a fixed cost per tensor.
Transfers overlap with compute, so with ``compute_seconds`` (forward + backward time of the region) only the part
that compute cannot hide is charged; without it the estimate is the upper bound (nothing hidden).

Bandwidths: ``disk`` is measured on the 2-core development machine by ``benchmarks/offload.py`` (page cache
warm, as during training: the file is read back seconds after it is written); ``cuda-host`` is an assumption
(pinned PCIe 4.0 x16, about 12 GB/s per direction), not a measurement: pass ``bandwidth=`` measured on your GPU.
"""

from __future__ import annotations

from typing import NamedTuple

from ...errors import FewBitError, check_choice

__all__ = ["Cost", "cost", "BANDWIDTH", "PER_TENSOR_SECONDS"]

BANDWIDTH = {"disk": 1.5e9, "cuda-host": 12e9}
PER_TENSOR_SECONDS = {"disk": 40e-6, "cuda-host": 15e-6}


class Cost(NamedTuple):
    """``bytes_saved``: bytes that leave memory; ``extra_seconds``: estimated added step time."""

    bytes_saved: int
    extra_seconds: float


def cost(
    saved_bytes: int,
    *,
    target: str = "disk",
    tensors: int = 1,
    compute_seconds: float | None = None,
    bandwidth: float | None = None,
) -> Cost:
    """Estimate what offloading ``saved_bytes`` (in ``tensors`` tensors) to ``target`` saves and costs.

    >>> saved, extra = cost(1 << 30, target="disk", tensors=32, bandwidth=1e9)
    >>> saved, round(extra, 4)             # 2 GiB moved at 1 GB/s, plus 32 x 40 us
    (1073741824, 2.1488)
    >>> round(cost(1 << 30, target="disk", tensors=32, bandwidth=1e9, compute_seconds=10.0).extra_seconds, 5)
    0.00128
    """
    check_choice("target", target, BANDWIDTH)
    if isinstance(saved_bytes, bool) or not isinstance(saved_bytes, int) or saved_bytes < 0:
        raise FewBitError(f"saved_bytes must be an integer >= 0, got {saved_bytes!r}")
    rate = BANDWIDTH[target] if bandwidth is None else float(bandwidth)
    if not rate > 0:
        raise FewBitError(f"bandwidth must be > 0 bytes per second, got {bandwidth!r}")
    overhead = max(int(tensors), 0) * PER_TENSOR_SECONDS[target]
    transfer = 2 * saved_bytes / rate
    hidden = 0.0 if compute_seconds is None else min(transfer, max(float(compute_seconds), 0.0))
    return Cost(saved_bytes, transfer - hidden + overhead)
