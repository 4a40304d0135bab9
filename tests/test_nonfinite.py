"""Non-finite inputs: the few-bit gradient at NaN and +-inf is torch's gradient there (issue 16.1)."""

import torch

from fewbit_design.runtime import nn as fnn


def test_regression_nonfinite_input_is_not_masked():
    # issue 16: few-bit SiLU returned a finite level at NaN and the outermost level at +-inf; torch returns NaN
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0], requires_grad=True)
    fnn.SiLU(bits=3)(x).backward(torch.ones(4))
    reference = x.detach().clone().requires_grad_()
    torch.nn.SiLU()(reference).backward(torch.ones(4))
    assert torch.equal(x.grad[:3].isnan(), reference.grad[:3].isnan())
    assert x.grad[:3].isnan().all()
