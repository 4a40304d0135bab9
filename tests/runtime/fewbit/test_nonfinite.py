"""Non-finite inputs: the gradient at NaN and +-inf is torch's, in every kernel and in BLPA.

Rule: codes have no spare value, so the few-bit op keeps a sparse record of the non-finite elements of x
(int64 positions + their values, nothing when every element is finite); backward puts NaN at NaN and torch's own
gradient at +-inf there. BLPA keeps A1 exactly for a call whose A1 is not finite. Oracle: torch's autograd on the
same input.
"""

import copy
import math

import pytest
import torch
from devices import on_cuda
from test_kinks import DTYPES, HAS_TRITON, same_bits, torch_grad, torch_module

from fewbit_design.design import activations
from fewbit_design.runtime import blpa, memory
from fewbit_design.runtime import nn as fnn
from fewbit_design.runtime._packing import packed_nbytes
from fewbit_design.runtime.fewbit import backends
from fewbit_design.runtime.fewbit import ops as op

SPECIAL = [math.nan, math.inf, -math.inf]


def test_regression_nonfinite_input_is_not_masked():
    # few-bit SiLU returned a finite level at NaN and the outermost level at +-inf; torch returns NaN
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0], requires_grad=True)
    fnn.SiLU(bits=3)(x).backward(torch.ones(4))
    reference = x.detach().clone().requires_grad_()
    torch.nn.SiLU()(reference).backward(torch.ones(4))
    assert torch.equal(x.grad[:3].isnan(), reference.grad[:3].isnan())
    assert x.grad[:3].isnan().all()


