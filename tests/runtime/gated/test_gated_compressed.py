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
from fewbit_design.runtime.gated import LAYOUTS, GatedMLP, convert
from fewbit_design.runtime.gated.compressed import saved_nbytes_per_token
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
    # per token, H and I multiples of 64: (H + 2I) K / 8 bytes of codes for x, gate and up and 8 bytes of (low,
    # step) per group of 64 of each; the dtype does not enter
    tokens, hidden, width = 8, 64, 128
    native = NativeGated(hidden, width, "silu", fused=fused, dtype=dtype)
    x = torch.randn(2, tokens // 2, hidden, dtype=dtype, requires_grad=True)
    by_hand = (hidden + 2 * width) * bits // 8 + 8 * (hidden + 2 * width) // 64
    assert by_hand == {4: 200, 8: 360}[bits]
    assert saved(compressed(native, bits), x) == tokens * by_hand
    assert saved_nbytes_per_token(hidden, width, bits=bits) == by_hand
    size = torch.finfo(dtype).bits // 8
    assert saved(replacement(native), x) == tokens * (hidden + 2 * width) * size  # exact mode: x, gate, up


def test_saved_bytes_of_odd_shapes_follow_the_packing():
    # 5 tokens, H = 24, I = 40: codes pack 8 to a group over the whole tensor, scales are per row and group of 64
    tokens, hidden, width, bits = 5, 24, 40, 4
    native = NativeGated(hidden, width, "gelu")
    x = torch.randn(tokens, hidden, requires_grad=True)
    codes = -(-tokens * hidden // 8) * bits + 2 * -(-tokens * width // 8) * bits
    scales = 8 * tokens * 3  # one group per row for x, gate and up
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


def _product_deviation(a, ma, ba, b, mb, bb):
    """Bounds (bias, deviation) of the error of A~^T B~ against A^T B for A~ = A + eA and B~ = B + eB, all elements'
    errors independent, |E eA| <= ba and E eA^2 <= ma elementwise (likewise for B): bias bounds the norm of the mean
    error (the sum of the absolute bias terms), deviation the root of the summed variances (each term's second
    moment, by (u + v + w)^2 <= 3 (u^2 + v^2 + w^2), bounds its variance)."""
    bias = (a.abs().t() @ bb + ba.t() @ b.abs() + ba.t() @ bb).norm()
    variance = 3 * (a.pow(2).t() @ mb + ma.t() @ b.pow(2) + ma.t() @ mb).sum()
    return float(bias), float(variance.sqrt())


def _derivative_bounds(activation):
    """The maxima of |act'|, |act''| and of the third derivative's magnitude over a fine grid (by autograd): the
    Lipschitz constants of act(gate~) and act'(gate~) and their Taylor bias terms."""
    t = torch.linspace(-12, 12, 24001, dtype=torch.float64, requires_grad=True)  # beyond: the derivatives fade
    bounds, f = [], NATIVE[activation](t)
    for _ in range(3):
        (f,) = torch.autograd.grad(f.sum(), t, create_graph=True)
        bounds.append(float(f.detach().abs().max()))
    assert all(bound == bound for bound in bounds), bounds  # finite on the grid
    return bounds


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gradient_error_within_the_rounding_bound(activation, bits):
    # Each weight gradient is a product A~^T B~ of values decoded from stochastically rounded codes (per element:
    # zero-mean error, variance at most step^2 / 4 = v) or recomputed from them: a~ = act(gate~) has an error of
    # at most max|act'| |gate~ - gate| (second moment max|act'|^2 v_gate) and, by Taylor, a bias of at most
    # max|act''| v_gate / 2; act'(gate~) likewise one derivative up. _product_deviation turns these per-element
    # bounds into a bound of the product's error: bias + 2 x the root of the variance (the squared error is a sum of
    # many independent terms and concentrates at its mean, so 2x is never reached by chance at these sizes).
    torch.manual_seed(0)
    tokens, hidden, width = 256, 64, 128
    native = NativeGated(hidden, width, activation, bias=True)
    x = torch.randn(tokens, hidden)
    g = torch.randn(tokens, hidden)
    _, exact = gradients(replacement(native), x, g)
    _, ours = gradients(compressed(native, bits), x, g)
    first, second, third = _derivative_bounds(activation)
    with torch.no_grad():
        gate, up = native.gate_proj(x), native.up_proj(x)
    gate.requires_grad_()
    a = NATIVE[activation](gate)
    (derivative,) = torch.autograd.grad(a.sum(), gate)
    with torch.no_grad():
        gate, a = gate.detach(), a.detach()
        grad_h = g @ native.down_proj.weight
        vg, vu, vx = (_rounding_variance(t, bits) for t in (gate, up, x))
        zero, exact_x = torch.zeros_like(g), torch.zeros_like(x)
        # a~ = act(gate~): second moment and bias of its error; d~ = act'(gate~) likewise
        ma, ba = first**2 * vg, second * vg / 2
        md, bd = second**2 * vg, third * vg / 2
        cases = [
            # dW_down = g^T (a~ up~): a~ up~ - a up = ea (up + eu) + a eu, bias at most ba |up|
            ("down", 5, g, zero, zero, a * up, 3 * (ma * (up**2 + vu) + a**2 * vu), ba * up.abs()),
            # dW_up = (grad_h a~)^T x~
            ("up", 3, grad_h * a, grad_h**2 * ma, grad_h.abs() * ba, x, vx, exact_x),
            # dW_gate = (act'(gate~) grad_h up~)^T x~
            (
                "gate", 1, derivative * grad_h * up, 3 * grad_h**2 * (md * (up**2 + vu) + derivative**2 * vu),
                grad_h.abs() * bd * up.abs(), x, vx, exact_x,
            ),
        ]  # fmt: skip
    errors = {}
    for key, index, a_values, a_moment, a_bias, b_values, b_moment, b_bias in cases:
        bias, deviation = _product_deviation(a_values, a_moment, a_bias, b_values, b_moment, b_bias)
        error = float((ours[index] - exact[index]).norm())
        assert error <= bias + 2 * deviation, (key, error, bias, deviation)
        errors[key] = error / float(exact[index].norm())
    if bits == 8:  # K-bit codes: about 1% at 8 bits, for every weight gradient (the gate's too)
        assert max(errors.values()) < 0.03, errors


def _relative_errors(bits, activation, fused, seed):
    """Relative error against exact mode of each gradient (dx and every parameter's) of one tiny gated MLP."""
    torch.manual_seed(0)
    native = NativeGated(64, 128, activation, fused=fused, bias=True)
    x, g = torch.randn(256, 64), torch.randn(256, 64)
    _, exact = gradients(replacement(native), x, g)
    torch.manual_seed(seed)
    _, ours = gradients(compressed(native, bits), x, g)
    return [float((mine - theirs).norm() / theirs.norm()) for mine, theirs in zip(ours, exact, strict=True)]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_gradient_error_shrinks_with_bits(activation, fused):
    # Regression: the first compressed mode kept 3-bit few-bit codes of act'(gate) whatever K was, so at
    # K = 8 dx and dW_gate kept the error of 3-bit few-bit (0.06-0.11, about half of their 4-bit error). Every error
    # term now comes from K-bit codes (step: the group's range / (2^K - 1), 17x smaller at 8 bits than at 4): each
    # gradient's 8-bit error is at most 1/8 of its 4-bit error (measured 1/17 to 1/15, at most 0.012), and the 4-bit
    # one at most 1/3 of the 2-bit one (measured 0.18-0.20).
    errors = {bits: _relative_errors(bits, activation, fused, seed=1) for bits in (2, 4, 8)}
    for index, (two, four, eight) in enumerate(zip(errors[2], errors[4], errors[8], strict=True)):
        assert eight <= four / 8, (index, errors)
        assert four <= two / 3, (index, errors)


# ----------------------------------------------------------------------------------------------------------------------
# torch.library and torch.compile


@pytest.mark.parametrize("fused", [False, True])
def test_opcheck(fused):
    torch.manual_seed(0)
    hidden, width, bits = 8, 16, 4
    module = compressed(NativeGated(hidden, width, "gelu", fused=fused, bias=True), bits)
    x = torch.randn(5, hidden, requires_grad=True)
    weights = [p for p in module.parameters()]
    if fused:
        w_gate, b_gate, w_down, b_down = weights
        w_up = b_up = None
    else:
        w_gate, b_gate, w_up, b_up, w_down, b_down = weights
    x_packed, x_scales = torch.ops.fewbit.group_quantize(x.detach(), bits, 64, True, torch.tensor(3))
    arguments = (
        x,
        w_gate,
        b_gate,
        w_up,
        b_up,
        w_down,
        b_down,
        "gelu",
        bits,
        64,
        True,
        torch.tensor(7),
        x_packed,
        x_scales,
    )
    torch.library.opcheck(torch.ops.fewbit.gated_mlp_compressed, arguments)
    _, *kept = torch.ops.fewbit.gated_mlp_compressed(*arguments)
    gate_packed, gate_scales, up_packed, up_scales = (t.detach() for t in kept)
    detached = [None if t is None else t.detach() for t in (w_gate, w_up, w_down)]
    for input_grad in (True, False):
        for weight_grad in (True, False):
            for bias_grad in (True, False):
                torch.library.opcheck(
                    torch.ops.fewbit.gated_mlp_compressed_backward,
                    (
                        torch.randn(5, hidden), x_packed, x_scales, gate_packed, gate_scales, up_packed, up_scales,
                        *detached, "gelu", bits, 64, input_grad, weight_grad, bias_grad,
                    ),
                )  # fmt: skip


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_aot_eager_matches_eager_and_saves_the_codes(fused):
    tokens, hidden, width, bits = 8, 64, 64, 4
    torch.manual_seed(0)
    module = compressed(NativeGated(hidden, width, "silu", fused=fused, bias=True), bits)
    assert compiled_saved_bytes(module, tokens, hidden) == saved_nbytes_per_token(
        hidden, width, bits=bits, tokens=tokens
    )


def compiled_saved_bytes(module, tokens, hidden):
    """Under aot_eager the module's output equals eager's bitwise and its gradients to float32 rounding (same seed,
    same codes); returns the bytes the compiled module saves."""
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x, g = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    torch.manual_seed(1)
    y_eager, g_eager = gradients(module, x, g)
    torch.manual_seed(1)
    y_compiled, g_compiled = gradients(compiled, x, g)
    torch.testing.assert_close(y_compiled, y_eager, rtol=0, atol=0)
    for mine, theirs in zip(g_compiled, g_eager, strict=True):  # same seed, same codes: the same gradients
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    return saved(compiled, x.requires_grad_())


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
    assert (model[0].mode, model[0].bits, model[0].rounding) == ("compressed", 4, "stochastic")
    assert "compressed: saves 4-bit codes of x, gate, up" in str(model.gated_report)
    assert model.state_dict().keys() == state.keys()
    x = torch.randn(4, 64, requires_grad=True)
    with memory.saved_bytes(model) as counted:
        model(x * 1)
    assert counted.by_module["0"] == saved_nbytes_per_token(64, 128, bits=4, tokens=4)
    convert(model)  # a GatedMLP keeps its mode
    assert model[0].mode == "compressed" and model.gated_report.already == 1


def test_bad_options_are_one_line():
    with pytest.raises(FewBitError, match="gated MLP mode must be 'exact', 'compressed' or 'recompute', got 'lossy'"):
        convert(Llama(), mode="lossy")
    with pytest.raises(FewBitError, match="bits must be .*2.*8.*, got 9"):
        convert(Llama(), mode="compressed", bits=9)
    with pytest.raises(FewBitError, match="rounding must be 'stochastic' or 'nearest', got 'up'"):
        convert(Llama(), mode="compressed", rounding="up")
    native = NativeGated(8, 16, "silu")
    with pytest.raises(FewBitError, match="rounding must be 'stochastic' or 'nearest', got 'down'"):
        compressed(native, 8, rounding="down")


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


def test_convert_nearest_rounding():
    model = convert(Llama(), mode="compressed", bits=8, rounding="nearest")
    assert model.rounding == "nearest" and "rounding='nearest'" in repr(model)
    x = torch.randn(4, 64, requires_grad=True)
    grads = [torch.autograd.grad(model(x).sum(), x)[0] for _ in range(2)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)  # nearest: no random draw


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


@pytest.mark.parametrize("fused", [False, True])
def test_no_bias_gradient_no_row_sums(fused):
    # LLaMA's MLP has no biases: the backward computed three sums over the rows (one of a (tokens, 2I) tensor) and
    # dropped them; with biases the sums are the bias gradients (test_gradients_* above check their values)
    from dispatched import Dispatched

    torch.manual_seed(0)
    for bias, expected in ((False, 0), (True, 2 if fused else 3)):
        module = compressed(NativeGated(16, 24, "silu", fused=fused, bias=bias), 8)
        y = module(torch.randn(5, 16, requires_grad=True) * 1)
        with Dispatched() as recorded:
            y.backward(torch.randn_like(y))
        sums = [name for name, _ in recorded.calls if name.startswith("aten.sum.")]
        assert len(sums) == expected, recorded.calls
