"""runtime.reversible: couplings, reversible sequences, layer-wise invertible layers and the three architectures.

Oracles: the same network built with ``reconstruct=False`` (plain autograd storing every activation), torch's own
``nn.BatchNorm2d`` for running statistics, index arithmetic written out element by element for the poolings,
and the byte sizes of the tensors each design keeps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from devices import DEVICES
from torch import nn

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime import reversible as R
from fewbit_design.runtime.reversible import _autograd as reversible_autograd

BUILDERS = {"revnet": R.revnet, "hybrid": R.hybrid_net, "layerwise": R.layerwise_net}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def oracle_of(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose reversible sequences store everything (plain autograd)."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, R.ReversibleSequence):
            m.reconstruct = False
    return twin


def gradients(model: nn.Module, x: torch.Tensor, grad_output: torch.Tensor | None, seed: int = 0):
    torch.manual_seed(seed)
    y = model(x)
    if grad_output is None:
        grad_output = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype).to(y.device)
    inputs = [p for p in model.parameters()] + ([x] if x.requires_grad else [])
    grads = torch.autograd.grad(y, inputs, grad_output, allow_unused=True)
    return y, grad_output, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)]


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Worst per-tensor relative error; tensors whose exact gradient is zero (a conv bias feeding a batch norm)
    are measured against 1e-3 of the norm of all gradients instead of their own norm."""
    total = torch.cat([w.flatten() for w in want]).norm()
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = max(float(w.norm()), 1e-3 * float(total))
        worst = max(worst, float((g - w).norm()) / scale)
    return worst


def small_net(arch: str, depth: int = 3, **options) -> nn.Module:
    options.setdefault("pooling", ("channel", "batch"))
    return BUILDERS[arch](depth, 8, input_size=(8, 12), **options)


# ------------------------------------------------------------------------------------------------------------------
# Exactness against the store-everything oracle.


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["revnet", "hybrid"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_gradients_equal_the_oracle_in_float64(arch, train, device):
    torch.manual_seed(0)
    options = {"dropout": 0.3} if arch == "revnet" else {}
    model = small_net(arch, **options).double().train(train).to(device)
    oracle = oracle_of(model)
    x = torch.randn(4, 3, 8, 12, dtype=torch.float64, requires_grad=True).to(device)
    y, grad_output, got = gradients(model, x, None)
    y_oracle, _, want = gradients(oracle, x, grad_output)
    assert torch.equal(y, y_oracle)  # same ops in the same order in forward
    assert relative_error(got, want) < 1e-10


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_is_replayed_and_the_callers_rng_is_untouched(device):
    torch.manual_seed(0)
    model = small_net("revnet", dropout=0.5).double().to(device)
    oracle = oracle_of(model)
    x = torch.randn(4, 3, 8, 12, dtype=torch.float64).to(device)
    _, grad_output, got = gradients(model, x, None, seed=5)
    after_reversible = torch.rand(3, device=device)  # dropout draws from the RNG of x's device
    _, _, want = gradients(oracle, x, grad_output, seed=5)
    after_oracle = torch.rand(3, device=device)
    assert relative_error(got, want) < 1e-10
    # forward consumed the same random numbers as the oracle and backward consumed none of the caller's
    assert torch.equal(after_reversible, after_oracle)
    # without the replay, the recomputed dropout masks differ and so do the gradients
    for m in model.modules():
        if isinstance(m, R.AdditiveCoupling):
            m.preserve_rng_state = False
    _, _, wrong = gradients(model, x, grad_output, seed=5)
    assert relative_error(wrong, want) > 1e-3


@pytest.mark.parametrize("slope,depth", [(0.5, 2), (0.1, 8)])
def test_layerwise_gradients_within_the_tolerance_its_snr_predicts(slope, depth):
    torch.manual_seed(0)
    model = small_net("layerwise", depth=depth, negative_slope=slope).double()
    oracle = oracle_of(model)
    x = torch.randn(4, 3, 8, 12, dtype=torch.float64)
    _, grad_output, got = gradients(model, x, None)
    _, _, want = gradients(oracle, x, grad_output)
    worst_snr_db = min(r.snr_db for r in R.reconstruction_snr(model, x))
    predicted = 10 ** (-worst_snr_db / 20)  # relative amplitude of the worst reconstruction error
    error = relative_error(got, want)
    # 1e-13: two float64 computations of the same gradients in a different order differ by that much anyway
    assert 0 < error <= 10 * predicted + 1e-13, (error, predicted)
    if predicted > 1e-11:  # where reconstruction dominates, the gradient error follows it (0.2x here)
        assert error > 0.01 * predicted and error > 1e-10, (error, predicted)


def test_running_statistics_after_one_training_step_equal_the_oracle():
    for arch in BUILDERS:
        torch.manual_seed(0)
        model = small_net(arch).double()
        oracle = oracle_of(model)
        x = torch.randn(4, 3, 8, 12, dtype=torch.float64)
        gradients(model, x, None)
        gradients(oracle, x, None)
        buffers = dict(model.named_buffers())
        assert buffers, arch
        for name, want in oracle.named_buffers():
            assert torch.equal(buffers[name], want), (arch, name)
            if name.endswith("num_batches_tracked"):
                assert int(want) == 1, (arch, name)


def test_inputs_that_do_not_require_grad_and_frozen_parameters():
    torch.manual_seed(0)
    model = small_net("revnet").double()
    model.stem.weight.requires_grad_(False)
    oracle = oracle_of(model)
    x = torch.randn(4, 3, 8, 12, dtype=torch.float64)
    y = model(x)
    y.square().sum().backward()
    oracle(x).square().sum().backward()
    assert x.grad is None and model.stem.weight.grad is None
    for (name, p), q in zip(model.named_parameters(), oracle.parameters(), strict=True):
        if p.requires_grad:
            assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14), name
    # nothing requires grad at all: a plain forward without a graph
    with torch.no_grad():
        assert not model(x).requires_grad


