"""The gated-MLP op's exact mode against native in float32, bfloat16 and float16: gradients within the tolerance
derived in tests/tolerances.py (no reconstruction term: the op recomputes act(gate) * up with native's kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_gradient_close, gradient_tolerance

from fewbit_design.runtime.gated import GatedMLP
from fewbit_design.runtime.gated.nn import LAYOUTS

ROWS, HIDDEN, WIDTH = 24, 16, 40
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_exact_mode_gradients_within_the_derived_tolerance(activation, fused, dtype):
    """Tolerance: ``eps + 2 sqrt(n) eps_float32`` (tests/tolerances.py): each result's final rounding to ``dtype``,
    and float32 accumulation over the longest reduction n (the rows for weight gradients, the intermediate width for
    the input's) in another order or blocking than native's."""
    torch.manual_seed(0)
    if fused:
        children = {"gate_up_proj": torch.nn.Linear(HIDDEN, 2 * WIDTH, bias=False)}
    else:
        children = {"gate_proj": torch.nn.Linear(HIDDEN, WIDTH, bias=False)}
        children["up_proj"] = torch.nn.Linear(HIDDEN, WIDTH, bias=False)
    children["down_proj"] = torch.nn.Linear(WIDTH, HIDDEN, bias=False)
    ours = GatedMLP(children, LAYOUTS[3] if fused else LAYOUTS[0], activation).to(dtype)

    def native(x):
        if fused:
            gate, up = ours.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = ours.gate_proj(x), ours.up_proj(x)
        return ours.down_proj(ACTIVATIONS[activation](gate) * up)

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, HIDDEN, generator=generator).to(dtype)
    upstream = torch.randn(ROWS, HIDDEN, generator=generator).to(dtype)
    results = []
    for forward in (native, ours):
        leaf = x.clone().requires_grad_()
        results.append(torch.autograd.grad(forward(leaf), [leaf, *ours.parameters()], upstream))
    tolerance = gradient_tolerance(dtype, max(ROWS, HIDDEN, WIDTH))
    names = ["input", *(name for name, _ in ours.named_parameters())]
    for what, theirs, mine in zip(names, *results, strict=True):
        assert_gradient_close(theirs, mine, tolerance, f"{activation} {dtype} {what} gradient")
