"""attention.exact and the default runtime.convert: the attention core keeps the value projection's input (which
q_proj and k_proj keep anyway) instead of v and rebuilds v in backward. Forward and gradients equal native (eager
bitwise; compiled within tests/tolerances.py), one hidden-sized tensor per token less saved, eager and compiled, and a
LLaMA block (I = 8/3 H, no GQA) saves at most 0.70x of the compiled native block."""

import copy

import families
import pytest
import torch
from tolerances import assert_gradient_close, gradient_tolerance

from fewbit_design import runtime
from fewbit_design.runtime import memory
from fewbit_design.runtime.attention import convert
from fewbit_design.runtime.attention.exact import RECIPE, ValueLinear, value_recompute_attention

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")

VOCAB, BATCH, TOKENS, HIDDEN = 64, 2, 16, 64
COMPILE_BACKEND = "aot_eager_decomp_partition"  # inductor's decompositions and partitioner, as the benchmark


def build(layers=1, heads=4, kv_heads=4, intermediate=None):
    """A tiny LLaMA (seeded; LLaMA's own intermediate size 8/3 H rounded to 8 unless given)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate or -(-(8 * HIDDEN // 3) // 8) * 8, vocab_size=VOCAB, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, max_position_embeddings=TOKENS, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def step(model, forward=None, mask=None):
    """(loss, {parameter name: gradient}, bytes saved for backward) of one training step."""
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(1, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(1))
    with memory.saved_bytes(model) as saved:
        loss = (model if forward is None else forward)(input_ids=tokens, labels=tokens, attention_mask=mask).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, saved.total


def compiled(model):
    torch._dynamo.reset()
    return torch.compile(model, backend=COMPILE_BACKEND)


@pytest.mark.parametrize("kv_heads, padded", [(4, False), (4, True), (2, False), (2, True)])
def test_eager_forward_and_gradients_are_bitwise_native_and_v_is_not_kept(kv_heads, padded):
    """Bitwise: the same forward kernel, v rebuilt by the same matmul, native's backward kernel. GQA with a mask goes
    through repeat_kv (the repeated k and v are native's to keep, the unrepeated k ours), without one through
    enable_gqa."""
    native = build(kv_heads=kv_heads)
    ours = convert(copy.deepcopy(native), mode="exact")
    assert str(ours.attention_report).startswith("1 attention core(s) rebuild v in backward (exact)")
    assert type(ours.model.layers[0].self_attn.v_proj) is ValueLinear
    mask = None
    if padded:  # left padding: a 4-D boolean mask reaches the core instead of is_causal
        mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
        mask[0, :3] = 0
    loss, grads, native_bytes = step(native, mask=mask)
    got_loss, got_grads, got_bytes = step(ours, mask=mask)
    assert torch.equal(got_loss, loss)
    assert got_grads.keys() == grads.keys()
    assert all(torch.equal(got_grads[n], g) for n, g in grads.items())
    v_bytes = BATCH * TOKENS * HIDDEN * kv_heads // 4 * 4  # v: (B, H_kv, S, D) float32
    if padded and kv_heads < 4:  # repeat_kv: native keeps repeated k and v, ours the unrepeated k
        v_bytes = 2 * BATCH * TOKENS * HIDDEN * 4 - BATCH * TOKENS * HIDDEN * kv_heads // 4 * 4
    if padded:  # native SDPA keeps the float copy of the boolean mask it makes (4 bytes an element), ours the mask
        v_bytes += BATCH * TOKENS * TOKENS * 3
    assert native_bytes - got_bytes == v_bytes
    assert getattr(ours.model.layers[0].self_attn.v_proj, RECIPE) is None  # no tensor kept past the forward


def test_compiled_gradients_equal_native_and_v_is_not_kept():
    """Under compile the op is opaque: no backward node reads v, so the partitioner cannot keep it. Gradients
    within the float32 tolerance of tests/tolerances.py (the compiled graphs decompose the linears differently)."""
    native = build(layers=2)
    ours = convert(copy.deepcopy(native), mode="exact")
    reference = step(native)
    for model in (native, ours):
        forward = compiled(model)
        step(model, forward)  # compiles
        result = step(model, forward)
        assert torch.allclose(result[0], reference[0], rtol=1e-6, atol=1e-6)
        for name, grad in reference[1].items():
            tolerance = gradient_tolerance(torch.float32, BATCH * TOKENS)
            assert_gradient_close(grad, result[1][name], tolerance, name)
        if model is native:
            native_bytes = result[2]
    torch._dynamo.reset()
    assert native_bytes - result[2] >= 2 * BATCH * TOKENS * HIDDEN * 4 - BATCH * TOKENS * TOKENS  # 2 layers' v


def _block_bytes(model, x, kwargs, compile_it):
    block = model.model.layers[0]
    forward = block
    if compile_it:
        torch._dynamo.reset()
        forward = torch.compile(block, backend=COMPILE_BACKEND)
    for _ in range(2):  # the first call compiles
        with memory.saved_bytes(block) as counted:
            out = forward(x, **kwargs)
        (out[0] if isinstance(out, tuple) else out).square().mean().backward()
    torch._dynamo.reset()
    return counted.total


def test_default_convert_llama_block_at_most_0_70_of_compiled_native():
    """A LLaMA block after the default runtime.convert (exact modes) saves at most 0.70x of the compiled
    native block, eager and compiled. Per token the block keeps the two norm outputs, q and k, the attention output
    and gate and up: (5 H + 2 I) / (8 H + 3 I) = 0.646 at I = 8/3 H; keeping v too, 0.708."""
    native = build()
    converted = runtime.convert(copy.deepcopy(native))
    assert "attention" in converted.convert_report.applied
    assert not converted.convert_report.approximate.keys() - {"fewbit"}
    x = torch.randn(BATCH, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2), requires_grad=True)
    kwargs = {"position_embeddings": native.model.rotary_emb(x, torch.arange(TOKENS)[None]), "attention_mask": None}
    native_compiled = _block_bytes(native, x, kwargs, True)
    for compile_it in (False, True):
        assert _block_bytes(converted, x, kwargs, compile_it) <= 0.70 * native_compiled, compile_it


def _kept(function):
    """The storages autograd saves while ``function()`` runs (their ``_cdata``), and its result."""
    kept = set()

    def pack(tensor):
        kept.add(tensor.untyped_storage()._cdata)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = function()
    return result, kept


def test_not_a_view_of_the_projection_keeps_v():
    """v must be a view of what the projection returned, unchanged since (eager checks the base and the version) to
    be rebuilt: anything else is kept as it is (at its key/value heads, as native without a mask), with gradients
    bitwise native's. A copy of the view (a KV cache's ``torch.cat``, which a model with ``use_cache`` makes in
    training too) has the values but not the layout the op would rebuild v with."""
    projection = torch.nn.Linear(16, 16)
    x = torch.randn(1, 5, 16, requires_grad=True)
    q, k = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(2))
    projected = projection(x)
    recipe = (x, projected, projected._version)
    view = projected.view(1, 5, 2, 8).transpose(1, 2)
    options = dict(scale=None, is_causal=True, kv_repeat=1, enable_gqa=False)
    changed = projection(x)
    changed_view = changed.view(1, 5, 2, 8).transpose(1, 2)
    changed_recipe = (x, changed, changed._version)
    changed_view.mul_(2.0)  # written in place after the projection: rebuilding v would give the old values
    cases = [
        (view, recipe, True),
        (view * 1.0, recipe, False),
        (torch.cat([torch.tensor([]), view], dim=-2), recipe, False),  # DynamicLayer.update's first call
        (view, None, False),
        (changed_view, changed_recipe, False),
    ]
    for v, given, rebuilt in cases:
        output, kept = _kept(lambda: value_recompute_attention(q, k, v, None, given, projection, **options))  # noqa
        assert (x.untyped_storage()._cdata in kept) == rebuilt
        assert (v.untyped_storage()._cdata in kept) == (not rebuilt)
        native = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.equal(output, native)
        grad = torch.randn_like(native)
        inputs = (q, k, x)
        expected = torch.autograd.grad(native, inputs, grad, retain_graph=True)
        got = torch.autograd.grad(output, inputs, grad, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    with torch.no_grad():
        assert value_recompute_attention(q, k, view, None, recipe, projection, **options) is None


def test_model_without_a_value_projection_keeps_v():
    """Converted all the same (the core keeps k unrepeated and the caller's mask, where native keeps a float copy
    per layer), with v kept; the report says which and why."""
    model = build()
    attention = model.model.layers[0].self_attn
    attention.values = attention._modules.pop("v_proj")  # renamed: nothing to rebuild v from
    convert(model, mode="exact")
    assert "1 keep v (no value projection: v_proj / qkv_proj / value)" in str(model.attention_report)
    assert model.attention_report.keeps_v == [("model.layers.0.self_attn", "LlamaAttention")]


@pytest.mark.parametrize("repeat", [1, 2])
def test_opcheck(repeat):
    """Both ops, with q, k, v laid out as Hugging Face hands them over (a projection's output viewed heads-last); the
    backward's fake kernel gives the real gradients' strides (heads-last from the flash backward, contiguous where
    summed over a group), which inductor asserts."""
    kv_heads = 2 // repeat
    x = torch.randn(2, 6, 8 * kv_heads, requires_grad=True)
    weight = torch.randn(8 * kv_heads, 8 * kv_heads, requires_grad=True)
    bias = torch.randn(8 * kv_heads, requires_grad=True)
    projected = torch.nn.functional.linear(x, weight, bias).detach()
    v = projected.view(2, 6, kv_heads, 8).transpose(1, 2).requires_grad_()
    q = torch.randn(2, 6, 2, 8).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 6, kv_heads, 8).transpose(1, 2).requires_grad_()
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    for m in (None, mask):
        arguments = (q, k, v, x, weight, bias, m, None, m is None, repeat)
        torch.library.opcheck(torch.ops.fewbit.value_recompute_attention.default, arguments)
        output, log_sum_exp = torch.ops.fewbit.value_recompute_attention(*arguments)
        view = (list(v.size()), list(v.stride()), v.storage_offset())
        saved = (t.detach() for t in (q, k, x, weight, bias, output, log_sum_exp))  # a backward is not differentiated
        q_, k_, x_, *rest = saved
        grad = torch.randn_like(output)
        torch.library.opcheck(
            torch.ops.fewbit.value_recompute_attention_backward.default,
            (grad, q_, k_, None, x_, *rest, m, *view, None, m is None, repeat),
        )
        # v kept (not a view of a projection): the same ops without x
        kept = (q, k, v, None, None, None, m, None, m is None, repeat)
        torch.library.opcheck(torch.ops.fewbit.value_recompute_attention.default, kept)
        kept = (q_, k_, v.detach(), None, None, None, *rest[2:], m, *view, None, m is None, repeat)
        torch.library.opcheck(torch.ops.fewbit.value_recompute_attention_backward.default, (grad, *kept))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", ["gpt2", "bert", "vit", "whisper", "clip", *families.DECODERS])
def test_every_family_is_bitwise_native(family, padded):
    """Exact mode without dropout on every family of tests/families.py but T5 (position bias: left alone), grouped
    key/value heads where the family has them: logits and gradients bitwise native's, whether v is rebuilt (a
    ``v_proj`` / ``qkv_proj`` / BERT's ``value``), kept (GPT-2's ``Conv1D``; a key/value cache's copy) or k and v
    would be repeated (a mask)."""
    native, batch = families.build(family, kv_heads=1)
    if padded and "input_ids" in batch:
        mask = torch.ones_like(batch["input_ids"])
        mask[0, :3] = 0
        batch = {**batch, "attention_mask": mask}
    ours = convert(copy.deepcopy(native), mode="exact")
    assert ours.attention_report.replaced and not ours.attention_report.skipped
    results = []
    for model in (native.train(), ours.train()):
        out = families.output(model, batch)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
        trained = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad((out * weights).sum(), trained, allow_unused=True)
        results.append((out.detach(), grads))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
