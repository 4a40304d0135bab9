"""``runtime.convert`` on what broke it: frozen norm parameters (LoRA / PEFT, frozen LayerNorms), options of the wrong
type, and a model converted twice (one report of what the model holds)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime.fewbit.convert import convert as fewbit_convert
from fewbit_design.runtime.fewbit.nn import FewBitModule
from fewbit_design.runtime.norms import MemorySharingNorm

WIDTH, RANK, ROWS = 16, 2, 6
# float32 through a few layers: a memory-sharing norm's gradients differ from torch's by rounding (~1e-7 relative,
# tests/runtime/norms/test_norms_grads.py) and the layers before it carry that on; 1e-5 of each parameter's largest
# gradient leaves room for that and fails on any real difference (a wrong norm gradient is off by O(1))
TOLERANCE = 1e-5


class LoRALinear(torch.nn.Module):
    """A linear layer with a low-rank adapter beside it: ``base(x) + up(down(x))``, as PEFT's LoRA computes."""

    def __init__(self, features: int, rank: int = RANK) -> None:
        super().__init__()
        self.base = torch.nn.Linear(features, features)
        self.down = torch.nn.Linear(features, rank, bias=False)
        self.up = torch.nn.Linear(rank, features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _inputs() -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))


def _gradients(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return {name: parameter.grad for name, parameter in model.named_parameters()}


def _assert_native_gradients(native: torch.nn.Module, converted: torch.nn.Module) -> None:
    """The converted model's gradients are the native ones (to rounding) where a parameter requires grad, and
    absent where it is frozen."""
    x = _inputs()
    expected, found = _gradients(native, x), _gradients(converted, x)
    assert expected.keys() == found.keys()
    for name, parameter in native.named_parameters():
        if not parameter.requires_grad:
            assert expected[name] is None and found[name] is None, name
            continue
        error = float((expected[name] - found[name]).abs().max())
        assert error <= TOLERANCE * float(expected[name].abs().max()), f"{name}: {error:.3g}"


FREEZE = {
    "whole norm": lambda norm: norm.requires_grad_(False),
    "weight only": lambda norm: norm.weight.requires_grad_(False),
    "bias only": lambda norm: norm.bias.requires_grad_(False),
}


@pytest.mark.parametrize("probe", ["example_inputs", "none"])
@pytest.mark.parametrize("frozen", list(FREEZE))
def test_convert_replaces_a_norm_with_frozen_parameters_and_keeps_native_gradients(frozen, probe):
    torch.manual_seed(0)
    native = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 4))
    FREEZE[frozen](native[1])
    model = copy.deepcopy(native)
    weight, bias = model[1].weight, model[1].bias
    runtime.convert(model, example_inputs=_inputs() if probe == "example_inputs" else None)
    assert isinstance(model[1], MemorySharingNorm), str(model.convert_report)
    assert model[1].weight is weight and model[1].bias is bias  # shared, frozen as they were
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in native.parameters()]
    _assert_native_gradients(native, model)


def test_convert_of_a_model_frozen_but_for_lora_adapters_keeps_their_gradients():
    torch.manual_seed(0)
    native = torch.nn.Sequential(
        LoRALinear(WIDTH), torch.nn.LayerNorm(WIDTH), LoRALinear(WIDTH), torch.nn.RMSNorm(WIDTH),
        torch.nn.Linear(WIDTH, 4),
    )  # fmt: skip
    native.requires_grad_(False)
    for module in native.modules():
        if isinstance(module, LoRALinear):
            module.down.requires_grad_(True)
            module.up.requires_grad_(True)
    model = copy.deepcopy(native)
    runtime.convert(model, example_inputs=_inputs())
    assert isinstance(model[1], MemorySharingNorm) and isinstance(model[3], MemorySharingNorm)
    assert model.convert_report.approximate == {}  # norms alone: exact
    _assert_native_gradients(native, model)


# ----------------------------------------------------------------------------------------------------------------------
# Options of the wrong type


BAD_OPTIONS = [
    pytest.param({"strict": "yes"}, r"strict must be true or false, got 'yes'", id="strict-string"),
    pytest.param({"strict": 1}, r"strict must be true or false, got 1", id="strict-int"),
    pytest.param({"only_if_smaller": None}, r"only_if_smaller must be true or false, got None", id="only-if-none"),
    pytest.param({"bits": 3.0}, r"bits must be an integer from 1 to 8, got 3\.0", id="bits-float"),
    pytest.param({"bits": True}, r"bits must be an integer from 1 to 8, got True", id="bits-bool"),
]


@pytest.mark.parametrize("converter", ["runtime.convert", "fewbit.convert"])
@pytest.mark.parametrize(("kwargs", "message"), BAD_OPTIONS)
def test_convert_options_of_the_wrong_type_raise_one_line_before_anything_changes(converter, kwargs, message):
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.GELU())
    function = runtime.convert if converter == "runtime.convert" else fewbit_convert
    with pytest.raises(FewBitError, match=message) as raised:
        function(model, **kwargs)
    assert "\n" not in str(raised.value)
    assert [type(m) for m in model] == [torch.nn.LayerNorm, torch.nn.Linear, torch.nn.GELU]


def test_an_integer_bits_of_another_integral_type_is_accepted():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    runtime.convert(model, bits=np.int64(2), only_if_smaller=False)
    assert isinstance(model[1], FewBitModule) and model[1].bits == 2


# ----------------------------------------------------------------------------------------------------------------------
# Converting twice: one report of what the model holds


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH)
    )


def test_a_second_convert_merges_the_first_ones_report():
    model = _model()
    runtime.convert(model, activations=False, example_inputs=_inputs())
    first = model.convert_report
    assert first.applied == ("norms",)
    runtime.convert(model, norms=False, example_inputs=_inputs())
    report = model.convert_report
    assert isinstance(model[0], MemorySharingNorm) and isinstance(model[2], FewBitModule)
    assert report.applied == ("norms", "fewbit")  # what the model holds: the first call's norms, the second's few-bit
    assert report.calls == 2 and first.calls == 1  # the first call's report is left as it was
    assert list(report.approximate) == ["fewbit"]
    assert report.earlier == [first.technique("norms")]
    assert report.technique("norms").status == "off"  # the entries are the last call's
    assert report.technique("fewbit").status == "applied"
    text = str(report)
    assert text.startswith("convert: applied fewbit (call 2 on this model; it holds norms, fewbit)")
    assert "applied by the 1 earlier call(s) (still in the model):\n  norms: applied, 1 replacement(s)" in text
    assert "\n    memory-sharing norms: replaced 1 module(s)" in text  # the first call's norms report, indented


def test_a_third_convert_keeps_every_earlier_call_and_their_technique_reports():
    model = _model()
    runtime.convert(model, activations=False, example_inputs=_inputs())
    norms_report = model.norms_report
    runtime.convert(model, norms=False, only_if_smaller=False)
    fewbit_report = model.fewbit_report
    runtime.convert(model)  # finds nothing left to replace
    report = model.convert_report
    assert report.applied == ("norms", "fewbit")
    assert report.calls == 3
    assert [entry.name for entry in report.earlier] == ["norms", "fewbit"]
    assert report.technique("norms").status == "nothing" and report.technique("fewbit").status == "nothing"
    # the techniques' attributes are their last run (replaced nothing); the merged report keeps the runs that did
    assert report.earlier[0].report is norms_report and report.earlier[1].report is fewbit_report
    assert norms_report.replaced == {"0": "LayerNorm as layer_norm"} and len(fewbit_report.replaced) == 1
