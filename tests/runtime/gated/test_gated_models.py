"""gated.convert on tiny Hugging Face models (LLaMA, Mistral, Qwen2, Gemma, Phi-3, T5 v1.1): one training step
gives native's loss and gradients, and the bytes saved for backward drop by exactly what the op no longer keeps."""

import copy

import pytest
import torch

from fewbit_design.runtime import memory
from fewbit_design.runtime.gated import GatedMLP, convert

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")

HIDDEN, WIDTH, LAYERS, BATCH, LENGTH = 32, 64, 2, 2, 12
TOKENS = BATCH * LENGTH

# float32: the op runs torch's own kernels in native's order, so the LLaMA family comes out bitwise equal; T5's
# gelu_new writes the tanh formula out in Python where the op calls torch's gelu(approximate='tanh'), a few float32
# roundings apart (measured 5e-8 on the gradients). 1e-5 relative is far above both and far below any real change.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def build(kind, dropout=0.0, layers=LAYERS):
    torch.manual_seed(0)
    t = transformers
    common = dict(
        num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=WIDTH, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**common))
    if kind == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**common))
    if kind == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**common))
    if kind == "gemma":
        return t.GemmaForCausalLM(t.GemmaConfig(**common, head_dim=16))
    if kind == "phi3":
        return t.Phi3ForCausalLM(t.Phi3Config(**common))
    if kind == "t5":
        config = t.T5Config(
            d_model=HIDDEN, d_ff=WIDTH, num_layers=LAYERS // 2, num_decoder_layers=LAYERS // 2, num_heads=2, d_kv=16,
            vocab_size=64, feed_forward_proj="gated-gelu", dropout_rate=dropout, decoder_start_token_id=0,
        )  # fmt: skip
        return t.T5ForConditionalGeneration(config)
    raise AssertionError(kind)


def batch(kind):
    ids = torch.randint(0, 64, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    if kind == "t5":
        inputs["decoder_input_ids"] = ids
    return inputs


def step(model, inputs):
    """(loss, gradients, bytes saved for backward, loss after one SGD step)."""
    with memory.saved_bytes(model) as counted:
        loss = model(**inputs).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with torch.no_grad():
        after = model(**inputs).loss
    return loss.detach(), grads, counted, after


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma", "phi3", "t5"])
def test_converted_model_trains_like_native_and_saves_less(kind):
    native = build(kind)
    converted = convert(copy.deepcopy(native))
    report = converted.gated_report
    assert len(report.replaced) == LAYERS and report.skipped == []
    assert sum(isinstance(m, GatedMLP) for m in converted.modules()) == LAYERS
    inputs = batch(kind)
    loss_native, grads_native, saved_native, after_native = step(native, inputs)
    loss_ours, grads_ours, saved_ours, after_ours = step(converted, inputs)
    torch.testing.assert_close(loss_ours, loss_native, **TOLERANCE)
    for ours, theirs in zip(grads_ours, grads_native, strict=True):
        torch.testing.assert_close(ours, theirs, **TOLERANCE)
    torch.testing.assert_close(after_ours, after_native, **TOLERANCE)
    # per MLP and token, native keeps x, gate, act(gate), up and the product, the op x, gate and up: act(gate) and
    # the product (2 x WIDTH float32) are what it frees. T5's gelu_new is the tanh formula in Python, whose autograd
    # also keeps tanh(.), 1 + tanh(.) and 0.5 * gate: 5 x WIDTH freed. T5's encoder and decoder each see TOKENS tokens.
    freed = 5 if kind == "t5" else 2
    assert saved_native.total - saved_ours.total == LAYERS * TOKENS * freed * WIDTH * 4
    mlps = [name for name, m in converted.named_modules() if isinstance(m, GatedMLP)]
    assert mlps and all(saved_ours.by_module[name] == TOKENS * (HIDDEN + 2 * WIDTH) * 4 for name in mlps)


def test_t5_with_dropout_is_left_alone_with_the_reason():
    model = build("t5", dropout=0.1)
    with pytest.warns(UserWarning, match="nothing replaced"):
        convert(model)
    reasons = {item.reason for item in model.gated_report.skipped}
    assert reasons == {"dropout 'dropout' (p=0.1) between the product and 'wo': the op has no dropout"}


def test_compiled_converted_llama_gives_native_gradients():
    native = build("llama", layers=1)  # dynamo traces every layer: one keeps the test fast
    converted = convert(copy.deepcopy(native))
    compiled = torch.compile(converted, backend="aot_eager")
    inputs = batch("llama")
    native(**inputs).loss.backward()
    compiled(**inputs).loss.backward()
    for ours, theirs in zip(converted.parameters(), native.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, **TOLERANCE)
