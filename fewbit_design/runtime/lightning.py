""":class:`FewBitLightningCallback`: convert and plan memory when a Lightning ``Trainer`` starts fitting, with the
options of the Hugging Face ``Trainer``'s callback (:class:`~.hf.trainer.FewBitCallback`; both use
:mod:`.train_start`). This module imports Lightning (``pip install lightning``: the ``lightning`` extra); nothing
else in the package imports it.

Why here and not in :mod:`.hf`: the callback converts any ``LightningModule`` (a plain torch model or one holding a
Hugging Face model) and records nothing in a config: a Lightning checkpoint holds the state dict, whose keys a
conversion does not change, and the callback converts again when fitting starts again.

```python
import lightning
from fewbit_design.runtime.lightning import FewBitLightningCallback

trainer = lightning.Trainer(max_steps=100, callbacks=[FewBitLightningCallback(convert={}, plan={"budget": 0.5})])
trainer.fit(module, train_dataloaders=loader)   # at train start: converts, plans on the first batch, applies
```
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from ..errors import FewBitError
from .train_start import StartOptions, Step, first_batch

__all__ = ["FewBitLightningCallback"]

logger = logging.getLogger("fewbit_design.runtime.lightning")


class FewBitLightningCallback(StartOptions, pl.Callback):
    """A Lightning ``Callback`` that, when training starts (``on_train_start``: the model is on its device and the
    train dataloader is set up), converts the ``LightningModule`` and/or plans and applies memory, on one training
    step of the first train batch.

    Args:
        convert: keyword arguments of :func:`fewbit_design.runtime.convert` (``{}``: its defaults), or None to not
            convert. The conversion is measured on the training step (``runtime.convert``'s probe).
        plan: keyword arguments of :func:`fewbit_design.runtime.plan_memory` (e.g. ``{"budget": 0.5}``), or None to
            not plan. The plan is made after the conversion on the same step, and applied.
        strict: what a ``plan`` budget that no plan meets does: False (default) plans at the smallest feasible peak
            with one warning that names both figures, and training goes on; True raises :class:`FewBitError`.

    The options and their checks are the Hugging Face callback's: both are checked when the callback is made. The
    training step is the module's own: the batch moved to the device as Lightning moves it
    (``strategy.batch_to_device``), then ``training_step(batch, 0)`` (``self.log`` does nothing meanwhile), whose
    loss (the tensor, or the ``"loss"`` of a dict) is the one backward runs from. A module with manual optimization
    (its ``training_step`` steps the optimizer) raises :class:`FewBitError` before it changes. Lightning builds the
    optimizers before train start, so a conversion must keep the module's parameters (every technique does); one
    that replaces a parameter raises.

    At train start one summary line is printed by the global-zero process, the whole report is logged (logger
    ``fewbit_design.runtime.lightning``, INFO) and kept in :attr:`report`, and the figures (``fewbit/...``) go to
    the trainer's loggers and to :attr:`figures`. A module this callback converted already (a second ``fit``) is
    left as it is.
    """

    def __init__(
        self, convert: Mapping[str, Any] | None = None, plan: Mapping[str, Any] | None = None, *, strict: bool = False
    ) -> None:
        super().__init__(convert, plan, strict=strict)
        self.figures: dict[str, float] = {}
        self._done: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module in self._done:
            logger.info("FewBitLightningCallback: %s is converted already", type(pl_module).__name__)
            return
        if self.convert is None and self.plan is None:
            return
        if not pl_module.automatic_optimization:
            raise FewBitError(
                f"FewBitLightningCallback: {type(pl_module).__name__} uses manual optimization: its training_step "
                "steps the optimizer, so the callback cannot run it to measure; convert and plan the module yourself"
            )
        batch = trainer.strategy.batch_to_device(_first_batch(trainer.train_dataloader))
        with _training_step_as_forward(pl_module):
            started = self._start.run(pl_module, Step(args=(batch,), loss_fn=_loss), probe=True)
        self._done.add(pl_module)
        self.report, self.summary, self.figures = started.report, started.summary, started.figures
        logger.info("FewBitLightningCallback at train start:\n%s", self.report)
        if trainer.is_global_zero:
            print(self.summary, file=sys.stderr)
        for target in trainer.loggers:
            target.log_metrics(dict(self.figures), step=trainer.global_step)


def _first_batch(iterables: Any) -> Any:
    """The first batch of the train dataloader(s) as ``training_step`` receives it: one dataloader's batch, or a
    dict / list of the batches of several."""
    if iterables is None:
        raise FewBitError("FewBitLightningCallback: the trainer has no train dataloader at train start")
    if isinstance(iterables, Mapping):
        return {key: first_batch(item) for key, item in iterables.items()}
    if isinstance(iterables, list | tuple):
        return [first_batch(item) for item in iterables]
    return first_batch(iterables)


def _loss(output: Any) -> torch.Tensor:
    """The loss of a ``training_step`` output: the tensor itself, or its ``"loss"``."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise FewBitError(
            f"FewBitLightningCallback: training_step returned {type(output).__name__}, not a loss tensor or a dict "
            "with 'loss': there is no loss to measure a training step by"
        )
    return loss


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _training_step_as_forward(module: pl.LightningModule) -> Iterator[None]:
    """For the block, ``module(batch)`` runs ``module.training_step(batch, 0)`` (what the conversion's probe and the
    planner call), with ``self.log`` and ``self.log_dict`` doing nothing: measuring is not training."""
    names = ("forward", "log", "log_dict")
    saved = {name: module.__dict__[name] for name in names if name in module.__dict__}
    module.forward = lambda batch: module.training_step(batch, 0)
    module.log = module.log_dict = _ignore
    try:
        yield
    finally:
        for name in names:
            module.__dict__.pop(name, None)
        module.__dict__.update(saved)
