"""FewBitLightningCallback: a Lightning Trainer converts and plans a tiny GPT-2 at train start on a batch of its train
dataloader and trains it on CPU; in the exact modes (memory-sharing norms, checkpointing) the losses of the steps
are native's. Bad arguments raise when the callback is made, manual optimization before the module changes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hf_tiny import TokenDataset, structure, tiny_gpt2

from fewbit_design import runtime
from fewbit_design.errors import FewBitError

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")
lightning = pytest.importorskip("lightning", reason="lightning is not installed (the 'lightning' extra)")

from fewbit_design.runtime.lightning import FewBitLightningCallback  # noqa: E402  (needs lightning)

STEPS = 3


class _Module(lightning.LightningModule):
    def __init__(self, automatic: bool = True) -> None:
        super().__init__()
        self.model = tiny_gpt2(transformers)
        self.automatic_optimization = automatic
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Recorder(lightning.pytorch.loggers.Logger):
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(dict(metrics))


def _fit(module: _Module, callbacks: list, recorder: _Recorder | None = None) -> lightning.Trainer:
    torch.manual_seed(5)  # the dataloader's shuffling: the same batches in every run
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=4, shuffle=True)
    trainer = lightning.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, callbacks=callbacks, logger=recorder or False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    return trainer


def test_the_callback_converts_plans_and_trains_a_tiny_gpt2_with_native_losses_in_exact_modes(capsys):
    native = _Module()
    _fit(native, [])
    module, recorder = _Module(), _Recorder()
    callback = FewBitLightningCallback(
        convert={"activations": False}, plan={"budget": "min", "allow": ["checkpoint"], "repeats": 1}
    )
    trainer = _fit(module, [callback], recorder)

    assert trainer.global_step == STEPS
    norms = [m for m in module.modules() if isinstance(m, runtime.MemorySharingNorm)]
    assert len(norms) == 5  # ln_1 and ln_2 of both layers, and ln_f
    plan = module.fewbit_memory_plan
    assert "checkpoint" in plan.choices and plan.predicted_peak_bytes < plan.unconverted_peak_bytes
    assert not {"forward", "log", "log_dict"} & module.__dict__.keys()  # the training step is the module's again
    assert callback.figures["fewbit/replaced_modules"] == 5
    assert callback.figures["fewbit/convert_saved_bytes_after"] < callback.figures["fewbit/convert_saved_bytes_before"]
    assert callback.figures in recorder.metrics
    assert capsys.readouterr().err.count("FewBitLightningCallback: converted: norms") == 1
    # the same batches, and exact gradients: memory-sharing norms rebuild their input from the rounded output (a
    # few float32 eps of each gradient), and the plain SGD steps carry that into the next losses at the same scale
    assert len(module.losses) == len(native.losses) == STEPS
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(native.losses), rtol=1e-5, atol=0)


def test_a_second_fit_leaves_the_converted_module_as_it_is():
    module = _Module()
    callback = FewBitLightningCallback(convert={}, plan={"budget": "min", "allow": ["checkpoint"], "repeats": 1})
    _fit(module, [callback])
    converted, choices = structure(module), module.fewbit_memory_plan.choices
    trainer = _fit(module, [callback])  # max_steps reached already: fit starts and ends
    assert structure(module) == converted and module.fewbit_memory_plan.choices == choices
    assert trainer.global_step == STEPS


def test_manual_optimization_is_refused_before_the_module_changes():
    module = _Module(automatic=False)
    before = structure(module)
    with pytest.raises(FewBitError, match=r"manual optimization: its training_step steps the optimizer"):
        _fit(module, [FewBitLightningCallback(convert={})])
    assert structure(module) == before and not hasattr(module, "convert_report")


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"convert": {"bits": 0}}, r"FewBitLightningCallback\(convert=\.\.\.\): bits must be an integer from 1 to 8"),
        ({"convert": {"bitz": 2}}, r"runtime\.convert has no argument 'bitz'"),
        ({"plan": {"budget": "lots"}}, r"FewBitLightningCallback\(plan=\.\.\.\): .*budget"),
        ({"plan": {"example_kwargs": {}}}, r"the callback passes the model and a batch"),
        ({"strict": "yes"}, r"FewBitLightningCallback strict must be true or false"),
    ],
)
def test_bad_arguments_raise_when_the_callback_is_made(arguments, message):
    with pytest.raises(FewBitError, match=message):
        FewBitLightningCallback(**arguments)


def test_only_the_lightning_module_imports_lightning():
    code = (
        "import sys\n"
        "import fewbit_design.runtime.hf, fewbit_design.runtime.train_start, fewbit_design.runtime.hf.trainer\n"
        "print('lightning' in sys.modules, 'pytorch_lightning' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
