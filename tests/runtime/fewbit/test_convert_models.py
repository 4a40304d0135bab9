"""convert on real model structures: Hugging Face models from tiny configs, the report, strict mode, sharing, and
no conversion that costs memory (ResNet).

Tables: hand-made level-set tables (conftest ``make_table``) in a temporary shipped-table folder, so the tests do not
depend on which tables are shipped (gelu with approximate='tanh' among them).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types

import pytest
import torch

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime import nn as fnn
from fewbit_design.runtime.fewbit.convert import convert as fewbit_convert

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")

SPECS = [("gelu", {}), ("gelu", {"approximate": "tanh"}), ("silu", {}), ("relu", {}), ("tanh", {}), ("mish", {})]


@pytest.fixture
def model_tables(tmp_path, monkeypatch, make_table):
    """A shipped-table folder with 3-bit uniform tables for the activations of the models below."""
    entries = []
    for name, params in SPECS:
        table = make_table(name, 3, params)
        file = f"{name}-{len(entries)}.json"
        table.save(tmp_path / file)
        entries.append(
            {"file": file, "activation": name, "params": table.params, "bits": 3, "mode": "levelsets",
             "symmetric": False, "weight": "uniform", "error": 0.0}
        )  # fmt: skip
    (tmp_path / "index.json").write_text(json.dumps({"format": "fewbit-index/1", "tables": entries}))
    monkeypatch.setenv("FEWBIT_TABLES_DIR", str(tmp_path))
    return tmp_path


def build(kind: str) -> tuple[torch.nn.Module, dict]:
    """A tiny model from a transformers config and an input for it (seeded)."""
    torch.manual_seed(0)
    t = transformers
    tokens = {"input_ids": torch.randint(0, 64, (2, 12))}
    pixels = {"pixel_values": torch.randn(2, 3, 32, 32)}
    if kind.startswith("gpt2"):
        activation = "gelu" if kind == "gpt2-gelu" else "gelu_new"
        config = t.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        config.activation_function = activation
        return t.GPT2LMHeadModel(config), tokens
    if kind == "llama":
        config = t.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=64,
        )  # fmt: skip
        return t.LlamaForCausalLM(config), tokens
    if kind == "bert":
        config = t.BertConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=64
        )
        return t.BertModel(config), tokens
    if kind == "vit":
        config = t.ViTConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
        return t.ViTModel(config), pixels
    if kind == "convnext":
        return t.ConvNextModel(t.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)), pixels
    if kind == "resnet":
        config = t.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
        return t.ResNetModel(config), pixels
    raise AssertionError(kind)


def _activation_modules(model):
    """Activation modules of the model that are not (inside) a few-bit module."""
    known = tuple(cls for cls in vars(transformers.activations).values() if isinstance(cls, type))
    wrapped = {f"{name}.fn" for name, module in model.named_modules() if isinstance(module, runtime.FewBit)}
    return {
        name: module
        for name, module in model.named_modules()
        if type(module).__module__ in ("transformers.activations", "torch.nn.modules.activation")
        and isinstance(module, known + (torch.nn.Tanh, torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU))
        and name not in wrapped
    }


def _output(model, inputs):
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("kind", ["gpt2-gelu_new", "gpt2-gelu", "llama", "bert", "vit", "convnext"])
def test_convert_replaces_every_activation_of_hugging_face_models_bitwise(kind, model_tables):
    model, inputs = build(kind)
    model.eval()  # no dropout; parameters still require grad, so the few-bit path runs
    activations = _activation_modules(model)
    assert activations, "the model has activation modules"
    expected = _output(model, inputs)
    # the few-bit converter alone: runtime.convert gives LLaMA's MLP (and its SiLU) to the gated op (test_convert.py)
    converted = fewbit_convert(model)
    report = converted.fewbit_report
    assert converted is model
    assert not _activation_modules(model)
    replaced_names = {name for item in report.replaced for name in item.names}
    assert replaced_names == set(activations)
    assert not report.skipped
    assert all(item.bits == 3 for item in report.replaced)
    torch.testing.assert_close(_output(model, inputs), expected, rtol=0, atol=0)
    _output(model, inputs).sum().backward()  # the backward runs through the codes


def test_gpt2_gelu_new_uses_the_tanh_table_and_saves_half_the_bytes(model_tables):
    model, inputs = build("gpt2-gelu_new")
    with memory.saved_bytes(model) as native:
        _output(model, inputs)
    report = runtime.convert(model).fewbit_report
    assert {item.activation for item in report.replaced} == {"gelu(approximate='tanh')"}
    assert report.by_class() == {"transformers.activations.NewGELUActivation": 2}
    assert "2 x transformers.activations.NewGELUActivation -> FewBit" in str(report)
    with memory.saved_bytes(model) as converted:
        _output(model, inputs)
    assert converted.total < 0.8 * native.total


def test_convert_logs_its_summary(model_tables, caplog):
    model, _ = build("llama")
    with caplog.at_level(logging.INFO, logger="fewbit_design"):
        fewbit_convert(model)
    assert "2 x transformers.activations.SiLUActivation -> FewBit (silu, 3 bits)" in caplog.text


def test_unsupported_activation_is_reported_and_strict_raises(model_tables):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.PReLU(), torch.nn.Linear(4, 4), torch.nn.GELU())
    report = runtime.convert(model).fewbit_report
    assert isinstance(model[3], fnn.GELU) and isinstance(model[1], torch.nn.PReLU)
    assert report.skipped[0].names == ("1",) and "trainable slope" in report.skipped[0].reason
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.PReLU(), torch.nn.GELU())
    with pytest.raises(FewBitError, match=r"strict=True.*'1'.*PReLU.*trainable slope"):
        runtime.convert(model, strict=True)
    assert isinstance(model[2], torch.nn.GELU)  # strict checks before it changes anything
    clipped = torch.nn.Sequential(transformers.activations.ClippedGELUActivation(-10, 10))
    with pytest.raises(FewBitError, match="ClippedGELUActivation"):
        runtime.convert(clipped, strict=True)


def test_a_model_with_nothing_to_convert_warns(model_tables):
    with pytest.warns(UserWarning, match="nothing replaced in Sequential"):
        runtime.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.warns(UserWarning, match="PReLU has a trainable slope"):
        runtime.convert(torch.nn.Sequential(torch.nn.PReLU()))


# ------------------------------------------------------------------------------------------------- sharing (16.4)


class TwoUses(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1, self.fc2, self.act = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.act(x))))


def test_a_shared_activation_becomes_one_shared_replacement(model_tables):
    shared = torch.nn.GELU()
    model = torch.nn.Sequential(TwoUses(shared), torch.nn.Linear(4, 4), shared)
    model.alias = model[0]  # one module under two names
    report = runtime.convert(model).fewbit_report
    assert isinstance(model[2], fnn.GELU) and model[0].act is model[2]
    assert model.alias is model[0]
    # every name it has is listed, the one under the alias included
    assert len(report.replaced) == 1 and report.replaced[0].names == ("0.act", "2", "alias.act")
    assert len({id(module) for module in model.modules() if isinstance(module, fnn.GELU)}) == 1
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()


def test_a_shared_library_activation_is_wrapped_once(model_tables):
    shared = transformers.activations.NewGELUActivation()
    model = torch.nn.ModuleDict({"a": torch.nn.Sequential(torch.nn.Linear(4, 4), shared), "b": shared})
    runtime.convert(model)
    assert isinstance(model["a"][1], runtime.FewBit) and model["b"] is model["a"][1]
    assert model["b"].fn is shared


# ------------------------------------------------------------------------------------------- libraries not imported


def test_convert_does_not_import_model_libraries():
    code = (
        "import sys, torch; from fewbit_design import runtime; from fewbit_design.runtime.fewbit import convert\n"
        "convert.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)), only_if_smaller=False)\n"
        "print(sorted(m for m in ('transformers', 'timm') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.fixture
def fake_timm(monkeypatch):
    """timm's activation module, as far as convert looks at it (the timm wheel may not import beside CPU torch):
    classes of the same names in a module registered as ``timm.layers.activations``."""
    module = types.ModuleType("timm.layers.activations")

    class GELUTanh(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(x, approximate="tanh")

    class Swish(torch.nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x)

    GELUTanh.__module__ = Swish.__module__ = module.__name__
    module.GELUTanh, module.Swish = GELUTanh, Swish
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_timm_classes_are_recognised_when_timm_is_imported(fake_timm, model_tables):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), fake_timm.GELUTanh(), torch.nn.Linear(4, 4), fake_timm.Swish())
    x = torch.randn(3, 4, requires_grad=True)
    expected = model(x)
    report = runtime.convert(model).fewbit_report
    assert [item.activation for item in report.replaced] == ["gelu(approximate='tanh')", "silu"]
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_real_timm_activations_when_timm_imports(model_tables):
    timm_activations = pytest.importorskip("timm.layers.activations", reason="timm does not import here")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), timm_activations.GELUTanh(), timm_activations.Swish())
    x = torch.randn(3, 4, requires_grad=True)
    expected = model(x)
    report = runtime.convert(model).fewbit_report
    assert len(report.replaced) == 2
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


# --------------------------------------------------------------------------------------- no conversion costs memory


class BasicBlock(torch.nn.Module):
    """torchvision's ResNet basic block (torch only)."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.relu = torch.nn.ReLU(inplace=True)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


