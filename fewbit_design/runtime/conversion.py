"""``runtime.convert``: the registered techniques that ``convert`` runs (each technique's
:class:`~.registry.ConvertRole`), applied to an existing model, each kept only where it pays off, with one report of
what was done and measured. This module names no technique: it reads the registry.

What runs. By default, the techniques whose role is on by default (in registry order: memory-sharing norms, the
gated-MLP op, the exact attention core and few-bit activations: exact gradients except the activations'); with
``compress=K``, every technique in the form its role gives for K bits (K-bit codes: norms' outputs, attention's q,
k and v, linear layers' inputs; gated MLPs recompute gate and up from their input's codes; approximate gradients).
A technique's switch turns it off (``norms=False``); its keywords set its options (few-bit's ``bits``, ``weight``,
``mode``, ``filter``, ``tables``, ``only_if_smaller``, ``strict``). :func:`keywords` lists them; the docs'
technique pages describe each.

Never more memory: with a probe (``example_inputs``, or for a Hugging Face ``PreTrainedModel`` inputs built from its
config, caches off while probing: :mod:`.probe`) the bytes saved for backward by one training step are measured
before and after each technique, and a technique that does not reduce them is undone, with the reason in the report.
Without a probe, the rules each converter has (few-bit's ``only_if_smaller`` rule) apply.

The report, ``model.convert_report`` (:class:`ConvertReport`), holds per technique what was replaced and left (the
technique's own report, still set on the model by its converter: ``model.norms_report``, ...), the bytes measured
and which gradients are approximate; and what a technique could not reach (activation and dropout functions called
in forward code). A model converted again keeps one report: the last call's, holding the earlier calls' applied
techniques (:attr:`ConvertReport.earlier`), so that ``applied`` and ``approximate`` describe the model as it is.

>>> import torch
>>> from fewbit_design import runtime
>>> model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
>>> model = runtime.convert(model, example_inputs=torch.randn(4, 8))                # doctest: +SKIP
>>> print(model.convert_report)                                                      # doctest: +SKIP
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import FewBitError, check_boolean, check_integer, close_matches
from . import registry
from .modules import ORIGINAL, remember, restore, snapshot
from .probe import caches_disabled, example_errors, huggingface_probe, step_bytes
from .record import append_convert, forget
from .report import Report

__all__ = [
    "convert",
    "unconvert",
    "check_arguments",
    "keywords",
    "argument_names",
    "ConvertReport",
    "TechniqueReport",
    "FunctionalCall",
]

logger = logging.getLogger("fewbit_design.runtime.convert")

REPORT_MESSAGE = (
    "convert(report={report!r}): convert always returns the model; the report of the conversion is the attribute "
    "model.convert_report of the returned model (each technique's own: {attributes}) (drop report=)"
)


# ----------------------------------------------------------------------------------------------------------------------
# Report


@dataclass
class TechniqueReport:
    """One technique in one :func:`convert` call.

    ``status``: ``"applied"`` (kept), ``"undone"`` (applied, measured no smaller, restored), ``"nothing"`` (nothing
    to replace), ``"off"`` (switched off). ``report``: the technique's own report (what it replaced and left, and
    why). ``before`` / ``after``: bytes saved for backward by one training step on the probe, when measured.
    """

    name: str
    status: str
    replaced: int = 0
    reason: str = ""
    approximate: str | None = None
    before: int | None = None
    after: int | None = None
    report: Any = None

    def __str__(self) -> str:
        head = f"{self.name}: {self.status}"
        if self.replaced:
            head += f", {self.replaced} replacement(s)"
        if self.before is not None and self.after is not None:
            head += (
                f", saved for backward {self.before} -> {self.after} bytes ({self.after / max(self.before, 1):.2f}x)"
            )
        head += f"; gradients {'approximate: ' + self.approximate if self.approximate else 'exact'}"
        lines = [head]
        if self.reason:
            lines.append(f"  {self.reason}")
        if self.report is not None and self.status != "off":
            lines += ["  " + line for line in str(self.report).splitlines()]
        return "\n".join(lines)


@dataclass(frozen=True)
class FunctionalCall:
    """Something a technique could not reach, found on the probe: a function called in a module's forward code (not
    a module, so convert could not replace it), ``calls`` times."""

    module: str
    module_class: str
    function: str
    calls: int


@dataclass
class ConvertReport:
    """What :func:`convert` did: ``techniques`` in the order applied, the ``probe`` (what was run to measure, or
    why nothing was), ``before`` / ``after`` (bytes saved for backward by one training step, when measured) and
    ``unseen`` (activation and dropout functions called functionally, which no module replacement can reach).

    A model converted more than once keeps one report: that of the last call, which also holds ``earlier`` (the
    entries of the techniques applied by the earlier calls, oldest first, still in the model) and ``calls`` (how
    many convert calls the model had). ``techniques``, ``probe``, ``before``, ``after`` and ``unseen`` are the last
    call's; :attr:`applied` and :attr:`approximate` are of the model as it is now (every call's)."""

    techniques: list[TechniqueReport] = field(default_factory=list)
    probe: str = "none"
    before: int | None = None
    after: int | None = None
    unseen: list[FunctionalCall] = field(default_factory=list)
    earlier: list[TechniqueReport] = field(default_factory=list)
    calls: int = 1

    def technique(self, name: str) -> TechniqueReport:
        """The last call's entry of technique ``name`` (as the report names it)."""
        for item in self.techniques:
            if item.name == name:
                return item
        raise FewBitError(f"no technique {name!r} in this report: it has {', '.join(t.name for t in self.techniques)}")

    @property
    def applied(self) -> tuple[str, ...]:
        """The techniques kept in the model (by any convert call on it)."""
        return tuple(dict.fromkeys(item.name for item in self._held()))

    @property
    def approximate(self) -> dict[str, str]:
        """Technique -> which gradients it makes approximate, for the techniques kept (by any call)."""
        texts: dict[str, list[str]] = {}
        for item in self._held():
            if item.approximate and item.approximate not in texts.setdefault(item.name, []):
                texts[item.name].append(item.approximate)
        return {name: "; ".join(found) for name, found in texts.items() if found}

    def _held(self) -> list[TechniqueReport]:
        return self.earlier + [item for item in self.techniques if item.status == "applied"]

    def merge_earlier(self, previous: ConvertReport) -> ConvertReport:
        """Make this report (a new call's) the one report of the model: the techniques ``previous`` holds as applied
        become :attr:`earlier` (before any already there) and its calls are counted in :attr:`calls`. Returns self.

        Args:
            previous: the model's report before this call.
        """
        held = previous.earlier + [item for item in previous.techniques if item.status == "applied"]
        self.earlier = held + self.earlier
        self.calls += previous.calls
        return self

    def __str__(self) -> str:
        this_call = [item.name for item in self.techniques if item.status == "applied"]
        head = f"convert: applied {', '.join(this_call) or 'nothing'}"
        if self.calls > 1:
            head += f" (call {self.calls} on this model; it holds {', '.join(self.applied) or 'nothing'})"
        lines = [f"{head}; probe: {self.probe}"]
        if self.before is not None and self.after is not None:
            ratio = self.after / max(self.before, 1)
            by = " by this call" if self.calls > 1 else ""
            lines.append(
                f"saved for backward by one training step{by}: {self.before} -> {self.after} bytes ({ratio:.2f}x)"
            )
        lines += [str(item) for item in self.techniques]
        if self.unseen:
            lines.append("could not see (functions called in forward code, not modules; left native):")
            for call in self.unseen:
                lines.append(f"  {call.module or '(model)'} ({call.module_class}): {call.function} x {call.calls}")
        if self.earlier:
            lines.append(f"applied by the {self.calls - 1} earlier call(s) (still in the model):")
            lines += ["  " + line for item in self.earlier for line in str(item).splitlines()]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# The call's set of techniques


