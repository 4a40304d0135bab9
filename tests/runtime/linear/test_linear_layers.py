"""CompressedLinear / CompressedConv1D against the native layers: forward bitwise, dX and db exact, dW within the
bound derived from the group steps and unbiased, saved bytes counted by hand, bfloat16, shared inputs, the custom
op under opcheck and torch.compile."""

from __future__ import annotations

import math

import pytest
import torch
from test_linear_quant import group_steps

from fewbit_design.runtime import memory
from fewbit_design.runtime.linear import CompressedLinear, compressed_linear, ops
from fewbit_design.runtime.linear.ops import native_linear

GROUP = 64


def layer_pair(in_features, out_features, *, transposed=False, bias=True, dtype=torch.float32, seed=0):
    """(weight, bias) parameters: (out, in) for Linear, (in, out) for Conv1D."""
    torch.manual_seed(seed)
    shape = (in_features, out_features) if transposed else (out_features, in_features)
    weight = torch.nn.Parameter((torch.randn(shape) / math.sqrt(in_features)).to(dtype))
    return weight, torch.nn.Parameter(torch.randn(out_features).to(dtype)) if bias else None


def grads(fn, x, weight, bias, grad):
    for tensor in (x, weight, bias):
        if tensor is not None:
            tensor.grad = None
    fn(x, weight, bias).backward(grad)
    return x.grad, weight.grad, None if bias is None else bias.grad


def run_both(shape, out_features, *, transposed=False, bias=True, dtype=torch.float32, bits=8, rounding="stochastic"):
    weight, b = layer_pair(shape[-1], out_features, transposed=transposed, bias=bias, dtype=dtype)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    y_native = native_linear(x, weight, b, transposed)
    grad = torch.randn_like(y_native)
    native = grads(lambda *a: native_linear(*a, transposed), x, weight, b, grad)
    y = compressed_linear(x, weight, b, bits=bits, rounding=rounding, transposed=transposed)
    ours = grads(
        lambda *a: compressed_linear(*a, bits=bits, rounding=rounding, transposed=transposed), x, weight, b, grad
    )
    return x, grad, y_native, y, native, ours


def dw_bound(x, grad, bits, transposed, scale=1.0):
    """|dW - dW_native| <= |g|^T step element-wise: dW - dW_native = g^T (x~ - x) and |x~ - x| < step per element
    (stochastic; step / 2 for nearest, ``scale``)."""
    rows_x = x.detach().reshape(-1, x.shape[-1])
    rows_g = grad.reshape(-1, grad.shape[-1]).double().abs()
    bound = rows_g.t() @ (scale * group_steps(rows_x, bits, GROUP))
    # float32 matmul rounding of both products: a few ulps of sum |g| |x| per element
    bound += 1e-6 * (rows_g.t() @ rows_x.double().abs())
    return bound.t() if transposed else bound


