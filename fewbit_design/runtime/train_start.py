"""What the training callbacks share: the Hugging Face ``Trainer``'s :class:`~.hf.trainer.FewBitCallback` and
Lightning's :class:`~.lightning.FewBitLightningCallback` take the same ``convert=``, ``plan=`` and ``strict=``,
checked when a callback is made (:class:`TrainStart`), and do the same at train start (:meth:`TrainStart.run`):
convert the model, plan memory on one training step of a train batch, apply the plan, and give one report, one
summary and the figures to log. This module imports no training framework.

Terms: a *step* (:class:`Step`) is how the model is called on a batch for one training step and how the loss is
read from its output; the *report* is the whole text (the conversion's report and the memory plan's table), the
*summary* one or two lines of it (what was converted, the plan, the predicted peak).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import FewBitError, check_boolean
from .hf.config_record import convert_options, plan_options
from .planner.report import format_bytes
from .planner.techniques import plan_keywords

__all__ = ["TrainStart", "Step", "Started", "to_device", "first_batch", "step_of_batch"]


@dataclass(frozen=True)
class Step:
    """One training step of a model on a batch: ``model(*args, **kwargs)``, its loss ``loss_fn(output)`` (None: the
    planner's default, ``output.loss`` or the first floating-point tensor).

    Attributes:
        args: positional arguments of the call
        kwargs: keyword arguments of the call
        loss_fn: the loss from the output, or None
    """

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    loss_fn: Callable[[Any], torch.Tensor] | None = None

    @property
    def example_inputs(self) -> Any:
        """The step as ``runtime.convert``'s ``example_inputs`` (its probe)."""
        return dict(self.kwargs) if self.kwargs else self.args


@dataclass
class Started:
    """What :meth:`TrainStart.run` did.

    Attributes:
        plan: the :class:`~fewbit_design.runtime.planner.MemoryPlan` applied, or None
        report: the conversion's report and the plan's table
        summary: one or two lines: what was converted, the plan and its predicted peak
        figures: ``fewbit/...`` numbers to log (replaced modules, bytes before and after, budget, predicted peak)
    """

    plan: Any
    report: str
    summary: str
    figures: dict[str, float]


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (in mappings, lists and tuples, nested) moved to ``device``.

    Args:
        value: a batch
        device: where the model is
    """
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(item, device) for item in value)
    return value


def first_batch(dataloader: Any) -> Any:
    """The first batch of ``dataloader``, drawn so that the training that follows sees the same data (the CPU random
    state, which a shuffling sampler draws from, is as it was).

    Args:
        dataloader: any iterable of batches
    """
    with torch.random.fork_rng(devices=[]):
        return next(iter(dataloader))


def step_of_batch(batch: Any) -> Step:
    """A Hugging Face style step: a mapping is the keyword arguments, a list or tuple the positional ones, anything
    else the one argument.

    Args:
        batch: a batch of the train dataloader, on the model's device
    """
    if isinstance(batch, Mapping):
        return Step(kwargs=dict(batch))
    return Step(args=tuple(batch) if isinstance(batch, list | tuple) else (batch,))


class StartOptions:
    """The options of a train-start callback (``convert=``, ``plan=``, ``strict=``; see :class:`TrainStart`, which
    checks them when the callback is made, naming it) and what its start made: :attr:`report` and :attr:`summary`."""

    def __init__(
        self, convert: Mapping[str, Any] | None = None, plan: Mapping[str, Any] | None = None, *, strict: bool = False
    ) -> None:
        self._start = TrainStart(type(self).__name__, convert, plan, strict)
        self.convert, self.plan, self.strict = self._start.convert, self._start.plan, self._start.strict
        self.report: str | None = None
        self.summary: str | None = None


class TrainStart:
    """A callback's ``convert=``, ``plan=`` and ``strict=``, checked when it is made: an unknown argument, a value
    that cannot be recorded, and every value the conversion and the planner check without a model (``bits=0``, a
    bad budget) raise :class:`FewBitError` naming the callback.

    Args:
        where: the callback's name, for messages (``"FewBitCallback"``)
        convert: keyword arguments of :func:`fewbit_design.runtime.convert`, or None to not convert
        plan: keyword arguments of :func:`fewbit_design.runtime.plan_memory`, or None to not plan
        strict: False: a budget no plan meets plans at the smallest feasible peak with one warning; True: it raises
    """

    def __init__(self, where: str, convert: Mapping[str, Any] | None, plan: Mapping[str, Any] | None, strict: bool):
        from .conversion import check_arguments
        from .planner.plan import check_plan_arguments

        self.where = where
        self.convert = convert_options(convert, f"{where}(convert=...)")
        self.plan = plan_options(plan, f"{where}(plan=...)")
        self.strict = check_boolean(f"{where} strict", strict)
        if self.convert is not None:
            _checked(f"{where}(convert=...)", check_arguments, self.convert)
        if self.plan is not None:
            checkable = set(inspect.signature(check_plan_arguments).parameters) | set(plan_keywords())
            _checked(
                f"{where}(plan=...)",
                check_plan_arguments,
                {key: value for key, value in self.plan.items() if key in checkable},
            )

    def run(self, model: torch.nn.Module, step: Step | None, *, probe: bool = False) -> Started:
        """Convert ``model`` in place (when ``convert`` was given), then plan on ``step`` and apply the plan (when
        ``plan`` was given); the model must keep its parameters (the optimizer holds them already).

        Args:
            model: the model, in place
            step: one training step on a train batch (needed to plan; None when there is no plan)
            probe: measure the conversion on ``step`` (``runtime.convert``'s ``example_inputs``) instead of the
                probe ``runtime.convert`` builds itself (a Hugging Face model's, from its config)
        """
        parameters = [id(parameter) for parameter in model.parameters()]
        lines: list[str] = []
        figures: dict[str, float] = {}
        if self.convert is not None:
            self._convert(model, step if probe else None, lines, figures)
        plan = None
        if self.plan is not None:
            assert step is not None, "a plan needs a step"
            plan = self._plan(model, step)
            plan.apply(model)
            lines.append("memory plan:\n" + plan.report())
            figures["fewbit/budget_bytes"] = plan.budget_bytes
            figures["fewbit/predicted_peak_bytes"] = plan.predicted_peak_bytes
            figures["fewbit/unconverted_peak_bytes"] = plan.unconverted_peak_bytes
        if [id(parameter) for parameter in model.parameters()] != parameters:
            raise FewBitError(
                f"{self.where}: the conversion replaced parameters of the model, but the optimizer was built before "
                "train start, so it would not train them: convert the model before the optimizer is made"
            )
        return Started(plan, "\n".join(lines), _summary(self.where, model, plan), figures)

    def _convert(self, model: torch.nn.Module, step: Step | None, lines: list[str], figures: dict) -> None:
        from .conversion import convert

        options = dict(self.convert)
        if step is not None:
            options["example_inputs"] = step.example_inputs
        with _quiet("fewbit_design.runtime.convert"):  # its INFO lines are in the report, logged once
            converted = convert(model, **options)
        if converted is not model:
            raise FewBitError(f"{self.where}: convert returned another model; the trainer keeps the one it has")
        report = model.convert_report
        lines.append(f"convert: {report}")
        figures["fewbit/replaced_modules"] = sum(
            item.replaced for item in report.techniques if item.status == "applied"
        )
        for key in ("before", "after"):
            if getattr(report, key) is not None:  # bytes saved for backward by one step of convert's probe
                figures[f"fewbit/convert_saved_bytes_{key}"] = getattr(report, key)

    def _plan(self, model: torch.nn.Module, step: Step) -> Any:
        from .planner.plan import plan_memory

        options = {"infeasible": "raise" if self.strict else "smallest", **self.plan}
        if step.loss_fn is not None:
            options.setdefault("loss_fn", step.loss_fn)
        was_training = model.training
        model.train()
        try:
            return plan_memory(model, *step.args, example_kwargs=dict(step.kwargs) or None, **options)
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


def _summary(where: str, model: torch.nn.Module, plan: Any) -> str:
    """One or two lines, after ``where``: what was converted, the plan and its predicted peak."""
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
    return f"{where}: " + "; ".join(parts or ["nothing to do"])
