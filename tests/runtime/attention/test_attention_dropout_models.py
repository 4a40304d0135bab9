"""The attention cores in tiny Hugging Face models (tests/families.py) with attention dropout on, grouped key/value
heads and padding or sliding-window masks: every family whose default config has attention dropout is converted (or
says why not); a training step equals native's given the same dropout masks; k and v are kept at their key/value
heads with and without a mask; one mask is kept for all layers, never a sequence x sequence tensor per layer."""

import copy

import pytest
import torch
from families import BATCH, DECODERS, TOKENS, build, output
from tolerances import assert_gradient_close, gradient_tolerance

from fewbit_design.runtime import memory
from fewbit_design.runtime.attention import convert
from fewbit_design.runtime.attention.convert import _attention_core
from fewbit_design.runtime.attention.dropout import draw_seed, dropout_keep

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")

#: the name of the oracle in transformers' AttentionInterface
REFERENCE = "fewbit_test_reference_dropout"
#: the families whose default config has attention dropout, and what convert does with them
DEFAULT_DROPOUT = {"gpt2": "replaced", "bert": "replaced", "t5": "position bias"}
#: families whose every attention call the cores cover (Whisper's and T5's cross-attention do not: other lengths)
COVERED = ("gpt2", "bert", "vit", *DECODERS)


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **_):
    """transformers' ``sdpa`` function with the keep mask the cores draw (one seed per call from torch's generator,
    :func:`dropout_keep`) passed into native SDPA's math path: native attention given the same dropout masks."""
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    mask = attention_mask
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill_(mask.logical_not(), float("-inf"))
    keep = None
    if dropout > 0.0:
        shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        keep = dropout_keep(int(draw_seed(query.device)), shape, dropout, query.device)
    result, _ = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout, is_causal, keep, scale=scaling
    )
    return result.transpose(1, 2).contiguous(), None


def _with_reference(model):
    """``model`` with its attention modules looking up :data:`REFERENCE` (their own config copies)."""
    transformers.AttentionInterface.register(REFERENCE, _reference_attention)
    for module in model.modules():
        if _attention_core(module) is not None:
            module.config = copy.copy(module.config)
            module.config._attn_implementation_internal = REFERENCE
    return model


def _batch(family, batch, padded):
    if padded and "input_ids" in batch:  # left padding: a 4-D boolean mask reaches the cores
        mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
        mask[0, :3] = 0
        return {**batch, "attention_mask": mask}
    return batch


def _step(model, batch, seed=3):
    """(loss, {parameter name: gradient}) of one training step from ``torch.manual_seed(seed)``; the loss weighs the
    output with fixed random weights (the mean square of a normalised output has no gradient to speak of)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    result = output(model, batch).float()
    weights = torch.randn(result.shape, generator=torch.Generator().manual_seed(seed))
    loss = (result * weights).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["exact", "compressed"])
@pytest.mark.parametrize("family", [*DEFAULT_DROPOUT, *DECODERS])
def test_families_with_attention_dropout_are_converted_or_say_why(family, mode):
    """GPT-2, BERT and T5 ship with attention dropout 0.1, the decoders take ``attention_dropout``: GPT-2's and BERT's
    attention and every decoder's are converted (GPT-2's keeps v in the exact mode: its Conv1D is no value
    projection); T5's attention takes a learned position bias with a gradient, left alone with that reason."""
    model, _ = build(family, dropout=0.1)
    convert(model, mode=mode)
    report = model.attention_report
    if DEFAULT_DROPOUT.get(family, "replaced") == "replaced":
        assert report.replaced and not report.skipped, str(report)
        assert bool(report.keeps_v) == (family == "gpt2" and mode == "exact"), str(report)
    else:
        assert not report.replaced and all("position bias" in reason for *_, reason in report.skipped), str(report)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("mode", ["exact", "compressed"])
@pytest.mark.parametrize("family", COVERED)
def test_training_step_equals_native_given_the_same_masks(family, mode, padded):
    """With attention dropout 0.1 (hidden dropout too, where the family has it): one training step of the converted
    model against native attention with the same keep masks (SDPA's math path, what native runs with dropout, given
    the masks the cores draw) and the same hidden dropout masks (the same draws from torch's generator). Exact mode:
    loss and gradients within tests/tolerances.py's float32 tolerance (sums over the batch's tokens in another order);
    compressed (8-bit q, k, v): relative L2 error per parameter under 2%, as without dropout."""
    native, batch = build(family, kv_heads=1, dropout=0.1)
    batch = _batch(family, batch, padded)
    converted = convert(copy.deepcopy(native), mode=mode)
    assert converted.attention_report.replaced
    loss, grads = _step(_with_reference(native.train()), batch)
    got_loss, got_grads = _step(converted.train(), batch)
    assert got_grads.keys() == grads.keys()
    tolerance = gradient_tolerance(torch.float32, BATCH * TOKENS)
    if mode == "exact":
        assert_gradient_close(loss, got_loss, tolerance, "loss")
    largest = max(float(grad.abs().max()) for grad in grads.values())
    for name, grad in grads.items():
        if float(grad.abs().max()) < 1e-6 * largest:
            # no gradient in exact arithmetic (a key bias: softmax ignores a shift of a row), rounding noise both ways
            assert float(got_grads[name].abs().max()) < 1e-5 * largest, name
        elif mode == "exact":
            assert_gradient_close(grad, got_grads[name], tolerance, name)
        else:
            error = float((got_grads[name] - grad).norm() / grad.norm().clamp_min(1e-30))
            assert error < 0.02, (name, error)