def test_backward_never_calls_a_nested_backward(monkeypatch):
    torch.manual_seed(0)
    model = small_net("hybrid")
    y = model(torch.randn(4, 3, 8, 12))

    def forbidden(*args, **kwargs):
        raise AssertionError("nested .backward() called")

    monkeypatch.setattr(torch.autograd, "backward", forbidden)
    monkeypatch.setattr(torch.Tensor, "backward", forbidden)
    grads = torch.autograd.grad(y.sum(), list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)


# ------------------------------------------------------------------------------------------------------------------
# Memory.


def saved(model: nn.Module, x: torch.Tensor) -> int:
    with memory.saved_bytes(model) as m:
        model(x)
    return m.total


def test_saved_bytes_are_exactly_the_output_and_do_not_grow_with_depth():
    x = torch.randn(4, 3, 16, 16)
    # kept: the stem's input x, the body's output (after channel then batch pooling: 16 -> 64 channels,
    # 4 -> 16 samples, 16x16 -> 4x4) and the linear layer's 4 x 64 input features
    expected = x.numel() * 4 + (16 * 64 * 4 * 4) * 4 + 4 * 64 * 4
    for arch in ("revnet", "hybrid"):
        sizes = {}
        for depth in (4, 32):
            torch.manual_seed(0)
            sizes[depth] = saved(BUILDERS[arch](depth, 16, input_size=(16, 16)), x)
        assert sizes[4] == expected, arch
        assert abs(sizes[32] - sizes[4]) <= 0.05 * sizes[4], (arch, sizes)
    # the layer-wise net adds only the per-channel mean and variance of each batch norm (2 x channels floats)
    torch.manual_seed(0)
    layerwise = R.layerwise_net(4, 16, input_size=(16, 16))
    bn_channels = sum(m.num_features for m in layerwise.modules() if isinstance(m, R.InvertibleBatchNorm2d))
    assert saved(layerwise, x) == expected + 2 * bn_channels * 4


def test_a_plain_resnet_grows_linearly_in_the_same_measurement():
    x = torch.randn(4, 3, 16, 16)
    sizes = {}
    for depth in (4, 8, 32):
        torch.manual_seed(0)
        sizes[depth] = saved(R.resnet(depth, 16, input_size=(16, 16)), x)
    per_block = (sizes[8] - sizes[4]) / 4
    assert per_block > 0
    assert abs(sizes[32] - (sizes[4] + 28 * per_block)) <= 0.05 * sizes[32]
    assert sizes[32] > 5 * sizes[4]
    torch.manual_seed(0)
    assert sizes[32] > 20 * saved(R.revnet(32, 16, input_size=(16, 16)), x)


