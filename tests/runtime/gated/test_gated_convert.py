"""gated.convert: what it finds by structure, what the probe rejects, the report, idempotence, and the registry
contract (technique.py)."""

import copy
import re
import warnings

import pytest
import torch

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime import nn as fewbit_nn
from fewbit_design.runtime.gated import GatedMLP, convert
from fewbit_design.runtime.gated.technique import TECHNIQUE, GatedOptions
from fewbit_design.runtime.registry import Technique


class Gated(torch.nn.Module):
    """A gated MLP in LLaMA's layout; ``swap`` puts the activation on up (not the pattern), ``dropout`` adds one."""

    def __init__(self, act=None, *, swap=False, dropout=None, hidden=8, width=16):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, width, bias=False)
        self.up_proj = torch.nn.Linear(hidden, width, bias=False)
        self.down_proj = torch.nn.Linear(width, hidden, bias=False)
        self.act_fn = act if act is not None else torch.nn.SiLU()
        self.swap = swap
        if dropout is not None:
            self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.swap:
            gate, up = up, gate
        product = self.act_fn(gate) * up
        if hasattr(self, "dropout"):
            product = self.dropout(product)
        return self.down_proj(product)


class Fused(torch.nn.Module):
    """Phi-3's layout: one gate_up projection split in halves."""

    def __init__(self, hidden=8, width=16):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(hidden, 2 * width, bias=False)
        self.down_proj = torch.nn.Linear(width, hidden, bias=False)
        self.activation_fn = torch.nn.GELU(approximate="tanh")

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class T5Like(torch.nn.Module):
    """T5 v1.1's layout (wi_0 gate, wi_1 up, wo down, act, dropout)."""

    def __init__(self, p):
        super().__init__()
        self.wi_0, self.wi_1, self.wo = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.dropout, self.act = torch.nn.Dropout(p), torch.nn.ReLU()

    def forward(self, x):
        return self.wo(self.dropout(self.act(self.wi_0(x)) * self.wi_1(x)))


def model_of(*blocks):
    torch.manual_seed(0)
    return torch.nn.Sequential(*blocks)


def test_replaces_each_layout_keeps_parameters_and_outputs():
    model = model_of(Gated(), Fused(), T5Like(0.0), Gated(torch.nn.GELU()), Gated(torch.nn.ReLU()))
    parameters = dict(model.named_parameters())
    x = torch.randn(3, 8)
    expected = model(x)
    converted = convert(model)
    assert converted is model
    assert [type(block).__name__ for block in model] == ["GatedMLP"] * 5
    assert [block.activation for block in model] == ["silu", "gelu_tanh", "relu", "gelu", "relu"]
    # the same Parameter objects under the same names: optimizers and state_dict keys are unaffected
    assert dict(model.named_parameters()) == parameters
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # torch's own activations: bitwise
    report = model.gated_report
    assert [item.names for item in report.replaced] == [("0",), ("1",), ("2",), ("3",), ("4",)]
    assert [item.fused for item in report.replaced] == [False, True, False, False, False]
    assert report.skipped == []
    assert "1 x test_gated_convert.Fused -> GatedMLP (gelu_tanh, fused gate_up; saves x, gate, up)" in str(report)


def test_converting_twice_changes_nothing():
    model = model_of(Gated(), torch.nn.ReLU())
    convert(model)
    first = model[0]
    convert(model)
    assert model[0] is first
    assert model.gated_report.replaced == [] and model.gated_report.already == 1


def test_a_shared_module_gets_one_replacement_at_every_place():
    shared = Gated()
    model = model_of(shared, torch.nn.Identity(), shared)
    convert(model)
    assert isinstance(model[0], GatedMLP) and model[0] is model[2]
    assert [item.names for item in model.gated_report.replaced] == [("0", "2")]


def test_the_model_itself_is_returned_converted():
    converted = convert(Gated())
    assert isinstance(converted, GatedMLP)
    assert len(converted.gated_report.replaced) == 1


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        (Gated(swap=True), "its forward is not down\\(act\\(gate\\(x\\)\\) \\* up\\(x\\)\\) on a probe"),
        (Gated(dropout=0.1), "dropout 'dropout' \\(p=0.1\\) between the product and 'down_proj'"),
        (T5Like(0.1), "dropout 'dropout' \\(p=0.1\\) between the product and 'wo'"),
        (Gated(torch.nn.Tanh()), "its activation 'act_fn' \\(torch.nn.modules.activation.Tanh\\) is not one"),
        (Gated(torch.nn.PReLU()), "PReLU has a trainable slope"),
        (Gated(fewbit_nn.SiLU(bits=2)), "few-bit already \\(apply the gated op before few-bit activations\\)"),
    ],
)
def test_left_alone_with_the_reason(block, reason):
    model = model_of(block)
    before = copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning, match="gated.convert: nothing replaced"):
        convert(model)
    assert model[0] is block
    (skipped,) = model.gated_report.skipped
    assert skipped.names == ("0",)
    assert re.search(reason, skipped.reason), skipped.reason
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_a_linear_subclass_hooks_and_meta_parameters_are_left_alone():
    class MyLinear(torch.nn.Linear):
        pass

    subclass = Gated()
    subclass.up_proj = MyLinear(8, 16, bias=False)
    hooked = Gated()
    hooked.gate_proj.register_forward_hook(lambda module, inputs, output: output * 2)
    with torch.device("meta"):
        meta = Gated()
    model = model_of(subclass, hooked, meta)
    with pytest.warns(UserWarning):
        convert(model)
    reasons = [item.reason for item in model.gated_report.skipped]
    assert reasons == [
        "'up_proj' is test_gated_convert.test_a_linear_subclass_hooks_and_meta_parameters_are_left_alone.<locals>."
        "MyLinear, not torch.nn.Linear",
        "'gate_proj' has hooks, which the replacement would not run",
        "its parameters are on the meta device (nothing to probe)",
    ]


