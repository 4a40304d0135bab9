"""Bytes dropout keeps for backward (``memory.saved_bytes``): mode "bits" keeps ceil(n / 8), an eighth of the bool
mask native CUDA dropout keeps (n bytes) and 1/16 to 1/64 of the noise native CPU dropout keeps (n elements of x's
dtype); mode "seed" keeps the generator's state whatever n; neither keeps x or y."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fewbit_design.runtime import memory
from fewbit_design.runtime.dropout import ops


def _saved(function, x: torch.Tensor) -> int:
    with memory.saved_bytes() as saved:
        y = function(x)
    y.sum().backward()
    return saved.total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 1021), (4, 16, 40)])
def test_bits_keep_an_eighth_of_a_byte_mask_and_native_cpu_keeps_its_noise(dtype, shape):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    numel = x.numel()
    assert _saved(lambda t: ops.dropout(t, 0.1), x) == math.ceil(numel / 8)
    assert _saved(lambda t: F.dropout(t, 0.1), x) == numel * x.element_size()


@pytest.mark.parametrize("shape", [(7,), (4, 16, 40), (64, 1024)])
def test_seed_keeps_the_generator_state_whatever_the_size(shape):
    x = torch.randn(shape, requires_grad=True)
    assert _saved(lambda t: ops.dropout(t, 0.1, mode="seed"), x) == ops.state_nbytes(x.device)
    assert ops.state_nbytes(x.device) == torch.get_rng_state().numel()


def test_a_non_leaf_input_is_not_kept():
    """x produced by an op (it is freed after forward unless something keeps it): dropout keeps only its mask."""
    leaf = torch.randn(8, 100, requires_grad=True)
    with memory.saved_bytes() as saved:
        y = ops.dropout(leaf * 2.0, 0.2)
    y.sum().backward()
    assert saved.total == 100
