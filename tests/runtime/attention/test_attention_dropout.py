"""Attention with dropout (attention.dropout, the exact core's fewbit::dropout_attention and the compressed core's
dropout path): output and gradients equal native SDPA's math path given the same keep mask (injected into it); the
backward draws the forward's keep mask bit for bit; nothing of size S x S is kept; k and v stay at their key/value
heads; seeds come from torch's generator (reproducible under torch.manual_seed, never baked into a compiled graph);
the custom ops pass opcheck and compile (aot_eager, inductor)."""

import pytest
import torch
from tolerances import assert_gradient_close, gradient_tolerance

from fewbit_design.errors import FewBitError
from fewbit_design.runtime.attention import compressed_attention, dropout
from fewbit_design.runtime.attention.dropout import dropout_keep
from fewbit_design.runtime.attention.exact import dropout_attention

BATCH, HEADS, LENGTH, DIM, P = 2, 4, 9, 16, 0.3

# (kv_repeat, is_causal, mask kind, keys): the calls Hugging Face's models make (causal without a mask, a padding or
# window mask, bidirectional, another key length), with and without grouped-query attention
CASES = [
    (1, True, None, LENGTH),
    (2, True, None, LENGTH),
    (1, False, "bool", LENGTH),
    (2, False, "bool", LENGTH),
    (2, False, "float", LENGTH),
    (1, False, None, LENGTH),
    (2, False, "bool", 5),
]


def _inputs(kv_repeat, mask_kind, dtype=torch.float32, seed=0, kv_length=LENGTH):
    """q, k, v laid out as Hugging Face hands them over (a projection's output viewed heads-last), a mask, a grad."""
    generator = torch.Generator().manual_seed(seed)

    def draw(heads, length):
        return torch.randn(BATCH, length, heads, DIM, generator=generator).to(dtype).transpose(1, 2).requires_grad_()

    q, k, v = draw(HEADS, LENGTH), draw(HEADS // kv_repeat, kv_length), draw(HEADS // kv_repeat, kv_length)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(BATCH, 1, LENGTH, kv_length, generator=generator) > 0.3
        mask[1, :, 2] = False  # a query that sees no key: zero output and gradients, as SDPA
    elif mask_kind == "float":
        mask = torch.randn(BATCH, 1, LENGTH, kv_length, generator=generator).to(dtype)
    grad = torch.randn(BATCH, HEADS, LENGTH, DIM, generator=generator).to(dtype)
    return q, k, v, mask, grad


def _native_with_keep(q, k, v, mask, keep, p, scale, is_causal):
    """Native SDPA's math path with the keep mask passed in (its ``dropout_mask``), k and v repeated by Hugging Face's
    ``repeat_kv`` and a boolean mask made additive as SDPA's front end makes it: the oracle."""
    repeat = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
    output, _ = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, p, is_causal, keep, scale=scale)
    return output


