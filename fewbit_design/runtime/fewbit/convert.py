"""Swap the activation modules of an existing model for few-bit ones, and say what was done.

What is recognised (by exact class; a library is looked at only when it is already imported, never imported here):

* ``torch.nn`` activations of the registry (ReLU, GELU, SiLU, LeakyReLU, ...): replaced by the matching
  :mod:`fewbit_design.runtime.nn` module with the same hyper-parameters;
* ``transformers.activations`` (GELUActivation, NewGELUActivation, GELUTanh / PytorchGELUTanh, FastGELUActivation,
  AccurateGELUActivation, SiLUActivation, MishActivation, QuickGELUActivation, ReLUSquaredActivation) and timm's
  activation layers (``timm.layers.activations``: GELU, GELUTanh, QuickGELU, Swish, SiLU, Mish, Sigmoid, Tanh,
  HardSwish, HardSigmoid): wrapped as :class:`~.nn.FewBit` around the original module, so the forward *is* the
  original module's forward (bitwise, tanh and sigmoid approximations included) and the table serves only the
  backward. The table is the one of the closed form the module computes (e.g. ``gelu`` with
  ``approximate='tanh'`` for NewGELUActivation);
* activations that have no table (PReLU, RReLU, ClippedGELUActivation, LaplaceActivation, XIELUActivation, ...)
  are left alone with the reason in the report; ``strict=True`` raises instead.

No conversion that costs memory (``only_if_smaller=True``, the default): an activation whose native backward saves
only its *output* (ReLU, Sigmoid, Tanh; probed once per class) and that sits in a convolutional block (its parent
holds convolutions or batch norms, at any depth) or before a layer that saves its input in a Sequential feeds a
layer that saves that same tensor, so replacing it frees nothing and adds the codes: it is left alone. This rule is
conservative (an output that only a pooling or the loss consumes is left alone too).

With ``example_inputs=`` the decision is measured instead: one forward pass records which module saved each
storage (:func:`fewbit_design.runtime.memory.storage_key`, the instrument's rules: parameters, buffers and leaves
that require grad are not counted); an activation is replaced only when the bytes saved by it alone exceed its codes.

>>> import torch
>>> from fewbit_design import runtime
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
>>> model = runtime.convert(model, bits=3)                                       # doctest: +SKIP
>>> print(model.fewbit_report)                                                    # doctest: +SKIP
>>> model = runtime.convert(model, filter={MyAct: "myact.json"})                 # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...design import activations
from ...errors import FewBitError, check_boolean, check_choice, check_integer, close_matches
from ...table import MODES, Table
from .. import memory, modules
from ..modules import Slot, swap
from ..modules import class_path as _class_path
from ..probe import example_errors, forward_bytes, no_side_effects, run_example
from ..report import Report
from .lookup import WEIGHTS, TableLike, as_table, resolve_table
from .matching import (
    ECOSYSTEM,
    _Candidate,
    _output_saved_by_neighbour,
    _recognise,
    _saves_only_output,
    _slots,
    canonical_name,
)
from .nn import FewBit, FewBitModule, from_torch

__all__ = ["convert", "FewBitReport", "ConversionReport", "Filter", "ECOSYSTEM", "canonical_name"]

logger = logging.getLogger("fewbit_design.runtime.convert")

Filter = Mapping[type, TableLike | None] | Callable[[str, torch.nn.Module], Any] | None


REPORT_MESSAGE = (
    "convert(report={report!r}): convert always returns the model; the report of the conversion is the attribute "
    "model.fewbit_report of the returned model (drop report=)"
)

_OUTPUT_ONLY_REASON = (
    "its native backward saves only its output, and it sits where the next layer (convolution, linear, norm, "
    "pooling) saves that output too: replacing it would add the codes and free nothing "
    "(pass example_inputs= to measure, or only_if_smaller=False to replace it anyway)"
)


# ----------------------------------------------------------------------------------------------------------------------
# Report


@dataclass(frozen=True)
class Replaced:
    """One module that was replaced (``names``: every name it has in the model; a shared module is one entry)."""

    names: tuple[str, ...]
    original: str
    replacement: str
    activation: str
    bits: int


@dataclass(frozen=True)
class Skipped(modules.Skipped):
    """One activation module left alone, and why (``unsupported``: a recognised activation with no few-bit version,
    which ``strict=True`` refuses)."""

    unsupported: bool = False


@dataclass(kw_only=True)
class FewBitReport(Report):
    """What :func:`convert` did: a :class:`~..report.Report` whose ``replaced`` are the modules replaced
    (:class:`Replaced`), ``skipped`` the activation modules left alone (:class:`Skipped`) and ``already`` how many
    were few-bit already.

    Attributes:
        measured: ``{"native": bytes, "converted": bytes}`` saved for backward on the example, when it measured.
    """

    measured: dict[str, int] | None = None

    ALREADY: ClassVar[str] = "module(s) were few-bit already"

    @property
    def already_fewbit(self) -> int:
        """Deprecated name of :attr:`already`."""
        return self.already

    def by_class(self) -> dict[str, int]:
        """Number of replaced modules per original class."""
        return dict(Counter(item.original for item in self.replaced))

    @property
    def places(self) -> int:
        """Number of places (qualified names) the replaced modules occupy: a module used twice counts twice."""
        return sum(len(item.names) for item in self.replaced)

    def head(self) -> str:
        at = f" at {self.places} place(s)" if self.places != self.count else ""
        return f"replaced {self.count} module(s){at}, left {len(self.skipped)} activation module(s) alone"

    def replaced_lines(self) -> list[str]:
        lines = []
        for original, count in self.by_class().items():
            example = next(item for item in self.replaced if item.original == original)
            lines.append(f"  {count} x {original} -> {example.replacement} ({example.activation}, {example.bits} bits)")
        for item in self.replaced:
            if len(item.names) > 1:
                lines.append(f"  one shared replacement at {', '.join(repr(name) for name in item.names)}")
        return lines

    def left_lines(self) -> list[str]:
        lines = list(super().left_lines())
        if self.measured:
            lines.append(
                f"  saved for backward on the example: {self.measured['native']} -> {self.measured['converted']} bytes"
            )
        return lines


#: the former name of :class:`FewBitReport` (deprecated; kept for one release)
ConversionReport = FewBitReport


# ----------------------------------------------------------------------------------------------------------------------
# Describing a replacement (what is recognised and where: .matching)


def _describe(name: str, params: Mapping[str, Any]) -> str:
    if not params:
        return name
    return f"{name}(" + ", ".join(f"{key}={value!r}" for key, value in params.items()) + ")"


# ----------------------------------------------------------------------------------------------------------------------
# Measurement on an example input


def _exclusive_bytes(
    model: torch.nn.Module, example_inputs: Any, candidates: Mapping[int, torch.nn.Module]
) -> tuple[dict[int, int], dict[int, int]]:
    """Per candidate module (by id): bytes of the storages saved by it and by no other module
    (:attr:`memory.SavedBytes.exclusive_by_module`), and the elements it took (summed over calls). One forward pass
    with grad enabled."""
    elements: Counter[int] = Counter()

    def count(module, inputs):
        if inputs and isinstance(inputs[0], torch.Tensor):
            elements[id(module)] += inputs[0].numel()

    handles = [module.register_forward_pre_hook(count) for module in candidates.values()]
    try:
        with torch.enable_grad(), memory.saved_bytes(model) as saved:
            run_example(model, example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    names = {id(module): name for name, module in model.named_modules()}  # the names memory.saved_bytes uses
    exclusive = {key: saved.exclusive_by_module.get(names.get(key, None), 0) for key in candidates}
    return exclusive, dict(elements)


# ----------------------------------------------------------------------------------------------------------------------
# convert


def _decision(filter: Filter, name: str, module: torch.nn.Module) -> Any:
    """True (default table), a table, or None (leave the module alone)."""
    if filter is None:
        return True
    if isinstance(filter, Mapping):
        for cls, table in filter.items():
            if isinstance(module, cls):
                return table
        return True
    return filter(name, module)


def _check_options(*, bits: Any, weight: Any, mode: Any, only_if_smaller: Any, strict: Any) -> dict[str, Any]:
    """The few-bit options checked (``bits`` an int, not a float or a bool; the switches True or False), as keyword
    arguments."""
    return {
        "bits": check_integer("bits", bits, low=1, high=8),
        "weight": check_choice("weight", weight, WEIGHTS),
        "mode": check_choice("mode", mode, MODES),
        "only_if_smaller": check_boolean("only_if_smaller", only_if_smaller),
        "strict": check_boolean("strict", strict),
    }


def _check_filter(filter: Filter) -> None:
    if filter is None or (callable(filter) and not isinstance(filter, type)):
        return
    if isinstance(filter, Mapping):
        for cls in filter:
            if not isinstance(cls, type):
                raise FewBitError(f"filter: keys must be module classes, got {cls!r} ({type(cls).__name__})")
        return
    raise FewBitError(
        f"filter must be None, a dict {{module class: table}} or a callable(name, module), got {filter!r}"
    )


def _check_tables(tables: Mapping[str, TableLike] | None) -> dict[str, tuple[str, Table]]:
    """``{canonical name: (name as given, Table)}``, every table loaded and checked."""
    if tables is None:
        return {}
    if not isinstance(tables, Mapping):
        raise FewBitError(
            f"tables must be a dict {{module name: table}} (e.g. from runtime.calibrate), got {type(tables).__name__}"
        )
    result: dict[str, tuple[str, Table]] = {}
    for name, table in tables.items():
        if not isinstance(name, str):
            raise FewBitError(f"tables: keys must be module names (str), got {name!r} ({type(name).__name__})")
        key = canonical_name(name)
        if key in result:
            raise FewBitError(f"tables: names {result[key][0]!r} and {name!r} name the same module {key!r}")
        try:
            result[key] = (name, as_table(table))
        except FewBitError as exc:
            raise FewBitError(f"tables[{name!r}]: {exc}") from None
    return result


def _check_table_names(model: torch.nn.Module, tables: Mapping[str, tuple[str, Table]], slots: list[Slot]) -> None:
    """Every name in ``tables`` must be a module of the model (compiled or not): a table that matches nothing would
    be dropped without a word and the module would get the shipped table."""
    known = {canonical_name(name) for slot in slots for name in slot.names}
    unmatched = [given for key, (given, _) in tables.items() if key not in known]
    if not unmatched:
        return
    activations_found = [
        slot.names[0] for slot in slots if isinstance(slot.module, FewBitModule) or _recognise(slot.module) is not None
    ]
    hints = sorted({hit for name in unmatched for hit in close_matches(canonical_name(name), activations_found)})
    listed = ", ".join(repr(name) for name in activations_found[:12]) or "none"
    if len(activations_found) > 12:
        listed += f", ... ({len(activations_found)} in all)"
    raise FewBitError(
        f"convert: tables name {len(unmatched)} module(s) that {type(model).__name__} does not have: "
        f"{', '.join(repr(name) for name in unmatched)}"
        + (f" (did you mean {', '.join(repr(hit) for hit in hints)}?)" if hints else "")
        + f"; its activation modules are {listed}"
    )


def _device_of(module: torch.nn.Module) -> torch.device | None:
    for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        return tensor.device
    return None


def convert(
    model: torch.nn.Module,
    *,
    bits: int = 3,
    weight: str = "uniform",
    mode: str = "levelsets",
    filter: Filter = None,
    tables: Mapping[str, TableLike] | None = None,
    only_if_smaller: bool = True,
    example_inputs: Any = None,
    strict: bool = False,
    report: bool = False,
) -> torch.nn.Module:
    """Replace the activation modules of ``model`` (in place) by few-bit modules; return the model, always.

    What was done is the :class:`FewBitReport` in the returned model's attribute ``fewbit_report``, set by every
    call (the next call overwrites it). ``report=True`` (an older form that returned ``(model, report)``) raises.

    Recognised modules (see the module docstring) get the shipped table for (``bits``, ``weight``, ``mode``) of
    the function they compute. Options:

    * ``filter``: a dict ``{module class: table}`` (instances of a key use that table, a Table, a dict or a path;
      a class the runtime does not know is wrapped as ``FewBit(module, table)``; a ``None`` value leaves those
      modules alone), or a callable ``filter(name, module)`` returning a table, ``True`` (default treatment) or
      ``None`` / ``False`` (leave it alone). A table chosen by ``filter`` is always used.
    * ``tables``: ``{qualified module name: table}``, e.g. the per-layer tables of
      :func:`fewbit_design.runtime.calibrate`; they win over the shipped ones (and are always used). A name that is
      no module of the model raises (naming it and the model's activation modules). Names are compared without the
      ``_orig_mod.`` parts of ``torch.compile``, so tables calibrated on a compiled model apply to the plain one and
      the other way round.
    * ``only_if_smaller`` (default True): leave alone the activations whose replacement would not reduce the bytes
      saved for backward: by a rule (native backward saves only the output) or, with ``example_inputs`` (a tensor,
      a tuple of positional arguments or a dict of keyword arguments for ``model``), by measuring one forward pass.
    * ``strict``: raise :class:`FewBitError` when an activation module without few-bit support is present.
    * ``report``: must stay False; read ``model.fewbit_report`` instead.

    Every argument is checked first, whatever the model holds. The conversion is all or nothing: every replacement
    is built (its table found and checked) before the first module is swapped, so an error leaves the model as it
    was. A module shared by several places (one instance used twice, or one module under two names) gets one shared
    replacement, and the report lists every place. Few-bit modules already in the model are left as they are, so
    converting twice changes nothing the second time. A model that is itself an activation module (``convert(
    torch.nn.GELU())``) cannot be changed in place: its replacement is returned, so use the return value. The
    summary is logged (logger ``fewbit_design.runtime.convert``, INFO); a model in which nothing was replaced gives
    a warning. Raises :class:`FewBitError` naming the module when its table cannot be found.
    """
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"convert takes a torch.nn.Module, got {type(model).__name__}")
    if report is not False:
        raise FewBitError(REPORT_MESSAGE.format(report=report))
    checked = _check_options(bits=bits, weight=weight, mode=mode, only_if_smaller=only_if_smaller, strict=strict)
    _check_filter(filter)
    checked_tables = _check_tables(tables)
    # under torch.inference_mode / no_grad the probes would see nothing saved and the tables' tensors would be
    # inference tensors, unusable in training later: convert always works in normal mode
    with torch.inference_mode(False):
        converted, result = _convert(
            model,
            **checked,
            filter=filter,
            tables=checked_tables,
            example_inputs=example_inputs,
        )
    logger.info("convert %s: %s", type(model).__name__, result)
    if not result.replaced and not result.already:
        absent = "it has no activation module the runtime recognises"
        modules.warn_nothing_replaced("convert", model, result.skipped, absent)
    converted.fewbit_report = result
    return converted


def _convert(
    model: torch.nn.Module,
    *,
    bits: int,
    weight: str,
    mode: str,
    filter: Filter,
    tables: Mapping[str, tuple[str, Table]],
    only_if_smaller: bool,
    example_inputs: Any,
    strict: bool,
) -> tuple[torch.nn.Module, FewBitReport]:
    result = FewBitReport()
    if isinstance(model, FewBitModule):
        result.already = 1
        return model, result
    slots = _slots(model, root=True)
    _check_table_names(model, tables, slots)
    plans = _plans(slots, filter, tables, result)
    unsupported = [item for item in result.skipped if item.unsupported]
    if strict and unsupported:
        item = unsupported[0]
        raise FewBitError(
            f"convert(strict=True): module {item.names[0]!r} ({item.original}) has no few-bit version: {item.reason}"
        )
    if only_if_smaller:
        plans = _drop_costly(model, plans, example_inputs, bits, result)
    # build every replacement first (any error leaves the model untouched), then swap
    built = [(slot, *_built(slot, decision, candidate, bits, weight, mode)) for slot, decision, candidate in plans]
    converted = swap(model, slots, {id(slot.module): replacement for slot, replacement, _ in built})
    for slot, replacement, activation in built:
        original = _class_path(type(slot.module))
        result.replaced.append(Replaced(slot.names, original, type(replacement).__name__, activation, replacement.bits))
    if example_inputs is not None and result.measured is not None:
        try:
            with no_side_effects(converted), example_errors():
                result.measured["converted"] = forward_bytes(converted, example_inputs)
        except BaseException:
            swap(converted, _slots(converted, root=True), {id(r): slot.module for slot, r, _ in built})
            raise
    return converted, result


def _plans(
    slots: list[Slot], filter: Filter, tables: Mapping[str, tuple[str, Table]], result: FewBitReport
) -> list[tuple[Slot, Any, _Candidate | None]]:
    """``(slot, decision, candidate)`` of every activation module to replace; the ones left go to the report."""
    plans: list[tuple[Slot, Any, _Candidate | None]] = []
    for slot in slots:
        module = slot.module
        if isinstance(module, FewBitModule):
            result.already += 1
            continue
        recognised = _recognise(module)
        decision = _decision(filter, slot.names[0], module)
        explicit = next((tables[key][1] for key in map(canonical_name, slot.names) if key in tables), None)
        if explicit is not None and decision is not None and decision is not False:
            decision = explicit
        if decision is None or decision is False:
            if recognised is not None:
                result.skipped.append(Skipped(slot.names, _class_path(type(module)), "left alone by filter"))
            continue
        if decision is True:
            if recognised is None:
                continue
            if isinstance(recognised, str):
                result.skipped.append(Skipped(slot.names, _class_path(type(module)), recognised, unsupported=True))
                continue
        plans.append((slot, decision, recognised if isinstance(recognised, _Candidate) else None))
    return plans


def _built(slot: Slot, decision: Any, candidate: _Candidate | None, bits: int, weight: str, mode: str):
    """(replacement, activation description) for one slot, in training mode and on the device of the original."""
    module = slot.module
    replacement, activation = _build(slot.names[0], module, decision, candidate, bits=bits, weight=weight, mode=mode)
    replacement.train(module.training)
    device = _device_of(module) or (_device_of(slot.places[0][0]) if slot.places else None)
    if device is not None:
        replacement.to(device)
    return replacement, activation


def _drop_costly(model, plans, example_inputs, bits, result: FewBitReport):
    """The plans whose replacement reduces the bytes saved for backward (the others go to the report)."""
    kept = []
    if example_inputs is None:
        for plan in plans:
            slot, decision, candidate = plan
            if decision is True and _saves_only_output(slot.module) and _output_saved_by_neighbour(slot):
                result.skipped.append(Skipped(slot.names, _class_path(type(slot.module)), _OUTPUT_ONLY_REASON))
            else:
                kept.append(plan)
        return kept
    candidates = {id(slot.module): slot.module for slot, _, _ in plans}
    with no_side_effects(model), example_errors():
        exclusive, elements = _exclusive_bytes(model, example_inputs, candidates)
        result.measured = {"native": forward_bytes(model, example_inputs)}
    for plan in plans:
        slot, decision, candidate = plan
        key = id(slot.module)
        table_bits = getattr(decision, "bits", bits) if decision is not True else bits
        codes = math.ceil(elements.get(key, 0) / 8) * int(table_bits)
        own = exclusive.get(key, 0)
        if elements.get(key, 0) and own <= codes:
            result.skipped.append(
                Skipped(
                    slot.names,
                    _class_path(type(slot.module)),
                    f"measured on the example: it alone saves {own} bytes, its {table_bits}-bit codes would take "
                    f"{codes}: replacing it would not reduce memory",
                )
            )
        else:
            kept.append(plan)
    return kept


def _build(name: str, module, decision, candidate: _Candidate | None, *, bits: int, weight: str, mode: str):
    """(replacement module, description of the activation whose table it uses)."""
    try:
        if candidate is None:  # a class the runtime does not know, with a table chosen by filter
            replacement = FewBit(module, decision)
            return replacement, replacement.table.activation
        if candidate.torch_class:
            replacement = (
                from_torch(module, bits=bits, weight=weight, mode=mode)
                if decision is True
                else from_torch(module, table=decision)
            )
            params = {key: getattr(replacement, key) for key in activations.get(candidate.activation).defaults}
            return replacement, _describe(candidate.activation, _non_default(candidate.activation, params))
        table = resolve_table(
            None if decision is True else decision,
            activation=candidate.activation,
            params=candidate.params,
            bits=bits,
            weight=weight,
            mode=mode,
        )
        return FewBit(module, table), _describe(candidate.activation, _non_default(candidate.activation, table.params))
    except FewBitError as exc:
        raise FewBitError(f"cannot convert module {name!r} ({module!r}): {exc}") from None


def _non_default(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    defaults = activations.get(name).defaults
    return {key: value for key, value in params.items() if defaults.get(key) != value}
