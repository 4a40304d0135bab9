"""BLPA fused units: exact forward, paper-formula backward, sign-preserving quantizer, memory, errors.

Oracles: torch autograd of the unfused ``nn.Sequential(BatchNorm, ReLU, Conv2d/Linear)``; an autograd oracle of
eqs. (5)-(8) built here with straight-through substitutions (independent of ``unit_backward``); the paper's
eqs. (9)-(10) written out here with floor(); brute-force byte counts for the memory accounting.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import blpa, memory
from fewbit_design.runtime._packing import pack_reference, packed_nbytes
from fewbit_design.runtime.blpa import quant

DOUBLE = torch.float64


def _randomize_bn(bn: nn.Module, generator: torch.Generator, gamma_range=(-2.0, 2.0), beta_range=(-1.0, 1.0)):
    with torch.no_grad():
        bn.weight.copy_(torch.empty_like(bn.weight).uniform_(*gamma_range, generator=generator))
        bn.bias.copy_(torch.empty_like(bn.bias).uniform_(*beta_range, generator=generator))


def _conv_pair(bits, *, bias=False, momentum=0.1, stride=1, groups=1, naive=False):
    generator = torch.Generator().manual_seed(0)
    unit = blpa.BNReLUConv2d(
        4, 6, 3, stride=stride, padding=1, groups=groups, bias=bias, bits=bits, naive=naive, momentum=momentum
    ).to(DOUBLE)
    _randomize_bn(unit.bn, generator)
    reference = nn.Sequential(
        nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Conv2d(4, 6, 3, stride, 1, groups=groups, bias=bias)
    ).to(DOUBLE)
    reference.load_state_dict(unit.state_dict())
    return unit, reference


def _linear_pair(bits, *, momentum=0.1):
    generator = torch.Generator().manual_seed(1)
    unit = blpa.BNReLULinear(5, 3, bits=bits, momentum=momentum).to(DOUBLE)
    _randomize_bn(unit.bn, generator)
    reference = nn.Sequential(nn.BatchNorm1d(5, momentum=momentum), nn.ReLU(), nn.Linear(5, 3)).to(DOUBLE)
    reference.load_state_dict(unit.state_dict())
    return unit, reference


def _head_pair(bits):
    generator = torch.Generator().manual_seed(2)
    unit = blpa.BNReLUPoolLinear(4, 3, bits=bits).to(DOUBLE)
    _randomize_bn(unit.bn, generator)
    reference = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).to(
        DOUBLE
    )
    reference.load_state_dict(unit.state_dict())
    return unit, reference


PAIRS = {
    "conv": (_conv_pair, (5, 4, 6, 7)),
    "conv_bias_stride_groups": (lambda bits, **kw: _conv_pair(bits, bias=True, stride=2, groups=2, **kw), (3, 4, 7, 5)),
    "linear": (_linear_pair, (9, 5)),
    "head": (lambda bits, **kw: _head_pair(bits), (3, 4, 5, 5)),
}


# ------------------------------------------------------------------------------------------- forward, state dict


@pytest.mark.parametrize("kind", sorted(PAIRS))
@pytest.mark.parametrize("bits", [None, 4, 8])
def test_forward_and_running_stats_match_unfused(kind, bits):
    make, shape = PAIRS[kind]
    unit, reference = make(bits)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(shape, dtype=DOUBLE, generator=generator) * 3 + 1
        torch.testing.assert_close(unit(x), reference(x), rtol=0, atol=1e-12)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(unit.state_dict()[key], value, rtol=0, atol=1e-12, msg=key)
    unit.eval()
    reference.eval()
    x = torch.randn(shape, dtype=DOUBLE, generator=generator)
    torch.testing.assert_close(unit(x), reference(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_cumulative_average_momentum_none(kind):
    make, shape = PAIRS[kind]
    unit, reference = make(4, momentum=None)
    generator = torch.Generator().manual_seed(4)
    for _ in range(4):
        x = torch.randn(shape, dtype=DOUBLE, generator=generator) * 2 - 1
        unit(x)
        reference(x)
    assert int(unit.bn.num_batches_tracked) == 4
    torch.testing.assert_close(unit.bn.running_mean, reference[0].running_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(unit.bn.running_var, reference[0].running_var, rtol=0, atol=1e-12)


def test_state_dict_loads_both_ways():
    unit = blpa.BNReLUConv2d(3, 5, 3, bias=True, bits=4)
    sequential = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 5, 3, bias=True))
    expected = ["0.weight", "0.bias", "0.running_mean", "0.running_var", "0.num_batches_tracked", "2.weight", "2.bias"]
    assert list(unit.state_dict()) == expected
    assert list(sequential.state_dict()) == expected
    with torch.no_grad():
        for p in sequential.parameters():
            p.uniform_(-1, 1)
        sequential[0].running_var.fill_(2.5)
    unit.load_state_dict(sequential.state_dict())
    other = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 5, 3, bias=True))
    other.load_state_dict(unit.state_dict())
    for key, value in sequential.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    linear = blpa.BNReLULinear(4, 2, bias=False)
    assert list(linear.state_dict()) == expected[:-1]
    nn.Sequential(nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2, bias=False)).load_state_dict(linear.state_dict())


def test_eval_mode_saves_nothing_and_keeps_running_stats():
    unit, reference = _conv_pair(4)
    unit.eval()
    before = {k: v.clone() for k, v in unit.state_dict().items()}
    x = torch.randn(2, 4, 5, 5, dtype=DOUBLE)
    with torch.no_grad(), memory.saved_bytes(unit) as saved:
        unit(x)
    assert saved.total == 0
    for key, value in unit.state_dict().items():
        assert torch.equal(value, before[key]), key


# ------------------------------------------------------------------------------------------- quantizer


def _paper_codes(a2: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, bits: int):
    """Eqs. (9)-(10) verbatim (gamma > 0), channels along dim 1."""
    shape = (1, -1) + (1,) * (a2.dim() - 2)
    scale = (2**bits / (6 * gamma)).view(shape)
    offset = torch.floor(beta.view(shape) * scale)
    codes = (torch.floor(a2 * scale) + 2 ** (bits - 1) - offset).clamp(0, 2**bits - 1)
    values = (codes + 0.5 - 2 ** (bits - 1) + offset) / scale
    return codes, values


def _quantize_roundtrip(a1, gamma, beta, bits):
    shape = (1, -1) + (1,) * (a1.dim() - 2)
    a2 = a1 * gamma.view(shape) + beta.view(shape)
    grid = quant.channel_grid(gamma, beta, bits)
    codes = quant.quantize(a1, a2, grid)
    mask, a1_tilde, a3_tilde = quant.dequantize(codes, grid, gamma, beta)
    return a2, codes, mask, a1_tilde, a3_tilde


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_reconstruction_equals_paper_eq10_inside_the_window(bits):
    """Where the paper's window straddles zero, values equal eqs. (9)-(10) inside both clipping windows."""
    generator = torch.Generator().manual_seed(5)
    gamma = torch.rand(6, dtype=DOUBLE, generator=generator) * 2 + 0.1
    beta = (torch.rand(6, dtype=DOUBLE, generator=generator) * 4 - 2) * gamma  # |beta| < 2 gamma: straddles 0
    a1 = torch.randn(200, 6, dtype=DOUBLE, generator=generator) * 1.5
    a2, codes, mask, a1_tilde, _ = _quantize_roundtrip(a1, gamma, beta, bits)
    paper_codes, paper_values = _paper_codes(a2, gamma, beta, bits)
    # both windows contain |A1| < 3 - delta (ours is centred to half a bin, the paper's to one bin)
    inside = a1.abs() < 3 - 6 / 2**bits
    assert inside.float().mean() > 0.5
    values = a1_tilde * gamma + beta
    torch.testing.assert_close(values[inside], paper_values[inside], rtol=0, atol=1e-12)
    shift = codes.to(DOUBLE) - paper_codes  # the same bins, labelled with a per-channel offset of 0 or 1
    for channel in range(6):
        assert shift[:, channel][inside[:, channel]].unique().numel() == 1