@dataclass
class _Entry:
    """One entry of the report: the techniques answering to one report name, and the one this call runs (None: it is
    off), with its options."""

    name: str
    members: list[registry.Technique]
    running: registry.Technique | None = None
    options: Any = None
    off: str = ""


def _roles() -> list[tuple[registry.Technique, registry.ConvertRole]]:
    return [(t, t.in_convert) for t in registry.techniques() if t.in_convert is not None]


def keywords() -> dict[str, str]:
    """``convert``'s technique keywords: ``{keyword: what it is}`` (the techniques' switches and their options)."""
    found: dict[str, str] = {}
    for technique, role in _roles():
        if role.switch is not None:
            found.setdefault(role.switch, "switch: False turns it off")
        for keyword in role.keywords:
            found.setdefault(keyword, f"{technique.name} option")
    return found


def argument_names() -> list[str]:
    """Every keyword :func:`convert` takes: its own, then the techniques' (:func:`keywords`)."""
    return ["compress", "example_inputs", "report", *keywords()]


def _route(options: Mapping[str, Any]) -> tuple[dict[str, bool], dict[str, dict[str, Any]]]:
    """``(switches, {technique: its options given})`` from convert's technique keywords; an unknown one raises."""
    known = keywords()
    for key in options:
        if key not in known:
            hints = close_matches(key, list(known))
            hint = f"; did you mean {', '.join(map(repr, hints))}?" if hints else ""
            raise FewBitError(
                f"convert got an unexpected keyword {key!r}{hint} (its keywords: compress, example_inputs, "
                f"{', '.join(known)})"
            )
    switches = {
        role.switch: check_boolean(role.switch, options.get(role.switch, True))
        for _, role in _roles()
        if role.switch is not None
    }
    given = {t.name: {k: options[k] for k in role.keywords if k in options} for t, role in _roles()}
    return switches, given


