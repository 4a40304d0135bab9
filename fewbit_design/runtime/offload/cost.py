"""The cost model the planner reads: bytes an offload saves and the time it may add (pure Python).

Offloading moves every saved byte twice (out in forward, back in backward) and pays a fixed cost per transfer: one
per tensor, or one per block for the small tensors packed together (``pack_bytes``; pass ``tensors=`` transfers).
Transfers overlap with compute, so with ``compute_seconds`` (forward + backward time of the region) only the part
that compute cannot hide is charged; without it the estimate is the upper bound (nothing hidden). On CPU the
copies into and out of the page cache are CPU work beside the compute; overlap hides their latency, not always
their cost, so prefer the upper bound where cores are scarce. The per-tensor costs are estimates (thread hand-off
and system calls; stream and event calls on CUDA), not measurements.

Bandwidths (bytes per second, out then back): ``disk`` was measured on the 2-core development machine by
``benchmarks/offload.py`` (``os.pwrite`` 0.23-0.44 GB/s, ``os.preadv`` 2.6-3.7 GB/s from the page cache, as during
training, where the file is read back seconds after it is written; the lower numbers under heavy load);
``cuda-host`` is an assumption (pinned PCIe 4.0 x16, about 12 GB/s each way), not a measurement. Pass
``bandwidth=`` (one figure for both directions) measured on your machine.
"""

from __future__ import annotations

from typing import NamedTuple

from ...errors import FewBitError, check_choice

__all__ = ["Cost", "cost", "BANDWIDTH", "PER_TENSOR_SECONDS"]

BANDWIDTH = {"disk": (0.4e9, 3.0e9), "cuda-host": (12e9, 12e9)}
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
    if bandwidth is None:
        out, back = BANDWIDTH[target]
    else:
        out = back = float(bandwidth)
        if not out > 0:
            raise FewBitError(f"bandwidth must be > 0 bytes per second, got {bandwidth!r}")
    overhead = max(int(tensors), 0) * PER_TENSOR_SECONDS[target]
    transfer = saved_bytes / out + saved_bytes / back
    hidden = 0.0 if compute_seconds is None else min(transfer, max(float(compute_seconds), 0.0))
    return Cost(saved_bytes, transfer - hidden + overhead)