def torch_resnet():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(inplace=True),
        torch.nn.MaxPool2d(2),
        BasicBlock(8),
        BasicBlock(8),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    )


def _saved(model, inputs):
    with memory.saved_bytes(model) as measured:
        model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return measured.total


@pytest.mark.parametrize("kind", ["hugging-face", "torch"])
def test_default_conversion_never_increases_saved_bytes_on_resnet(kind, model_tables):
    model, inputs = build("resnet") if kind == "hugging-face" else (torch_resnet(), torch.randn(2, 3, 16, 16))
    native = _saved(model, inputs)
    with pytest.warns(UserWarning, match="nothing replaced"):
        report = runtime.convert(model).fewbit_report
    assert _saved(model, inputs) <= native
    assert report.skipped and all("saves only its output" in item.reason for item in report.skipped)
    if kind == "hugging-face":
        forced, _ = build("resnet")
        runtime.convert(forced, only_if_smaller=False)
        assert _saved(forced, inputs) > native  # what the rule avoids: the codes on top of the saved outputs
    else:  # measured: the last ReLU feeds only the average pooling (which saves no input), so replacing it pays
        measured = runtime.convert(torch_resnet(), example_inputs=inputs)
        assert _saved(measured, inputs) < native
        assert [type(module) for module in measured.modules()].count(fnn.ReLU) == 1


