"""The memory plan: :func:`plan_memory` (check the arguments, profile once, choose); which option each block of the
chain runs, what it is predicted to cost, and (after :meth:`MemoryPlan.measure`) what it measured; applying it,
reporting it, and its JSON form."""

from __future__ import annotations

import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ...errors import FewBitError, check_choice, check_keys, parse_budget, resolve_budget, show
from .. import memory, registry
from ..fingerprint import BlockFingerprint, check_fingerprint, fingerprint, fingerprint_from_json
from ..modules import remember
from ..planfile import PlanFile
from ..record import record_plan
from . import report as reporting
from .model import ChainCosts, OptionCost, minimum_budget, optimise, replay, settle_ties
from .report import format_bytes, retained
from .schema import APPROXIMATE_CHOICES, APPROXIMATE_DEFAULT, OBJECTIVES, check_plan, costs_from_json
from .techniques import (
    apply_model_options,
    apply_option,
    apply_regions,
    check_choices,
    is_exact,
    model_options,
    parse_option,
    remove_model_options,
    remove_wrappers,
    technique_plan_settings,
)

__all__ = [
    "plan_memory",
    "check_plan_arguments",
    "INFEASIBLE",
    "MemoryPlan",
    "load_plan",
    "choose",
    "format_bytes",
    "FORMAT",
    "OBJECTIVES",
    "APPROXIMATE_CHOICES",
]

logger = logging.getLogger("fewbit_design.runtime.planner")

FORMAT = "fewbit-memory-plan/1"
#: what :func:`plan_memory` does when no plan meets the budget
INFEASIBLE = ("raise", "smallest")
#: a plan file holds a few KB per block (its profile) and a timeline of at most about 400 events
MAX_PLAN_BYTES = 64 * 2**20


def _refuse_compiled(model: torch.nn.Module, fix: str) -> None:
    """A :class:`FewBitError` for a model that ``torch.compile`` wrapped (an ``OptimizedModule``, whose module names
    start with ``_orig_mod``): the planner's blocks are the uncompiled model's, and a compiled graph would not see
    the checkpoint wrappers and saved-tensor hooks a plan adds."""
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        raise FewBitError(f"{type(model).__name__} is a model compiled by torch.compile: {fix}")


