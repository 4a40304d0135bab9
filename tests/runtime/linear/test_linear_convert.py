"""runtime.linear.convert and its TECHNIQUE: in place, same parameters and state-dict keys, idempotent, the report,
bad arguments; tiny GPT-2 (Conv1D) and LLaMA (Linear) converted: forward bitwise, fewer saved bytes, a train step."""

from __future__ import annotations

import copy

import pytest
import torch

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime.linear import CompressedConv1D, CompressedLinear, convert
from fewbit_design.runtime.linear.technique import TECHNIQUE, LinearOptions

transformers = pytest.importorskip("transformers")


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 8, bias=False))


def test_convert_keeps_parameters_names_and_outputs():
    model = mlp()
    native = copy.deepcopy(model)
    parameters = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert convert(model, bits=4) is model
    assert dict(native.named_parameters()).keys() == parameters.keys()
    assert [type(m) for m in model] == [CompressedLinear, torch.nn.GELU, CompressedLinear]
    assert dict(model.named_parameters()) == parameters  # the very same Parameter objects
    assert list(model.state_dict()) == keys
    model.load_state_dict(native.state_dict())
    x = torch.randn(5, 64)
    assert torch.equal(model(x), native(x))
    assert [(name, original) for name, original in model.linear_report.replaced] == [("0", "Linear"), ("2", "Linear")]
    assert "compressed 2 linear layer(s) (4 bits" in str(model.linear_report)


def test_converting_twice_changes_nothing():
    model = convert(mlp(), bits=4)
    before = [(type(m), getattr(m, "bits", None)) for m in model.modules()]
    convert(model, bits=8)
    assert [(type(m), getattr(m, "bits", None)) for m in model.modules()] == before
    assert model.linear_report.already == 2 and not model.linear_report.replaced


def test_a_shared_layer_is_converted_once_and_tied_weights_stay_tied():
    shared = torch.nn.Linear(16, 16)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    convert(model)
    assert model[0] is model[2] and isinstance(model[0], CompressedLinear) and model[0].weight is shared.weight
    assert len(model.linear_report.replaced) == 1


def test_subclasses_are_left_alone_with_a_reason_and_filter_selects():
    attention = torch.nn.MultiheadAttention(16, 2)
    model = torch.nn.ModuleDict({"attention": attention, "head": torch.nn.Linear(16, 4), "out": torch.nn.Linear(4, 2)})
    convert(model, filter=lambda name, module: name != "out")
    assert type(attention.out_proj) is torch.nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(model["head"], CompressedLinear) and type(model["out"]) is torch.nn.Linear
    assert "subclass of nn.Linear" in str(model.linear_report)


def test_a_single_layer_is_converted_and_returned():
    layer = torch.nn.Linear(8, 8)
    converted = convert(layer, bits=2)
    assert isinstance(converted, CompressedLinear) and converted.bits == 2 and type(layer) is torch.nn.Linear
    assert converted.weight is layer.weight and converted.bias is layer.bias
    assert str(converted.linear_report).startswith("compressed 1 linear layer(s)")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 1}, "bits"),
        ({"bits": 16}, "bits"),
        ({"group_size": -4}, "group_size"),
        ({"rounding": "round"}, "rounding"),
        ({"filter": "linear"}, "filter"),
    ],
)
def test_bad_arguments_raise_one_line(kwargs, message):
    with pytest.raises(FewBitError, match=message):
        convert(mlp(), **kwargs)


def test_technique_contract():
    assert (TECHNIQUE.name, TECHNIQUE.seam, TECHNIQUE.exact) == ("linear", "module", False)
    assert TECHNIQUE.config({}) == LinearOptions(8) and TECHNIQUE.config({"linear_bits": 4}) == LinearOptions(4)
    block = mlp()
    assert (
        TECHNIQUE.changes_block(block, LinearOptions(4)) and type(block[0]) is torch.nn.Linear
    )  # changes_block works on a copy
    assert TECHNIQUE.apply(block, LinearOptions(4)) is block and block[0].bits == 4
    assert not TECHNIQUE.changes_block(block, LinearOptions(4))  # idempotent
    assert not TECHNIQUE.changes_block(torch.nn.GELU(), LinearOptions(4))  # nothing it can handle: untouched
    layer = torch.nn.Linear(4, 4)
    applied = TECHNIQUE.apply(layer, LinearOptions(8))
    assert isinstance(applied, CompressedLinear) and applied.weight is layer.weight


# ----------------------------------------------------------------------------------------------------------------------
# Tiny Hugging Face models


def build(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=32)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def saved(model, tokens):
    with memory.saved_bytes(model) as measured:
        model(input_ids=tokens).logits.sum().backward()
    model.zero_grad(set_to_none=True)
    return measured.total


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tiny_transformers_convert_save_less_and_train_a_step(kind):
    native = build(kind).train()
    native.config.attn_pdrop = native.config.resid_pdrop = native.config.embd_pdrop = 0.0
    for module in native.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model = convert(copy.deepcopy(native), bits=8)
    kinds = {type(m) for m in model.modules()}
    assert (CompressedConv1D if kind == "gpt2" else CompressedLinear) in kinds
    assert (transformers.pytorch_utils.Conv1D if kind == "gpt2" else torch.nn.Linear) not in kinds
    tokens = torch.randint(0, 64, (2, 16))
    assert torch.equal(model(input_ids=tokens).logits, native(input_ids=tokens).logits)
    assert saved(model, tokens) < saved(native, tokens)
    # one step: same loss (exact forward), weight gradients close to native (8 bits: well under 5% relative in the
    # norm; the step bound is tested per layer in test_linear_layers), a finite update
    losses = []
    for net in (native, model):
        loss = net(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, ours), theirs in zip(model.named_parameters(), native.parameters(), strict=True):
        relative = (ours.grad - theirs.grad).norm() / theirs.grad.norm().clamp_min(1e-12)
        assert float(relative) < 0.05, name
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert float(model(input_ids=tokens, labels=tokens).loss.detach()) < float(losses[1])