@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("shape", [(7, 100), (2, 5, 64), (3, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_is_bitwise_native_and_input_and_bias_gradients_are_exact(transposed, shape, bias):
    _, _, y_native, y, native, ours = run_both(shape, 9, transposed=transposed, bias=bias)
    assert torch.equal(y, y_native)
    assert torch.equal(ours[0], native[0])  # dX = g W: the same product as native autograd's
    if bias:
        assert torch.equal(ours[2], native[2])


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "conv1d"])
def test_weight_gradient_is_within_the_step_bound(bits, rounding, transposed):
    x, grad, _, _, native, ours = run_both((6, 4, 130), 11, transposed=transposed, bits=bits, rounding=rounding)
    bound = dw_bound(x, grad, bits, transposed, 1.0 if rounding == "stochastic" else 0.5)
    error = (ours[1].double() - native[1].double()).abs()
    assert bool((error <= bound).all())
    relative = float(error.norm() / native[1].double().norm())
    # the bound is worst case; the typical error is about a tenth of it (step / sqrt(6) rms per element against a
    # sum of |g| step): the error must not be 0 (the codes are in use) and stays far under the bound
    assert 0 < relative < float(bound.norm() / native[1].double().norm())
    print(f"dW relative error, {bits} bits, {rounding}: {relative:.2e}")


def test_weight_gradient_is_unbiased_over_seeds():
    # mean over seeds of dW converges to the exact dW: the error of the mean of S independent draws has
    # E||.||^2 <= sum_ij sum_r g_ri^2 step_rj^2 / 4 / S (variance of one rounding <= step^2 / 4)
    weight, bias = layer_pair(96, 5)
    x = torch.randn(16, 96) * 3
    grad = torch.randn(16, 5)
    exact = grad.t().double() @ x.double()
    bits, seeds = 2, 256
    total = torch.zeros_like(exact)
    for seed in range(seeds):
        torch.manual_seed(seed)
        weight.grad = None
        compressed_linear(x, weight, bias, bits=bits).backward(grad)
        total += weight.grad.double()
    variance = (grad.double().t() ** 2) @ (group_steps(x, bits, GROUP) ** 2) / 4
    error = (total / seeds - exact).norm()
    assert float(error) <= 3 * math.sqrt(float(variance.sum()) / seeds)
    weight.grad = None
    compressed_linear(x, weight, bias, bits=bits, rounding="nearest").backward(grad)
    assert float(error) < float((weight.grad.double() - exact).norm()) / 4  # nearest's bias does not average out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_saved_bytes_are_the_packed_codes_and_scales(dtype, bits):
    rows, features = 24, 100
    layer = CompressedLinear(features, 16, bits=bits).to(dtype)
    native = torch.nn.Linear(features, 16).to(dtype)
    x = torch.randn(rows, features, dtype=dtype)

    def measure(module):
        h = x.clone().requires_grad_()  # a leaf: not counted, so the input is counted only where a layer saves it
        with memory.saved_bytes(module) as saved:
            module(h * 2).sum().backward()
        return saved.total

    codes = math.ceil(rows * features / 8) * bits
    scales = rows * math.ceil(features / GROUP) * 2 * 4  # float32 (low, step) per group
    assert measure(layer) == codes + scales
    assert measure(native) == rows * features * dtype.itemsize
    print(f"{dtype} {bits} bits: {codes + scales} bytes vs native {rows * features * dtype.itemsize}")


def test_layers_taking_one_tensor_save_one_set_of_codes():
    torch.manual_seed(0)
    q, k, v = (CompressedLinear(64, 64, bits=4) for _ in range(3))
    x = torch.randn(8, 64, requires_grad=True)
    with memory.saved_bytes() as saved:
        h = x * 2  # computed in the forward, as a norm's output is
        sum(layer(h) for layer in (q, k, v)).sum().backward()
    assert saved.total == 8 * 64 * 4 // 8 + 8 * 8  # one set of 4-bit codes, one (low, step) per row
    with memory.saved_bytes() as fresh:  # an input from the caller (no grad_fn): its own codes per call
        sum(layer(x.detach()) for layer in (q, k, v)).sum().backward()
    assert fresh.total == 3 * (8 * 64 * 4 // 8 + 8 * 8)


def test_a_view_of_a_shared_input_finds_its_codes():
    """A layer fed a view of the same elements (LLaMA's lm_head reads ``hidden[:, 0:]`` of the final norm's output;
    o_proj a reshape of the attention output) keeps the codes made for the tensor: one set, as native keeps one
    tensor (the same shape: the codes' scales are laid out by rows). A view whose elements changed in place since
    (the version moved on) is quantized afresh."""
    torch.manual_seed(0)
    first, second = CompressedLinear(64, 8, bits=8), CompressedLinear(64, 8, bits=8)
    x = torch.randn(2, 4, 64, requires_grad=True)
    one_set = 2 * 4 * 64 + 2 * 4 * 8
    with memory.saved_bytes() as saved:
        h = x * 2
        (first(h).sum() + second(h[:, 0:]).sum()).backward()
    assert saved.total == one_set
    with memory.saved_bytes() as changed:
        h = x * 2
        out = first(h).sum()
        view = h[:, 0:]
        view.mul_(3)
        (out + second(view).sum()).backward()
    assert changed.total == 2 * one_set


def test_layers_sharing_codes_decode_them_once_in_backward(monkeypatch):
    """The q, k and v projections' backward passes read one set of codes: it is decoded once (one pass and one
    float allocation instead of three), and each weight gradient is bitwise what a decode of its own gives."""
    from fewbit_design.runtime.linear import quant

    torch.manual_seed(0)
    layers = [CompressedLinear(64, 16, bits=8) for _ in range(3)]
    x = torch.randn(24, 64, requires_grad=True)
    h = x * 2
    outputs = [layer(h) for layer in layers]
    [(packed, scales)] = [entry[2] for entry in ops._SHARED._entries.values() if entry[0]() is h]
    decoded = quant.dequantize_groups(packed, scales, 64, 8, GROUP, torch.float32)
    grads_out = [torch.randn_like(out) for out in outputs]
    expected = [g.t().mm(decoded) for g in grads_out]
    calls = []
    decode = quant.dequantize_groups
    monkeypatch.setattr(quant, "dequantize_groups", lambda *args: calls.append(args[2]) or decode(*args))
    torch.autograd.backward(outputs, grads_out)
    assert calls == [64]
    for layer, want in zip(layers, expected, strict=True):
        assert torch.equal(layer.weight.grad, want)


def test_codes_changed_in_place_are_decoded_afresh():
    from fewbit_design.runtime.linear import quant

    x = torch.randn(8, 64)
    packed, scales = quant.quantize_groups(x, 8, GROUP, stochastic=False, seed=0)
    first = torch.ops.fewbit.group_dequantize(packed, scales, 64, 8, GROUP, torch.float32)
    assert torch.ops.fewbit.group_dequantize(packed, scales, 64, 8, GROUP, torch.float32) is first
    assert torch.ops.fewbit.group_dequantize(packed, scales, 64, 8, GROUP, torch.bfloat16).dtype == torch.bfloat16
    packed.zero_()
    again = torch.ops.fewbit.group_dequantize(packed, scales, 64, 8, GROUP, torch.float32)
    assert torch.equal(again, quant.dequantize_groups_reference(packed, scales, 64, 8, GROUP, torch.float32))
    assert not torch.equal(again, first)


def test_changing_the_input_in_place_gives_fresh_codes():
    layer = CompressedLinear(64, 4, bits=8, rounding="nearest")
    x = torch.randn(2, 64, requires_grad=True)
    h = x * 1
    layer(h).sum().backward(retain_graph=True)  # h's own graph is used again below
    first = layer.weight.grad.clone()
    with torch.no_grad():
        h.mul_(10)
    layer.weight.grad = None
    layer(h).sum().backward()
    assert torch.allclose(layer.weight.grad, first * 10, rtol=1e-2)


def test_without_a_weight_gradient_nothing_about_the_input_is_kept():
    layer = CompressedLinear(64, 4).requires_grad_(False)
    x = torch.randn(3, 64, requires_grad=True)
    with memory.saved_bytes(layer) as saved:
        layer(x * 1).sum().backward()
    assert saved.total == 0 and x.grad is not None
    with torch.no_grad():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_bfloat16_gradients():
    # bfloat16: x~ is rounded to bfloat16 (relative 2**-8) and both dW are bfloat16 products (relative 2**-8 of
    # sum |g| |x| each, fp32 accumulation): add those to the step bound
    x, grad, y_native, y, native, ours = run_both((5, 3, 128), 8, dtype=torch.bfloat16, bits=4)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_native)
    assert torch.equal(ours[0], native[0]) and torch.equal(ours[2], native[2])
    rows_g = grad.reshape(-1, 8).double().abs()
    rows_x = x.detach().reshape(-1, 128).double()
    bound = rows_g.t() @ (group_steps(rows_x, 4, GROUP) + 2**-8 * rows_x.abs())
    bound += 2 * 2**-8 * (rows_g.t() @ rows_x.abs())
    assert ours[1].dtype == torch.bfloat16
    assert bool(((ours[1].double() - native[1].double()).abs() <= bound).all())


def test_compressed_linear_op_passes_opcheck():
    weight, bias = layer_pair(100, 6)
    x = torch.randn(4, 100, requires_grad=True)
    packed, scales = torch.ops.fewbit.group_quantize(x.detach(), 4, GROUP, True, torch.tensor(1))
    for transposed, w in ((False, weight), (True, torch.nn.Parameter(weight.detach().t().contiguous()))):
        torch.library.opcheck(torch.ops.fewbit.compressed_linear, (x, w, bias, packed, scales, 4, GROUP, transposed))


def test_under_torch_compile_it_saves_the_same_codes_and_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(CompressedLinear(100, 32, bits=4), torch.nn.Tanh(), CompressedLinear(32, 8, bits=4))
    native = torch.nn.Sequential(torch.nn.Linear(100, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    native.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(12, 100)
    with memory.saved_bytes(model) as saved:
        y = compiled(x)
    # first layer: codes of x (12 x 100, 4 bits) + scales (2 groups a row); Tanh saves its output (12 x 32 float32),
    # which is also the second layer's input, kept by it as codes (12 x 32) + scales (1 group a row)
    expected = 12 * 100 * 4 // 8 + 12 * 2 * 8 + 12 * 32 * 4 + 12 * 32 * 4 // 8 + 12 * 8
    assert saved.total == expected
    y_native = native(x)
    assert torch.equal(y, y_native)  # aot_eager runs the same eager kernels: the forward stays bitwise native
    grad = torch.randn_like(y)
    y.backward(grad)
    y_native.backward(grad)
    assert torch.equal(model[2].bias.grad, native[2].bias.grad)
    assert torch.equal(model[0].bias.grad, native[0].bias.grad)  # tanh' from the exact output, dX = g W exact
    rows_g = grad.double().abs()
    hidden = torch.tanh(native[0](x)).detach()
    bound = rows_g.t() @ group_steps(hidden, 4, GROUP) + 1e-6 * (rows_g.t() @ hidden.double().abs())
    assert bool(((model[2].weight.grad.double() - native[2].weight.grad.double()).abs() <= bound).all())