def _entries(switches: Mapping[str, bool], given: Mapping[str, dict[str, Any]], compress: int | None) -> list[_Entry]:
    """The report's entries in registry order, each with the technique this call runs and its options (checked)."""
    entries: dict[str, _Entry] = {}
    for technique, role in _roles():
        entry = entries.setdefault(role.report_name or technique.name, _Entry(role.report_name or technique.name, []))
        entry.members.append(technique)
        try:
            options = role.options_for(technique.options(**given[technique.name]), compress)
        except TypeError as error:  # a keyword the options do not have: a registry mistake, not the user's
            raise AssertionError(f"{technique.name}: {error}") from None
        if options is None or entry.running is not None:
            continue
        if role.switch is not None and not switches[role.switch]:
            entry.off = f"switched off ({role.switch}=False)"
            continue
        entry.running, entry.options = technique, options
    for entry in entries.values():
        if entry.running is None and not entry.off:
            entry.off = "switched off (compress=None)"
    return list(entries.values())


def _entry_report(entry: _Entry) -> TechniqueReport:
    technique = entry.running or entry.members[0]
    options = entry.options if entry.running is not None else technique.options()
    return TechniqueReport(entry.name, "off", approximate=technique.approximate(options), reason=entry.off)


# ----------------------------------------------------------------------------------------------------------------------
# convert


