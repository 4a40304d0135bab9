"""attention.ops: the compressed attention core's forward is bitwise SDPA's; its backward formula is SDPA's gradient
(on exact values); its gradients from K-bit codes approach native's as K grows; it saves no S x S tensor and no
full-precision q, k, v; the custom ops pass opcheck and compile."""

import pytest
import torch

from fewbit_design.runtime import memory
from fewbit_design.runtime.attention import attention_backward_reference, compressed_attention
from fewbit_design.runtime.attention.ops import attention_backward_flash, native_attention
from fewbit_design.runtime.linear import saved_nbytes

BATCH, HEADS, LENGTH, DIM = 2, 4, 9, 16

# (kv_repeat, enable_gqa, is_causal, mask): the argument combinations Hugging Face's sdpa path produces
CASES = [
    (1, False, True, None),
    (1, False, False, "float"),
    (2, False, False, "bool"),
    (2, True, True, None),
]


def _inputs(kv_repeat, mask_kind, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()

    q = draw(BATCH, HEADS, LENGTH, DIM)
    k, v = draw(BATCH, HEADS // kv_repeat, LENGTH, DIM), draw(BATCH, HEADS // kv_repeat, LENGTH, DIM)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(BATCH, 1, LENGTH, LENGTH, generator=generator) > 0.3
        mask[..., 0] = True  # every query sees at least one key
    elif mask_kind == "float":
        mask = torch.randn(BATCH, 1, LENGTH, LENGTH, generator=generator, dtype=dtype)
    grad = torch.randn(BATCH, HEADS, LENGTH, DIM, generator=generator, dtype=dtype)
    return q, k, v, mask, grad


def _relative_errors(kv_repeat, enable_gqa, causal, mask_kind, bits):
    q, k, v, mask, grad = _inputs(kv_repeat, mask_kind)
    native = native_attention(q, k, v, mask, None, causal, kv_repeat, enable_gqa)
    expected = torch.autograd.grad(native, (q, k, v), grad)
    output = compressed_attention(
        q, k, v, mask, is_causal=causal, kv_repeat=kv_repeat, enable_gqa=enable_gqa, bits=bits
    )
    assert torch.equal(output, native)
    got = torch.autograd.grad(output, (q, k, v), grad)
    return [float((a - b).norm() / b.norm()) for a, b in zip(got, expected, strict=True)]


@pytest.mark.parametrize("kv_repeat, enable_gqa, causal, mask_kind", CASES)
def test_forward_is_bitwise_sdpa(kv_repeat, enable_gqa, causal, mask_kind):
    q, k, v, mask, _ = _inputs(kv_repeat, mask_kind)
    native = native_attention(q, k, v, mask, 0.3, causal, kv_repeat, enable_gqa)
    got = compressed_attention(q, k, v, mask, scale=0.3, is_causal=causal, kv_repeat=kv_repeat, enable_gqa=enable_gqa)
    assert torch.equal(got, native)


@pytest.mark.parametrize("kv_repeat, enable_gqa, causal, mask_kind", CASES)
def test_backward_formula_is_sdpa_gradient(kv_repeat, enable_gqa, causal, mask_kind):
    """On exact values (float64) the backward formula gives autograd's gradient of native SDPA: what the codes
    approximate is the right function."""
    q, k, v, mask, grad = _inputs(kv_repeat, mask_kind, dtype=torch.float64)
    native = native_attention(q, k, v, mask, 0.3, causal, kv_repeat, enable_gqa)
    expected = torch.autograd.grad(native, (q, k, v), grad)
    with torch.no_grad():
        got = attention_backward_reference(grad, q, k, v, mask, 0.3, causal)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kv_repeat, enable_gqa, causal, mask_kind", CASES)
def test_gradient_error_falls_with_bits(kv_repeat, enable_gqa, causal, mask_kind):
    """Relative gradient error (L2, per tensor) against native: measured about 0.55 / 0.11 / 0.006 at 2 / 4 / 8
    bits; each step of 2 bits at least halves it, and 8 bits stays under 2%."""
    errors = {bits: _relative_errors(kv_repeat, enable_gqa, causal, mask_kind, bits) for bits in (2, 4, 6, 8)}
    for low, high in ((2, 4), (4, 6), (6, 8)):
        assert all(b < a / 2 for a, b in zip(errors[low], errors[high], strict=True)), errors
    assert max(errors[8]) < 0.02, errors


def test_rows_with_every_key_masked_get_zero_gradients():
    q, k, v, mask, grad = _inputs(1, "bool")
    mask[0, :, 3, :] = False  # query 3 of batch 0 sees nothing: SDPA's output row is NaN there
    output = compressed_attention(q, k, v, mask, bits=8)
    got = torch.autograd.grad(output, (q, k, v), grad.masked_fill(output.isnan(), 0.0))
    assert all(torch.isfinite(g).all() for g in got)
    assert torch.equal(got[0][0, :, 3], torch.zeros_like(got[0][0, :, 3]))


def test_saves_codes_only():
    """Saved for backward: the q, k, v codes (and the mask), nothing of size S x S and no full-precision q, k, v."""
    q, k, v, mask, _ = _inputs(2, "bool")
    with memory.saved_bytes() as saved:
        compressed_attention(q, k, v, mask, kv_repeat=2, bits=4)
    codes = sum(saved_nbytes(t.shape, 4, 64) for t in (q, k, v))
    assert saved.total == codes + mask.untyped_storage().nbytes()
    with memory.saved_bytes() as native:
        native_attention(q, k, v, mask, None, False, 2, False)
    assert saved.total < native.total / 3


def test_no_grad_is_the_native_call():
    q, k, v, _, _ = _inputs(1, None)
    with torch.no_grad(), memory.saved_bytes() as saved:
        output = compressed_attention(q, k, v, is_causal=True)
    assert output.grad_fn is None and saved.total == 0


def _heads_last(tensor):
    """The same values laid out (B, S, H, D) in memory: how Hugging Face's q, k, v reach the core (a projection's
    output viewed and transposed), and how the CPU flash kernel lays out its output and gradients."""
    return tensor.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()


@pytest.mark.parametrize("layout", ["contiguous", "heads-last"])
@pytest.mark.parametrize("kv_repeat, mask_kind", [(2, "bool"), (2, None), (1, None), (1, "float")])
def test_opcheck(kv_repeat, mask_kind, layout):
    """The fake kernels give the real kernels' strides (which ``torch.compile`` with inductor asserts) for every
    layout and path: the flash kernel's output follows q, the math kernel's is contiguous, gradients from the flash
    backward are heads-last unless summed over a group."""
    q, k, v, mask, grad = _inputs(kv_repeat, mask_kind)
    if layout == "heads-last":
        q, k, v, grad = (_heads_last(t) for t in (q, k, v, grad))
    seed = torch.zeros((), dtype=torch.int64)
    codes = [c for t in (q, k, v) for c in torch.ops.fewbit.group_quantize(t.detach(), 8, 64, False, seed)]
    torch.library.opcheck(
        torch.ops.fewbit.compressed_attention.default,
        (q, k, v, mask, codes, None, mask is None, kv_repeat, False, 8, 64, None, 0.0),
    )
    shapes = [list(q.shape), list(k.shape), list(v.shape)]
    torch.library.opcheck(
        torch.ops.fewbit.compressed_attention_backward.default,
        (grad.detach(), mask, codes, *shapes, None, mask is None, 8, 64, None, 0.0),
    )


def test_compiled_equals_eager():
    q, k, v, _, grad = _inputs(2, None)

    def run(q, k, v):
        return compressed_attention(q, k, v, is_causal=True, enable_gqa=True, bits=8)

    eager = torch.autograd.grad(run(q, k, v), (q, k, v), grad)
    torch._dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    output = compiled(q, k, v)
    assert torch.equal(output, run(q, k, v))
    for a, b in zip(torch.autograd.grad(output, (q, k, v), grad), eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal, mask_kind", [(True, None), (False, "bool"), (False, "float")])
def test_backward_keeps_few_score_sized_temporaries(causal, mask_kind):
    """The backward's S x S temporaries are updated in place: at most 3 score-sized float tensors live at once (the
    out-of-place formula peaked at 5.4), with the same values as before (test_backward_formula_is_sdpa_gradient)."""
    length = 64
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, length, 8, generator=generator) for _ in range(4))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(1, 1, length, length, generator=generator) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(1, 1, length, length, generator=generator)
    with memory.peak(q, k, v, grad, *(t for t in (mask,) if t is not None)) as peak:
        attention_backward_reference(grad, q, k, v, mask, None, causal)
    assert peak.peak_bytes < 3 * 2 * length * length * 4


@pytest.mark.parametrize("kv_repeat, causal, kv_length", [(1, True, 9), (2, False, 9), (2, True, 13), (4, False, 5)])
def test_flash_backward_equals_the_reference(kv_repeat, causal, kv_length):
    """float32 without a mask: torch's flash-attention kernels give the reference formula's gradients to float32
    rounding (the same float32 accumulation, summed in another order): measured within 3e-7 relative."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(BATCH, HEADS, LENGTH, DIM, generator=generator)
    k, v = (torch.randn(BATCH, HEADS // kv_repeat, kv_length, DIM, generator=generator) for _ in range(2))
    grad = torch.randn(BATCH, HEADS, LENGTH, DIM, generator=generator)
    expected = attention_backward_reference(grad, q, k, v, None, 0.3, causal)
    got = attention_backward_flash(grad, q, k, v, 0.3, causal)
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_float32_backward_without_mask_keeps_no_score_sized_temporary():
    """The compressed op's float32 backward without a mask runs blockwise (flash kernels): less than one S x S float
    tensor is live at once (the reference formula held 2.5)."""
    length = 128
    q, k, v = (torch.randn(1, 2, length, 8, requires_grad=True) for _ in range(3))
    output = compressed_attention(q, k, v, is_causal=True, bits=8)
    grad = torch.randn_like(output)
    with memory.peak(output, grad) as peak:
        torch.autograd.grad(output, (q, k, v), grad)
    assert peak.peak_bytes < 2 * length * length * 4
