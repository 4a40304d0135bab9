"""Memory-sharing norms save, measured by runtime.memory.saved_bytes, only the rows' statistics beyond what the next
linear layer saves anyway; the counts are computed by hand from the shapes."""

from __future__ import annotations

import copy

import pytest
import torch

from fewbit_design.runtime import memory, norms

BATCH, TOKENS, WIDTH, OUT = 2, 5, 16, 8
ROWS = BATCH * TOKENS
FLOAT32 = 4


def _measure(model: torch.nn.Module, base: torch.Tensor) -> int:
    x = base * 1.0  # not a leaf: the norm's input counts when it is saved
    with memory.saved_bytes(model) as saved:
        model(x).sum().backward()
    return saved.total


def _model(**norm_options) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(WIDTH, **norm_options), torch.nn.Linear(WIDTH, OUT))


@pytest.mark.parametrize(
    "options", [{}, {"bias": False}, {"elementwise_affine": False}], ids=["affine", "no-bias", "no-affine"]
)
def test_layernorm_then_linear_saves_only_the_rows_rstd_beyond_the_linear_input(options):
    native = _model(**options)
    converted = norms.convert(copy.deepcopy(native))
    base = torch.randn(BATCH, TOKENS, WIDTH, requires_grad=True)
    activations = ROWS * WIDTH * FLOAT32
    # native: the LayerNorm's input, its mean and rstd (float32 per row), the Linear's input (the norm's output)
    assert _measure(native, base) == 2 * activations + 2 * ROWS * FLOAT32
    # converted: the norm's output (the same storage the Linear saves, counted once) and rstd
    assert _measure(converted, base) == activations + ROWS * FLOAT32


def test_kept_channels_cost_their_normalised_input_and_indices_only():
    native = _model()
    with torch.no_grad():
        native[0].weight[[1, 4, 9]] = 0.0
    converted = norms.convert(copy.deepcopy(native))
    base = torch.randn(BATCH, TOKENS, WIDTH, requires_grad=True)
    kept = 3
    int64 = 8
    expected = ROWS * WIDTH * FLOAT32 + ROWS * FLOAT32 + ROWS * kept * FLOAT32 + kept * int64
    assert _measure(converted, base) == expected


def test_compiled_converted_saves_what_eager_converted_saves():
    torch._dynamo.reset()
    converted = norms.convert(_model())
    compiled = torch.compile(converted, backend="aot_eager")
    base = torch.randn(BATCH, TOKENS, WIDTH, requires_grad=True)
    assert _measure(compiled, base) == ROWS * WIDTH * FLOAT32 + ROWS * FLOAT32