def test_dropout_rng_states_are_saved_through_save_for_backward():
    torch.manual_seed(0)
    plain = R.ReversibleSequence(R.AdditiveCoupling(nn.Conv2d(2, 2, 1), nn.Conv2d(2, 2, 1)))
    random = R.ReversibleSequence(
        R.AdditiveCoupling(nn.Sequential(nn.Conv2d(2, 2, 1), nn.Dropout(0.5)), nn.Conv2d(2, 2, 1))
    )
    x = torch.randn(2, 4, 3, 3)
    state_bytes = torch.get_rng_state().numel()
    assert saved(plain, x) == x.numel() * 4
    assert saved(random, x) == x.numel() * 4 + state_bytes  # the output and one CPU RNG state


# ------------------------------------------------------------------------------------------------------------------
# RNG helpers: the CUDA-only part, exercised with stand-in getters and setters.


def test_cuda_device_indices_pick_distinct_cuda_devices_only():
    devices = [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta"), torch.device("cuda", 1)]
    devices.append(torch.device("cuda", 0))
    assert reversible_autograd._cuda_device_indices(devices) == [1, 0]
    assert reversible_autograd._cuda_device_indices([torch.device("cpu")]) == []


def test_rng_replay_sets_then_restores_every_device_state():
    fake = {0: torch.tensor([10]), 3: torch.tensor([30])}
    calls = []

    def get_state(index):
        return fake[index].clone()

    def set_state(state, index):
        calls.append((index, int(state)))
        fake[index] = state.clone()

    torch.manual_seed(7)
    saved_states = reversible_autograd._capture_rng_state([0, 3], get_cuda_state=get_state)
    assert len(saved_states) == 3 and torch.equal(saved_states[0], torch.get_rng_state())
    first = torch.rand(2)
    fake[0], fake[3] = torch.tensor([11]), torch.tensor([31])  # the devices' generators moved on
    with reversible_autograd._replayed_rng(saved_states, [0, 3], get_cuda_state=get_state, set_cuda_state=set_state):
        assert torch.equal(torch.rand(2), first)  # CPU stream replayed
        assert int(fake[0]) == 10 and int(fake[3]) == 30  # CUDA states set to the saved ones
    assert calls == [(0, 10), (3, 30), (0, 11), (3, 31)]  # then given back
    assert not torch.equal(torch.rand(2), first)


# ------------------------------------------------------------------------------------------------------------------
# Autocast.


class _AutocastProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(torch.is_autocast_enabled("cpu"))
        return self.conv(x)


def test_autocast_bfloat16_runs_and_is_replayed_in_backward():
    torch.manual_seed(0)
    for arch in ("revnet", "hybrid", "layerwise"):
        model = small_net(arch)
        x = torch.randn(4, 3, 8, 12)
        _, grad_output, want = gradients(model, x, None)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        got = torch.autograd.grad(y, list(model.parameters()), grad_output.to(y.dtype), allow_unused=True)
        got = [torch.zeros_like(w) if g is None else g for g, w in zip(got, want, strict=True)]
        assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in got), arch
        total = torch.cat([w.flatten() for w in want]).norm()
        assert float(torch.cat([(g - w).flatten() for g, w in zip(got, want, strict=True)]).norm()) < 0.1 * total
    probe = _AutocastProbe()
    sequence = R.ReversibleSequence(R.AdditiveCoupling(probe, nn.Conv2d(2, 2, 1)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sequence(torch.randn(1, 4, 4, 4))
    out.float().sum().backward()
    assert probe.seen == [True, True]  # forward, and the recomputation in backward


# ------------------------------------------------------------------------------------------------------------------
# Layers.


def test_coupling_inverse_and_odd_split():
    torch.manual_seed(0)
    block = R.AdditiveCoupling(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Tanh()), split_dim=-1).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    x1, x2 = x[:, :3], x[:, 3:]
    y1 = x1 + block.f(x2)
    assert torch.equal(block(x), torch.cat([y1, x2 + block.g(y1)], dim=-1))
    assert torch.allclose(block.inverse(block(x)), x, rtol=0, atol=1e-14)
    with pytest.raises(FewBitError, match=r"shape \(5, 7\).*odd"):
        block(torch.randn(5, 7, dtype=torch.float64))


def test_coupling_branch_scale_formula_inverse_and_gradients():
    torch.manual_seed(0)
    block = R.AdditiveCoupling(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), nn.Linear(3, 3), split_dim=-1, scale=0.3)
    block = block.double()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    # oracle: the formula written out with plain autograd
    x1, x2 = x[:, :3], x[:, 3:]
    y1 = x1 + 0.3 * block.f(x2)
    want_y = torch.cat([y1, x2 + 0.3 * block.g(y1)], dim=-1)
    assert torch.equal(block(x), want_y)
    assert torch.allclose(block.inverse(block(x)), x, rtol=0, atol=1e-14)
    assert "scale=0.3" in repr(block)
    grad_output = torch.randn(5, 6, dtype=torch.float64)
    inputs = [x, *block.parameters()]
    got = torch.autograd.grad(R.ReversibleSequence(block)(x), inputs, grad_output)
    want = torch.autograd.grad(want_y, inputs, grad_output)
    assert relative_error(list(got), list(want)) < 1e-12
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(FewBitError, match="AdditiveCoupling scale must be"):
            R.AdditiveCoupling(nn.Identity(), nn.Identity(), scale=bad)


