"""Reversible nets on a GPU against CPU.

Every test here is marked ``cuda`` (skipped without a GPU; scripts/gpu_suite.sh runs them). Oracle: the same net on
CPU (float64).
"""

from __future__ import annotations

import copy

import pytest
import torch
from devices import norm_error
from test_reversible import BUILDERS, gradients, relative_error, small_net

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_reversible_net_on_cuda_matches_cpu(arch):
    torch.manual_seed(0)
    model = small_net(arch).double()
    on_cuda = copy.deepcopy(model).cuda()
    x = torch.randn(4, 3, 8, 12, dtype=torch.float64, requires_grad=True)
    y, grad_output, got = gradients(model, x, None)
    x_cuda = x.detach().cuda().requires_grad_()
    y_cuda, _, got_cuda = gradients(on_cuda, x_cuda, grad_output.cuda())
    assert norm_error([y_cuda], [y]) < 1e-12
    assert relative_error([g.cpu() for g in got_cuda], got) < 1e-10
