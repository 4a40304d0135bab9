"""Models on a GPU (issue 23.2): ``torch.compile`` of converted GPT-2 and LLaMA, BLPA units and reversible nets on
CUDA against CPU, and ``memory.peak`` against the CUDA caching allocator.

Every test here is marked ``cuda`` (skipped without a GPU; scripts/gpu_suite.sh runs them). Oracles: the same model
run eagerly (compile), the same model on CPU (BLPA, reversible; float64, TF32 off), and
``torch.cuda.max_memory_allocated`` (memory).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_blpa_kernels import BITS_NAIVE, CASES, run_unit, unit_case
from test_reversible import BUILDERS, gradients, relative_error, small_net

from fewbit_design import runtime
from fewbit_design.runtime import memory
from fewbit_design.runtime import nn as fnn

pytestmark = pytest.mark.cuda


@pytest.fixture
def no_tf32():
    """float32 matrix products and convolutions in full float32 (cuDNN convolutions use TF32 by default)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def norm_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """||got - want|| / ||want|| over all the tensors together (float64, on CPU)."""
    got_all = torch.cat([g.detach().double().cpu().flatten() for g in got])
    want_all = torch.cat([w.detach().double().cpu().flatten() for w in want])
    return float((got_all - want_all).norm() / want_all.norm())


# ----------------------------------------------------------------------------------------------------------------------
# torch.compile of converted Hugging Face models


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
    _, report = runtime.convert(model, report=True)
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


# ----------------------------------------------------------------------------------------------------------------------
# BLPA units and reversible nets: CUDA against CPU


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


# ----------------------------------------------------------------------------------------------------------------------
# memory.peak against the allocator


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