def test_measured_decision_keeps_only_replacements_that_reduce_bytes(model_tables):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 1),
        torch.nn.GELU(), torch.nn.Conv2d(8, 4, 1),
    )  # fmt: skip
    x = torch.randn(2, 3, 8, 8)
    native = _saved(model, x)
    mean = model[1].running_mean.clone()
    report = runtime.convert(model, example_inputs=x).fewbit_report
    assert isinstance(model[2], torch.nn.ReLU) and isinstance(model[4], fnn.GELU)
    assert "measured on the example" in report.skipped[0].reason
    torch.testing.assert_close(model[1].running_mean, mean, rtol=0, atol=0)  # measuring left the statistics alone
    assert report.measured["native"] == native and report.measured["converted"] == _saved(model, x) < native


def test_measured_decision_on_hugging_face_resnet_and_gpt2(model_tables):
    model, inputs = build("resnet")
    native = _saved(model, inputs)
    report = runtime.convert(model, example_inputs=inputs).fewbit_report
    assert _saved(model, inputs) <= native and report.skipped  # the ReLUs before a convolution stay
    model, inputs = build("gpt2-gelu_new")
    report = runtime.convert(model, example_inputs=inputs).fewbit_report
    assert len(report.replaced) == 2 and report.measured["converted"] < report.measured["native"]
