""":class:`FewBitCallback`: convert and plan memory when a Hugging Face ``Trainer`` starts training, log the report,
and record what was done in ``model.config`` (see :mod:`.config_record`). This module imports transformers (the
``models`` extra; the ``Trainer`` also needs accelerate)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from transformers import TrainerCallback

from ...errors import FewBitError
from ..train_start import StartOptions, first_batch, step_of_batch, to_device
from .config_record import ATTRIBUTE, _config_of, record

__all__ = ["FewBitCallback"]

logger = logging.getLogger("fewbit_design.runtime.hf")


class FewBitCallback(StartOptions, TrainerCallback):
    """A ``transformers.TrainerCallback`` that, when training starts, converts the model and/or plans and applies
    memory, logs what it did, and records it in ``model.config.fewbit`` (so ``save_pretrained`` keeps it and
    :func:`~.config_record.restore` re-applies it after ``from_pretrained``).

    Args:
        convert: keyword arguments of :func:`fewbit_design.runtime.convert` (``{}``: its defaults), or None to not
            convert. Recorded as given: JSON values only (no ``filter``, no ``example_inputs``).
        plan: keyword arguments of :func:`fewbit_design.runtime.plan_memory` (e.g. ``{"budget": 0.5}``), or None to
            not plan. The example is the first batch of the train dataloader (the training batch size); the plan
            is made after the conversion, applied, and recorded as saved.
        strict: what a ``plan`` budget that no plan meets does: False (default) plans at the smallest feasible peak
            with one warning that names both figures, and training goes on; True raises :class:`FewBitError`.

    Both are checked when the callback is made: an unknown argument, a value that cannot be recorded, and every
    value the conversion and the planner check without a model (``bits=0``, a bad budget). At train start one
    concise summary (what was converted, the plan, the predicted peak) is printed once by the main process; the
    whole report (conversion, memory plan table) is logged (logger ``fewbit_design.runtime.hf``, INFO, once: the
    converters' own INFO lines are held back meanwhile), its figures are appended to ``state.log_history`` as one
    entry of ``fewbit/...`` keys, and the text is kept in :attr:`report`. The Trainer builds its optimizer before
    train start, so a conversion must keep the model's parameters (few-bit, checkpointing and offloading do); one
    that replaces a parameter raises :class:`FewBitError`. A model without ``model.config`` to record in (not a
    Hugging Face model), or ``plan`` without a train dataloader, raises :class:`FewBitError` at train start before
    the model changes. A model whose config already holds a record and that has it applied (after
    :func:`~.config_record.restore`) is left as it is.
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        dataloader = kwargs.get("train_dataloader")
        self._check_start(model, dataloader)
        if getattr(model, "fewbit_memory_plan", None) is not None and getattr(model.config, ATTRIBUTE, None):
            logger.info("FewBitCallback: %s has its recorded conversion applied already", type(model).__name__)
            return
        step = None
        if self.plan is not None:  # a batch of the training batch size, on the model's device
            device = next((parameter.device for parameter in model.parameters()), torch.device("cpu"))
            step = step_of_batch(to_device(first_batch(dataloader), device))
        started = self._start.run(model, step)
        record(model, convert=self.convert, plan=started.plan)
        self.report, self.summary = started.report, started.summary
        logger.info("FewBitCallback at train start:\n%s", self.report)
        if getattr(state, "is_world_process_zero", True):
            print(self.summary, file=sys.stderr)
        state.log_history.append({**started.figures, "step": state.global_step})

    def _check_start(self, model: Any, dataloader: Any) -> None:
        """What train start needs, checked before the model changes: a model with a config to record in (a Hugging
        Face model) and, to plan, a train dataloader."""
        if model is None:
            raise FewBitError("FewBitCallback: the Trainer passed no model to on_train_begin")
        _config_of(model, "FewBitCallback")
        if self.plan is not None and dataloader is None:
            raise FewBitError("FewBitCallback(plan=...): the Trainer passed no train dataloader to plan on")