def convert(
    model: torch.nn.Module,
    *,
    compress: int | None = None,
    example_inputs: Any = None,
    report: bool = False,
    **options: Any,
) -> torch.nn.Module:
    """Convert ``model`` in place with the registered techniques that pay off (see the module docstring); return it.

    Args:
        model: the model; changed in place (a model that is itself one replaced module, ``convert(torch.nn.GELU())``,
            is returned replaced: use the return value).
        compress: None (default) or 2..8: every technique in its K-bit form (norms keep codes of their output, gated
            MLPs run the gated op's compressed mode, attention cores keep codes of q, k and v, linear layers of their
            input; approximate gradients).
        example_inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments for ``model``: the
            probe on which each technique is measured (one training step) and undone when it does not reduce the
            bytes saved for backward. A Hugging Face model gets a probe built from its config when this is None.
        report: must stay False; read ``model.convert_report`` instead.
        options: the techniques' keywords (:func:`keywords`): each technique's switch (``norms=False``,
            ``gated=False``, ``attention=False``, which covers both attention cores, ``activations=False``) and the
            few-bit activations' options (``bits=3``, ``weight="uniform"``, ``mode="levelsets"``, ``filter``,
            ``tables``, ``only_if_smaller``, ``strict``: as :func:`fewbit_design.runtime.fewbit.convert.convert`
            takes them).

    Every argument is checked first; the conversion is all or nothing (an error leaves the model as it was). The
    report is ``model.convert_report`` (:class:`ConvertReport`; a second call merges the first's into it: its
    ``earlier`` entries keep the earlier calls' technique reports); the techniques' own reports stay where their
    converters put them (``model.fewbit_report``, ..., each the technique's last run). A model in which nothing was
    replaced gives a warning.
    """
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"convert takes a torch.nn.Module, got {type(model).__name__}")
    if report is not False:
        attributes = ", ".join(f"model.{role.report_attribute}" for _, role in _roles())
        raise FewBitError(REPORT_MESSAGE.format(report=report, attributes=attributes))
    compress, entries = _checked(compress, options)
    for entry in entries:
        if entry.running is not None and entry.running.in_convert.check is not None:
            entry.running.in_convert.check(model, entry.options)
    remember(model)
    with torch.inference_mode(False), caches_disabled(model):
        converted, result, warned = _convert(model, entries, example_inputs)
    if converted is not model:
        converted.__dict__[ORIGINAL] = model.__dict__[ORIGINAL]
    _record(converted, {"compress": compress, **options} if compress is not None else dict(options))
    logger.info("convert %s: %s", type(model).__name__, result)
    if not any(item.status == "applied" for item in result.techniques) and not _already_converted(converted):
        why = "; ".join(warned) or f"convert: nothing replaced in {type(model).__name__}"
        warnings.warn(why, stacklevel=2)
    previous = model.__dict__.get("convert_report")
    converted.convert_report = result.merge_earlier(previous) if isinstance(previous, ConvertReport) else result
    return converted


def check_arguments(*, compress: int | None = None, **options: Any) -> None:
    """Check :func:`convert`'s arguments without a model (every technique's options made and checked): one
    :class:`FewBitError` names a bad one. The Trainer callback checks its ``convert=`` so when it is made.

    Args:
        compress: as :func:`convert` takes it
        options: the techniques' keywords, as :func:`convert` takes them
    """
    _checked(compress, options)


def _checked(compress: Any, options: Mapping[str, Any]) -> tuple[int | None, list[_Entry]]:
    if compress is not None:
        compress = check_integer("compress (bits of compressed linear inputs, or None)", compress, low=2, high=8)
    switches, given = _route(options)
    return compress, _entries(switches, given, compress)


def _record(model: torch.nn.Module, options: dict[str, Any]) -> None:
    """Record this call in a Hugging Face model's config (``model.config.fewbit``), so that ``save_pretrained`` keeps
    it and ``runtime.hf.restore`` replays it; options that JSON cannot hold (a ``filter`` callable) leave the record
    as it was, and ``restore`` then says so."""
    append_convert(model, options)


def unconvert(model: torch.nn.Module) -> torch.nn.Module:
    """Undo every :func:`convert` and ``MemoryPlan.apply`` on ``model``: the native modules back at their places (the
    same objects, with the same parameters), checkpoint wrappers and offload hooks removed, the key/value cache
    setting and the config's record as they were; return the model (the original root when a conversion replaced
    it). Gradients are then native. A model never converted is returned as it is. Like Hugging Face's
    ``gradient_checkpointing_disable()``.

    Args:
        model: a model :func:`convert` or a memory plan changed
    """
    plan = model.__dict__.get("fewbit_memory_plan")
    if plan is not None:
        plan.remove(model)
    original = model.__dict__.pop(ORIGINAL, None)
    if original is None:
        return model
    root, taken = original
    restore(taken)
    attributes = {"convert_report", *(role.report_attribute for _, role in _roles())}
    for item in (root, model):
        for key in attributes | {ORIGINAL}:
            item.__dict__.pop(key, None)
    forget(root)
    return root


