"""dropout.convert and the technique in ``runtime.convert`` and ``plan_memory``: every ``torch.nn.Dropout`` with
p > 0 is replaced (p, inplace and training mode kept), the other dropout forms are left alone with the reason,
converting twice changes nothing; GPT-2 and BERT with dropout 0.1 save fewer bytes, by exactly what the masks no
longer keep, and train with native's losses for the same seed; dropout called functionally is reported; the planner
chooses it; bad input is one FewBitError line."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from families import build, output

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory, registry
from fewbit_design.runtime.dropout.convert import convert
from fewbit_design.runtime.dropout.nn import CompactDropout
from fewbit_design.runtime.dropout.technique import DropoutOptions

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")

#: runtime.convert with every other technique switched off
ONLY_DROPOUT = dict(norms=False, gated=False, attention=False, activations=False)


class SubclassDropout(torch.nn.Dropout):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


class StableDropout(torch.nn.Module):  # named like transformers' SEW-D dropout, another formula
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _zoo() -> torch.nn.Sequential:
    hooked = torch.nn.Dropout(0.2)
    hooked.register_forward_hook(lambda module, inputs, out: None)
    shared = torch.nn.Dropout(0.3, inplace=True)
    frozen = torch.nn.Dropout(0.4).eval()
    modules = [torch.nn.Dropout(0.1), shared, torch.nn.Sequential(shared), frozen, torch.nn.Dropout(0.0), hooked]
    modules += [torch.nn.Dropout2d(0.2), torch.nn.AlphaDropout(0.1), SubclassDropout(0.1), StableDropout()]
    return torch.nn.Sequential(*modules)


def test_convert_replaces_dropout_and_says_why_it_left_the_rest():
    model = convert(_zoo())
    kinds = [type(model[i]) is CompactDropout for i in (0, 1, 3, 4, 5, 6, 7, 8, 9)]
    assert kinds == [True] * 3 + [False] * 6 and type(model[2][0]) is CompactDropout
    assert model[1] is model[2][0] and model[1].inplace and model[1].p == 0.3
    assert model[3].p == 0.4 and not model[3].training and model[0].training
    report = model.dropout_report
    assert [item.names for item in report.replaced] == [("0",), ("1", "2.0"), ("3",)]
    reasons = {item.names[0]: item.reason for item in report.skipped}
    assert reasons == {
        "4": "p = 0 (it draws and keeps nothing)",
        "5": "it carries hooks (the replacement would drop them)",
        "6": "drops whole channels (another mask)",
        "7": "alpha dropout (another formula)",
        "8": "a subclass of torch.nn.Dropout (its forward may differ)",
        "9": "not torch.nn.Dropout (another formula)",
    }
    lines = str(report).splitlines()
    assert lines[0] == "dropout: replaced 3 module(s), left 6 alone; the mask kept as 1 bit per element"
    assert lines[1:4] == [f"  1 x torch.nn.Dropout(p={p}) -> CompactDropout" for p in (0.1, 0.3, 0.4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = convert(model)
    assert again.dropout_report.already == 3 and not again.dropout_report.replaced


def test_a_model_that_is_a_dropout_comes_back_replaced_and_nothing_to_replace_warns():
    replaced = convert(torch.nn.Dropout(0.1), mode="seed")
    assert type(replaced) is CompactDropout and replaced.mode == "seed"
    with pytest.warns(UserWarning, match=r"nothing replaced in Sequential: .*Dropout: p = 0"):
        convert(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))


def test_a_dropout_whose_p_was_set_out_of_range_is_left_alone_with_the_reason():
    model = torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Dropout(0.1))
    model[1].p = 1.5  # torch checks p only when the module is made
    model = convert(model)
    assert type(model[0]) is CompactDropout and type(model[1]) is torch.nn.Dropout
    assert model.dropout_report.skipped[0].reason == "dropout probability p must be in [0, 1], got 1.5"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: convert("model"), "dropout.convert takes a torch.nn.Module, got str"),
        (lambda: convert(torch.nn.Dropout(0.1), mode="byte"), "dropout mode must be 'bits' or 'seed', got 'byte'"),
        (lambda: DropoutOptions(mode="byte"), "dropout_mode must be 'bits' or 'seed', got 'byte'"),
        (lambda: CompactDropout(-1.0), "dropout probability p must be a number >= 0, got -1.0"),
        (lambda: runtime.convert(torch.nn.Dropout(0.1), dropout="yes"), "dropout must be true or false, got 'yes'"),
    ],
)
def test_bad_input_is_one_error_line(call, message):
    with pytest.raises(FewBitError, match=message):
        call()


def _dropout_calls(model: torch.nn.Module) -> list[int]:
    """Hooks on every CompactDropout that record the size of each input it drops from."""
    sizes: list[int] = []
    for module in model.modules():
        if isinstance(module, CompactDropout):
            module.register_forward_hook(lambda module, inputs, out: sizes.append(inputs[0].numel()))
    return sizes


def _train(model: torch.nn.Module, inputs: dict, steps: int = 3) -> tuple[list[torch.Tensor], list[int]]:
    """The losses of ``steps`` SGD steps, each from its own seed, and the bytes each step saved for backward."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, saved = [], []
    for index in range(steps):
        torch.manual_seed(100 + index)
        with memory.saved_bytes(model) as counted:
            loss = output(model, inputs).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        saved.append(counted.total)
    return losses, saved


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_converted_model_trains_with_natives_losses_and_keeps_bits(family):
    native, inputs = build(family, dropout=0.1)
    converted = runtime.convert(build(family, dropout=0.1)[0], **ONLY_DROPOUT)
    dropouts = [m for m in native.modules() if type(m) is torch.nn.Dropout]
    assert len(dropouts) >= 3 and all(m.p == 0.1 for m in dropouts)
    assert sum(type(m) is CompactDropout for m in converted.modules()) == len(dropouts)
    assert not any(type(m) is torch.nn.Dropout for m in converted.modules())
    sizes = _dropout_calls(converted)
    losses, saved = _train(converted, inputs)
    native_losses, native_saved = _train(native, inputs)
    assert all(torch.equal(a, b) for a, b in zip(losses, native_losses, strict=True)), (losses, native_losses)
    # native CPU dropout keeps its float32 noise (4 bytes an element), the converted one a bit: the difference is that
    per_step = sum(4 * size - math.ceil(size / 8) for size in sizes[: len(sizes) // 3])
    assert per_step > 0 and [n - s for n, s in zip(native_saved, saved, strict=True)] == [per_step] * 3


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_default_convert_runs_it_unconvert_undoes_it_and_the_switch_turns_it_off(family):
    model = runtime.convert(build(family, dropout=0.1)[0])
    entry = model.convert_report.technique("dropout")
    assert entry.status == "applied" and entry.after < entry.before and entry.approximate is None, str(entry)
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())
    assert any(type(m) is torch.nn.Dropout for m in runtime.unconvert(model).modules())
    off = runtime.convert(build(family, dropout=0.1)[0], dropout=False)
    assert off.convert_report.technique("dropout").reason == "switched off (dropout=False)"
    assert not any(isinstance(m, CompactDropout) for m in off.modules())


class FunctionalDropout(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.dropout(self.linear(x), 0.2, self.training)
        return torch.dropout(hidden, 0.0, self.training) + F.dropout(hidden, p=0.1, training=False)


def test_dropout_called_in_forward_code_is_reported_unseen():
    model = torch.nn.Sequential(FunctionalDropout(), torch.nn.Dropout(0.1))
    converted = runtime.convert(model, example_inputs=torch.randn(3, 8), **ONLY_DROPOUT)
    rows = [(u.module, u.module_class, u.function, u.calls) for u in converted.convert_report.unseen]
    # p > 0 twice (training or not: in training the second call draws too), p = 0 not; nothing inside the dropout
    assert rows == [("0", "FunctionalDropout", "torch.nn.functional.dropout", 2)]


def test_eager_attention_dropout_of_gpt2_is_reported_unseen():
    model, inputs = build("gpt2", dropout=0.1)
    model.config._attn_implementation = "eager"  # GPT-2's eager attention calls F.dropout on its probabilities
    converted = runtime.convert(model, example_inputs=inputs, **ONLY_DROPOUT)
    rows = [(u.module, u.module_class, u.function) for u in converted.convert_report.unseen]
    assert rows == [("transformer.h.0.attn", "GPT2Attention", "torch.nn.functional.dropout")]


def chain() -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Dropout(0.1)) for _ in range(3)]
    return torch.nn.Sequential(*blocks)