def _adversarial_channels():
    """(gamma, beta) per channel: far-away beta, negative and zero gamma, beta exactly on edges."""
    gamma = [1.0, 1.0, -1.0, -0.5, 0.25, 1.0, 0.0, 0.0, 0.0, 2.0, -2.0, 1e-30, 3.0, 1.0]
    beta = [10.0, -10.0, 7.0, -4.0, 100.0, 0.0, 1.0, -1.0, 0.0, 6.0, -6.0, 1.0, 3.0 * 3 / 8, -3.0]
    return torch.tensor(gamma, dtype=DOUBLE), torch.tensor(beta, dtype=DOUBLE)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_mask_equals_sign_adversarially(bits):
    gamma, beta = _adversarial_channels()
    generator = torch.Generator().manual_seed(6)
    channels = gamma.numel()
    a1 = torch.randn(400, channels, dtype=DOUBLE, generator=generator) * 4
    # elements that make A2 exactly zero: a1 = -beta / gamma where that is exact, plus a1 == 0 with beta == 0
    a1[:20] = torch.where(gamma != 0, -beta / torch.where(gamma == 0, 1.0, gamma), 0.0)
    a1[20:40] = 0.0
    # elements just either side of the zero of A2
    zero = torch.where(gamma != 0, -beta / torch.where(gamma == 0, 1.0, gamma), 0.0)
    a1[40:60] = torch.nextafter(zero, torch.full_like(zero, 1e300))
    a1[60:80] = torch.nextafter(zero, torch.full_like(zero, -1e300))
    a2, codes, mask, a1_tilde, a3_tilde = _quantize_roundtrip(a1, gamma, beta, bits)
    assert (a2 == 0).any() and (a2 > 0).any() and (a2 < 0).any()
    assert torch.equal(mask, a2 > 0)
    assert int(codes.max()) < 2**bits
    assert torch.isfinite(a1_tilde).all()
    assert torch.equal(a3_tilde > 0, a2 > 0)
    # gamma == 0: A2 = beta is exact, A1 is quantized directly (half a bin away inside the window)
    zero_gamma = gamma == 0
    inside = a1.abs() < 2.9
    half_bin = 3.0 / 2**bits
    error = (a1_tilde - a1).abs()
    assert bool((error[:, zero_gamma][inside[:, zero_gamma]] <= half_bin + 1e-12).all())


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_in_window_error_bound_and_constant_channel(bits):
    generator = torch.Generator().manual_seed(7)
    gamma = torch.tensor([1.5, -0.7, 0.3, 2.0], dtype=DOUBLE)
    beta = torch.tensor([0.2, 0.1, -0.25, 9.0], dtype=DOUBLE)
    half_bin = 3.0 / 2**bits
    limit = 3.0 - half_bin  # the window contains |A1| <= 3 - delta / 2 in every channel
    a1 = (torch.rand(300, 4, dtype=DOUBLE, generator=generator) * 2 - 1) * limit
    a2, _, mask, a1_tilde, a3_tilde = _quantize_roundtrip(a1, gamma, beta, bits)
    regular = slice(0, 3)  # channel 3 has its window entirely above zero (beta = 4.5 |gamma|)
    assert float((a1_tilde - a1)[:, regular].abs().max()) <= half_bin + 1e-12
    # |A3~ - A3| <= 3 |gamma| / 2**K = half_bin * |gamma|
    bound = half_bin * gamma.abs()[regular] + 1e-12
    assert bool(((a3_tilde - a2.clamp_min(0))[:, regular].abs() <= bound).all())
    assert torch.equal(mask, a2 > 0)
    # constant channel (zero variance, as BatchNorm produces it): one code, exact sign
    x = torch.full((8, 3, 2, 2), 0.1, dtype=DOUBLE)
    unit = blpa.BNReLUConv2d(3, 2, 1, bits=bits).to(DOUBLE)
    with torch.no_grad():
        unit.bn.bias.copy_(torch.tensor([0.5, -0.5, 0.0], dtype=DOUBLE))
    x.requires_grad_()
    unit(x).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(unit.bn.weight.grad).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("numel", [1, 7, 8, 1023, 8 * 5 + 3])