@dataclass
class MemoryPlan(PlanFile):
    """A plan from :func:`fewbit_design.runtime.plan_memory` (see its docstring for the algorithm).

    Attributes:
        facts: what profiling measured beside the costs (the unconverted peak, saved bytes, ...), for the report
        measured: what :meth:`measure` found, or None
        fingerprint: the blocks' classes and parameter shapes, checked when the plan is applied
        chain: qualified name of the chain ("" for the model itself).
        choices: one option per block (``"plain"``, ``"fewbit"``, ``"fewbit+checkpoint"``, ...).
        costs: the profile: every measured option of every block and the fixed parts of the step.
        budget_bytes: the budget (bytes for the whole step: parameters, inputs and everything allocated in it).
        baseline_bytes: parameters, buffers and example inputs (alive before the step).
        step_seconds: the measured time of one plain training step of the whole model.
        settings: ``allow``, ``approximate``, ``bits``, ``blpa_bits``, ``objective`` and the offload options
            (``approximate`` is absent in plans saved before it existed: they read as ``"allowed"``, the rule
            their choices were made by).
        measured: after :meth:`measure`: ``peak_bytes`` (whole step, like the prediction), ``step_seconds``,
            ``saved_bytes`` per block, a ``timeline`` (live bytes after each operator) and ``marks`` (the index in
            that timeline where each event of the predicted timeline ends: :class:`.profile.StepMarks`); None
            before.
        model_options: the ``"model"``-scope techniques applied to the whole model besides the chain's choices (the
            LM head); their effect is in the costs around the chain. Absent in plans saved before they existed.
        fingerprint: per block of the chain, its class and parameter shapes (see
            :mod:`fewbit_design.runtime.fingerprint`); :meth:`apply` refuses a model whose blocks differ.
            Empty in plans saved before fingerprints existed: they load, and apply without that check.

    Every field is checked (:meth:`validate`, :mod:`.schema`) when a plan is read and again when it is applied.
    """

    FORMAT = FORMAT
    KIND = "memory plan"
    MAX_BYTES = MAX_PLAN_BYTES

    chain: str
    choices: tuple[str, ...]
    costs: ChainCosts
    budget_bytes: int
    baseline_bytes: int
    step_seconds: float
    settings: dict[str, Any]
    facts: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] | None = None
    fingerprint: tuple[BlockFingerprint, ...] = ()
    model_options: tuple[str, ...] = ()

    def validate(self, source: str | None = None) -> None:
        """Check every field (:func:`.schema.check_plan`): one :class:`FewBitError` naming the field and the
        constraint, e.g. a choice that uses a technique ``settings.allow`` leaves out."""
        try:
            check_plan(self)
        except FewBitError as error:
            where = f"memory plan {source!r}" if source else "memory plan"
            raise FewBitError(f"{where}: {error}") from None

    # --- predictions -----------------------------------------------------------------------------------------
    def _selected(self) -> list[OptionCost]:
        return [block.option(choice) for block, choice in zip(self.costs.blocks, self.choices, strict=True)]

    def _plain(self) -> list[OptionCost]:
        return [block.option("plain") for block in self.costs.blocks]

    @property
    def predicted_peak_bytes(self) -> int:
        """Predicted peak of the whole step: baseline plus the peak of bytes allocated in it."""
        return self.baseline_bytes + replay(self.costs, self._selected()).peak

    @property
    def unconverted_peak_bytes(self) -> int:
        """Predicted peak of the step with every block plain (measured as ``facts['measured_peak_bytes']``)."""
        return self.baseline_bytes + replay(self.costs, self._plain()).peak

    @property
    def predicted_step_seconds(self) -> float:
        """The measured plain step time plus every block's extra time under its option."""
        return self.step_seconds + self.predicted_extra_seconds

    @property
    def predicted_extra_seconds(self) -> float:
        return sum(o.seconds - p.seconds for o, p in zip(self._selected(), self._plain(), strict=True))

    def techniques_used(self) -> set[str]:
        """The techniques the plan uses anywhere."""
        return {t for choice in self.choices for t in parse_option(choice)} | set(self.model_options)

    def approximate_blocks(self) -> list[str]:
        """The blocks whose gradients the plan changes: those whose option holds a technique that is approximate in
        its configured mode (few-bit, BLPA, compressed linears and attention, gated's compressed mode)."""
        return [
            block.name
            for block, choice in zip(self.costs.blocks, self.choices, strict=True)
            if not is_exact(choice, self.settings)
        ]

    def _exact_plan_fits(self) -> bool:
        """Whether a plan of exact options only (under this plan's settings) fits its budget."""
        exact = [[o.option for o in b.options if is_exact(o.option, self.settings)] for b in self.costs.blocks]
        return optimise(self.costs, self.budget_bytes - self.baseline_bytes, exact) is not None

    def reversible_estimate(self) -> dict[str, float]:
        """What a reversible version of the chain would save: the bytes the plain chain holds at its exit minus one
        hidden state (a reversible chain keeps only its output and rebuilds the rest from it), and an extra time
        of one forward pass of the chain (the inverses), taken as a third of the blocks' forward + backward time."""
        plain = self._plain()
        held = sum(retained(b, o) for b, o in zip(self.costs.blocks, plain, strict=True))
        saved = max(held - self.costs.blocks[-1].output_bytes, 0)
        return {"saved_bytes": saved, "extra_seconds": sum(o.seconds for o in plain) / 3}

    # --- planning again from the same profile ---------------------------------------------------------------
    def replan(
        self,
        budget: int | str | float | None = None,
        *,
        allow: Any = None,
        objective: str = "time",
        approximate: str | None = None,
    ) -> MemoryPlan:
        """A new plan from this plan's profile (no model run): another ``budget`` (as in ``plan_memory``), a subset
        of the profiled techniques (``allow``), another ``objective``, or another rule for approximate techniques
        (``approximate``, as in ``plan_memory``; default: this plan's). Raises :class:`FewBitError` when nothing
        fits."""
        self.validate()
        allow = tuple(self.settings["allow"]) if allow is None else allow
        if approximate is None:
            approximate = self.settings.get("approximate", APPROXIMATE_DEFAULT)
        return choose(
            self.chain,
            self.costs,
            dict(self.facts),
            baseline=self.baseline_bytes,
            step_seconds=self.step_seconds,
            settings={**self.settings, "objective": objective, "approximate": approximate},
            budget=budget,
            allow=allow,
            fingerprint=self.fingerprint,
        )

    # --- applying --------------------------------------------------------------------------------------------
    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Convert ``model`` (in place) as planned and return it. ``model`` must have the profiled architecture
        (the same chain, as many blocks, the same names, and blocks of the same classes and parameter shapes: the
        plan's fingerprint); apply before wrapping in DDP/FSDP.

        Everything is checked before the model is changed: the plan itself (:meth:`validate`), the model's
        architecture, offload's options and folder (when a block is offloaded), and that the model is not converted
        already. A plan is applied once per model: applying a
        plan to a model that a plan was applied to (the same one twice, or another one) raises
        :class:`FewBitError`; build a fresh model for each ``apply``.

        The key/value cache: the plan was profiled with ``use_cache=False`` (a training step needs no cache), so
        ``apply`` sets ``config.use_cache = False`` on every config of the model that has it on (a Hugging Face
        model's default), logs it once (logger ``fewbit_design.runtime.planner``, INFO) and keeps the previous
        values in ``model.fewbit_use_cache`` (``{qualified name of the module holding the config: value}``, ``""``
        for the model). With the cache on, a training step keeps every layer's keys and values alive to its end, past
        checkpointed blocks: a stock GPT-2's "min" plan peaked at 1.1-1.4x its budget in a plain loop. Set it back
        for generation (``model.config.use_cache = True``)."""
        from .profile import cache_configs

        container, keys, blocks = self.check_model(model)
        check_choices(keys, blocks, self.choices, self.settings)  # before any change
        remember(model)  # for runtime.unconvert
        apply_model_options(model, self.model_options, self.settings)
        for index, (key, choice) in enumerate(zip(keys, self.choices, strict=True)):
            blocks[index] = apply_option(container, key, choice, self.settings)
        handles = apply_regions(model, blocks, self.choices, self.settings)
        for name, handle in handles.items():  # each region's handle: .stats reachable, .remove() undoes the region
            setattr(model, f"fewbit_{name}", handle)
        caches = [(name, config) for name, config in cache_configs(model) if config.use_cache]
        model.fewbit_use_cache = {name: config.use_cache for name, config in caches}
        for _, config in caches:
            config.use_cache = False
        if caches:
            logger.info(
                "plan.apply: use_cache=False on the config of %s (the plan was measured without the key/value cache, "
                "which a training step does not need; set it back for generation)",
                ", ".join(f"{type(model.get_submodule(n)).__name__} ({n or 'the model'})" for n, _ in caches),
            )
        model.fewbit_memory_plan = self
        record_plan(model, self)
        return model

    def remove(self, model: torch.nn.Module) -> None:
        """Undo :meth:`apply`'s wrappers and regions on ``model`` (checkpoint wrappers, offload hooks), put its
        key/value cache setting back, and forget the plan; the modules the plan replaced stay (``runtime.unconvert``
        puts those back too).

        Args:
            model: the model this plan was applied to
        """
        if model.__dict__.get("fewbit_memory_plan") is not self:
            raise FewBitError("plan.remove: this plan is not the one applied to the model")
        container = model.get_submodule(self.chain) if self.chain else model
        for block in container.children():
            remove_wrappers(block)
        remove_model_options(model, self.model_options)
        for technique in registry.techniques():
            handle = model.__dict__.pop(f"fewbit_{technique.name}", None)
            if handle is not None and hasattr(handle, "remove"):
                handle.remove()
        from .profile import cache_configs

        previous = model.__dict__.pop("fewbit_use_cache", {})
        for name, config in cache_configs(model):
            if name in previous:
                config.use_cache = previous[name]
        del model.fewbit_memory_plan

    def check_model(self, model: torch.nn.Module) -> tuple[torch.nn.Module, list[str], list[torch.nn.Module]]:
        """The checks of :meth:`apply` that need no technique (the plan itself, the model's architecture against
        the plan's chain and fingerprint, no plan applied yet), without changing anything; returns the chain, its
        keys and its blocks. Raises :class:`FewBitError` naming what does not match."""
        self.validate()
        if not isinstance(model, torch.nn.Module):
            raise FewBitError(f"apply takes a torch.nn.Module, got {type(model).__name__}")
        _refuse_compiled(model, "apply the plan to the model before torch.compile: plan.apply(model), then compile")
        named = dict(model.named_modules())
        if self.chain not in named:
            raise FewBitError(f"the plan is for a model with a chain {self.chain!r}; this model has no such submodule")
        container = named[self.chain]
        keys = list(container._modules)
        expected = [b.name.rpartition(".")[2] if self.chain else b.name for b in self.costs.blocks]
        if keys != expected:
            where = self.chain or "the model"
            raise FewBitError(f"the plan is for a chain of blocks {expected}, but {where} has {keys}")
        blocks = [container._modules[key] for key in keys]
        check_fingerprint(self.fingerprint, blocks, [b.name for b in self.costs.blocks], "the memory plan")
        if getattr(model, "fewbit_memory_plan", None) is not None:
            raise FewBitError(
                "a memory plan was applied to this model already (apply changes the model in place); apply the plan "
                "to a freshly built model"
            )
        return container, keys, blocks

    def _blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The blocks of the chain of ``model`` (which has the plan's architecture)."""
        container = model.get_submodule(self.chain)
        return [container._modules[b.name.rpartition(".")[2] if self.chain else b.name] for b in self.costs.blocks]

    # --- measuring -------------------------------------------------------------------------------------------
    def measure(
        self,
        model: torch.nn.Module,
        *inputs: Any,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        steps: int = 3,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Run one training step of the applied ``model`` under :func:`memory.peak` and :func:`memory.saved_bytes`,
        then ``steps`` timed steps; gradients are set to None before and after (no optimizer step). The result is
        kept in ``measured`` (and shown by :meth:`report`): ``peak_bytes`` (live tensor bytes, what the plan
        predicts) and, beside it, ``rss_peak_bytes``, the process's peak RSS during that step above its RSS before
        it (Linux; ``None`` elsewhere; see :mod:`fewbit_design.runtime.memory` for why the two differ). Caches are
        off meanwhile, as when profiling (:func:`.profile.caches_disabled`), and gradients on, whatever the caller's
        mode (``torch.no_grad()``, ``torch.inference_mode()``: the step is a training step)."""
        from .profile import StepMarks, caches_disabled, default_loss, outside_inference, training_grad_mode

        loss_fn = loss_fn or default_loss
        parameters = list(model.parameters())
        for parameter in parameters:
            parameter.grad = None
        with training_grad_mode():  # a training step, whatever the caller's mode (as plan_memory)
            inputs, kwargs = outside_inference(inputs), outside_inference(kwargs)
        alive = [t for t in (*inputs, *kwargs.values()) if isinstance(t, torch.Tensor)]
        names = [b.name for b in self.costs.blocks]
        with caches_disabled(model), training_grad_mode():
            with memory.peak(model, *alive, timeline=True) as result:
                marks = StepMarks(self._blocks(model), names, result)
                try:
                    with memory.saved_bytes(model) as saved:
                        loss = loss_fn(model(*inputs, **kwargs))
                    loss.backward()
                    del loss
                finally:
                    step_marks = marks.finish()
            times = []
            for _ in range(steps):
                for parameter in parameters:
                    parameter.grad = None
                start = time.perf_counter()
                loss_fn(model(*inputs, **kwargs)).backward()
                times.append(time.perf_counter() - start)
        for parameter in parameters:
            parameter.grad = None
        per_block = {}
        for block in self.costs.blocks:
            prefix = block.name + "."
            inside = (v for k, v in saved.by_module.items() if k == block.name or k.startswith(prefix))
            per_block[block.name] = sum(inside)
        timeline = result.timeline or []
        stride = max(1, len(timeline) // 400)
        self.measured = {
            "peak_bytes": result.max_bytes,
            "rss_peak_bytes": result.rss_peak_bytes,
            "step_seconds": statistics.median(times) if times else float("nan"),
            "saved_bytes": per_block,
            "timeline": [[name, value + result.baseline_bytes] for name, value in timeline[::stride]],
            "marks": {label: -(-index // stride) for label, index in step_marks.items()},
        }
        return self.measured

    # --- reporting -------------------------------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """One row per block: option, predicted bytes saved and extra seconds (against plain), and measured saved
        bytes when measured (the plain block's saved bytes from the profile minus the measured ones)."""
        return reporting.rows(self)

    def report(self, *, file: Any = None) -> str:
        """The plan as a table (printed to ``file`` when given) and returned as text."""
        return reporting.report(self, file)

    def figure_data(self) -> dict[str, Any]:
        """The numbers behind the plan's figure (:func:`.report.figure_data`)."""
        return reporting.figure_data(self)

    # --- JSON ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = FORMAT
        return data

    @classmethod
    def _from_checked(cls, data: dict[str, Any]) -> MemoryPlan:
        """The plan of a dict whose format was checked (:meth:`~..planfile.PlanFile.from_dict`). ``facts``,
        ``measured`` and ``fingerprint`` may be absent (plans saved before fingerprints existed load, and apply
        without that check)."""
        required = ("format", "chain", "choices", "costs", "budget_bytes", "baseline_bytes", "step_seconds")
        check_keys("the plan", data, required + ("settings",), ("facts", "measured", "fingerprint", "model_options"))
        if not isinstance(data["choices"], list | tuple):
            raise FewBitError(f"choices must be a list, got {show(data['choices'])}")
        if not isinstance(data["settings"], dict):
            raise FewBitError(f"settings must be an object (a dict), got {show(data['settings'])}")
        settings = dict(data["settings"])
        if isinstance(settings.get("allow"), list):
            settings["allow"] = tuple(settings["allow"])
        for key, value in settings.items():  # a technique's nested options (a region's object of settings)
            if isinstance(value, dict):
                settings[key] = dict(value)
        facts = data.get("facts")
        return cls(
            chain=data["chain"],
            choices=tuple(data["choices"]),
            costs=costs_from_json(data["costs"]),
            budget_bytes=data["budget_bytes"],
            baseline_bytes=data["baseline_bytes"],
            step_seconds=data["step_seconds"],
            settings=settings,
            facts={} if facts is None else facts,
            measured=data.get("measured"),
            fingerprint=fingerprint_from_json(data.get("fingerprint", []), "fingerprint"),
            model_options=tuple(_list_of_strings("model_options", data.get("model_options", []))),
        )


def _list_of_strings(where: str, value: Any) -> list[str]:
    if not isinstance(value, list | tuple) or not all(isinstance(item, str) for item in value):
        raise FewBitError(f"{where} must be a list of technique names, got {show(value)}")
    return list(value)


def load_plan(path: str | os.PathLike) -> MemoryPlan:
    """Read a plan that :meth:`MemoryPlan.save` wrote; ``load_plan(path).apply(model)`` applies it. The file is
    read with the bounds of a table file (size, JSON nesting, UTF-8) and checked completely: every failure is one
    :class:`FewBitError` naming the file."""
    return MemoryPlan.load(path)


def choose(
    chain_name: str,
    costs: ChainCosts,
    facts: dict[str, Any],
    *,
    baseline: int,
    step_seconds: float,
    settings: dict[str, Any],
    budget: Any,
    allow: Any,
    fingerprint: tuple[BlockFingerprint, ...] = (),
    infeasible: str = "raise",
) -> MemoryPlan:
    """Optimise over a profile: the options of each block whose techniques are all in ``allow``. ``budget`` in the
    syntax of :func:`fewbit_design.errors.parse_budget`: a fraction is of the unconverted predicted peak, ``"min"``
    the smallest feasible one. ``settings["approximate"]`` (default ``"allowed"``) is the rule for approximate
    techniques: ``"allowed"`` takes the fastest plan that fits; ``"if-needed"`` the plan with the fewest blocks of
    approximate gradients that fits (none when an exact plan fits), and the fastest of those; and where the
    unconverted model fits the budget, the unconverted model (every block plain: a technique only adds work, so
    one that profiled faster than plain did so by timing noise)."""
    if isinstance(allow, str):
        allow = (allow,)
    allow = tuple(check_choice("allowed technique", t, registry.names()) for t in allow)
    objective = check_choice("objective", settings["objective"], OBJECTIVES)
    approximate = check_choice("approximate", settings.get("approximate", APPROXIMATE_DEFAULT), APPROXIMATE_CHOICES)
    allowed = [[o.option for o in b.options if set(parse_option(o.option)) <= set(allow)] for b in costs.blocks]
    plain = replay(costs, [b.option("plain") for b in costs.blocks]).peak
    smallest = minimum_budget(costs, allowed)
    if objective == "memory" or budget is None:
        target = plain if budget is None and objective == "time" else smallest
    else:
        target = resolve_budget(budget, unconverted=baseline + plain, minimum=lambda: baseline + smallest) - baseline
    if approximate == "if-needed" and plain <= target:
        choices = ["plain"] * len(costs.blocks)  # nothing to save: a technique is faster than plain only by noise
    else:
        settled = settle_ties(costs, _ranks(costs, settings))
        choices = optimise(_exact_first(settled, settings) if approximate == "if-needed" else settled, target, allowed)
    if choices is None:
        message = (
            f"no plan fits a budget of {format_bytes(target + baseline)} with {', '.join(allow) or 'no technique'}: "
            f"the smallest feasible peak is {format_bytes(smallest + baseline)} (unconverted: "
            f"{format_bytes(plain + baseline)})"
        )
        if check_choice("infeasible", infeasible, INFEASIBLE) == "raise":
            raise FewBitError(message)
        warnings.warn(f"{message}; planned at the smallest feasible peak instead", stacklevel=3)
        target = smallest
        settled = settle_ties(costs, _ranks(costs, settings))
        choices = optimise(_exact_first(settled, settings) if approximate == "if-needed" else settled, target, allowed)
    facts = {**facts, "minimum_budget_bytes": smallest + baseline}
    return MemoryPlan(
        chain=chain_name,
        choices=tuple(choices),
        costs=costs,
        budget_bytes=target + baseline,
        baseline_bytes=baseline,
        step_seconds=step_seconds,
        settings={**settings, "allow": allow, "approximate": approximate},
        facts=facts,
        fingerprint=fingerprint,
    )


def _ranks(costs: ChainCosts, settings: dict[str, Any]) -> list[list[int]]:
    """The fixed rule that breaks ties of time (:func:`.model.settle_ties`): fewer techniques first, then exact
    before approximate (under ``settings``: each technique's configured mode)."""
    return [
        [2 * len(parse_option(o.option)) + (0 if is_exact(o.option, settings) else 1) for o in b.options]
        for b in costs.blocks
    ]


def _exact_first(costs: ChainCosts, settings: dict[str, Any]) -> ChainCosts:
    """``costs`` with every option that is approximate under ``settings`` (few-bit, BLPA, gated's compressed mode,
    ...) made slower by more than any plan's whole time, so that the least-time plan of :func:`.model.optimise` has
    the fewest approximate blocks that fit the budget (none when an exact plan fits), and among those the least real
    time. The bytes are unchanged: which plans fit is the same."""
    penalty = 1.0 + 2 * sum(max(o.seconds for o in block.options) for block in costs.blocks)
    blocks = tuple(
        replace(
            block,
            options=tuple(
                replace(o, seconds=o.seconds + penalty) if not is_exact(o.option, settings) else o
                for o in block.options
            ),
        )
        for block in costs.blocks
    )
    return replace(costs, blocks=blocks)


def check_plan_arguments(
    *,
    budget: Any = None,
    allow: Any = None,
    objective: str = "time",
    approximate: str = "if-needed",
    repeats: int = 3,
    infeasible: str = "raise",
    technique_settings: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Check :func:`plan_memory`'s arguments that do not need the model (the Trainer callback checks them when it is
    made); return ``(allow, the techniques' plan settings)``. One :class:`FewBitError` names a bad one. The
    arguments are :func:`plan_memory`'s of the same names.

    Args:
        budget: the budget
        allow: the techniques allowed
        objective: ``"time"`` or ``"memory"``
        approximate: ``"if-needed"`` or ``"allowed"``
        repeats: timed runs
        infeasible: ``"raise"`` or ``"smallest"``
        technique_settings: technique options by plan-settings key
        options: technique options by their ``plan_memory`` keywords
    """
    if allow is None:
        allow = registry.names()
    if isinstance(allow, str):
        allow = (allow,)
    if not isinstance(allow, tuple | list):
        raise FewBitError(f"allow must be a tuple of technique names, got {allow!r}")
    allow = tuple(check_choice("allowed technique", t, registry.names()) for t in allow)
    check_choice("objective", objective, OBJECTIVES)
    check_choice("approximate", approximate, APPROXIMATE_CHOICES)
    check_choice("infeasible", infeasible, INFEASIBLE)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise FewBitError(f"repeats must be a positive integer, got {repeats!r}")
    if budget is not None:
        parse_budget(budget)  # a bad budget fails before the model is profiled
    return allow, technique_plan_settings(technique_settings, options)


def plan_memory(
    model: torch.nn.Module,
    *example_inputs: Any,
    budget: int | str | float | None = None,
    allow: tuple[str, ...] | list[str] | None = None,
    objective: str = "time",
    approximate: str = "if-needed",
    chain: str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    repeats: int = 3,
    example_kwargs: dict[str, Any] | None = None,
    technique_settings: dict[str, Any] | None = None,
    infeasible: str = "raise",
    **options: Any,
) -> MemoryPlan:
    """Profile ``model`` on example inputs once and choose per block of its chain the fastest combination of
    techniques whose predicted peak fits ``budget`` (see :mod:`fewbit_design.runtime.planner` for the algorithm),
    with exact gradients unless no exact plan fits (``approximate``).

    Args:
        model: the model in training mode; it is run, not changed (gradients, buffers and the random state are
            restored).
        example_inputs: positional inputs of one training step, with the training batch size (bytes scale with it).
        budget: the whole step's memory (parameters, inputs and everything the step allocates), in the syntax of
            :func:`fewbit_design.errors.parse_budget` (shared with ``checkpoint.plan`` and the CLI): bytes, a string
            such as ``"2GiB"``, a fraction in (0, 1] of the unconverted predicted peak (``0.5`` or ``"0.5"``),
            ``"min"`` (the smallest feasible peak) or None (the unconverted peak: nothing to save).
        allow: the registered techniques the plan may use (default None: all of them,
            :func:`fewbit_design.runtime.registry.names`).
        objective: ``"time"`` (the fastest plan within the budget) or ``"memory"`` (the smallest feasible peak,
            then the fastest plan at it; the budget is ignored).
        approximate: when the plan may use the techniques that change gradients (few-bit, BLPA): ``"if-needed"``
            (default) only where no exact plan (checkpoint, offload, plain) fits the budget: in as few blocks as
            the budget needs; and at a budget the unconverted model fits, the plan changes nothing (every block
            plain). ``"allowed"``: the fastest plan whatever the gradients (few-bit wherever it profiled faster).
            The report names the blocks with approximate gradients.
        chain: the qualified name of the chain (default: found, see :func:`.profile.find_chain`).
        loss_fn: the step's loss from the model's output (default: ``output.loss`` or the mean of the first
            floating-point tensor).
        repeats: timed runs (a block's options: rounds, each option against plain in the same round), at least;
            more (up to three times as many) until the medians are stable. Options within their spreads (the noise
            measured) tie: charged the same time and broken by a fixed rule (fewer techniques, then exact first),
            so that timing noise does not flip the plan (:func:`.model.settle_ties`).
        example_kwargs: keyword inputs of the step.
        infeasible: what a budget no plan meets gives: ``"raise"`` (default: one :class:`FewBitError` naming the
            smallest feasible peak) or ``"smallest"`` (the plan at the smallest feasible peak, with one warning that
            names both figures; the Trainer callback's default, so that training goes on).
        technique_settings: the registered techniques' options, by their plan-settings keys (each technique's
            :attr:`~fewbit_design.runtime.registry.Technique.settings`: ``{"linear_bits": 4}``); unset ones keep
            their defaults.
        options: technique options by the keywords their techniques declare (``Technique.aliases``): ``bits``
            (few-bit tables' bits), ``blpa_bits``, and offload's ``offload_min_bytes`` (saved tensors smaller than
            this stay in memory), ``offload_pack_bytes`` (tensors from ``offload_min_bytes`` up to this go out
            packed, one transfer per block; default 0, no packing: a packed block keeps its small tensors until it
            returns), ``offload_target`` and ``offload_prefetch`` (0, the default, transfers synchronously and the
            predicted peak is exact; ``k > 0`` runs up to ``k`` transfers on a thread, overlapped with compute, and
            each offloaded block's predicted peaks carry ``k`` times its largest transfer: an upper bound).

    Raises :class:`FewBitError` when no plan fits the budget (naming the smallest feasible one), for a bad
    argument before anything runs (a bad budget included), and when the model cannot run a training step on the
    example inputs (naming what it raised).

    The plan stores the chain's fingerprint (each block's class and parameter shapes); :meth:`MemoryPlan.apply`
    refuses a model whose blocks differ.

    The step is a training step whatever the caller's mode: under ``torch.no_grad()`` or ``torch.inference_mode()``
    it is profiled with gradients on (example inputs made under inference mode are copied out of it), as
    ``runtime.convert`` runs its probe. Frozen parameters (``requires_grad=False``: frozen embeddings, LoRA's frozen
    blocks) are planned as they train: a block that needs no backward costs none. A model wrapped by
    ``torch.compile`` is refused: plan and apply before compiling.

    Accuracy and margin: the predicted peak is of the bytes :func:`memory.peak` counts in one step (parameters,
    inputs, activations, gradients; no optimizer step, whose state is the optimizer's), and the plan keeps no margin
    below ``budget``: over the sweeps of ``tests/runtime/planner/test_accuracy.py`` and
    ``benchmarks/planner_accuracy.py`` the measured peak was within 0.1% of the prediction and never above the budget
    (the few-bit tables every block could carry are reserved in full, :func:`.model.reserved_bytes`; offload's
    staging buffer for packed tensors once per step from the chain's start, :func:`.model.pool_bytes`, exact for the
    first step after ``apply``, above later ones, whose buffer exists before the step). What the
    prediction cannot see: scratch space inside an operator (on CUDA the allocator's peak, ``cuda_peak_bytes``, is
    above it) and blocks whose work depends on data; give such a model a lower budget. The predicted step time is
    the measured plain step plus each block's measured extra time alone, medians on the profiling machine's load:
    exact where time is the operators run (``test_step_time_model_is_exact_where_time_is_operators``); on a real
    machine the cost of an operator differs in a chain and alone, and load moves both, so it is an estimate (the
    ratio to the unconverted step measured 0.85-1.13x of the prediction on a heavily loaded 2-core machine,
    ``benchmarks/planner_accuracy.py``). No margin is kept for time.
    """
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"plan_memory takes a torch.nn.Module, got {type(model).__name__}")
    _refuse_compiled(
        model,
        "plan and apply on the model before compiling it (plan_memory(model, ...).apply(model), then "
        "torch.compile(model)); the compiled wrapper's ._orig_mod is that model",
    )
    allow, settings = check_plan_arguments(
        budget=budget,
        allow=allow,
        objective=objective,
        approximate=approximate,
        repeats=repeats,
        infeasible=infeasible,
        technique_settings=technique_settings,
        **options,
    )
    if not model.training:
        raise FewBitError("plan_memory plans a training step: call model.train() first")
    if any(parameter.is_inference() for parameter in model.parameters()):
        raise FewBitError(
            "the model's parameters were made under torch.inference_mode(), so autograd cannot train them: build "
            "(or load) the model outside it"
        )
    if not example_inputs and not example_kwargs:
        raise FewBitError(
            "plan_memory needs example inputs of one training step, with the training batch size: "
            "plan_memory(model, x, ...) or example_kwargs={...}"
        )
    from .profile import outside_inference, profile_model, training_grad_mode

    with training_grad_mode():  # a training step, whatever the caller's mode (torch.no_grad, inference_mode)
        inputs, kwargs = outside_inference(tuple(example_inputs)), outside_inference(dict(example_kwargs or {}))
        chain_name, costs, facts = profile_model(
            model, inputs, kwargs, chain=chain, allow=allow, settings=settings, loss_fn=loss_fn, repeats=repeats
        )
        container = model.get_submodule(chain_name) if chain_name else model
        settings = {**settings, "allow": allow, "approximate": approximate, "objective": objective}
        variants = [((), costs, facts)]
        for names in model_options(model, allow, settings)[1:]:
            variants.append((names, *_with_model_options(model, names, settings, chain_name, inputs, kwargs, costs,
                                                         facts, loss_fn, repeats)))  # fmt: skip
    common = dict(settings=settings, allow=allow, fingerprint=fingerprint(list(container)))
    return _best_variant(chain_name, variants, budget, objective, infeasible, common)


def _with_model_options(model, names, settings, chain_name, inputs, kwargs, costs, facts, loss_fn, repeats):
    """(costs, facts) of the step with the ``"model"``-scope techniques ``names`` applied (and removed again): the
    blocks' costs are the ones profiled; what is around the chain is profiled again."""
    from .profile import profile_step_facts

    apply_model_options(model, names, settings)
    try:
        around, step = profile_step_facts(model, inputs, kwargs, chain=chain_name, loss_fn=loss_fn, repeats=repeats)
    finally:
        remove_model_options(model, names)
    return replace(costs, **around), {**facts, **step}


def _best_variant(chain_name, variants, budget, objective, infeasible, common) -> MemoryPlan:
    """The plan of the best variant (the step with each set of ``"model"``-scope techniques, the first without one).
    A model technique is used only where the budget needs it: under the time objective the first variant's plan when
    it fits; else, for ``"min"`` and the memory objective, the smallest predicted peak, and the fastest plan that fits
    otherwise. A fraction of a budget is of the unconverted model's peak, whatever the variant."""
    plans, failures = [], []
    absolute = budget
    for names, costs, facts in variants:
        facts = dict(facts)
        baseline, step_seconds = facts.pop("baseline_bytes"), facts.pop("step_seconds")
        arguments = dict(baseline=baseline, step_seconds=step_seconds, budget=absolute, **common)
        if not names:
            absolute = _absolute_budget(budget, costs, baseline, common["allow"])
        try:
            plan = choose(chain_name, costs, facts, infeasible="raise", **arguments)
        except FewBitError as error:
            failures.append((names, costs, facts, arguments, error))
            continue
        plan.model_options = tuple(names)
        plans.append(plan)
    if plans:
        if not plans[0].model_options and (budget is None or (objective == "time" and budget != "min")):
            return plans[0]
        if objective == "memory" or budget == "min":
            return min(plans, key=lambda p: (p.predicted_peak_bytes, p.predicted_step_seconds))
        return min(plans, key=lambda p: (p.predicted_step_seconds, p.predicted_peak_bytes))
    if infeasible == "raise":
        raise failures[0][4]
    return _smallest_fallback(chain_name, failures)


def _smallest_fallback(chain_name, failures) -> MemoryPlan:
    """No variant fits: the plan at the smallest feasible peak of all, its warning given once."""
    fallbacks = []
    for names, costs, facts, arguments, _ in failures:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = choose(chain_name, costs, facts, infeasible="smallest", **arguments)
        plan.model_options = tuple(names)
        fallbacks.append((plan.predicted_peak_bytes, len(fallbacks), plan, caught))
    _, _, plan, caught = min(fallbacks, key=lambda item: item[:2])
    for warning in caught:
        warnings.warn(warning.message, warning.category, stacklevel=4)
    return plan


def _absolute_budget(budget: Any, costs: ChainCosts, baseline: int, allow: tuple[str, ...]) -> Any:
    """``budget`` in bytes (a fraction: of the unconverted model's predicted peak), or as it is for None and
    ``"min"``."""
    if budget is None or budget == "min":
        return budget
    allowed = [[o.option for o in b.options if set(parse_option(o.option)) <= set(allow)] for b in costs.blocks]
    plain = replay(costs, [b.option("plain") for b in costs.blocks]).peak
    smallest = minimum_budget(costs, allowed)
    return resolve_budget(budget, unconverted=baseline + plain, minimum=lambda: baseline + smallest)