def _saved_bytes(family, kv_heads, mode, padded, dropout, use_cache):
    model, batch = build(family, layers=2, heads=4, kv_heads=kv_heads, dropout=dropout)
    model.config.use_cache = use_cache
    convert(model.train(), mode=mode)
    with memory.saved_bytes(model) as saved:
        output(model, _batch(family, batch, padded))
    config = model.config
    return saved.total, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("mode, use_cache", [("exact", False), ("exact", True), ("compressed", True)])
@pytest.mark.parametrize("family", DECODERS)
def test_key_value_heads_are_kept_unrepeated(family, mode, use_cache, padded, dropout):
    """Grouped-query attention, 4 query heads on 2 key/value heads against 4: what a 2-layer model keeps is smaller by
    exactly the key/value tensors of the 2 heads fewer, so they are kept at their key/value heads, with a mask (where
    transformers' sdpa function repeats k and v to 4 heads and native keeps the repeated copies: the same bytes both
    ways) and without. Exact mode keeps k and rebuilds v (with ``use_cache`` the cache's copies of k and v are kept,
    unrepeated); compressed mode keeps 8-bit codes of k and v and a float32 (low, step) per row of D <= 64."""
    grouped, dim = _saved_bytes(family, 2, mode, padded, dropout, use_cache)
    full, _ = _saved_bytes(family, 4, mode, padded, dropout, use_cache)
    rows, layers, fewer = BATCH * TOKENS, 2, 2
    per_head = {"exact": rows * dim * 4 * (2 if use_cache else 1), "compressed": 2 * rows * (dim + 8)}[mode]
    assert full - grouped == layers * fewer * per_head


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["exact", "compressed"])
@pytest.mark.parametrize("family, window", [("gpt2", None), ("bert", None), ("llama", None), ("mistral", 4)])
def test_one_mask_is_kept_for_all_layers(family, window, mode, dropout):
    """Padding masks (GPT-2, BERT; causal with padding: LLaMA) and Mistral's sliding window (4 tokens of 8): the
    model makes one boolean mask and hands it to every layer; in 2 layers every saved tensor of size S x S is that one
    storage (native keeps a float copy per layer, and with dropout the probabilities and the keep mask besides)."""
    model, batch = build(family, layers=2, kv_heads=1, dropout=dropout)
    if window is not None:
        model.config.sliding_window = window
    convert(model.train(), mode=mode)
    storages = set()

    def pack(tensor):
        if tensor.shape[-2:] == (TOKENS, TOKENS):
            storages.add(tensor.untyped_storage()._cdata)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output(model, _batch(family, batch, padded=True))
    assert len(storages) == 1


def _block_bytes(model, family, compile_it):
    """Bytes the first block saves in a training step on random hidden states, eager or compiled."""
    block = model.transformer.h[0] if family == "gpt2" else model.model.layers[0]
    hidden = torch.randn(BATCH, TOKENS, 32, generator=torch.Generator().manual_seed(2), requires_grad=True) * 1.0
    kwargs = {}
    if family != "gpt2":
        kwargs = {"position_embeddings": model.model.rotary_emb(hidden, torch.arange(TOKENS)[None])}
    forward = block
    if compile_it:
        torch._dynamo.reset()
        forward = torch.compile(block, backend="aot_eager_decomp_partition")
    for _ in range(2):  # the first call compiles
        with memory.saved_bytes(block) as saved:
            out = forward(hidden, **kwargs)
        grads = torch.autograd.grad((out[0] if isinstance(out, tuple) else out).square().mean(), hidden)
        assert torch.isfinite(grads[0]).all()
    torch._dynamo.reset()
    return saved.total


@pytest.mark.parametrize("mode", ["exact", "compressed"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_block_keeps_at_most_what_it_keeps_in_eager(family, mode):
    """With attention dropout (GPT-2's, LLaMA's ``attention_dropout`` with grouped key/value heads) a converted block
    compiled (inductor's decompositions and partitioner) trains and keeps at most what it keeps in eager: the cores
    are opaque custom ops that save what they save in eager, the seed drawn in the graph."""
    model, _ = build(family, kv_heads=1, dropout=0.1)
    convert(model.train(), mode=mode)
    assert _block_bytes(model, family, True) <= _block_bytes(model, family, False)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_exact_mode_leaves_dropout_to_a_fused_native_kernel(family, monkeypatch):
    """Where native SDPA with dropout runs a fused kernel (CUDA: flash or memory-efficient attention, which keep no
    sequence x sequence tensor either and draw the mask again in backward), the exact core leaves the call to it: no
    dropout core runs and the step is native's, bit for bit (same seed, same draws). On CPU native runs its math
    path, so the core runs. CUDA's choice is stood in for by fake_mode(kernels="cuda")'s answer on CPU here."""
    import importlib

    from fewbit_design.runtime.attention import ops
    from fewbit_design.runtime.fake import fake_mode

    convert_module = importlib.import_module("fewbit_design.runtime.attention.convert")  # (the package has convert)
    calls = []
    original = convert_module.dropout_attention
    monkeypatch.setattr(convert_module, "dropout_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    native, batch = build(family, dropout=0.1)
    converted = convert(copy.deepcopy(native), mode="exact")
    assert converted.attention_report.replaced
    output(converted.train(), batch)
    assert calls, "on CPU the dropout core runs (native's math path keeps S x S)"
    calls.clear()
    monkeypatch.setattr(convert_module, "native_keeps_probabilities", lambda *args: False)
    torch.manual_seed(3)
    expected = output(native.train(), batch)
    torch.manual_seed(3)
    got = output(converted.train(), batch)
    assert not calls and torch.equal(got, expected)
    with fake_mode(kernels="cuda"):
        q = torch.randn(1, 2, 8, 4)
        assert not ops.native_keeps_probabilities(q, q, q, None, 0.1, None, True, False)
    assert ops.native_keeps_probabilities(q, q, q, None, 0.1, None, True, False)  # a real CPU tensor