def test_pack_codes_matches_packing_reference(bits, numel):
    generator = torch.Generator().manual_seed(bits * 1000 + numel)
    codes = torch.randint(0, 2**bits, (numel,), generator=generator).to(torch.uint8)
    packed = quant.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(numel, bits)
    assert torch.equal(packed, pack_reference(codes, bits))
    assert torch.equal(quant.unpack_codes(packed, bits, numel).to(torch.int64), codes.to(torch.int64))


# ------------------------------------------------------------------------------------------- gradients


def _oracle_grads(unit, reference, x, grad_out, a1_tilde):
    """Autograd of the unfused module with A~ substituted where eqs. (5)-(8) use it (straight-through tricks)."""
    bn, op = reference[0], reference[-1]
    x = x.detach().clone().requires_grad_()
    dims = [0] + list(range(2, x.dim()))
    shape = (1, -1) + (1,) * (x.dim() - 2)
    mean = x.mean(dims, keepdim=True)
    invstd = torch.rsqrt(x.var(dims, unbiased=False, keepdim=True) + bn.eps).detach()
    a1_tilde = a1_tilde.detach()
    # eq. (8): value A1, gradient invstd * (g - mean(g) - A1~ mean(A1~ g))
    projection = (a1_tilde * x * invstd).mean(dims, keepdim=True)
    a1 = (x - mean) * invstd - a1_tilde * projection + (a1_tilde * projection).detach()
    gamma, beta = bn.weight.view(shape), bn.bias.view(shape)
    # eq. (7): value gamma A1 + beta, gradient to gamma from A1~, to A1 exact
    a2 = a1 * gamma.detach() + a1_tilde * gamma - (a1_tilde * gamma).detach() + beta
    a2.retain_grad()
    a3 = torch.relu(a2)  # eq. (6) with the exact mask
    a3_tilde = torch.relu(a1_tilde.detach() * gamma.detach() + beta.detach())
    if isinstance(op, nn.Conv2d):

        def apply(inp, weight, bias):
            return F.conv2d(inp, weight, bias, op.stride, op.padding, op.dilation, op.groups)

    elif len(reference) == 5:

        def apply(inp, weight, bias):
            return F.linear(inp.mean((2, 3)), weight, bias)

    else:
        apply = F.linear
    # eq. (5): gradient to W from A3~, to A3 exact
    out = apply(a3, op.weight.detach(), op.bias) + apply(a3_tilde, op.weight, None)
    out = out - apply(a3_tilde, op.weight, None).detach()
    out.backward(grad_out)
    grads = {"input": x.grad, "gamma": bn.weight.grad, "beta": bn.bias.grad, "weight": op.weight.grad}
    if op.bias is not None:
        grads["bias"] = op.bias.grad
    return grads, a2.grad


