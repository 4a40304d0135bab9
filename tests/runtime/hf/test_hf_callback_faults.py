"""FewBitCallback at train start on what broke it: a model that is not a Hugging Face model and ``plan`` without a
train dataloader are refused before the model changes, and a model with frozen norms converts."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import structure, tiny_gpt2

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import hf

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")

WIDTH = 16


def _start(callback: hf.FewBitCallback, model: torch.nn.Module, dataloader=None):
    """Train start as the Trainer calls it (state, control, the model and the train dataloader)."""
    state = transformers.TrainerState()
    control = transformers.TrainerControl()
    callback.on_train_begin(None, state, control, model=model, train_dataloader=dataloader)
    return state


def _untouched(model: torch.nn.Module, before: list) -> bool:
    attributes = ("convert_report", "fewbit_memory_plan", "norms_report", "fewbit_report")
    return structure(model) == before and not any(hasattr(model, name) for name in attributes)


def test_the_callback_refuses_a_model_without_a_config_before_converting_or_planning_it():
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
        torch.nn.Linear(4 * WIDTH, WIDTH),
    )  # fmt: skip
    before = structure(model)
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, WIDTH)), batch_size=4)
    callback = hf.FewBitCallback(convert={}, plan={"budget": "min", "allow": ["checkpoint"], "repeats": 1})
    with pytest.raises(FewBitError, match=r"^FewBitCallback: Sequential has no config object .*PreTrainedModel"):
        _start(callback, model, batches)
    assert _untouched(model, before)
    assert callback.report is None


def test_the_callback_refuses_plan_without_a_train_dataloader_before_converting():
    model = tiny_gpt2(transformers)
    before = structure(model)
    callback = hf.FewBitCallback(convert={}, plan={"budget": "min"})
    with pytest.raises(FewBitError, match=r"FewBitCallback\(plan=\.\.\.\): the Trainer passed no train dataloader"):
        _start(callback, model)
    assert _untouched(model, before)
    assert getattr(model.config, "fewbit", None) is None


def test_the_callback_converts_a_model_with_frozen_norms():
    model = tiny_gpt2(transformers)
    frozen = [module for module in model.modules() if isinstance(module, torch.nn.LayerNorm)]
    for module in frozen:
        module.requires_grad_(False)
    state = _start(hf.FewBitCallback(convert={}), model)
    replaced = [module for module in model.modules() if isinstance(module, runtime.MemorySharingNorm)]
    assert len(replaced) == len(frozen) == 5  # ln_1 and ln_2 of both layers, and ln_f
    assert not any(parameter.requires_grad for module in replaced for parameter in module.parameters())
    assert model.config.fewbit["convert"] == {}
    assert state.log_history[0]["fewbit/replaced_modules"] >= len(frozen)