def inputs(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(37, generator=generator, dtype=torch.float64) * 3
    x[[0, 5, 17, 18, 36]] = torch.tensor([math.nan, math.inf, -math.inf, math.nan, -math.inf], dtype=torch.float64)
    grad = torch.randn(37, generator=generator, dtype=torch.float64)
    return x.to(dtype), grad.to(dtype)


# every backend on CPU (Triton under the interpreter), and the reference and the compiled Triton kernels on a GPU
DEVICE_BACKENDS = [
    pytest.param("cpu", "reference", id="cpu-reference"),
    pytest.param("cpu", "numba", id="cpu-numba"),
    pytest.param("cpu", "triton", id="cpu-triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
    on_cuda("cuda", "reference", id="cuda-reference"),
    on_cuda("cuda", "triton", id="cuda-triton"),
]


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("name", activations.names())
def test_gradient_at_nan_and_inf_is_torchs(name, device, backend, make_table):
    table = make_table(name, 3)
    for dtype in DTYPES:
        x, grad = (t.to(device) for t in inputs(dtype))
        leaf = x.clone().requires_grad_()
        with backends.use_backend(backend):
            op.fewbit_activation(leaf, torch_module(name), backends.table_tensors(table, device)).backward(grad)
        nonfinite = ~torch.isfinite(x)
        # NaN -> NaN; +-inf -> torch's gradient (torch's own at NaN depends on the element's position, see ops)
        expected = torch.where(torch.isnan(x), torch.full_like(grad, math.nan), torch_grad(name, x, grad))
        assert same_bits(leaf.grad[nonfinite], expected[nonfinite]), (name, dtype, leaf.grad[nonfinite], expected)
        # the finite elements keep the table's gradient: the same as on the finite elements alone
        finite = x[~nonfinite].clone().requires_grad_()
        with backends.use_backend(backend):
            op.fewbit_activation(finite, torch_module(name), backends.table_tensors(table, device)).backward(
                grad[~nonfinite]
            )
        assert same_bits(leaf.grad[~nonfinite], finite.grad), (name, dtype)


@pytest.mark.parametrize("shape_kind", ["transposed", "expanded"])
def test_positions_follow_logical_order_of_a_view(shape_kind, make_table):
    base = torch.randn(4, 6, dtype=torch.float64)
    base[1, 2], base[3, 0] = math.nan, math.inf
    x = base.t() if shape_kind == "transposed" else base[:1].expand(3, 6)
    leaf = x.detach().requires_grad_()
    op.fewbit_activation(leaf, torch.nn.SiLU(), backends.table_tensors(make_table("silu", 3))).backward(
        torch.ones_like(x)
    )
    assert torch.equal(torch.isnan(leaf.grad), ~torch.isfinite(x))


@pytest.mark.parametrize("name", ["relu6", "elu", "hardshrink", "silu"])
def test_torchs_own_gradient_at_nan_depends_on_position(name):
    # why NaN -> NaN rather than "torch's value": torch's vectorised loop and its scalar tail disagree at NaN for
    # some activations (this documents torch 2.x's behaviour; silu is NaN everywhere)
    x = torch.full((37,), math.nan)
    values = set(str(value) for value in torch_grad(name, x).tolist())
    assert "nan" in values or len(values) > 1 or name == "silu"


def saved(module, x):
    with memory.saved_bytes() as counter:
        out = module(x)
    del out
    return counter.total


def test_no_extra_bytes_when_every_element_is_finite(make_table):
    module = fnn.SiLU(table=make_table("silu", 3))
    x = torch.randn(1000, requires_grad=True)
    constant = 2**3 * (4 + 8)  # the levels in float32 and float64 (constant size, as before)
    assert saved(module, x) == packed_nbytes(1000, 3) + constant
    # three non-finite elements: three int64 positions and three float32 values on top
    y = x.detach().clone()
    y[[3, 500, 999]] = torch.tensor([math.nan, math.inf, -math.inf])
    assert saved(module, y.requires_grad_()) == packed_nbytes(1000, 3) + constant + 3 * 8 + 3 * 4


def test_a_sum_that_overflows_on_finite_values_records_nothing():
    x = torch.full((8,), 3e38)
    assert not torch.isfinite(x.sum())
    assert op.nonfinite_record(x) is None
    record = op.nonfinite_record(torch.tensor([1.0, math.nan, 2.0, -math.inf]))
    assert record[0].tolist() == [1, 3] and math.isnan(record[1][0]) and record[1][1] == -math.inf


def test_compiled_forward_marks_the_whole_gradient(make_table):
    # torch.compile has no data-dependent shapes: the compiled op saves a flag and the gradient becomes NaN, which
    # GradScaler detects
    module = fnn.SiLU(table=make_table("silu", 3))
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = torch.tensor([1.0, math.nan, -2.0], requires_grad=True)
    compiled(x).sum().backward()
    assert torch.isnan(x.grad).all()
    finite = torch.tensor([1.0, 0.5, -2.0], requires_grad=True)
    compiled(finite).sum().backward()
    assert torch.isfinite(finite.grad).all()


def test_cuda_graph_capture_saves_the_flag_not_the_sparse_record(make_table, monkeypatch):
    # during CUDA graph capture the forward must not synchronise with the host (the sparse record's bool() and
    # nonzero() would fail the capture): it saves the compiled form's flag. The capture test itself is
    # test_cuda_kernels.py::test_cuda_graph_captures_forward_and_backward; here the capture state is faked on CPU.
    module = fnn.SiLU(table=make_table("silu", 3))
    record = op.nonfinite_record
    monkeypatch.setattr(op, "nonfinite_record", lambda x: pytest.fail("the sparse record synchronises"))
    monkeypatch.setattr(op, "_capturing", lambda x: True, raising=False)
    x = torch.tensor([1.0, math.nan, -2.0], requires_grad=True)
    module(x).sum().backward()
    assert torch.isnan(x.grad).all()
    finite = torch.tensor([1.0, 0.5, -2.0], requires_grad=True)
    module(finite).sum().backward()
    assert torch.isfinite(finite.grad).all()
    monkeypatch.setattr(op, "nonfinite_record", record)
    monkeypatch.setattr(op, "_capturing", lambda x: False)  # outside a capture: the exact rule again
    x.grad = None
    module(x).sum().backward()
    assert torch.isnan(x.grad).tolist() == [False, True, False]


def blpa_pair(bits=4):
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.Conv2d(3, 4, 3, padding=1))
    parts = [copy.deepcopy(module) for module in reference]
    return reference, blpa.BNReLUConv2d.from_modules(*parts, bits=bits)


@pytest.fixture(params=[("cpu", "torch"), ("cpu", "numba"), on_cuda(("cuda", "torch"))], ids=lambda p: "-".join(p))
def blpa_device(request):
    """The device of a BLPA test, with the BLPA backend set for it (CUDA tensors run the torch backend)."""
    device, backend = request.param
    blpa.set_backend(backend)
    yield device
    blpa.set_backend("auto")


@pytest.mark.parametrize("special", SPECIAL)
def test_blpa_gradients_are_non_finite_where_torchs_are(special, blpa_device):
    reference, unit = (module.to(blpa_device) for module in blpa_pair())
    x = torch.randn(2, 3, 5, 5, device=blpa_device)
    x[0, 1, 2, 3] = special
    x_reference, x_unit = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_reference, out_unit = reference(x_reference), unit(x_unit)
    grad = torch.randn_like(out_reference)
    out_reference.backward(grad)
    out_unit.backward(grad)
    assert torch.equal(out_reference.isnan(), out_unit.isnan())
    pairs = [
        (x_reference.grad, x_unit.grad),
        (reference[0].weight.grad, unit.bn.weight.grad),
        (reference[0].bias.grad, unit.bn.bias.grad),
        (reference[2].weight.grad, unit.op.weight.grad),
        (reference[2].bias.grad, unit.op.bias.grad),
    ]
    for expected, got in pairs:
        assert torch.equal(expected.isnan(), got.isnan()) and torch.equal(expected.isinf(), got.isinf())
    assert not torch.isfinite(unit.op.weight.grad).all()  # before the rule, A3~ from the codes hid the NaN here


def test_blpa_finite_input_still_stores_codes(blpa_device):
    _, unit = blpa_pair(bits=4)
    out = unit.to(blpa_device)(torch.randn(2, 3, 5, 5, device=blpa_device, requires_grad=True))
    stored = out.grad_fn.saved_tensors[0]
    assert stored.dtype == torch.uint8 and stored.numel() == packed_nbytes(2 * 3 * 5 * 5, 4)
