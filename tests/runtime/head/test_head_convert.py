"""head.convert on tiny Hugging Face causal LMs: with labels the loss goes through the chunked head (equal loss and
gradients, logits None, no logits saved), without labels nothing changes; remove(), idempotence, the technique."""

from __future__ import annotations

import copy

import pytest
import torch

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime.head import convert, remove
from fewbit_design.runtime.head.technique import TECHNIQUE, HeadOptions

transformers = pytest.importorskip("transformers")

VOCAB = 97
# Loss and gradients against the native model: the same float32 computation in another summation order (chunked
# sums of the loss and of grad_weight), so a few float32 ulps of each tensor's largest entry.
RTOL, ATOL = 1e-5, 1e-6


def build(kind: str) -> torch.nn.Module:
    """A tiny causal LM (seeded, eval mode: GPT-2's dropout would draw different masks in the two models)."""
    torch.manual_seed(0)
    t = transformers
    common = dict(vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    decoder = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, **common)  # fmt: skip
    if kind == "gpt2":
        config = t.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                              eos_token_id=0)  # fmt: skip
        model = t.GPT2LMHeadModel(config)
    elif kind == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**decoder))
    elif kind == "mistral":
        model = t.MistralForCausalLM(t.MistralConfig(**decoder))
    elif kind == "qwen2":
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**decoder))
    elif kind == "gemma2":
        model = t.Gemma2ForCausalLM(t.Gemma2Config(head_dim=8, final_logit_softcapping=2.0, **decoder))
    else:
        raise AssertionError(kind)
    model.config.use_cache = False
    return model.eval()


def batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=generator)
    labels = input_ids.clone()
    labels[0, :3] = -100  # a masked prompt
    return input_ids, labels


def _close(actual, expected):
    scale = float(expected.detach().abs().max().clamp_min(1e-30))
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL * scale)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mistral", "qwen2", "gemma2"])
def test_loss_and_gradients_equal_native(kind):
    native = build(kind)
    converted = convert(copy.deepcopy(native), chunk_rows=5)
    input_ids, labels = batch()
    expected = native(input_ids=input_ids, labels=labels)
    output = converted(input_ids=input_ids, labels=labels)
    assert output.logits is None and "logits" not in output.keys()
    _close(output.loss, expected.loss)
    expected.loss.backward()
    output.loss.backward()
    for (name, want), got in zip(native.named_parameters(), converted.parameters(), strict=True):
        assert (got.grad is None) == (want.grad is None), name
        if want.grad is not None:
            _close(got.grad, want.grad)
    report = converted.head_report
    assert (report.vocab_size, report.hidden_size, report.chunk_rows) == (VOCAB, 16, 5)
    assert report.tied == (kind in ("gpt2", "gemma2"))  # their configs tie the head to the input embedding
    assert report.softcap == (2.0 if kind == "gemma2" else None)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_without_labels_nothing_changes(kind):
    native = build(kind)
    converted = convert(copy.deepcopy(native))
    input_ids, _ = batch()
    assert torch.equal(converted(input_ids=input_ids).logits, native(input_ids=input_ids).logits)
    assert torch.equal(converted(input_ids)[0], native(input_ids)[0])


def test_trainer_arguments_num_items_and_tuple_output():
    native = build("llama")
    converted = convert(copy.deepcopy(native), chunk_rows=4)
    input_ids, labels = batch()
    items = torch.tensor(11)
    want = native(input_ids=input_ids, labels=labels, num_items_in_batch=items).loss
    _close(converted(input_ids=input_ids, labels=labels, num_items_in_batch=items).loss, want)
    output = converted(input_ids, None, None, None, None, labels, return_dict=False)  # labels given by position
    assert isinstance(output, tuple) and output[1] is None
    _close(output[0], native(input_ids=input_ids, labels=labels).loss)


