"""The fields of a memory plan and their constraints, checked when a plan is read and again when it is applied.

A plan file can be edited, and a plan object can be changed after it was made; nothing in it is trusted. Counts and
bytes are JSON integers (not floats, strings or booleans), flags are JSON booleans, times are finite numbers, every
choice is one of its block's profiled options and uses only the techniques of ``settings.allow`` (a plan that promises
exact gradients cannot apply an approximate technique), and every technique's options are checked by the technique (its
options' own ranges). Bytes that are sizes or peaks are >= 0; ``kept``, ``post_forward_peak`` and ``post_bytes`` are
differences of live bytes and may be negative, down to what could be freed: a block's ``kept`` down to minus its
``output_bytes`` (a block leaves at least as many bytes alive as it found, its input aside), the two chain fields down
to minus ``entry_bytes`` and the last block's ``input_bytes`` and ``output_bytes`` (what was alive before the chain, and
the last block's input and output, alive when the chain's exit is measured). Every technique setting present is checked
by its technique (:func:`.techniques.check_technique_settings`), naming the key.
"""

from __future__ import annotations

from typing import Any

from ...errors import (
    FewBitError,
    check_boolean,
    check_choice,
    check_integer,
    check_keys,
    check_number,
    check_string,
    show,
)
from .. import registry
from ..fingerprint import check_fingerprint_value
from .model import BlockCosts, ChainCosts, OptionCost
from .techniques import check_technique_settings, option_name, parse_option

__all__ = [
    "OBJECTIVES",
    "APPROXIMATE_CHOICES",
    "APPROXIMATE_DEFAULT",
    "check_plan",
    "costs_from_json",
]

OBJECTIVES = ("time", "memory")
#: when the plan may use approximate techniques (few-bit, BLPA): only where no exact plan fits the budget, or freely
APPROXIMATE_CHOICES = ("if-needed", "allowed")
#: ``settings.approximate`` of a plan saved before the setting existed: those plans were chosen by the fastest
#: time whatever the gradients, so they read as "allowed" (the rule their choices were made by; a replan at their
#: own budget gives the same plan)
APPROXIMATE_DEFAULT = "allowed"
OPTION_FIELDS = ("option", "forward_peak", "kept", "backward_peak", "saves_input", "saves_output", "seconds")
# absent in plans saved before they existed (0, False)
OPTION_OPTIONAL = ("resident_bytes", "spread", "pool_bytes", "holds_arguments")
BLOCK_FIELDS = ("name", "input_bytes", "output_bytes", "gradient_bytes", "options")
CHAIN_FIELDS = ("entry_bytes", "pre_forward_peak", "post_forward_peak", "post_bytes", "pre_backward_peak")
CHAIN_OPTIONAL = ("argument_bytes",)  # absent in plans saved before it existed (0)
#: differences of live bytes (the modules after the chain may free bytes the chain allocated): any sign
SIGNED_CHAIN_FIELDS = ("post_forward_peak", "post_bytes")
SETTINGS_FIELDS = ("allow", "objective")
SETTINGS_OPTIONAL = ("approximate",)  # absent in plans saved before it existed (APPROXIMATE_DEFAULT)
FACT_FIELDS = ("measured_peak_bytes", "minimum_budget_bytes", "saved_bytes")
MEASURED_FIELDS = ("peak_bytes", "step_seconds", "saved_bytes", "timeline")
MEASURED_OPTIONAL = ("marks", "rss_peak_bytes")  # absent in plans measured before they existed; rss null where not
# measurable


def _list(where: str, value: Any) -> list | tuple:
    if not isinstance(value, list | tuple):
        raise FewBitError(f"{where} must be a list, got {show(value)}")
    return value


def costs_from_json(data: Any, where: str = "costs") -> ChainCosts:
    """The :class:`ChainCosts` of a plan file, with its structure checked (objects with exactly their fields, lists
    where lists belong); the values' types and ranges are :func:`check_plan`'s part."""
    check_keys(where, data, ("blocks",) + CHAIN_FIELDS, CHAIN_OPTIONAL)
    blocks = []
    for index, block in enumerate(_list(f"{where}.blocks", data["blocks"])):
        here = f"{where}.blocks[{index}]"
        check_keys(here, block, BLOCK_FIELDS)
        options = []
        for k, option in enumerate(_list(f"{here}.options", block["options"])):
            check_keys(f"{here}.options[{k}]", option, OPTION_FIELDS, OPTION_OPTIONAL)
            options.append(OptionCost(**option))
        blocks.append(
            BlockCosts(
                block["name"], block["input_bytes"], block["output_bytes"], block["gradient_bytes"], tuple(options)
            )
        )
    return ChainCosts(tuple(blocks), **{name: data[name] for name in CHAIN_FIELDS + CHAIN_OPTIONAL if name in data})


