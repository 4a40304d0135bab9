"""The Trainer page's example (docs/hf.md) runs as written on a tiny GPT-2, the budget no plan meets included (one
warning naming both figures, the smallest plan, training goes on); bad callback arguments raise when the callback is
made; the summary is printed once at train start."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from hf_tiny import tiny_gpt2, tokens

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import hf

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")
pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it; the 'models' extra)")

PAGE = Path(__file__).resolve().parents[3] / "docs" / "hf.md"


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.rows = tokens(batch=8, length=8)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def _example() -> str:
    """The first Python block of docs/hf.md."""
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.M | re.S)[0]


def test_the_page_example_runs_as_written_and_an_unmet_budget_warns_and_trains(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    namespace = {
        "Trainer": transformers.Trainer,
        "GPT2LMHeadModel": transformers.GPT2LMHeadModel,
        "model": tiny_gpt2(transformers),
        "args": arguments,
        "data": _Tokens(),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(_example(), namespace)  # budget 0.5 of this tiny GPT-2 is below its smallest feasible peak
    unmet = [str(w.message) for w in caught if "no plan fits a budget of" in str(w.message)]
    assert len(unmet) == 1 and "the smallest feasible peak is" in unmet[0], [str(w.message) for w in caught]
    assert "planned at the smallest feasible peak instead" in unmet[0]
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2  # training went on
    plan = trainer.model.fewbit_memory_plan
    assert plan.budget_bytes == plan.facts["minimum_budget_bytes"]
    printed = capsys.readouterr().err
    assert printed.count("FewBitCallback: converted:") == 1 and "memory plan:" in printed
    restored = namespace["model"]  # the page's last line: restore(GPT2LMHeadModel.from_pretrained("out"))
    assert restored.fewbit_memory_plan.choices == plan.choices


def test_strict_raises_on_a_budget_no_plan_meets(tmp_path):
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    callback = hf.FewBitCallback(plan={"budget": 0.5, "repeats": 1}, strict=True)
    trainer = transformers.Trainer(tiny_gpt2(transformers), arguments, train_dataset=_Tokens(), callbacks=[callback])
    with pytest.raises(FewBitError, match="no plan fits a budget of"):
        trainer.train()


@pytest.mark.parametrize(
    "convert, plan, message",
    [
        ({"bits": 0}, None, r"convert=\.\.\.\): bits must be an integer from 1 to 8, got 0"),
        ({"bits": 3.0}, None, r"bits must be an integer"),
        ({"compress": 1}, None, r"compress .* got 1"),
        ({"norms": "no"}, None, r"norms must be true or false"),
        (None, {"budget": "lots"}, r"plan=\.\.\.\): .*budget"),
        (None, {"allow": ["fewbits"]}, r"allowed technique must be"),
        (None, {"bits": 9}, r"plan_memory\(bits=9\)"),
        (None, {"infeasible": "ignore"}, r"infeasible must be 'raise' or 'smallest'"),
    ],
)
def test_bad_arguments_raise_when_the_callback_is_made(convert, plan, message):
    with pytest.raises(FewBitError, match=message):
        hf.FewBitCallback(convert=convert, plan=plan)
