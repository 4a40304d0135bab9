"""The record of a conversion in a Hugging Face model's config, and restoring it after ``from_pretrained``.

The record is one JSON object at ``model.config.fewbit`` (``save_pretrained`` writes it into ``config.json`` like
any other config attribute, and ``from_pretrained`` reads it back):

```json
{"format": "fewbit-hf/1", "version": "0.1.0",
 "convert": {"bits": 3} or [{"bits": 3}, {"compress": 8}] or null,
 "plan": {... the memory plan as MemoryPlan.to_dict() writes it ...} or null}
```

``runtime.convert`` and ``MemoryPlan.apply`` write it themselves on a model with a config (a model converted by hand
and saved with ``save_pretrained`` reloads converted after :func:`restore`); :func:`record` writes it explicitly.
``convert`` holds the keyword arguments of each :func:`fewbit_design.runtime.convert` call (a list for several
calls, replayed in order) as given (replayed as they are,
whatever keywords ``convert`` takes: they are checked against its signature when recorded and when restored); only
JSON values can be recorded, so ``filter`` (classes, callables) and ``example_inputs`` (tensors) cannot, and a
``tables`` value that is a :class:`~fewbit_design.table.Table` is recorded as its JSON form. ``plan`` is the plan as
:meth:`~fewbit_design.runtime.planner.MemoryPlan.save` writes it, read back and checked completely by
:meth:`~fewbit_design.runtime.planner.MemoryPlan.from_dict`. The conversion runs first, then the plan (the order in
which :class:`~.trainer.FewBitCallback` made them).

Why the missing record is detected at :func:`restore` and not at ``save_pretrained``: a model converted by hand
(``runtime.convert``, ``plan.apply``) leaves no trace in its config or its weights (few-bit tables are
non-persistent buffers, checkpointing replaces ``forward`` only, so the ``state_dict`` keys are the unconverted
model's), and transformers has no hook on ``save_pretrained`` short of patching it; a save-time check would need
every conversion to register a hook on the model. A model is restored exactly when its user expects a conversion,
so :func:`restore` of a model without a record warns once, naming the fix.
"""

from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..._version import __version__
from ...errors import FewBitError, check_keys, close_matches, show
from ..modules import ORIGINAL
from ..record import ATTRIBUTE, FORMAT, append_convert, forget, json_form, record_plan

__all__ = [
    "FORMAT",
    "ATTRIBUTE",
    "record",
    "read_record",
    "restore",
    "convert_options",
    "plan_options",
    "append_convert",
    "record_plan",
    "forget",
]

RECORD_FIELDS = ("format", "version", "convert", "plan")
#: convert's keywords that cannot be replayed from a JSON record (or that make no sense there)
NOT_RECORDED = {"filter": "it holds classes or a callable", "example_inputs": "it holds tensors", "report": ""}
#: plan_memory's arguments that FewBitCallback fills in itself
PLAN_FILLED = ("model", "example_inputs", "example_kwargs")

MISSING_RECORD = (
    "restore: {model}.config has no {attribute!r} record, so the model stays unconverted. A model converted by hand "
    "(runtime.convert, plan.apply) and saved with save_pretrained reloads unconverted: before saving, call "
    "fewbit_design.runtime.hf.record(model, convert={{...the convert arguments...}}, plan=plan) (FewBitCallback "
    "records it for you), or convert this model again"
)


def _signature_names(function: Any) -> list[str]:
    return [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    ]


def _check_known(where: str, options: Mapping[str, Any], known: list[str], function: str) -> None:
    for key in options:
        if not isinstance(key, str):
            raise FewBitError(f"{where}: keys must be argument names of {function} (str), got {show(key)}")
        if key not in known:
            hints = close_matches(key, known)
            hint = f" (did you mean {', '.join(repr(h) for h in hints)}?)" if hints else ""
            raise FewBitError(f"{where}: {function} has no argument {key!r}{hint}; it takes {', '.join(known)}")


def convert_options(options: Any, where: str = "convert") -> dict[str, Any] | None:
    """The keyword arguments of :func:`fewbit_design.runtime.convert` as the record holds them (checked against its
    signature, JSON only), or None."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise FewBitError(f"{where} must be a dict of runtime.convert's keyword arguments or None, got {show(options)}")
    from ..conversion import argument_names

    known = [name for name in argument_names() if name not in NOT_RECORDED]
    for key, why in NOT_RECORDED.items():
        if key in options:
            because = f" ({why})" if why else ""
            raise FewBitError(
                f"{where}[{key!r}]: convert's {key!r} cannot be recorded in model.config{because}; the recordable "
                f"arguments are {', '.join(known)} (per-module tables by name: tables={{name: path or Table}})"
            )
    _check_known(where, options, known, "runtime.convert")
    return json_form(where, dict(options))


def plan_options(options: Any, where: str = "plan") -> dict[str, Any] | None:
    """Keyword arguments for :func:`fewbit_design.runtime.plan_memory` (checked against its signature; they are not
    recorded: the plan they make is), or None."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise FewBitError(f"{where} must be a dict of plan_memory's keyword arguments or None, got {show(options)}")
    from ..planner.plan import plan_memory
    from ..planner.techniques import plan_keywords

    filled = [key for key in PLAN_FILLED if key in options]
    if filled:
        raise FewBitError(f"{where}[{filled[0]!r}]: the callback passes the model and a batch of the train dataloader")
    known = [name for name in _signature_names(plan_memory) if name not in PLAN_FILLED] + plan_keywords()
    _check_known(where, options, known, "plan_memory")
    return dict(options)


