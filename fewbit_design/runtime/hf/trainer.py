""":class:`FewBitCallback`: convert and plan memory when a Hugging Face ``Trainer`` starts training, log the report,
and record what was done in ``model.config`` (see :mod:`.config_record`). This module imports transformers (the
``models`` extra; the ``Trainer`` also needs accelerate)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from ...errors import FewBitError, check_boolean
from ..planner.report import format_bytes
from ..planner.techniques import plan_keywords
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

    def __init__(
        self, convert: Mapping[str, Any] | None = None, plan: Mapping[str, Any] | None = None, *, strict: bool = False
    ) -> None:
        from ..conversion import check_arguments
        from ..planner.plan import check_plan_arguments

        self.convert = convert_options(convert, "FewBitCallback(convert=...)")
        self.plan = plan_options(plan, "FewBitCallback(plan=...)")
        self.strict = check_boolean("FewBitCallback strict", strict)
        self.report: str | None = None
        self.summary: str | None = None
        if self.convert is not None:
            _checked("FewBitCallback(convert=...)", check_arguments, self.convert)
        if self.plan is not None:
            checkable = set(inspect.signature(check_plan_arguments).parameters) | set(plan_keywords())
            _checked(
                "FewBitCallback(plan=...)",
                check_plan_arguments,
                {key: value for key, value in self.plan.items() if key in checkable},
            )

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

            with _quiet("fewbit_design.runtime.convert"):  # their INFO lines are in this report, logged once
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
        self.summary = _summary(model, plan)
        logger.info("FewBitCallback at train start:\n%s", self.report)
        if getattr(state, "is_world_process_zero", True):
            print(self.summary, file=sys.stderr)
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
        options = {"infeasible": "raise" if self.strict else "smallest", **self.plan}
        try:
            if isinstance(batch, Mapping):
                return plan_memory(model, example_kwargs=dict(batch), **options)
            inputs = tuple(batch) if isinstance(batch, list | tuple) else (batch,)
            return plan_memory(model, *inputs, **options)
        finally:
            model.train(was_training)


def _checked(where: str, check: Any, arguments: Mapping[str, Any]) -> None:
    try:
        check(**arguments)
    except FewBitError as error:
        raise FewBitError(f"{where}: {error}") from None


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """The logger ``name`` (and those below it) held at WARNING for the block."""
    target = logging.getLogger(name)
    level = target.level
    target.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        target.setLevel(level)


def _summary(model: torch.nn.Module, plan: Any) -> str:
    """One or two lines: what was converted, the plan and its predicted peak."""
    parts = []
    report = getattr(model, "convert_report", None)
    if report is not None:
        approximate = ", ".join(report.approximate) or "none"
        parts.append(f"converted: {', '.join(report.applied) or 'nothing'} (approximate: {approximate})")
    if plan is not None:
        used = ", ".join(sorted(plan.techniques_used())) or "nothing"
        parts.append(
            f"memory plan: {used}; predicted peak {format_bytes(plan.predicted_peak_bytes)} for a budget of "
            f"{format_bytes(plan.budget_bytes)} (unconverted {format_bytes(plan.unconverted_peak_bytes)})"
        )
    return "FewBitCallback: " + "; ".join(parts or ["nothing to do"])