def test_plan_memory_chooses_it_and_its_plan_file_round_trips(tmp_path):
    assert "dropout" in registry.names() and registry.technique("dropout").exact
    x = torch.randn(64, 64)
    plan = runtime.plan_memory(chain(), x, budget="min", allow=("dropout",), repeats=1)
    # the blocks before the last (the planner measures nothing to gain on the last block and keeps it plain)
    assert plan.choices[:2] == ("dropout", "dropout") and plan.settings["dropout_mode"] == "bits", plan.choices
    assert not plan.approximate_blocks()
    path = tmp_path / "plan.json"
    plan.save(path)
    model = runtime.load_plan(path).apply(chain())
    assert [type(block[2]) is CompactDropout for block in model] == [c == "dropout" for c in plan.choices]


def test_a_model_in_eval_mode_is_measured_as_it_trains_and_keeps_its_mode():
    """from_pretrained gives a model in eval mode, where dropout draws nothing: convert measures one *training*
    step, so the dropout technique is kept (it was undone: 'saves nothing'), and every module's mode is put back."""
    model, _ = build("gpt2", dropout=0.1)
    model.eval()
    converted = runtime.convert(model, activations=False)
    entry = converted.convert_report.technique("dropout")
    assert entry.status == "applied" and entry.after < entry.before, str(entry)
    assert not any(module.training for module in converted.modules())
