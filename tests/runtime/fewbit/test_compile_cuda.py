"""``torch.compile`` of converted GPT-2 and LLaMA on a GPU.

Every test here is marked ``cuda`` (skipped without a GPU; scripts/gpu_suite.sh runs them). Oracle: the same model
run eagerly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from devices import norm_error

from fewbit_design import runtime

pytestmark = pytest.mark.cuda


def _step(model, inputs):
    from test_convert_models import _output

    output = _output(model, inputs)
    output.float().square().mean().backward()
    gradients = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return output.detach(), gradients


@pytest.mark.parametrize("kind", ["gpt2-gelu_new", "llama"])
def test_torch_compile_of_a_converted_model(kind, no_tf32):
    from test_convert_models import build

    model, inputs = build(kind)  # tiny transformers config, seeded; shipped 3-bit tables
    model = model.cuda().eval()  # eval: no dropout; parameters still require grad, so the few-bit path runs
    inputs = {key: value.cuda() for key, value in inputs.items()}
    native = copy.deepcopy(model)
    report = runtime.convert(model).fewbit_report
    assert report.replaced
    native_out, native_grads = _step(native, inputs)
    eager_out, eager_grads = _step(model, inputs)
    compiled_out, compiled_grads = _step(torch.compile(model), inputs)
    assert torch.equal(eager_out, native_out)  # the few-bit forward is the native op
    assert norm_error([compiled_out], [eager_out]) < 1e-5  # inductor reorders float32 arithmetic
    # the compiled backward runs the few-bit op: its gradients are the eager few-bit ones (up to reordering), not the
    # native ones
    approximation = norm_error(eager_grads, native_grads)
    assert approximation > 1e-4, approximation
    assert norm_error(compiled_grads, eager_grads) < 0.01 * approximation
