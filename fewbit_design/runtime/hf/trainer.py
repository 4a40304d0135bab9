""":class:`FewBitCallback`: convert and plan memory when a Hugging Face ``Trainer`` starts training, log the report,
and record what was done in ``model.config`` (see :mod:`.config_record`). This module imports transformers (the
``models`` extra; the ``Trainer`` also needs accelerate)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from ...errors import FewBitError
from .config_record import ATTRIBUTE, _config_of, convert_options, plan_options, record

__all__ = ["FewBitCallback"]

logger = logging.getLogger("fewbit_design.runtime.hf")


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_device(item, device) for item in value)
    return value


class FewBitCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that, when training starts, converts the model and/or plans and applies
    memory, logs what it did, and records it in ``model.config.fewbit`` (so ``save_pretrained`` keeps it and
    :func:`~.config_record.restore` re-applies it after ``from_pretrained``).

    Args:
        convert: keyword arguments of :func:`fewbit_design.runtime.convert` (``{}``: its defaults), or None to not
            convert. Recorded as given: JSON values only (no ``filter``, no ``example_inputs``).
        plan: keyword arguments of :func:`fewbit_design.runtime.plan_memory` (e.g. ``{"budget": 0.5}``), or None to
            not plan. The example is the first batch of the train dataloader (the training batch size); the plan
            is made after the conversion, applied, and recorded as saved.

    Both are checked when the callback is made (an unknown argument, a value that cannot be recorded). At train
    start the report (conversion summary, memory plan table) is logged (logger ``fewbit_design.runtime.hf``, INFO),
    its figures are appended to ``state.log_history`` as one entry of ``fewbit/...`` keys, and the text is kept in
    :attr:`report`. The Trainer builds its optimizer before train start, so a conversion must keep the model's
    parameters (few-bit, checkpointing and offloading do); one that replaces a parameter raises
    :class:`FewBitError`. A model without ``model.config`` to record in (not a Hugging Face model), or ``plan``
    without a train dataloader, raises :class:`FewBitError` at train start before the model changes. A model whose
    config already holds a record and that has it applied (after :func:`~.config_record.restore`) is left as it is.
    """

    def __init__(self, convert: Mapping[str, Any] | None = None, plan: Mapping[str, Any] | None = None) -> None:
        self.convert = convert_options(convert, "FewBitCallback(convert=...)")
        self.plan = plan_options(plan, "FewBitCallback(plan=...)")
        self.report: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._check_start(model, kwargs.get("train_dataloader"))
        if getattr(model, "fewbit_memory_plan", None) is not None and getattr(model.config, ATTRIBUTE, None):
            logger.info("FewBitCallback: %s has its recorded conversion applied already", type(model).__name__)
            return
        parameters = [id(parameter) for parameter in model.parameters()]
        lines, figures = [], {}
        converted = model
        if self.convert is not None:
            from ..conversion import convert

            converted = convert(model, **self.convert)
            if converted is not model:
                raise FewBitError("FewBitCallback: convert returned another model; the Trainer keeps the one it has")
            report = model.convert_report
            lines.append(f"convert: {report}")
            figures["fewbit/replaced_modules"] = sum(
                item.replaced for item in report.techniques if item.status == "applied"
            )
            for key in ("before", "after"):
                if getattr(report, key) is not None:  # bytes saved for backward by one step of convert's probe
                    figures[f"fewbit/convert_saved_bytes_{key}"] = getattr(report, key)
        plan = None
        if self.plan is not None:
            plan = self._plan(model, kwargs.get("train_dataloader"))
            plan.apply(model)
            lines.append("memory plan:\n" + plan.report())
            figures.update(
                {
                    "fewbit/budget_bytes": plan.budget_bytes,
                    "fewbit/predicted_peak_bytes": plan.predicted_peak_bytes,
                    "fewbit/unconverted_peak_bytes": plan.unconverted_peak_bytes,
                }
            )
        if [id(parameter) for parameter in model.parameters()] != parameters:
            raise FewBitError(
                "FewBitCallback: the conversion replaced parameters of the model, but the Trainer built its optimizer "
                "before train start, so it would not train them: convert the model before making the Trainer (and "
                "record it with fewbit_design.runtime.hf.record)"
            )
        record(model, convert=self.convert, plan=plan)
        self.report = "\n".join(lines)
        logger.info("FewBitCallback at train start:\n%s", self.report)
        state.log_history.append({**figures, "step": state.global_step})

    def _check_start(self, model: Any, dataloader: Any) -> None:
        """What train start needs, checked before the model changes: a model with a config to record in (a Hugging
        Face model) and, to plan, a train dataloader."""
        if model is None:
            raise FewBitError("FewBitCallback: the Trainer passed no model to on_train_begin")
        _config_of(model, "FewBitCallback")
        if self.plan is not None and dataloader is None:
            raise FewBitError("FewBitCallback(plan=...): the Trainer passed no train dataloader to plan on")

    def _plan(self, model: torch.nn.Module, dataloader: Any) -> Any:
        from ..planner.plan import plan_memory

        with torch.random.fork_rng(devices=[]):  # an extra iterator must not change the order of the training data
            batch = next(iter(dataloader))
        device = next((parameter.device for parameter in model.parameters()), torch.device("cpu"))
        batch = _to_device(batch, device)
        was_training = model.training
        model.train()
        try:
            if isinstance(batch, Mapping):
                return plan_memory(model, example_kwargs=dict(batch), **self.plan)
            inputs = tuple(batch) if isinstance(batch, list | tuple) else (batch,)
            return plan_memory(model, *inputs, **self.plan)
        finally:
            model.train(was_training)
