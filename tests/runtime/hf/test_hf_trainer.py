"""FewBitCallback: a Hugging Face Trainer converts and plans at train start, logs the memory
report, trains, and the saved model restores its conversion after from_pretrained."""

from __future__ import annotations

import logging

import pytest
import torch
from hf_tiny import TokenDataset, loss_and_gradients, structure, tiny_gpt2, tokens

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import hf
from fewbit_design.runtime.fewbit.nn import FewBitModule

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")
pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it; the 'models' extra)")


def test_the_callback_converts_plans_logs_and_trains_a_tiny_gpt2_and_the_saved_model_restores(tmp_path, caplog):
    model = tiny_gpt2(transformers)
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    callback = hf.FewBitCallback(convert={"bits": 2}, plan={"budget": "min", "allow": ["checkpoint"], "repeats": 1})
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=TokenDataset(), callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="fewbit_design.runtime.hf"):
        trainer.train()

    assert trainer.state.global_step == 3
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())  # the optimizer trained it
    assert sum(isinstance(module, FewBitModule) for module in model.modules()) == 2
    assert "checkpoint" in model.fewbit_memory_plan.choices
    first = trainer.state.log_history[0]
    norms = sum(isinstance(module, runtime.MemorySharingNorm) for module in model.modules())
    assert norms == 5  # runtime.convert: ln_1 and ln_2 of both layers, and ln_f, beside the two GELUs
    assert first["step"] == 0 and first["fewbit/replaced_modules"] == 2 + norms
    assert first["fewbit/convert_saved_bytes_after"] < first["fewbit/convert_saved_bytes_before"]
    assert first["fewbit/predicted_peak_bytes"] <= first["fewbit/budget_bytes"] < first["fewbit/unconverted_peak_bytes"]
    assert [entry["step"] for entry in trainer.state.log_history[1:4]] == [1, 2, 3]  # the training losses follow
    logged = "\n".join(record.getMessage() for record in caplog.records if record.name == "fewbit_design.runtime.hf")
    assert "FewBitCallback at train start" in logged and "predicted peak" in logged and "replaced 2 module" in logged
    assert callback.report in logged
    assert model.config.fewbit["convert"] == {"bits": 2}
    assert model.config.fewbit["plan"]["choices"] == list(model.fewbit_memory_plan.choices)

    trainer.save_model(str(tmp_path / "saved"))
    restored = hf.restore(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved"))
    assert structure(restored) == structure(model)
    batch = tokens(seed=2)
    loss, gradients = loss_and_gradients(model, batch)
    restored_loss, restored_gradients = loss_and_gradients(restored, batch)
    assert torch.equal(restored_loss, loss)
    assert all(torch.equal(restored_gradients[name], gradients[name]) for name in gradients)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"convert": {"bitz": 2}}, r"FewBitCallback\(convert=\.\.\.\): runtime\.convert has no argument 'bitz'"),
        ({"convert": {"example_inputs": None}}, r"convert's 'example_inputs' cannot be recorded"),
        ({"plan": {"budgett": 0.5}}, r"FewBitCallback\(plan=\.\.\.\): plan_memory has no argument 'budgett'.*'budget'"),
        ({"plan": {"example_kwargs": {}}}, r"\['example_kwargs'\]: the callback passes the model and a batch"),
        ({"plan": 0.5}, r"FewBitCallback\(plan=\.\.\.\) must be a dict of plan_memory's keyword arguments"),
    ],
)
def test_the_callback_checks_its_arguments_when_made(arguments, message):
    with pytest.raises(FewBitError, match=message):
        hf.FewBitCallback(**arguments)
