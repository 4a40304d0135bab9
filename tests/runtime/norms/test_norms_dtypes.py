"""Memory-sharing norms against native in float32, bfloat16 and float16: gradients within the tolerance derived in
tests/tolerances.py (final rounding of each result, the reconstruction from the rounded output, float32 reductions)."""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_gradient_close, gradient_tolerance

from fewbit_design.runtime import norms
from fewbit_design.runtime.norms import MemorySharingNorm

transformers = pytest.importorskip("transformers")

ROWS, WIDTH = 24, 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _llama_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(WIDTH)


NORMS = {
    "LayerNorm": lambda: torch.nn.LayerNorm(WIDTH),
    "RMSNorm": lambda: torch.nn.RMSNorm(WIDTH, eps=1e-6),
    "LlamaRMSNorm": _llama_norm,
}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", list(NORMS))
def test_gradients_within_the_derived_tolerance(name, dtype):
    """Tolerance: ``(1 + reconstruction) eps + 2 sqrt(n) eps_float32`` (tests/tolerances.py), where the
    reconstruction of xhat = (y - b) / w from y rounded to ``dtype`` costs eps/2 of ``|xhat| + |b / w|`` (measured on
    this input and these parameters) and one more eps where the original rounds xhat to ``dtype`` before scaling
    it (LlamaRMSNorm), and n is the longest reduction (the width for the input gradient, the rows for the weight's)."""
    generator = torch.Generator().manual_seed(0)
    native = NORMS[name]()
    with torch.no_grad():
        native.weight.copy_(torch.rand(WIDTH, generator=generator) + 0.5)
        if getattr(native, "bias", None) is not None:
            native.bias.copy_(torch.randn(WIDTH, generator=generator) * 0.3)
    native = native.to(dtype)
    holder = norms.convert(torch.nn.Sequential(native))
    ours = holder[0]
    assert isinstance(ours, MemorySharingNorm), holder.norms_report
    x = (torch.randn(ROWS, WIDTH, generator=generator) * 2 + 0.3).to(dtype)
    upstream = torch.randn(ROWS, WIDTH, generator=generator).to(dtype)
    results = []
    for module in (native, ours):  # the same Parameter objects: gradients of each run taken apart
        leaf = x.clone().requires_grad_()
        parameters = [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]
        results.append(torch.autograd.grad(module(leaf), [leaf, *parameters], upstream))
    centred = x.float() - (x.float().mean(-1, keepdim=True) if name == "LayerNorm" else 0.0)
    xhat = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)
    ratio = 0.0 if getattr(native, "bias", None) is None else float((native.bias / native.weight).abs().max())
    reconstruction = 0.5 * (float(xhat.abs().max()) + ratio) + (1.0 if name == "LlamaRMSNorm" else 0.0)
    tolerance = gradient_tolerance(dtype, max(ROWS, WIDTH), reconstruction=reconstruction)
    for what, theirs, mine in zip(("input", "weight", "bias"), *results, strict=False):
        assert_gradient_close(theirs, mine, tolerance, f"{name} {dtype} {what} gradient")
