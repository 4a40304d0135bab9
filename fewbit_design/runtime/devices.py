"""Descriptions of devices one may not have: memory, dense FLOP/s, memory bandwidth and host-link bandwidth, for the
roofline time model (:mod:`.roofline`) and the whole-step estimate (:mod:`.estimate`).

Presets are the vendors' published datasheet numbers (each cited beside it): peaks that no training step reaches, so
a time predicted from them is a lower bound, labelled *predicted* wherever it is shown. Memory is the datasheet's
capacity in GB (10^9 bytes); ``nvidia-smi`` shows a few percent more, less the CUDA context (about 0.5 GB) and the
allocator's cache. Dense FLOP/s are without structured sparsity; ``float32`` is the non-tensor-core rate. The host
link is one direction of the PCIe x16 slot (offload writes in forward and reads in backward).

``"cpu"`` is this machine, measured (:func:`measure_cpu`): a float32 and a bfloat16 matrix product, a large copy,
and the physical memory; the host link is the copy bandwidth (offloading on a CPU is a copy).

>>> device("h100-80gb").memory_bytes
80000000000
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

from ..errors import FewBitError, close_matches

__all__ = ["Device", "PRESETS", "device", "device_names", "measure_cpu"]

GB = 10**9
TERA = 10**12


@dataclass(frozen=True)
class Device:
    """One device as the time and memory models see it.

    Attributes:
        name: its preset name (``h100-80gb``) or ``cpu``
        memory_bytes: memory capacity in bytes
        bfloat16_flops: dense bfloat16 (and float16) FLOP/s, float32 accumulation
        float32_flops: dense float32 FLOP/s
        memory_bandwidth: bytes per second between the device and its memory
        host_bandwidth: bytes per second, one direction, between the device and host memory
        source: where the numbers come from
        kernels: whose kernel choices its memory follows (``"cuda"`` or ``"cpu"``; :func:`~.fake.fake_mode`)
    """

    name: str
    memory_bytes: int
    bfloat16_flops: float
    float32_flops: float
    memory_bandwidth: float
    host_bandwidth: float
    source: str
    kernels: str = "cuda"

    def flops(self, dtype_name: str) -> float:
        """The dense FLOP/s for arithmetic in ``dtype_name`` (``"bfloat16"``, ``"float16"``, ``"float32"``, ...):
        the 16-bit rate for 16-bit types, the float32 rate otherwise (float64 included: an upper bound)."""
        return self.bfloat16_flops if dtype_name in ("bfloat16", "float16") else self.float32_flops


PRESETS: dict[str, Device] = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with
    # sparsity (989.5 dense), FP32 67 TFLOPS; PCIe Gen5 128 GB/s (64 GB/s each way)
    "h100-80gb": Device("h100-80gb", 80 * GB, 989.5 * TERA, 67 * TERA, 3.35 * TERA, 64 * GB,
                        "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM"),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with
    # sparsity (989.5 dense), FP32 67 TFLOPS; PCIe Gen5 128 GB/s (64 GB/s each way)
    "h200": Device("h200", 141 * GB, 989.5 * TERA, 67 * TERA, 4.8 * TERA, 64 * GB,
                   "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM"),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column): 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS
    # (624 with sparsity), FP32 19.5 TFLOPS; PCIe Gen4 64 GB/s (32 GB/s each way)
    "a100-80gb": Device("a100-80gb", 80 * GB, 312 * TERA, 19.5 * TERA, 2.039 * TERA, 32 * GB,
                        "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM"),
    # NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s, BF16 242 TFLOPS with sparsity (121 dense),
    # FP32 30.3 TFLOPS; PCIe Gen4 x16 64 GB/s (32 GB/s each way)
    "l4": Device("l4", 24 * GB, 121 * TERA, 30.3 * TERA, 300 * GB, 32 * GB, "NVIDIA L4 Tensor Core GPU datasheet"),
    # NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090 column): 24 GB GDDR6X, 1,008 GB/s, peak BF16 tensor
    # TFLOPS with FP32 accumulate 165.2 (330.4 with sparsity), FP32 82.6 TFLOPS; PCIe Gen4 x16 (32 GB/s each way)
    "rtx-4090": Device("rtx-4090", 24 * GB, 165.2 * TERA, 82.6 * TERA, 1.008 * TERA, 32 * GB,
                       "NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090"),
}  # fmt: skip


def device_names() -> tuple[str, ...]:
    """Every name :func:`device` takes: the presets and ``cpu``."""
    return (*PRESETS, "cpu")


def device(name: str) -> Device:
    """The device called ``name``: a preset (:data:`PRESETS`) or ``"cpu"`` (this machine, measured once per process).

    Args:
        name: ``h100-80gb``, ``h200``, ``a100-80gb``, ``l4``, ``rtx-4090`` or ``cpu`` (any case; ``_`` for ``-``)
    """
    key = str(name).strip().lower().replace("_", "-")
    if key == "cpu":
        return measure_cpu()
    if key not in PRESETS:
        hints = close_matches(key, list(device_names()))
        hint = f"; did you mean {', '.join(map(repr, hints))}?" if hints else ""
        raise FewBitError(f"unknown device {name!r}{hint} (devices: {', '.join(device_names())})")
    return PRESETS[key]


def _rate(run, work: float, repeats: int = 3) -> float:
    """``work`` divided by the best time of ``repeats`` runs of ``run`` (after one warm-up run)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return work / max(best, 1e-9)


@functools.cache
def measure_cpu() -> Device:
    """This machine as a :class:`Device`: the FLOP/s of a 512 x 512 matrix product in float32 and in bfloat16, the
    bandwidth of a 64 MiB copy (read and write), the physical memory. Measured once per process (about a second)."""
    import torch

    size = 512
    flops = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        flops[dtype] = _rate(lambda a=a, b=b: torch.mm(a, b), 2.0 * size**3)
    source = torch.empty(2**24, dtype=torch.float32)
    source.fill_(1.0)
    target = torch.empty_like(source)
    bandwidth = _rate(lambda: target.copy_(source), 2.0 * source.numel() * source.element_size())
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - platforms without sysconf
        memory = 0
    return Device("cpu", int(memory), flops[torch.bfloat16], flops[torch.float32], bandwidth, bandwidth,
                  "measured on this machine (matrix products, a 64 MiB copy)", kernels="cpu")  # fmt: skip
