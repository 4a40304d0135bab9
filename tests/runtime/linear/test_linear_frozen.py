"""Compressed linear inputs and frozen weights (a LoRA base layer, a frozen LM head): ``runtime.convert(compress=K)``
leaves a linear layer whose weight does not require grad native, with the reason in the report (backward needs none
of its input, and the native layer keeps none), and compresses the trainable ones."""

from __future__ import annotations

import math
import warnings

import torch

from fewbit_design import runtime
from fewbit_design.runtime import memory
from fewbit_design.runtime.linear import GROUP_SIZE, CompressedLinear
from fewbit_design.runtime.linear.technique import FROZEN_WEIGHT_REASON

ROWS, WIDTH = 8, 64


def test_convert_compress_leaves_a_frozen_linear_native_and_says_why():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    )
    model[1].requires_grad_(False)  # frozen in the middle: its input is an intermediate tensor
    x = torch.randn(ROWS, WIDTH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = runtime.convert(model, compress=8, example_inputs=x)
    assert type(model[1]) is torch.nn.Linear
    assert isinstance(model[0], CompressedLinear) and isinstance(model[2], CompressedLinear)
    assert model.convert_report.technique("linear").report.skipped == [("1", "Linear", FROZEN_WEIGHT_REASON)]
    with memory.saved_bytes(model) as saved:
        model(x).sum().backward()
    # the 8-bit codes (a byte each) and float32 (low, step) per group of the inputs of the first and last layers:
    # nothing of the frozen layer's input is kept
    one_set = ROWS * WIDTH + ROWS * math.ceil(WIDTH / GROUP_SIZE) * 2 * 4
    assert saved.total == 2 * one_set