@pytest.mark.parametrize("arch", ["revnet", "hybrid"])
def test_branch_scale_defaults_to_one_over_depth(arch):
    def scales(model):
        return [m.scale for m in model.body.blocks if isinstance(m, R.AdditiveCoupling)]

    model = small_net(arch, depth=4)
    assert scales(model) == [0.25] * 4
    assert all(m.scale == 1.0 for m in model.modules() if isinstance(m, R.InvertibleConv2d))  # inner layers alone
    assert scales(small_net(arch, depth=4, branch_scale=1.0)) == [1.0] * 4
    assert scales(small_net(arch, depth=2, branch_scale=0.5)) == [0.5] * 2
    with pytest.raises(FewBitError, match=r"(revnet|hybrid_net) branch_scale must be > 0, got 0"):
        small_net(arch, depth=2, branch_scale=0)


def test_invertible_batchnorm_applies_the_floor_and_inverts_with_its_own_statistics():
    torch.manual_seed(0)
    bn = R.InvertibleBatchNorm2d(3, gamma_floor=0.25).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([-0.5, 0.0, 0.3], dtype=torch.float64))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64))
    x = torch.randn(4, 3, 5, 6, dtype=torch.float64) * 3 + 1
    y = bn(x)
    mean = x.mean(dim=(0, 2, 3))
    var = x.var(dim=(0, 2, 3), unbiased=False)
    scale = torch.tensor([-0.75, 0.25, 0.55], dtype=torch.float64)  # sign(g) (|g| + floor), sign(0) = +1
    want = (x - mean[:, None, None]) / torch.sqrt(var[:, None, None] + bn.eps) * scale[:, None, None]
    assert torch.allclose(y, want + bn.bias[:, None, None], rtol=1e-13, atol=1e-13)
    assert torch.allclose(bn.inverse(y), x, rtol=1e-13, atol=1e-13)
    # running statistics follow torch's BatchNorm2d (unbiased variance, momentum)
    reference = nn.BatchNorm2d(3).double()
    reference(x)
    assert torch.allclose(bn.running_mean, reference.running_mean, rtol=1e-14, atol=0)
    assert torch.allclose(bn.running_var, reference.running_var, rtol=1e-14, atol=0)
    # eval mode uses and inverts with the running statistics
    bn.eval()
    assert torch.allclose(bn.inverse(bn(x)), x, rtol=1e-13, atol=1e-13)
    with pytest.raises(FewBitError, match="gamma_floor"):
        R.InvertibleBatchNorm2d(3, gamma_floor=-1)


def test_leaky_relu_inverse_and_slope_check():
    layer = R.InvertibleLeakyReLU(0.3)
    x = torch.linspace(-3, 3, 61, dtype=torch.float64)
    assert torch.equal(layer(x), torch.nn.functional.leaky_relu(x, 0.3))
    assert torch.allclose(layer.inverse(layer(x)), x, rtol=1e-15, atol=0)
    with pytest.raises(FewBitError, match="negative_slope must be > 0"):
        R.InvertibleLeakyReLU(0.0)