def test_no_logits_are_saved_for_backward():
    """Bytes saved by a training step, hand-computed difference: the native loss keeps the float32 log-softmax of
    the (batch x seq) x vocab logits; the chunked one keeps one float32 logsumexp per row instead."""
    native = build("llama")
    converted = convert(copy.deepcopy(native), chunk_rows=4)
    input_ids, labels = batch()
    rows = input_ids.numel()
    with memory.saved_bytes(native) as native_saved:
        native(input_ids=input_ids, labels=labels)
    with memory.saved_bytes(converted) as converted_saved:
        converted(input_ids=input_ids, labels=labels)
    assert native_saved.total - converted_saved.total >= rows * VOCAB * 4 - rows * 4


def test_remove_and_idempotence():
    model = build("gpt2")
    convert(model)
    forward = model.forward
    convert(model)  # converting again changes nothing
    assert model.forward is forward
    assert not TECHNIQUE.changes_block(model, None)
    input_ids, labels = batch()
    assert remove(model) is model
    assert "forward" not in vars(model) and not hasattr(model, "head_report")
    assert model(input_ids=input_ids, labels=labels).logits.shape == (2, 9, VOCAB)


def test_deep_copy_of_a_converted_model_runs_its_own_weights():
    model = convert(build("llama"))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.zero_()
    input_ids, labels = batch()
    # a zero head gives uniform logits: the copy's loss is log(V), the original's is not
    assert abs(twin(input_ids=input_ids, labels=labels).loss.item() - torch.log(torch.tensor(VOCAB)).item()) < 1e-5
    assert abs(model(input_ids=input_ids, labels=labels).loss.item() - torch.log(torch.tensor(VOCAB)).item()) > 1e-3


def test_technique_applies_to_whole_models_and_leaves_the_rest():
    model = build("llama")
    holder = torch.nn.ModuleDict({"lm": model, "other": torch.nn.Linear(3, 3)})
    assert TECHNIQUE.name == "head" and TECHNIQUE.exact and TECHNIQUE.seam == "module"
    config = TECHNIQUE.config({"head_chunk_rows": 6})
    assert config == HeadOptions(6) and TECHNIQUE.config({}) == HeadOptions()
    assert not TECHNIQUE.changes_block(model.model.layers[0], config)  # a block without the head
    assert TECHNIQUE.changes_block(holder, config)
    assert TECHNIQUE.apply(holder, config) is holder
    assert model.head_report.chunk_rows == 6
    block = model.model.layers[0]
    assert TECHNIQUE.apply(block, config) is block and "forward" not in vars(block)


def test_convert_refuses_what_it_cannot_handle():
    with pytest.raises(FewBitError, match="Linear holds no Hugging Face causal LM"):
        convert(torch.nn.Linear(3, 3))
    with pytest.raises(FewBitError, match="chunk_rows must be an integer >= 1, got 0"):
        convert(build("llama"), chunk_rows=0)

    class DoubledForCausalLM(transformers.LlamaForCausalLM):  # changes its logits after the head in an unknown way
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output["logits"] = output.logits * 2
            return output

    torch.manual_seed(0)
    doubled = DoubledForCausalLM(build("llama").config)
    with pytest.raises(FewBitError, match="DoubledForCausalLM changes its logits after the output embedding"):
        convert(doubled)
    assert "forward" not in vars(doubled)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_compiled_converted_model_equals_native_and_does_not_recompile(kind):
    """Regression: under torch.compile the converted forward failed ('Linear' object has no attribute 'forward':
    dynamo replayed the head's forward swap wrongly). Loss and gradients equal native's (compiled with inductor's
    decompositions and partitioner), no logits, and later steps run the graphs of the first."""
    from torch._dynamo.utils import counters

    native = build(kind)
    converted = convert(copy.deepcopy(native), chunk_rows=5)
    compiled = torch.compile(converted, backend="aot_eager_decomp_partition")
    input_ids, labels = batch()
    expected = native(input_ids=input_ids, labels=labels)
    expected.loss.backward()
    torch._dynamo.reset()
    counters.clear()
    for step in range(3):
        converted.zero_grad(set_to_none=True)
        output = compiled(input_ids=input_ids, labels=labels)
        output.loss.backward()
        if step == 0:
            frames = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == frames  # steps 2 and 3 compiled nothing new
    assert output.logits is None
    _close(output.loss, expected.loss)
    for want, got in zip(native.parameters(), converted.parameters(), strict=True):
        if want.grad is not None:
            _close(got.grad, want.grad)