def _check_option(where: str, option: Any, output_bytes: int) -> None:
    if not isinstance(option, OptionCost):
        raise FewBitError(f"{where} must be an OptionCost, got {show(option)}")
    name = check_string(f"{where}.option", option.option)
    techniques = registry.names()
    if option_name(parse_option(name)) != name or any(t not in techniques for t in parse_option(name)):
        raise FewBitError(
            f"{where}.option must be 'plain' or techniques from {', '.join(techniques)} joined by '+' in that "
            f"order, got {show(name)}"
        )
    check_integer(f"{where}.forward_peak", option.forward_peak, low=0)
    check_integer(f"{where}.kept", option.kept)
    if option.kept < -output_bytes:
        raise FewBitError(
            f"{where}.kept must be >= -{output_bytes} (minus the block's output_bytes: a block cannot leave fewer "
            f"bytes alive than it found, its input aside), got {option.kept}"
        )
    check_integer(f"{where}.backward_peak", option.backward_peak, low=0)
    check_boolean(f"{where}.saves_input", option.saves_input)
    check_boolean(f"{where}.saves_output", option.saves_output)
    check_number(f"{where}.seconds", option.seconds, low=0)
    check_integer(f"{where}.resident_bytes", option.resident_bytes, low=0)
    check_number(f"{where}.spread", option.spread, low=0)
    check_integer(f"{where}.pool_bytes", option.pool_bytes, low=0)
    check_boolean(f"{where}.holds_arguments", option.holds_arguments)


def _check_costs(chain: str, costs: Any) -> None:
    if not isinstance(costs, ChainCosts):
        raise FewBitError(f"costs must be a ChainCosts, got {show(costs)}")
    if not isinstance(costs.blocks, tuple) or not costs.blocks:
        raise FewBitError(f"costs.blocks must be a non-empty tuple of BlockCosts, got {show(costs.blocks)}")
    for name in CHAIN_FIELDS + CHAIN_OPTIONAL:
        check_integer(f"costs.{name}", getattr(costs, name), low=None if name in SIGNED_CHAIN_FIELDS else 0)
    names = set()
    for index, block in enumerate(costs.blocks):
        here = f"costs.blocks[{index}]"
        if not isinstance(block, BlockCosts):
            raise FewBitError(f"{here} must be a BlockCosts, got {show(block)}")
        name = check_string(f"{here}.name", block.name)
        prefix, _, key = name.rpartition(".")
        if prefix != chain or not key:  # a module's key has no '.'; the chain's blocks are named chain.key
            expected = f"'{chain}.<key>'" if chain else "the key of a block of the model (no '.')"
            raise FewBitError(f"{here}.name must be {expected} for the chain {chain!r}, got {show(name)}")
        if name in names:
            raise FewBitError(f"{here}.name {name!r} appears twice")
        names.add(name)
        for field in ("input_bytes", "output_bytes", "gradient_bytes"):
            check_integer(f"{here}.{field}", getattr(block, field), low=0)
        if not isinstance(block.options, tuple) or not block.options:
            raise FewBitError(f"{here}.options must be a non-empty tuple of OptionCost, got {show(block.options)}")
        seen = set()
        for k, option in enumerate(block.options):
            _check_option(f"{here}.options[{k}]", option, block.output_bytes)
            if option.option in seen:
                raise FewBitError(f"{here}.options[{k}]: option {option.option!r} appears twice")
            seen.add(option.option)
        if "plain" not in seen:
            raise FewBitError(f"{here}.options has no 'plain' option (every block's profile starts with it)")
    last = costs.blocks[-1]
    freeable = costs.entry_bytes + last.input_bytes + last.output_bytes
    for name in SIGNED_CHAIN_FIELDS:
        if getattr(costs, name) < -freeable:
            raise FewBitError(
                f"costs.{name} must be >= -{freeable} (minus entry_bytes and the last block's input_bytes and "
                f"output_bytes: after the chain, the modules can free only what was alive before it and the last "
                f"block's input and output), got {getattr(costs, name)}"
            )