@pytest.mark.parametrize("height,width", [(2, 2), (6, 10), (4, 8)])
def test_poolings_stack_2x2_blocks_for_any_even_size(height, width):
    x = torch.randn(3, 2, height, width)
    channel = R.ChannelPool2d()(x)
    batch = R.BatchPool2d()(x)
    assert channel.shape == (3, 8, height // 2, width // 2)
    assert batch.shape == (12, 2, height // 2, width // 2)
    for i in range(2):
        for j in range(2):
            for k in range(2):
                assert torch.equal(channel[:, 4 * k + 2 * i + j], x[:, k, i::2, j::2])
            for n in range(3):
                assert torch.equal(batch[(2 * i + j) * 3 + n], x[n, :, i::2, j::2])
    assert torch.equal(R.ChannelPool2d().inverse(channel), x)
    assert torch.equal(R.BatchPool2d().inverse(batch), x)


def test_invertible_conv_is_a_half_channel_coupling():
    torch.manual_seed(0)
    conv = R.InvertibleConv2d(6, kernel_size=3).double()
    assert conv.f.in_channels == conv.f.out_channels == 3
    x = torch.randn(2, 6, 5, 7, dtype=torch.float64)
    assert torch.allclose(conv.inverse(conv(x)), x, rtol=0, atol=1e-13)


# ------------------------------------------------------------------------------------------------------------------
# Errors at construction.


def test_blocks_that_are_not_invertible_fail_at_construction():
    with pytest.raises(FewBitError, match="channels must be an even integer >= 2, got 5"):
        R.InvertibleConv2d(5)
    with pytest.raises(FewBitError, match="kernel_size must be an odd"):
        R.InvertibleConv2d(4, kernel_size=2)
    with pytest.raises(FewBitError, match="height and width must be even.*5, 4"):
        R.ChannelPool2d(input_size=(5, 4))
    with pytest.raises(FewBitError, match="divisible by 4"):
        R.hybrid_net(2, 6)
    with pytest.raises(FewBitError, match="divisible by 2"):
        R.layerwise_net(2, 5)
    with pytest.raises(FewBitError, match=r"pooling 1 \(batch\).*odd spatial size 5x5"):
        R.revnet(2, 8, input_size=(10, 10))
    with pytest.raises(FewBitError, match="pooling kind must be 'channel' or 'batch', got 'max'"):
        R.revnet(2, 8, pooling=("max",))
    with pytest.raises(FewBitError, match="block 0 must be an invertible module"):
        R.ReversibleSequence(nn.ReLU())


def test_odd_sizes_without_input_size_fail_at_the_first_forward_naming_the_shape():
    with pytest.raises(FewBitError, match=r"shape \(1, 2, 6, 7\)"):
        R.BatchPool2d()(torch.randn(1, 2, 6, 7))
    model = R.revnet(2, 8)
    with pytest.raises(FewBitError, match=r"shape \(2, 32, 3, 3\)"):
        model(torch.randn(2, 3, 6, 6))


# ------------------------------------------------------------------------------------------------------------------
# reconstruction_snr.


def test_reconstruction_snr_measures_every_block_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = small_net("hybrid", depth=2)
    state = copy.deepcopy(model.state_dict())
    results = R.reconstruction_snr(model, torch.randn(4, 3, 8, 12), alphas=True)
    couplings = [r for r in results if r.kind == "AdditiveCoupling" and r.sequence == "body"]
    inner = [r for r in results if r.sequence.endswith((".f", ".g"))]
    assert len(couplings) == 2 and len(inner) == 2 * 2 * 2 * 3
    assert all(40 < r.snr_db for r in results)  # float32 rounding only: far above 0 dB
    assert results[-1].kind == "BatchPool2d" and results[-1].snr_db == float("inf")  # a saved output, a permutation
    assert all(r.noise > 0 for r in results if r.kind != "BatchPool2d")
    assert all(r.alpha is not None and r.alpha > 0 for r in results)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(FewBitError, match="reconstruct=True"):
        R.reconstruction_snr(oracle_of(model), torch.randn(4, 3, 8, 12))


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_double_backward_is_one_clear_error(arch):
    model = small_net(arch, depth=2).double()
    x = torch.randn(2, 3, 8, 12, dtype=torch.float64, requires_grad=True)
    with pytest.raises(FewBitError, match="reversible sequences do not support higher-order gradients"):
        (grad,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
        grad.sum().backward()
    oracle = oracle_of(model)  # what the message suggests: reconstruct=False supports it
    (grad,) = torch.autograd.grad(oracle(x).square().sum(), x, create_graph=True)
    grad.sum().backward()
    assert x.grad is not None


def test_double_backward_never_drops_the_sequences_part_silently():
    model = small_net("revnet", depth=2).double()
    x = torch.randn(2, 3, 8, 12, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(model(x).shape, dtype=torch.float64)
    with pytest.raises(FewBitError, match="higher-order gradients"):
        torch.autograd.grad((model(x) * weights).sum() + x.pow(3).sum(), x, create_graph=True)
