"""BLPA units on a GPU against CPU.

Every test here is marked ``cuda`` (skipped without a GPU; scripts/gpu_suite.sh runs them). Oracle: the same unit on
CPU (float64, TF32 off).
"""

from __future__ import annotations

import copy

import pytest
import torch
from devices import norm_error
from test_blpa_kernels import BITS_NAIVE, CASES, run_unit, unit_case

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("bits,naive", BITS_NAIVE)
@pytest.mark.parametrize("kind,shape", CASES)
def test_blpa_unit_on_cuda_matches_cpu(kind, shape, bits, naive, dtype, no_tf32):
    unit, x, grad_out = unit_case(kind, shape, bits, naive, dtype)
    on_cuda = copy.deepcopy(unit).cuda()
    out, stored, grads = run_unit(unit, x, grad_out, "torch")
    out_cuda, stored_cuda, grads_cuda = run_unit(on_cuda, x.cuda(), grad_out.cuda(), "torch")
    # the forward is exact (BLPA approximates only what backward keeps): equal up to the order of the batch-statistic
    # reductions. Codes and gradients are compared in float64, where that rounding cannot move an element across a
    # bin edge (in float32 it could, and one element's A1~ would move by a whole bin).
    assert norm_error([out_cuda], [out]) < {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    if dtype == torch.float64:
        assert torch.equal(stored_cuda.cpu(), stored)
        for name, value in grads.items():
            assert norm_error([grads_cuda[name]], [value]) < 1e-10, name