def _check_settings(settings: Any) -> tuple[str, ...]:
    check_keys("settings", settings, SETTINGS_FIELDS, SETTINGS_OPTIONAL + tuple(registry.setting_defaults()))
    allow = settings["allow"]
    if not isinstance(allow, tuple | list):
        raise FewBitError(f"settings.allow must be a list of techniques, got {show(allow)}")
    for index, technique in enumerate(allow):
        check_choice(f"settings.allow[{index}]", technique, registry.names())
    if len(set(allow)) != len(allow):
        raise FewBitError(f"settings.allow names a technique twice: {show(list(allow))}")
    check_choice("settings.objective", settings["objective"], OBJECTIVES)
    if "approximate" in settings:
        check_choice("settings.approximate", settings["approximate"], APPROXIMATE_CHOICES)
    check_technique_settings(settings)  # every technique's own settings, whether allowed or not, naming the key
    return tuple(allow)


def _check_byte_map(where: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise FewBitError(f"{where} must be an object of block names to bytes, got {show(value)}")
    for key, nbytes in value.items():
        check_string(f"{where} key", key)
        check_integer(f"{where}[{key!r}]", nbytes, low=0)


def _check_facts(facts: Any) -> None:
    check_keys("facts", facts, (), FACT_FIELDS)
    for name in ("measured_peak_bytes", "minimum_budget_bytes"):
        if name in facts:
            check_integer(f"facts.{name}", facts[name], low=0)
    if "saved_bytes" in facts:
        _check_byte_map("facts.saved_bytes", facts["saved_bytes"])


def _check_measured(measured: Any) -> None:
    if measured is None:
        return
    check_keys("measured", measured, MEASURED_FIELDS, MEASURED_OPTIONAL)
    check_integer("measured.peak_bytes", measured["peak_bytes"], low=0)
    if measured.get("rss_peak_bytes") is not None:
        check_integer("measured.rss_peak_bytes", measured["rss_peak_bytes"], low=0)
    check_number("measured.step_seconds", measured["step_seconds"], low=0, allow_nan=True)  # NaN: no timed step
    _check_byte_map("measured.saved_bytes", measured["saved_bytes"])
    for index, event in enumerate(_list("measured.timeline", measured["timeline"])):
        if not isinstance(event, list | tuple) or len(event) != 2:
            raise FewBitError(f"measured.timeline[{index}] must be [label, bytes], got {show(event)}")
        check_string(f"measured.timeline[{index}] label", event[0])
        check_integer(f"measured.timeline[{index}] bytes", event[1], low=0)
    marks = measured.get("marks", {})
    if not isinstance(marks, dict):
        raise FewBitError(f"measured.marks must be an object of event labels to operator indices, got {show(marks)}")
    for label, index in marks.items():
        check_string("measured.marks key", label)
        check_integer(f"measured.marks[{label!r}]", index, low=0, high=len(measured["timeline"]))


def check_plan(plan: Any) -> None:
    """Check every field of a :class:`~.plan.MemoryPlan` (see the module docstring); one :class:`FewBitError`
    names the first field that breaks a constraint."""
    chain = check_string("chain", plan.chain)
    _check_costs(chain, plan.costs)
    allow = _check_settings(plan.settings)
    for index, name in enumerate(plan.model_options):
        check_choice(f"model_options[{index}]", name, registry.names())
        if registry.technique(name).scope != "model" or name not in allow:
            raise FewBitError(
                f"model_options[{index}] is {show(name)}: a technique of settings.allow whose scope is the model"
            )
    choices = plan.choices
    if not isinstance(choices, tuple | list):
        raise FewBitError(f"choices must be a list of option names, got {show(choices)}")
    if len(choices) != len(plan.costs.blocks):
        raise FewBitError(f"choices has {len(choices)} entries, but the chain has {len(plan.costs.blocks)} blocks")
    for index, (block, choice) in enumerate(zip(plan.costs.blocks, choices, strict=True)):
        check_string(f"choices[{index}]", choice)
        options = [option.option for option in block.options]
        if choice not in options:
            raise FewBitError(
                f"choices[{index}] is {choice!r}, which is not a profiled option of block {block.name!r} "
                f"({', '.join(options)})"
            )
        outside = [t for t in parse_option(choice) if t not in allow]
        if outside:
            raise FewBitError(
                f"choices[{index}] ({block.name!r}) is {choice!r}, which uses {', '.join(outside)}, but settings.allow "
                f"is {list(allow)}: a plan applies only the techniques it allows"
            )
    check_integer("budget_bytes", plan.budget_bytes, low=0)
    check_integer("baseline_bytes", plan.baseline_bytes, low=0)
    check_number("step_seconds", plan.step_seconds, low=0)
    _check_facts(plan.facts)
    _check_measured(plan.measured)
    check_fingerprint_value(plan.fingerprint, len(plan.costs.blocks), "fingerprint")
