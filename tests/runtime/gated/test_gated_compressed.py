"""The gated-MLP op's compressed mode (fewbit_design.runtime.gated.compressed): an exact forward, saved bytes equal to
the count derived by hand from the shapes, gradient errors within the bound derived from the codes' rounding (per
bit width), opcheck, torch.compile (aot_eager), convert and the technique setting."""

import copy
import warnings

import pytest
import torch
from test_gated_op import NATIVE, NativeGated, replacement

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime.fewbit.backends import quantize_reference, scale_reference, table_tensors
from fewbit_design.runtime.fewbit.lookup import load_table
from fewbit_design.runtime.gated import LAYOUTS, GatedMLP, convert
from fewbit_design.runtime.gated.compressed import TABLE_ACTIVATIONS, saved_nbytes_per_token
from fewbit_design.runtime.gated.ops import ACTIVATIONS


def compressed(native, bits, **options):
    layout = LAYOUTS[3] if native.fused else LAYOUTS[0]
    children = copy.deepcopy(dict(native.named_children()))
    return GatedMLP(children, layout, native.activation, mode="compressed", bits=bits, **options)


def gradients(module, x, g):
    x = x.detach().requires_grad_()
    y = module(x)
    return y, torch.autograd.grad(y, [x, *module.parameters()], g)