def _already_converted(model: torch.nn.Module) -> bool:
    return any(type(m).__module__.startswith("fewbit_design.runtime.") for m in model.modules())


def _probe(model: torch.nn.Module, example_inputs: Any, result: ConvertReport) -> tuple[Any, int | None]:
    """The probe and the bytes one step saves on it before any technique (None, None: nothing measured)."""
    if example_inputs is not None:
        result.probe = "example_inputs"
        with example_errors():
            return example_inputs, _training_step_bytes(model, example_inputs)
    probe, result.probe = huggingface_probe(model)
    if probe is None:
        return None, None
    try:
        with example_errors():
            return probe, _training_step_bytes(model, probe)
    except FewBitError as error:
        result.probe = f"none (the probe built from the config failed to run: {error}): not measured"
        return None, None


def _convert(
    model: torch.nn.Module, entries: list[_Entry], example_inputs: Any
) -> tuple[torch.nn.Module, ConvertReport, list[str]]:
    result = ConvertReport()
    probe, before = _probe(model, example_inputs, result)
    result.before = before
    original = snapshot(model)
    current = model
    warned: list[str] = []
    try:
        for entry in entries:
            item = _entry_report(entry)
            result.techniques.append(item)
            if entry.running is None:
                continue
            current, before, caught = _apply(current, entry, item, probe, before)
            warned += caught
        result.after = before if result.before is not None else None
        if probe is not None:
            for entry in entries:
                unseen = (entry.running or entry.members[0]).in_convert.unseen
                if unseen is not None:
                    with example_errors():
                        result.unseen += [FunctionalCall(*row) for row in unseen(current, probe, entry.options)]
    except BaseException:
        restore(original)
        raise
    return current, result, warned


def _training_step_bytes(model: torch.nn.Module, probe: Any) -> int:
    """Bytes saved by one training step on the probe, the model in training mode for it whatever its mode (a model
    from ``from_pretrained`` is in eval mode, where dropout draws nothing and would seem to save nothing), each
    module's mode put back after."""
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        return step_bytes(model, probe)
    finally:
        for module, training in modes:
            module.training = training


def _apply(
    model: torch.nn.Module, entry: _Entry, item: TechniqueReport, probe: Any, before: int | None
) -> tuple[torch.nn.Module, int | None, list[str]]:
    """Apply one entry's technique, measure it on the probe and undo it when it saves nothing; returns (the model,
    the bytes now saved, the technique's warnings)."""
    technique, role = entry.running, entry.running.in_convert
    taken = snapshot(model)
    previous = model.__dict__.get(role.report_attribute)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        changed = technique.convert(model, entry.options, probe)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    item.report = getattr(changed, role.report_attribute)
    if not isinstance(item.report, Report):
        raise TypeError(
            f"technique {technique.name!r}: its convert set model.{role.report_attribute} to a "
            f"{type(item.report).__name__}, not a fewbit_design.runtime.report.Report"
        )
    item.replaced = item.report.count
    if not item.replaced:
        item.status = "nothing"
        return model, before, messages
    item.status = "applied"
    if before is None:
        return changed, before, messages
    with example_errors():
        after = _training_step_bytes(changed, probe)
    item.before, item.after = before, after
    if after < before:
        return changed, after, messages
    item.status = "undone"
    item.reason = (
        f"measured on the probe: one training step saves {after} bytes for backward with it, {before} without: "
        "it does not reduce memory"
    )
    restore(taken)
    if previous is None:
        model.__dict__.pop(role.report_attribute, None)
    else:
        model.__dict__[role.report_attribute] = previous
    return model, before, messages