def _unit_grads(unit, x, grad_out):
    x = x.detach().clone().requires_grad_()
    out = unit(x)
    out.backward(grad_out, retain_graph=True)  # keep saved tensors readable for the tests
    grads = {"input": x.grad, "gamma": unit.bn.weight.grad, "beta": unit.bn.bias.grad, "weight": unit.op.weight.grad}
    if unit.op.bias is not None:
        grads["bias"] = unit.op.bias.grad
    return out, grads


def _decoded_a1(out, unit, shape):
    stored, _, gamma, beta, _ = out.grad_fn.saved_tensors
    numel = torch.Size(shape).numel()
    codes = quant.unpack_codes(stored, unit.bits, numel).view(shape)
    grid = quant.channel_grid(gamma, beta, unit.bits)
    return quant.dequantize(codes, grid, gamma, beta)[1]


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_exact_baseline_gradients_equal_autograd(kind):
    make, shape = PAIRS[kind]
    unit, reference = make(None)
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(shape, dtype=DOUBLE, generator=generator)
    x_ref = x.clone().requires_grad_()
    out_ref = reference(x_ref)
    grad_out = torch.randn(out_ref.shape, dtype=DOUBLE, generator=generator)
    out_ref.backward(grad_out)
    out, grads = _unit_grads(unit, x, grad_out)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-12)
    expected = {"input": x_ref.grad, "gamma": reference[0].weight.grad, "beta": reference[0].bias.grad}
    expected["weight"] = reference[-1].weight.grad
    if reference[-1].bias is not None:
        expected["bias"] = reference[-1].bias.grad
    for name, value in expected.items():
        torch.testing.assert_close(grads[name], value, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("kind", sorted(PAIRS))
@pytest.mark.parametrize("bits", [3, 4])
def test_gradients_follow_paper_formulas(kind, bits):
    """All gradients equal the straight-through autograd oracle of eqs. (5)-(8) built from the same A~."""
    make, shape = PAIRS[kind]
    unit, reference = make(bits)
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(shape, dtype=DOUBLE, generator=generator) * 2 + 0.5
    with torch.no_grad():
        grad_out = torch.randn(unit(x).shape, dtype=DOUBLE, generator=generator)
    unit.zero_grad()
    out, grads = _unit_grads(unit, x, grad_out)
    a1_tilde = _decoded_a1(out, unit, shape)
    expected, grad_relu_input = _oracle_grads(unit, reference, x, grad_out, a1_tilde)
    for name, value in expected.items():
        torch.testing.assert_close(grads[name], value, rtol=0, atol=1e-11, msg=name)


@pytest.mark.parametrize("kind", ["conv", "linear"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_beta_and_relu_input_gradients_are_exact(kind, bits):
    """Gradients to beta and to A2 equal plain autograd of the unfused module (paper section 3.3)."""
    make, shape = PAIRS[kind]
    unit, reference = make(bits)
    generator = torch.Generator().manual_seed(10)
    with torch.no_grad():  # beta far outside +-3|gamma| in some channels: the paper's formula would flip signs
        unit.bn.bias[:2] = torch.tensor([8.0, -8.0], dtype=DOUBLE) * unit.bn.weight[:2].abs()
        unit.bn.weight[2] = 0.0
    reference.load_state_dict(unit.state_dict())
    x = torch.randn(shape, dtype=DOUBLE, generator=generator)
    x_ref = x.clone().requires_grad_()
    bn, op = reference[0], reference[2]
    a2 = bn(x_ref)
    a2.retain_grad()
    out_ref = op(torch.relu(a2))
    grad_out = torch.randn(out_ref.shape, dtype=DOUBLE, generator=generator)
    out_ref.backward(grad_out)
    out, grads = _unit_grads(unit, x, grad_out)
    torch.testing.assert_close(grads["beta"], bn.bias.grad, rtol=0, atol=1e-12)
    needs = (True, True, True, True, unit.op.bias is not None)
    parts = blpa.unit_backward(
        grad_out, out.grad_fn.saved_tensors, unit._spec(), x.shape, unit.op.bias is not None, needs, reference=True
    )
    assert torch.equal(parts.relu_input, a2.grad)
    torch.testing.assert_close(parts.beta, grads["beta"], rtol=0, atol=1e-12)  # kernel sums in another order


def _squared_errors(bits, seed, channels=32):
    generator = torch.Generator().manual_seed(seed)
    unit = blpa.BNReLUConv2d(channels, 16, 3, padding=1, bits=bits).to(DOUBLE)
    exact = blpa.BNReLUConv2d(channels, 16, 3, padding=1, bits=None).to(DOUBLE)
    _randomize_bn(unit.bn, generator, gamma_range=(0.5, 2.0), beta_range=(-0.5, 0.5))
    with torch.no_grad():
        unit.bn.weight[::2] *= -1
    exact.load_state_dict(unit.state_dict())
    # uniform inputs: |A1| <= sqrt(3) < 3, nothing is clipped, so all error is quantization error
    x = torch.rand(8, channels, 6, 6, dtype=DOUBLE, generator=generator) * 4 - 1
    with torch.no_grad():
        grad_out = torch.randn(unit(x).shape, dtype=DOUBLE, generator=generator)
    _, approx = _unit_grads(unit, x, grad_out)
    _, truth = _unit_grads(exact, x, grad_out)
    return {name: (float((approx[name] - truth[name]).norm() ** 2), float(truth[name].norm() ** 2)) for name in truth}


def test_gradient_error_halves_per_extra_bit():
    errors = {}
    for bits in (4, 6, 8):
        runs = [_squared_errors(bits, seed) for seed in (11, 12, 13)]  # pooled over 3 draws: ratio noise ~ +-20%
        errors[bits] = {
            name: (sum(r[name][0] for r in runs) / sum(r[name][1] for r in runs)) ** 0.5 for name in runs[0]
        }
    assert errors[4]["beta"] < 1e-13
    for name in ("weight", "gamma", "input"):
        for low, high in ((4, 6), (6, 8)):
            ratio = errors[low][name] / errors[high][name]
            # two more bits: 4x smaller expected (2x per bit); seen 3.2-5.3 over 36 pooled draws
            assert 2.5 < ratio < 6.5, (name, low, high, errors)
    assert errors[8]["weight"] < 0.01 and errors[8]["input"] < 0.01


@pytest.mark.parametrize("bits", [4, 8])
def test_gamma_zero_gradient_uses_quantized_a1(bits):
    """gamma == 0: A2 = beta carries no A1, so A1 itself is quantized on (-3, 3] (bins of 6 / 2**K aligned at 0);
    the gradient to gamma is sum(A1~ * grad_A2) with that A1~ (oracle written from the documented scheme)."""
    generator = torch.Generator().manual_seed(12)
    unit = blpa.BNReLUConv2d(3, 4, 1, bits=bits).to(DOUBLE)
    with torch.no_grad():
        unit.bn.weight.zero_()
        unit.bn.bias.copy_(torch.tensor([0.5, -0.5, 0.0], dtype=DOUBLE))
    x = torch.rand(8, 3, 4, 4, dtype=DOUBLE, generator=generator) * 2
    x[0, 0, 0, 0] = 40.0  # an outlier beyond the window: clipped to the top bin
    grad_out = torch.randn(8, 4, 4, 4, dtype=DOUBLE, generator=generator)
    _, grads = _unit_grads(unit, x, grad_out)
    mean = x.mean((0, 2, 3), keepdim=True)
    a1 = (x - mean) / torch.sqrt(x.var((0, 2, 3), unbiased=False, keepdim=True) + unit.bn.eps)
    width = 6.0 / 2**bits
    bin_index = (torch.ceil(a1 / width) - 1).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    a1_tilde = (bin_index + 0.5) * width
    grad_a3 = torch.einsum("oc,nohw->nchw", unit.op.weight[:, :, 0, 0].detach(), grad_out)
    mask = torch.tensor([1.0, 0.0, 0.0], dtype=DOUBLE).view(1, 3, 1, 1)  # beta > 0 only in channel 0
    expected = (a1_tilde * grad_a3 * mask).sum((0, 2, 3))
    torch.testing.assert_close(grads["gamma"], expected, rtol=0, atol=1e-10)
    assert float(expected[0].abs()) > 1e-2  # informative: gamma can move away from 0
    assert torch.equal(grads["input"], torch.zeros_like(x))  # grad_A1 = gamma * grad_A2 = 0


def test_naive_baseline_uses_quantized_forward():
    unit, reference = _conv_pair(4, naive=True)
    x = torch.randn(5, 4, 6, 7, dtype=DOUBLE)
    out = unit(x)
    exact = reference(x)
    assert not torch.allclose(out, exact)
    a1_tilde = _decoded_a1(out, unit, x.shape)
    shape = (1, -1, 1, 1)
    a3_tilde = torch.relu(a1_tilde * unit.bn.weight.view(shape) + unit.bn.bias.view(shape))
    torch.testing.assert_close(out, reference[2](a3_tilde), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize("bits", [None, 2, 4, 5, 8])
def test_unit_saves_only_codes_and_statistics(bits):
    unit = blpa.BNReLUConv2d(6, 4, 3, padding=1, bits=bits)
    x = torch.randn(3, 6, 5, 7, requires_grad=True)
    with memory.saved_bytes(unit) as saved:
        unit(x)
    numel = x.numel()
    payload = numel * 4 if bits is None else packed_nbytes(numel, bits)
    assert saved.total == payload + 6 * 4  # + the per-channel inverse standard deviation (float32)


def test_preact_resnet_memory_ratios():
    totals = {}
    x = torch.randn(2, 3, 32, 32)
    for bits in (None, 8, 4):
        torch.manual_seed(0)
        model = blpa.preact_resnet(20, bits=bits)
        with memory.saved_bytes(model) as saved:
            model(x)
        totals[bits] = saved.total
    assert totals[4] <= totals[None] / 7, totals
    assert totals[8] <= 0.27 * totals[None], totals


def test_preact_resnet_structure():
    model = blpa.preact_resnet(29, num_classes=7, bits=4, width=2)
    units = [m for m in model.modules() if isinstance(m, blpa.BNReLUConv2d)]
    assert len(units) == 27  # 3 stages x 3 blocks x 3 units (29 = 9 * 3 + 2)
    fused = [u.bn for u in units] + [model.head.bn]
    assert all(any(m is bn for bn in fused) for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert model.head.op.out_features == 7 and model.head.bn.num_features == 64 * 2 * 4
    out = model(torch.randn(2, 3, 16, 16))
    assert out.shape == (2, 7)


# ------------------------------------------------------------------------------------------- convert


def test_convert_fuses_nested_sequentials_and_shares_parameters():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        inner,
        nn.BatchNorm2d(4),
        nn.GELU(),
        nn.Conv2d(4, 4, 1),  # not a ReLU: stays
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.BatchNorm1d(6),
        nn.ReLU(inplace=True),
        nn.Linear(6, 2),
    ).double()
    x = torch.randn(4, 3, 5, 5, dtype=DOUBLE)
    expected = model(x)
    conv_weight = inner[2].weight
    assert blpa.convert(model, bits=8) is model
    kinds = [type(m).__name__ for m in model]
    assert kinds[:2] == ["Conv2d", "Sequential"] and kinds[2:5] == ["BatchNorm2d", "GELU", "Conv2d"]
    assert kinds[5:8] == ["BNReLUConv2d", "Identity", "Identity"]
    assert kinds[10:] == ["BNReLULinear", "Identity", "Identity"]
    assert isinstance(model[1][0], blpa.BNReLUConv2d) and model[1][0].op.weight is conv_weight
    torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-12)  # exact forward (running stats move)


def test_convert_skips_or_raises_on_unfusable_runs():
    model = nn.Sequential(nn.BatchNorm2d(4, affine=False), nn.ReLU(), nn.Conv2d(4, 4, 1))
    assert isinstance(blpa.convert(model)[0], nn.BatchNorm2d)
    with pytest.raises(FewBitError, match="affine=True"):
        blpa.convert(model, strict=True)


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bits", [0, 1, 9, 4.5, True, "4"])
def test_bad_bits_raise(bits):
    with pytest.raises(FewBitError, match="bits must be an integer from 2 to 8"):
        blpa.BNReLUConv2d(3, 3, 1, bits=bits)
    with pytest.raises(FewBitError, match="BNReLULinear: bits"):
        blpa.BNReLULinear(3, 3, bits=bits)


def test_bad_patterns_raise():
    bn, relu, conv = nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3)
    with pytest.raises(FewBitError, match="second module must be nn.ReLU.*got GELU"):
        blpa.BNReLUConv2d.from_modules(bn, nn.GELU(), conv)
    with pytest.raises(FewBitError, match="first module must be nn.BatchNorm2d, got LayerNorm"):
        blpa.BNReLUConv2d.from_modules(nn.LayerNorm(4), relu, conv)
    with pytest.raises(FewBitError, match="last module must be nn.Conv2d, got Linear"):
        blpa.BNReLUConv2d.from_modules(bn, relu, nn.Linear(4, 4))
    with pytest.raises(FewBitError, match="channels mismatch: BatchNorm2d has 4 channels.*in_channels=5"):
        blpa.BNReLUConv2d.from_modules(bn, relu, nn.Conv2d(5, 4, 3))
    with pytest.raises(FewBitError, match="channels mismatch: BatchNorm1d has 4 channels.*in_features=3"):
        blpa.BNReLULinear.from_modules(nn.BatchNorm1d(4), relu, nn.Linear(3, 2))
    with pytest.raises(FewBitError, match="padding_mode='reflect'"):
        blpa.BNReLUConv2d.from_modules(bn, relu, nn.Conv2d(4, 4, 3, padding_mode="reflect"))
    with pytest.raises(FewBitError, match="naive=True needs bits"):
        blpa.BNReLUConv2d(4, 4, 1, bits=None, naive=True)
    unit = blpa.BNReLUConv2d.from_modules(bn, relu, conv, bits=None)
    assert unit.bn is bn and unit.op is conv


def test_bad_inputs_raise():
    unit = blpa.BNReLUConv2d(4, 4, 1)
    with pytest.raises(FewBitError, match="expects 4 channels"):
        unit(torch.randn(2, 3, 4, 4))
    with pytest.raises(FewBitError, match="expects a 4-D input"):
        unit(torch.randn(4, 4))
    with pytest.raises(FewBitError, match="more than 1 value per channel"):
        blpa.BNReLULinear(4, 2)(torch.randn(1, 4))
    for depth in (10, 50, 0, 164.0, True):
        with pytest.raises(FewBitError, match="depth must be 9n \\+ 2"):
            blpa.preact_resnet(depth)
    with pytest.raises(FewBitError, match="width must be a positive integer"):
        blpa.preact_resnet(20, width=0)


@pytest.mark.parametrize("kind", sorted(PAIRS))
@pytest.mark.parametrize("bits", [None, 4])
def test_an_empty_batch_in_training_gives_what_the_unfused_modules_give(kind, bits):
    """torch's BatchNorm returns an empty tensor for an empty batch in training (and counts the batch); a unit
    refused it ('more than 1 value per channel')."""
    build, shape = PAIRS[kind]
    unit, reference = build(bits)
    empty = (0,) + tuple(shape[1:])
    x = torch.randn(empty, dtype=DOUBLE, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, expected = unit(x), reference(x_ref)
    assert out.shape == expected.shape and out.numel() == 0
    out.sum().backward()
    expected.sum().backward()
    assert x.grad.shape == x_ref.grad.shape
    for got, want in zip(unit.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, want)  # running statistics and the batch count as torch keeps them
    for got, want in zip(unit.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)


@pytest.mark.parametrize("bits", [None, 4])
def test_double_backward_is_one_clear_error(bits):
    unit, _ = _linear_pair(bits)
    x = torch.randn(9, 5, dtype=DOUBLE, requires_grad=True)
    with pytest.raises(FewBitError, match="BLPA units do not support higher-order gradients"):
        (grad,) = torch.autograd.grad(unit(x).square().sum(), x, create_graph=True)
        grad.sum().backward()
    (grad,) = torch.autograd.grad(unit(x).square().sum(), x)  # first order is unaffected
    assert grad.shape == x.shape


def test_double_backward_never_drops_the_units_part_silently():
    """An incoming gradient without a graph (a linear loss) let the first pass succeed with a gradient that had no
    graph through the unit: the second derivative came out without the unit's part, and no error."""
    unit, _ = _linear_pair(None)
    x = torch.randn(9, 5, dtype=DOUBLE, requires_grad=True)
    weights = torch.randn(3, dtype=DOUBLE)
    with pytest.raises(FewBitError, match="higher-order gradients"):
        torch.autograd.grad((unit(x) * weights).sum() + x.pow(3).sum(), x, create_graph=True)
