"""The Lightning and accelerate examples of docs/hf.md run as written on a tiny GPT-2 on CPU: converted, planned,
and trained."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from hf_tiny import tiny_gpt2, tokens

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")

PAGE = Path(__file__).resolve().parents[3] / "docs" / "hf.md"


def _example(heading: str) -> str:
    """The first Python block after the section ``heading`` of docs/hf.md."""
    section = PAGE.read_text().split(f"\n## {heading}", 1)[1]
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.M | re.S)[0]


def _loader(batches: int = 2) -> torch.utils.data.DataLoader:
    rows = tokens(batch=4 * batches, length=8)
    data = [{"input_ids": row, "labels": row} for row in rows]
    return torch.utils.data.DataLoader(data, batch_size=4)


def test_the_lightning_example_runs_as_written(tmp_path, monkeypatch):
    lightning = pytest.importorskip("lightning", reason="lightning is not installed (the 'lightning' extra)")

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2(transformers)

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    monkeypatch.chdir(tmp_path)  # Lightning's default logger and checkpoints write into the working folder
    namespace = {"module": Module(), "loader": _loader()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice (dataloader workers, log intervals)
        exec(_example("Lightning"), namespace)
    module, trainer = namespace["module"], namespace["trainer"]
    assert trainer.global_step == 2  # one epoch of the two batches
    assert module.fewbit_memory_plan is not None and "linear" in module.convert_report.applied
    assert namespace["callback"].figures["fewbit/predicted_peak_bytes"] <= module.fewbit_memory_plan.budget_bytes


def test_the_accelerate_example_runs_as_written_and_trains():
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (the 'models' extra)")
    model = tiny_gpt2(transformers)
    namespace = {"model": model, "loader": _loader(), "torch": torch, "accelerator": accelerate.Accelerator(cpu=True)}
    exec(_example("accelerate"), namespace)
    assert "linear" in model.convert_report.applied and model.fewbit_memory_plan is not None
    model, optimizer, loader = namespace["model"], namespace["optimizer"], namespace["loader"]
    before = [parameter.detach().clone() for parameter in model.parameters()]
    for batch in loader:
        loss = model(**batch).loss
        namespace["accelerator"].backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    assert any(not torch.equal(old, new) for old, new in zip(before, model.parameters(), strict=True))