def _config_of(model: Any, where: str) -> Any:
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"{where} takes a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    config = getattr(model, "config", None)
    if config is None or isinstance(config, dict):
        raise FewBitError(
            f"{where}: {type(model).__name__} has no config object (model.config) to keep the record in; it takes a "
            "Hugging Face PreTrainedModel"
        )
    return config


def record(model: torch.nn.Module, *, convert: Mapping[str, Any] | None = None, plan: Any = None) -> dict[str, Any]:
    """Record in ``model.config.fewbit`` how ``model`` was converted, so that ``save_pretrained`` saves it and
    :func:`restore` re-applies it after ``from_pretrained``; return the record.

    Args:
        model: a Hugging Face model (it has ``model.config``), converted already; it is not changed.
        convert: the keyword arguments ``runtime.convert`` was called with (``{}`` for its defaults), or None when
            it was not converted.
        plan: the :class:`~fewbit_design.runtime.planner.MemoryPlan` applied to it (or its ``to_dict()``), or None.

    Raises :class:`FewBitError` when ``convert`` holds an argument ``runtime.convert`` does not take or a value that
    is not JSON, or when ``plan`` is not a valid plan.
    """
    config = _config_of(model, "record")
    options = _checked_convert(convert, "record(convert=...)")
    saved_plan = None
    if plan is not None:
        from ..planner.plan import MemoryPlan

        if isinstance(plan, MemoryPlan):
            plan.validate("record(plan=...)")
            saved_plan = plan.to_dict()
        else:
            saved_plan = MemoryPlan.from_dict(plan, source="record(plan=...)").to_dict()
        saved_plan = json.loads(json.dumps(saved_plan))  # plain JSON (lists, not tuples), as save_pretrained writes
    data = {"format": FORMAT, "version": __version__, "convert": options, "plan": saved_plan}
    setattr(config, ATTRIBUTE, data)
    return data


def read_record(model: torch.nn.Module) -> dict[str, Any] | None:
    """The record of ``model.config`` checked completely (the plan read back as a
    :class:`~fewbit_design.runtime.planner.MemoryPlan`), or None when it has none. Raises :class:`FewBitError`
    naming the field for a record of another format (another version of fewbit-design) or one that names something
    this version does not know (a convert argument, a technique)."""
    config = _config_of(model, "restore")
    data = getattr(config, ATTRIBUTE, None)
    if data is None:
        return None
    where = f"{type(model).__name__}.config.{ATTRIBUTE}"
    if isinstance(data, dict) and data.get("format") != FORMAT:
        written = f" (written by fewbit-design {data['version']})" if isinstance(data.get("version"), str) else ""
        raise FewBitError(
            f"{where}: format {show(data.get('format'))}{written} is not one this version ({__version__}) reads "
            f"({FORMAT!r}): install the fewbit-design that saved the model, or convert it again"
        )
    check_keys(where, data, RECORD_FIELDS)
    options = _checked_convert(data["convert"], f"{where}.convert")
    plan = None
    if data["plan"] is not None:
        from ..planner.plan import MemoryPlan

        plan = MemoryPlan.from_dict(data["plan"], source=f"{where}.plan")
    return {"format": FORMAT, "version": data["version"], "convert": options, "plan": plan}


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Re-apply the conversion recorded in ``model.config.fewbit`` (by :class:`~.trainer.FewBitCallback` or
    :func:`record`) to ``model``, in place, e.g. right after ``from_pretrained``; return the model.

    The whole record is checked before the model changes (:func:`read_record`); then ``runtime.convert(model,
    **record["convert"])`` and the plan's ``apply`` run, in that order. A model without a record is returned as it
    is, with a warning (once per model) that names the fix: it was saved unconverted or converted by hand without
    :func:`record`. Raises :class:`FewBitError` for a record of another format or naming something unknown, and
    when the plan does not fit the model (another architecture) or was applied to it already.
    """
    if _converted(model):
        return model  # the record is applied already (restore twice, or a model converted in this process)
    data = read_record(model)
    if data is None:
        if not getattr(model, "_fewbit_missing_record_warned", False):
            model._fewbit_missing_record_warned = True
            warnings.warn(MISSING_RECORD.format(model=type(model).__name__, attribute=ATTRIBUTE), stacklevel=2)
        return model
    if data["plan"] is not None:
        data["plan"].check_model(model)  # the architecture, before convert changes anything
    from ..conversion import convert

    calls = data["convert"]
    for call in [calls] if isinstance(calls, dict) else calls or []:
        model = convert(model, **call)
    if data["plan"] is not None:
        model = data["plan"].apply(model)
    return model


def _converted(model: torch.nn.Module) -> bool:
    return ORIGINAL in model.__dict__ or model.__dict__.get("fewbit_memory_plan") is not None


def _checked_convert(convert: Any, where: str) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The convert part of a record, checked: None, one call's keyword arguments (a dict), or several (a list)."""
    if not isinstance(convert, list | tuple):
        return convert_options(convert, where)
    return [convert_options(call, f"{where}[{index}]") for index, call in enumerate(convert)]