def saved(module, x):
    with memory.saved_bytes(module) as counted:
        module(x * 1)  # a non-leaf input, as inside a model
    return counted.total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_is_bitwise_the_exact_forward(activation, fused, dtype):
    torch.manual_seed(0)
    native = NativeGated(16, 24, activation, fused=fused, bias=True, dtype=dtype)
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    exact = replacement(native)(x)
    for bits in (2, 8):
        torch.testing.assert_close(compressed(native, bits)(x), exact, rtol=0, atol=0)
    with torch.no_grad():  # nothing to save: the same output
        torch.testing.assert_close(compressed(native, 4)(x), exact, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_saved_bytes_per_token_are_the_derived_count(bits, fused, dtype):
    # per token, H and I multiples of 64: (H + 2I) K / 8 bytes of codes for x, act(gate) and up, 8 bytes of (low,
    # step) per group of 64 of each, and I * 3 / 8 bytes of 3-bit act' codes; the dtype does not enter
    tokens, hidden, width = 8, 64, 128
    native = NativeGated(hidden, width, "silu", fused=fused, dtype=dtype)
    x = torch.randn(2, tokens // 2, hidden, dtype=dtype, requires_grad=True)
    by_hand = (hidden + 2 * width) * bits // 8 + 8 * (hidden + 2 * width) // 64 + width * 3 // 8
    assert by_hand == {4: 248, 8: 408}[bits]
    assert saved(compressed(native, bits), x) == tokens * by_hand
    assert saved_nbytes_per_token(hidden, width, bits=bits) == by_hand
    size = torch.finfo(dtype).bits // 8
    assert saved(replacement(native), x) == tokens * (hidden + 2 * width) * size  # exact mode: x, gate, up


def test_saved_bytes_of_odd_shapes_follow_the_packing():
    # 5 tokens, H = 24, I = 40: codes pack 8 to a group over the whole tensor, scales are per row and group of 64
    tokens, hidden, width, bits = 5, 24, 40, 4
    native = NativeGated(hidden, width, "gelu")
    x = torch.randn(tokens, hidden, requires_grad=True)
    codes = -(-tokens * hidden // 8) * bits + 2 * -(-tokens * width // 8) * bits + -(-tokens * width // 8) * 3
    scales = 8 * tokens * 3  # one group per row for x, act(gate) and up
    assert saved(compressed(native, bits), x) == codes + scales
    assert saved_nbytes_per_token(hidden, width, bits=bits, tokens=tokens) == codes + scales


def test_frozen_projections_keep_no_input_codes():
    tokens, hidden, width, bits = 8, 64, 64, 8
    module = compressed(NativeGated(hidden, width, "silu"), bits)
    for name in ("gate_proj", "up_proj"):
        getattr(module, name).weight.requires_grad_(False)
    x = torch.randn(tokens, hidden, requires_grad=True)
    assert (
        saved(module, x)
        == saved_nbytes_per_token(hidden, width, bits=bits, tokens=tokens) - (hidden * bits // 8 + 8) * tokens
    )
    grad_x, grad_down = torch.autograd.grad(module(x).sum(), [x, module.down_proj.weight])
    assert grad_x.shape == x.shape and grad_down.shape == module.down_proj.weight.shape


# ----------------------------------------------------------------------------------------------------------------------
# Gradient error per bit width


def _rounding_variance(t, bits, group_size=64):
    """Per-element upper bound of the variance of stochastic rounding: step^2 / 4, step = group range / (2^K - 1)."""
    rows, features = t.shape
    groups = -(-features // group_size)
    padded = torch.cat([t, t[:, -1:].expand(rows, groups * group_size - features)], dim=1)
    grouped = padded.reshape(rows, groups, group_size)
    step = (grouped.amax(-1) - grouped.amin(-1)) / (2**bits - 1)
    return (step.repeat_interleave(group_size, dim=1)[:, :features] ** 2) / 4


def _product_deviation(a, va, b, vb):
    """sqrt(E ||A~^T B~ - A^T B||^2) for A~ = A + noise of variance va, B~ likewise, all noises independent and
    zero-mean (stochastic rounding is unbiased): sum over (i, j) of sum_n (a_ni^2 vb_nj + va_ni b_nj^2 + va vb)."""
    return float((a.pow(2).t() @ vb + va.t() @ b.pow(2) + va.t() @ vb).sum().sqrt())


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gradient_error_within_the_rounding_bound(activation, bits):
    # Each weight gradient is a product A^T B of decoded codes; stochastic rounding is unbiased with per-element
    # variance at most step^2 / 4, so E||error||^2 is at most the sum of _product_deviation's terms. The squared
    # error is a sum of many independent terms and concentrates at its mean: 2x the root of that bound is never
    # reached by chance at these sizes. Gate: the few-bit codes of act' add the table's own (deterministic) error,
    # measured against the same gradient with q(gate) in place of act'(gate) and every other value exact.
    torch.manual_seed(0)
    tokens, hidden, width = 256, 64, 128
    native = NativeGated(hidden, width, activation, bias=True)
    x = torch.randn(tokens, hidden)
    g = torch.randn(tokens, hidden)
    _, exact = gradients(replacement(native), x, g)
    _, ours = gradients(compressed(native, bits), x, g)
    with torch.no_grad():
        gate, up = native.gate_proj(x), native.up_proj(x)
        a = NATIVE[activation](gate)
        grad_h = g @ native.down_proj.weight
        va, vu, vx = (_rounding_variance(t, bits) for t in (a, up, x))
        zero = torch.zeros_like(g)
        name, params = TABLE_ACTIVATIONS[activation]
        tensors = table_tensors(load_table(name, params=params, bits=3))
        codes = quantize_reference(gate, tensors.boundaries32, tensors.interval_codes, 3)
        q = scale_reference(torch.ones_like(gate), codes, tensors.levels32, 3)  # q(gate) = levels[code]
    errors = {}
    for key, index, reference, deviation in [
        # dW_down = g^T (a~ up~): variance of a~ up~ is up^2 va + a^2 vu + va vu
        ("down", 5, exact[5], _product_deviation(g, zero, a * up, up**2 * va + a**2 * vu + va * vu)),
        # dW_up = (grad_h a~)^T x~
        ("up", 3, exact[3], _product_deviation(grad_h * a, grad_h**2 * va, x, vx)),
        # dW_gate = (q(gate) grad_h up~)^T x~ around its value with exact up and x (the table's error apart)
        ("gate", 1, (q * grad_h * up).t() @ x, _product_deviation(q * grad_h * up, (q * grad_h) ** 2 * vu, x, vx)),
    ]:
        error = float((ours[index] - reference).norm())
        assert error <= 2 * deviation, (key, error, deviation)
        errors[key] = float((ours[index] - exact[index]).norm() / exact[index].norm())
    # the table's part of the gate gradient's error is the few-bit activation's, independent of K
    table_error = float(((q * grad_h * up).t() @ x - exact[1]).norm() / exact[1].norm())
    assert table_error < 0.2
    assert errors["gate"] <= table_error + 2 * _product_deviation(
        q * grad_h * up, (q * grad_h) ** 2 * vu, x, vx
    ) / float(exact[1].norm())
    if bits == 8:  # K-bit codes alone: about 1% at 8 bits
        assert errors["down"] < 0.03 and errors["up"] < 0.03


# ----------------------------------------------------------------------------------------------------------------------
# torch.library and torch.compile


@pytest.mark.parametrize("fused", [False, True])
def test_opcheck(fused):
    torch.manual_seed(0)
    hidden, width, bits = 8, 16, 4
    module = compressed(NativeGated(hidden, width, "gelu", fused=fused, bias=True), bits)
    tensors = table_tensors(load_table("gelu", bits=3))
    x = torch.randn(5, hidden, requires_grad=True)
    weights = [p for p in module.parameters()]
    if fused:
        w_gate, b_gate, w_down, b_down = weights
        w_up = b_up = None
    else:
        w_gate, b_gate, w_up, b_up, w_down, b_down = weights
    x_packed, x_scales = torch.ops.fewbit.group_quantize(x.detach(), bits, 64, True, torch.tensor(3))
    arguments = (
        x, w_gate, b_gate, w_up, b_up, w_down, b_down, "gelu", tensors.boundaries32, tensors.interval_codes, 3,
        bits, 64, True, torch.tensor(7), x_packed, x_scales, tensors.levels32, tensors.levels64,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.fewbit.gated_mlp_compressed, arguments)
    _, *kept = torch.ops.fewbit.gated_mlp_compressed(*arguments)
    derivative, a_packed, a_scales, up_packed, up_scales = (t.detach() for t in kept)
    detached = [None if t is None else t.detach() for t in (w_gate, w_up, w_down)]
    for input_grad in (True, False):
        for weight_grad in (True, False):
            torch.library.opcheck(
                torch.ops.fewbit.gated_mlp_compressed_backward,
                (
                    torch.randn(5, hidden), x_packed, x_scales, derivative, tensors.levels32, a_packed, a_scales,
                    up_packed, up_scales, *detached, 3, bits, 64, input_grad, weight_grad,
                ),
            )  # fmt: skip


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_aot_eager_matches_eager_and_saves_the_codes(fused):
    tokens, hidden, width, bits = 8, 64, 64, 4
    torch.manual_seed(0)
    module = compressed(NativeGated(hidden, width, "silu", fused=fused, bias=True), bits)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x, g = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    torch.manual_seed(1)
    y_eager, g_eager = gradients(module, x, g)
    torch.manual_seed(1)
    y_compiled, g_compiled = gradients(compiled, x, g)
    torch.testing.assert_close(y_compiled, y_eager, rtol=0, atol=0)
    for mine, theirs in zip(g_compiled, g_eager, strict=True):  # same seed, same codes: the same gradients
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert saved(compiled, x.requires_grad_()) == saved_nbytes_per_token(hidden, width, bits=bits, tokens=tokens)


# ----------------------------------------------------------------------------------------------------------------------
# convert, technique, errors


class Llama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(64, 128, bias=False)
        self.down_proj, self.act_fn = torch.nn.Linear(128, 64, bias=False), torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_convert_compressed_mode_and_report():
    model = torch.nn.Sequential(Llama(), torch.nn.LayerNorm(64))
    state = copy.deepcopy(model.state_dict())
    convert(model, mode="compressed", bits=4)
    assert (model[0].mode, model[0].bits, model[0].derivative_bits) == ("compressed", 4, 3)
    assert "compressed: saves act' codes and 4-bit codes of x, act(gate), up" in str(model.gated_report)
    assert model.state_dict().keys() == state.keys()  # the table buffers are not persistent
    x = torch.randn(4, 64, requires_grad=True)
    with memory.saved_bytes(model) as counted:
        model(x * 1)
    assert counted.by_module["0"] == saved_nbytes_per_token(64, 128, bits=4, tokens=4)
    convert(model)  # a GatedMLP keeps its mode
    assert model[0].mode == "compressed" and model.gated_report.already == 1


def test_bad_options_are_one_line():
    with pytest.raises(FewBitError, match="gated MLP mode must be 'exact' or 'compressed', got 'lossy'"):
        convert(Llama(), mode="lossy")
    with pytest.raises(FewBitError, match="bits must be .*2.*8.*, got 9"):
        convert(Llama(), mode="compressed", bits=9)
    native = NativeGated(8, 16, "silu")
    with pytest.raises(FewBitError, match="derivative_bits must be .*, got 0"):
        compressed(native, 8, derivative_bits=0)


def test_second_order_refused():
    module = compressed(NativeGated(8, 16, "silu"), 8)
    x = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(FewBitError, match="higher-order gradients"):
        torch.autograd.grad(module(x).sum(), x, create_graph=True)


def test_non_finite_input_gives_non_finite_gradients():
    module = compressed(NativeGated(8, 16, "silu"), 8)
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    x.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grad_x, grad_down = torch.autograd.grad(module(x).sum(), [x, module.down_proj.weight])
    assert torch.isnan(grad_x[1]).all() and torch.isnan(grad_down).any()
    assert torch.isfinite(grad_x[0]).all() and torch.isfinite(grad_x[2]).all()


def test_silu_table_is_the_derivative():
    # the table the mode loads for each activation approximates that activation's derivative
    gate = torch.linspace(-4, 4, 801, requires_grad=True)
    for activation in ACTIVATIONS:
        name, params = TABLE_ACTIVATIONS[activation]
        tensors = table_tensors(load_table(name, params=params, bits=3))
        codes = quantize_reference(gate.detach(), tensors.boundaries32, tensors.interval_codes, 3)
        q = scale_reference(torch.ones_like(gate), codes, tensors.levels32, 3)
        (derivative,) = torch.autograd.grad(NATIVE[activation](gate).sum(), gate)
        assert float((q - derivative).abs().mean()) < 0.1, activation


def test_autocast_forward_is_the_exact_forward():
    torch.manual_seed(0)
    native = NativeGated(64, 128, "silu", bias=True)
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exact, ours = replacement(native)(x), compressed(native, 8)(x)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, exact, rtol=0, atol=0)
    (grad_x,) = torch.autograd.grad(ours.float().sum(), [x])
    assert grad_x.dtype == torch.float32 and torch.isfinite(grad_x).all()
