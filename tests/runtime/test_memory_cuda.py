"""``memory.peak`` against the CUDA caching allocator.

Every test here is marked ``cuda`` (skipped without a GPU; scripts/gpu_suite.sh runs them). Oracle:
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import pytest
import torch

from fewbit_design.runtime import memory
from fewbit_design.runtime import nn as fnn

pytestmark = pytest.mark.cuda


# Sizes: every tensor of the step is a whole number of 512-byte allocator blocks (2 MiB activations, 4 MiB weights,
# 192 KiB of 3-bit codes) except the 4-byte loss and scalars (one 512-byte block each), and equal sizes let the
# allocator reuse blocks without splitting them. What remains is the rounding of those scalars and the scratch space
# of reductions (sum; the few-bit forward's non-finite check), which no tensor holds: a few KiB.
ROUNDING = 64 << 10


@pytest.mark.parametrize("activation", ["relu", "fewbit-gelu"])
def test_memory_peak_equals_the_allocator_within_its_rounding(activation):
    torch.manual_seed(0)
    width, batch, depth = 1024, 512, 4
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, bias=False)]
        layers += [torch.nn.ReLU() if activation == "relu" else fnn.GELU(bits=3)]
    model = torch.nn.Sequential(*layers).cuda()
    x = torch.randn(batch, width, device="cuda")
    model(x).sum().backward()  # warm-up (cuBLAS workspace, kernels); the measured step finds gradients allocated
    with memory.peak(model, x) as p:
        model(x).sum().backward()
    difference = p.cuda_peak_bytes - p.peak_bytes
    assert 0 <= difference <= ROUNDING, (p.peak_bytes, p.cuda_peak_bytes)
    assert p.peak_bytes >= batch * width * 4 * depth  # the measured step did hold the activations