def _call(q, k, v, mask, seed, is_causal, scale=None, p=P):
    """The exact core's op with v kept and a given seed."""
    return torch.ops.fewbit.dropout_attention(q, k, v, None, None, None, mask, seed, p, scale, is_causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_repeat, causal, mask_kind, kv_length", CASES)
def test_equals_native_math_path_given_the_same_keep_mask(kv_repeat, causal, mask_kind, kv_length, dtype):
    """Output and gradients equal native's (SDPA's math path, which is what native runs with dropout, with the keep
    mask the op draws for its seed passed in) within tests/tolerances.py's normwise tolerance: float32 sums over
    S_kv (output, dq) or over the group's S rows (dk, dv) in another order; in bfloat16 native also rounds each of the
    ``repeat`` per-head key/value gradients before summing them (``reconstruction = repeat``)."""
    q, k, v, mask, grad = _inputs(kv_repeat, mask_kind, dtype, kv_length=kv_length)
    seed = torch.tensor(20240917)
    keep = dropout_keep(int(seed), (BATCH, HEADS, LENGTH, kv_length), P, "cpu")
    assert 0.5 < keep.float().mean() < 0.9  # about 1 - P kept
    native = _native_with_keep(q, k, v, mask, keep, P, 0.3, causal)
    output = _call(q, k, v, mask, seed, causal, scale=0.3)
    tolerance = gradient_tolerance(dtype, LENGTH * kv_repeat, reconstruction=kv_repeat if dtype != torch.float32 else 0)
    assert_gradient_close(native.detach(), output.detach(), tolerance, "output")
    expected = torch.autograd.grad(native, (q, k, v), grad)
    got = torch.autograd.grad(output, (q, k, v), grad)
    for name, a, b in zip("qkv", expected, got, strict=True):
        assert_gradient_close(a, b, tolerance, f"d{name}")


def test_dropped_probabilities_change_the_result():
    """The oracle sees the mask: with another seed the output is far from native's for the first seed (so the
    equality above is not one a wrong mask would pass)."""
    q, k, v, mask, _ = _inputs(1, None)
    keep = dropout_keep(5, (BATCH, HEADS, LENGTH, LENGTH), P, "cpu")
    native = _native_with_keep(q, k, v, mask, keep, P, None, True)
    other = _call(q, k, v, mask, torch.tensor(6), True)
    assert float((other - native).detach().abs().max()) > 0.1 * float(native.detach().abs().max())


@pytest.mark.parametrize("block_elements", [dropout.BLOCK_ELEMENTS, LENGTH * LENGTH])
def test_backward_draws_the_forward_keep_mask_bitwise(monkeypatch, block_elements):
    """Every keep mask the backward draws is bitwise the one the forward drew for the same heads (in one block or,
    with a small block, one key/value head at a time), and both are the slices of dropout_keep for the seed."""
    monkeypatch.setattr(dropout, "BLOCK_ELEMENTS", block_elements)
    drawn = []
    original = dropout._keep_heads

    def recording(seed, first, count, *args):
        keep = original(seed, first, count, *args)
        drawn.append((first, count, keep.clone()))
        return keep

    monkeypatch.setattr(dropout, "_keep_heads", recording)
    q, k, v, mask, grad = _inputs(2, "bool")
    output = _call(q, k, v, mask, torch.tensor(11), False)
    forward = list(drawn)
    torch.autograd.grad(output, (q, k, v), grad)
    backward = drawn[len(forward) :]
    assert len(forward) == len(backward) == (BATCH if block_elements > LENGTH * LENGTH else BATCH * HEADS // 2)
    whole = dropout_keep(11, (BATCH, HEADS, LENGTH, LENGTH), P, "cpu").flatten(0, 1)
    for (first, count, mask_forward), (first_back, count_back, mask_backward) in zip(forward, backward, strict=True):
        assert (first, count) == (first_back, count_back)
        assert torch.equal(mask_forward, mask_backward)
        assert torch.equal(mask_forward, whole[first : first + count])


def _saved_storages(function):
    """(result, [(shape, storage)] of every tensor autograd saves while ``function()`` runs)."""
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.untyped_storage()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = function()
    return result, saved


def test_keeps_q_k_v_the_mask_and_the_seed_only():
    """Nothing of size S x S is kept: only q, k, v at their key/value heads (grouped), the caller's mask object and the
    8-byte seed. Native SDPA with dropout keeps the probabilities, the keep mask and repeated k and v besides."""
    q, k, v, mask, _ = _inputs(2, "bool")
    _, saved = _saved_storages(lambda: dropout_attention(q, k, v, mask, p=P))
    inputs = {t.untyped_storage()._cdata: name for name, t in zip("q k v mask".split(), (q, k, v, mask), strict=True)}
    kept = sorted(inputs.get(storage._cdata, f"{shape} {storage.nbytes()} bytes") for shape, storage in saved)
    assert kept == ["() 8 bytes", "k", "mask", "q", "v"]
    keep = dropout_keep(0, (BATCH, HEADS, LENGTH, LENGTH), P, "cpu")
    _, native = _saved_storages(lambda: _native_with_keep(q, k, v, mask, keep, P, None, False))
    assert any(shape[-2:] == (LENGTH, LENGTH) and storage._cdata not in inputs for shape, storage in native)


def test_value_projection_input_is_kept_instead_of_v():
    """Exact mode with the projection's recipe: x (which q_proj and k_proj keep anyway) instead of v, and v's
    gradient reaches the projection through the rebuilt view exactly as through v itself."""
    projection = torch.nn.Linear(24, 2 * DIM)
    x = torch.randn(BATCH, LENGTH, 24, generator=torch.Generator().manual_seed(3), requires_grad=True)
    q, k, _, mask, grad = _inputs(2, "bool")
    grads = []
    for rebuild in (True, False):
        projected = projection(x)
        v = projected.view(BATCH, LENGTH, 2, DIM).transpose(1, 2)
        recipe = (x, projected, projected._version) if rebuild else None
        torch.manual_seed(4)
        output, saved = _saved_storages(
            lambda: dropout_attention(q, k, v, mask, p=P, recipe=recipe, projection=projection)  # noqa: B023
        )
        storages = {storage._cdata for _, storage in saved}
        assert (x.untyped_storage()._cdata in storages) == rebuild
        assert (projected.untyped_storage()._cdata in storages) == (not rebuild)
        grads.append(torch.autograd.grad(output, (q, k, x, projection.weight), grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_seed_comes_from_torch_generator():
    """torch.manual_seed makes a call reproducible (the seed is drawn from the default generator), and two calls
    draw two masks."""
    q, k, v, mask, _ = _inputs(2, None)
    torch.manual_seed(7)
    first = dropout_attention(q, k, v, p=P, is_causal=True)
    second = dropout_attention(q, k, v, p=P, is_causal=True)
    torch.manual_seed(7)
    again = dropout_attention(q, k, v, p=P, is_causal=True)
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_compressed_core_with_dropout():
    """The compressed core's dropout path: the forward is the exact core's (the same function, the same seed drawn
    from the generator), its backward from 8-bit codes is within 2% of native's gradients with the same keep mask
    (the codes' error, as without dropout), and it keeps the codes, the mask and the seed."""
    q, k, v, mask, grad = _inputs(2, "bool")
    torch.manual_seed(8)
    seed = int(dropout.draw_seed("cpu"))
    torch.manual_seed(8)
    exact = dropout_attention(q, k, v, mask, p=P)
    torch.manual_seed(8)
    output, saved = _saved_storages(lambda: compressed_attention(q, k, v, mask, kv_repeat=2, bits=8, dropout=P))
    assert torch.equal(output, exact)
    assert all(
        shape[-2:] != (LENGTH, LENGTH) or storage._cdata == mask.untyped_storage()._cdata for shape, storage in saved
    )
    keep = dropout_keep(seed, (BATCH, HEADS, LENGTH, LENGTH), P, "cpu")
    expected = torch.autograd.grad(_native_with_keep(q, k, v, mask, keep, P, None, False), (q, k, v), grad)
    for a, b in zip(torch.autograd.grad(output, (q, k, v), grad), expected, strict=True):
        assert float((a - b).norm() / b.norm()) < 0.02


def test_bad_input_raises_one_error():
    q, k, v, mask, _ = _inputs(1, "bool")
    with pytest.raises(FewBitError, match=r"dropout probability must be in \[0, 1\), got 1"):
        dropout_attention(q, k, v, p=1.0)
    with pytest.raises(FewBitError, match="q's heads a multiple of k's"):
        dropout_attention(q, k[:, :3], v[:, :3], p=P)
    with pytest.raises(FewBitError, match=r"mask \(2, 1, 9, 5\) does not broadcast"):
        dropout_attention(q, k, v, mask[..., :5], p=P)
    with pytest.raises(FewBitError, match="dropout probability must be a number >= 0"):
        compressed_attention(q, k, v, dropout=-0.1)


@pytest.mark.parametrize("kv_repeat, causal, mask_kind, kv_length", CASES[1:4])
def test_opcheck(kv_repeat, causal, mask_kind, kv_length):
    """Both ops of the exact core (v kept, v rebuilt from x) and the compressed op's dropout path: fake kernels give
    the real kernels' strides, autograd is registered, and the seed is an input (not a constant)."""
    q, k, v, mask, grad = _inputs(kv_repeat, mask_kind, kv_length=kv_length)
    seed = torch.tensor(3)
    x = torch.randn(BATCH, LENGTH, 24)
    weight, bias = torch.randn(HEADS // kv_repeat * DIM, 24), torch.randn(HEADS // kv_repeat * DIM)
    rebuilt = torch.nn.functional.linear(x, weight, bias).view(BATCH, LENGTH, -1, DIM).transpose(1, 2)
    for values, recipe in ((v, (None, None, None)), (rebuilt.requires_grad_(), (x, weight, bias))):
        arguments = (q, k, values, *recipe, mask, seed, P, None, causal)
        torch.library.opcheck(torch.ops.fewbit.dropout_attention.default, arguments)
        view = (list(values.size()), list(values.stride()), values.storage_offset())
        kept = None if recipe[0] is not None else values.detach()
        backward = (grad, q.detach(), k.detach(), kept, *recipe, mask, seed, *view, P, None, causal)
        torch.library.opcheck(torch.ops.fewbit.dropout_attention_backward.default, backward)
    codes = [c for t in (q, k, v) for c in torch.ops.fewbit.group_quantize(t.detach(), 8, 64, False, seed)]
    compressed = (q, k, v, mask, codes, None, causal, kv_repeat, False, 8, 64, seed, P)
    torch.library.opcheck(torch.ops.fewbit.compressed_attention.default, compressed)
    shapes = [list(q.shape), list(k.shape), list(v.shape)]
    backward = (grad, mask, codes, *shapes, None, causal, 8, 64, seed, P)
    torch.library.opcheck(torch.ops.fewbit.compressed_attention_backward.default, backward)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled(backend):
    """Compiled (full graph) the op gives eager's output and gradients for the same seed; the seed is drawn inside
    the graph from torch's generator, not baked in: two calls of the compiled function draw two masks, and
    torch.manual_seed repeats one."""
    q, k, v, mask, grad = _inputs(2, "bool")
    seed = torch.tensor(12)
    eager = _call(q, k, v, mask, seed, False)
    eager_grads = torch.autograd.grad(eager, (q, k, v), grad)
    torch._dynamo.reset()
    compiled = torch.compile(_call, backend=backend, fullgraph=True)
    output = compiled(q, k, v, mask, seed, False)
    tolerance = gradient_tolerance(torch.float32, 2 * LENGTH)
    assert_gradient_close(eager.detach(), output.detach(), tolerance, "output")
    for name, a, b in zip("qkv", eager_grads, torch.autograd.grad(output, (q, k, v), grad), strict=True):
        assert_gradient_close(a, b, tolerance, f"d{name}")

    def drawing(q, k, v, mask):
        return dropout_attention(q, k, v, mask, p=P)

    torch._dynamo.reset()
    drawing = torch.compile(drawing, backend=backend, fullgraph=True)
    torch.manual_seed(9)
    first, second = drawing(q, k, v, mask), drawing(q, k, v, mask)
    torch.manual_seed(9)
    assert torch.equal(first, drawing(q, k, v, mask)) and not torch.equal(first, second)
    torch._dynamo.reset()
