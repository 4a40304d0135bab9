"""The gated-MLP op's recompute mode (fewbit_design.runtime.gated.recompute): an exact forward; gradients equal to
native autograd's evaluated at the decoded input x~ (an independent computation: the reference pattern run by torch
on x~); saved bytes equal to x's codes alone, derived by hand; the codes shared with a compressed norm before it;
opcheck, torch.compile (aot_eager), convert and compress=K."""

import copy

import pytest
import torch
from test_gated_compressed import Llama, compiled_saved_bytes, gradients, saved
from test_gated_op import NativeGated, replacement

from fewbit_design import runtime
from fewbit_design.runtime import memory
from fewbit_design.runtime.gated import LAYOUTS, GatedMLP, convert
from fewbit_design.runtime.gated.ops import ACTIVATIONS
from fewbit_design.runtime.gated.recompute import saved_nbytes_per_token
from fewbit_design.runtime.linear.quant import dequantize_groups, quantize_groups


def recomputing(native, bits, **options):
    layout = LAYOUTS[3] if native.fused else LAYOUTS[0]
    children = copy.deepcopy(dict(native.named_children()))
    return GatedMLP(children, layout, native.activation, mode="recompute", bits=bits, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_is_bitwise_the_exact_forward(activation, fused, dtype):
    torch.manual_seed(0)
    native = NativeGated(16, 24, activation, fused=fused, bias=True, dtype=dtype)
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    exact = replacement(native)(x)
    for bits in (2, 8):
        torch.testing.assert_close(recomputing(native, bits)(x), exact, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(recomputing(native, 4)(x), exact, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gradients_are_native_autograd_at_the_decoded_input(bits, activation, fused):
    # nearest rounding is deterministic: x~ is x through the same group quantizer and back. Backward recomputes gate
    # and up from x~ and runs the exact backward, so every gradient (x's too) is native autograd's at x~, to float32
    # rounding (the exact mode's kernels sum in another order: a few units of 1e-7 times the width)
    torch.manual_seed(0)
    tokens, hidden, width = 12, 64, 96
    native = NativeGated(hidden, width, activation, fused=fused, bias=True)
    module = recomputing(native, bits, rounding="nearest")
    x, g = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    _, mine = gradients(module, x, g)
    packed, scales = quantize_groups(x, bits, 64, stochastic=False, seed=0)
    decoded = dequantize_groups(packed, scales, hidden, bits, 64, x.dtype)
    y_at_decoded = native(decoded.requires_grad_())
    theirs = torch.autograd.grad(y_at_decoded, [decoded, *native.parameters()], g)
    for name, a, b in zip(["x", *dict(native.named_parameters())], mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # and not native's at x itself: the mode is approximate
    exact = torch.autograd.grad(native(x.requires_grad_()), [*native.parameters()], g)
    assert not torch.allclose(mine[1], exact[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_saved_bytes_are_the_codes_of_x_alone(bits, fused, dtype):
    # per token, H a multiple of 64: H K / 8 bytes of codes and 8 bytes of (low, step) per group of 64; gate and up
    # keep nothing, whatever I is
    tokens, hidden, width = 8, 64, 128
    native = NativeGated(hidden, width, "silu", fused=fused, dtype=dtype)
    x = torch.randn(2, tokens // 2, hidden, dtype=dtype, requires_grad=True)
    by_hand = hidden * bits // 8 + 8 * hidden // 64
    assert by_hand == {4: 40, 8: 72}[bits]
    assert saved(recomputing(native, bits), x) == tokens * by_hand
    assert saved_nbytes_per_token(hidden, bits=bits) == by_hand


def test_frozen_projections_still_keep_the_input_codes():
    # gate and up are rebuilt from x~ even when their weights need no gradient (LoRA elsewhere): x's codes stay
    tokens, hidden, width, bits = 8, 64, 64, 8
    module = recomputing(NativeGated(hidden, width, "silu"), bits)
    for name in ("gate_proj", "up_proj"):
        getattr(module, name).weight.requires_grad_(False)
    x = torch.randn(tokens, hidden, requires_grad=True)
    assert saved(module, x) == saved_nbytes_per_token(hidden, bits=bits, tokens=tokens)
    grad_x, grad_down = torch.autograd.grad(module(x).sum(), [x, module.down_proj.weight])
    assert grad_x.shape == x.shape and grad_down.shape == module.down_proj.weight.shape


@pytest.mark.parametrize("fused", [False, True])
def test_opcheck(fused):
    torch.manual_seed(0)
    hidden, width, bits = 8, 16, 4
    module = recomputing(NativeGated(hidden, width, "gelu", fused=fused, bias=True), bits)
    x = torch.randn(5, hidden, requires_grad=True)
    weights = list(module.parameters())
    if fused:
        (w_gate, b_gate, w_down, b_down), w_up, b_up = weights, None, None
    else:
        w_gate, b_gate, w_up, b_up, w_down, b_down = weights
    x_packed, x_scales = torch.ops.fewbit.group_quantize(x.detach(), bits, 64, True, torch.tensor(3))
    arguments = (x, w_gate, b_gate, w_up, b_up, w_down, b_down, "gelu", bits, 64, x_packed, x_scales)
    torch.library.opcheck(torch.ops.fewbit.gated_mlp_recompute, arguments)
    detached = [None if t is None else t.detach() for t in (w_gate, b_gate, w_up, b_up, w_down)]
    for input_grad in (True, False):
        torch.library.opcheck(
            torch.ops.fewbit.gated_mlp_recompute_backward,
            (torch.randn(5, hidden), x_packed, x_scales, *detached, "gelu", bits, 64, input_grad),
        )


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_aot_eager_matches_eager_and_saves_the_codes(fused):
    tokens, hidden, width, bits = 8, 64, 64, 4
    torch.manual_seed(0)
    module = recomputing(NativeGated(hidden, width, "silu", fused=fused, bias=True), bits)
    assert compiled_saved_bytes(module, tokens, hidden) == saved_nbytes_per_token(hidden, bits=bits, tokens=tokens)


def test_convert_recompute_mode_and_report():
    model = torch.nn.Sequential(Llama(), torch.nn.LayerNorm(64))
    convert(model, mode="recompute", bits=4)
    assert (model[0].mode, model[0].bits) == ("recompute", 4)
    assert "recompute: saves 4-bit codes of x, rebuilds gate and up" in str(model.gated_report)
    assert "mode='recompute', bits=4" in repr(model[0])


def test_compress_shares_the_norm_codes_and_keeps_nothing_of_its_own():
    # in a LLaMA block under compress=8, the MLP's input is the post-attention norm's output, whose codes the norm
    # keeps: the gated op keeps those very codes, so a model whose MLP reads them keeps no more than the norm's codes
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=64, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = runtime.convert(transformers.LlamaForCausalLM(config), compress=8)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, GatedMLP) and mlp.mode == "recompute"
    ids = torch.randint(1, 64, (2, 16))
    with memory.saved_bytes(model) as counted:
        model(input_ids=ids, labels=ids).loss  # noqa: B018
    assert counted.by_module.get("model.layers.0.mlp", 0) == 0, counted.by_module