def test_the_probe_sees_through_a_zero_initialised_down_projection():
    # with down_proj all zero every forward gives 0 and the probe with the module's weights proves nothing: it
    # probes with random weights then, which tells the pattern (replaced) from a look-alike (left alone)
    right, wrong = Gated(), Gated(swap=True)
    for block in (right, wrong):
        torch.nn.init.zeros_(block.down_proj.weight)
    model = model_of(right, wrong)
    convert(model)
    assert isinstance(model[0], GatedMLP) and model[1] is wrong
    assert "not down(act(gate(x)) * up(x)) on a probe" in model.gated_report.skipped[0].reason


def test_convert_takes_a_module():
    with pytest.raises(FewBitError, match="gated.convert takes a torch.nn.Module, got list"):
        convert([Gated()])


def test_technique_contract():
    assert isinstance(TECHNIQUE, Technique)
    assert (TECHNIQUE.name, TECHNIQUE.seam, TECHNIQUE.exact) == ("gated", "module", True)
    assert TECHNIQUE.config({}) == GatedOptions("exact", 8)
    assert TECHNIQUE.config({"gated_mode": "compressed", "gated_bits": 4}) == GatedOptions("compressed", 4)
    with pytest.raises(FewBitError, match="gated_mode must be 'exact', 'compressed' or 'recompute', got 'lossy'"):
        TECHNIQUE.config({"gated_mode": "lossy"})
    with pytest.raises(FewBitError, match="gated_bits must be .*8.*, got 9"):
        TECHNIQUE.config({"gated_mode": "compressed", "gated_bits": 9})
    block = model_of(Gated(), torch.nn.LayerNorm(8))
    assert TECHNIQUE.changes_block(block, GatedOptions("exact", 8)) and isinstance(
        block[0], Gated
    )  # changes_block leaves it
    applied = TECHNIQUE.apply(block, GatedOptions("exact", 8))
    assert applied is block and isinstance(block[0], GatedMLP) and block[0].mode == "exact"
    assert not TECHNIQUE.changes_block(block, GatedOptions("exact", 8))  # idempotent
    compressed = TECHNIQUE.apply(model_of(Gated(), torch.nn.LayerNorm(8)), GatedOptions("compressed", 4))
    assert (compressed[0].mode, compressed[0].bits) == ("compressed", 4)
    plain = model_of(torch.nn.Linear(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to replace: no warning escapes to the planner
        assert TECHNIQUE.apply(plain, GatedOptions("exact", 8)) is plain
    x = torch.randn(4, 8) * 1
    with memory.saved_bytes(block) as counted:
        block(x.requires_grad_() * 1)
    assert counted.by_module["0"] == 4 * (8 + 2 * 16) * 4  # x, gate, up (float32)


class Scaled(Gated):
    """The pattern times a learnable scale that starts at 1: the probe agrees, but the scale would be lost."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return super().forward(x) * self.scale


class WithMask(Gated):
    """The pattern with an optional second argument: the replacement would not take it."""

    def forward(self, x, mask=None):
        y = super().forward(x)
        return y if mask is None else y * mask


def test_own_parameters_and_extra_forward_arguments_are_left_alone():
    model = model_of(Scaled(), WithMask())
    with pytest.warns(UserWarning):
        convert(model)
    assert [type(block) for block in model] == [Scaled, WithMask]
    assert [item.reason for item in model.gated_report.skipped] == [
        "it holds parameters or buffers of its own (scale), outside the pattern",
        "its forward takes more than the input (mask=None), which the replacement would not take",
    ]


def test_forward_without_grad_is_the_training_forward():
    model = convert(model_of(Gated(), Fused()))
    x = torch.randn(5, 8)
    with torch.no_grad():
        inference = model(x)
    training = model(x.requires_grad_())
    assert training.requires_grad and not inference.requires_grad
    torch.testing.assert_close(inference, training.detach(), rtol=0, atol=0)


def test_linear_convert_after_gated_convert_leaves_the_op_s_linears_alone():
    """The gated-MLP op computes with its projections' weights itself: compressing them afterwards (by hand, as
    ``gated.convert`` then ``linear.convert``) leaves them plain and unlisted, compresses the rest, and trains."""
    from fewbit_design.runtime import linear

    model = model_of(Gated(), torch.nn.Linear(8, 8))
    convert(model, mode="compressed", bits=8)
    linear.convert(model, bits=8)
    projections = [model[0].get_submodule(name) for name in ("gate_proj", "up_proj", "down_proj")]
    assert [type(projection) for projection in projections] == [torch.nn.Linear] * 3
    assert type(model[1]).__name__ == "CompressedLinear"
    assert model.linear_report.skipped == [] and len(model.linear_report.replaced) == 1
    model(torch.randn(3, 8)).sum().backward()
    assert model[0].gate_proj.weight.grad is not None
