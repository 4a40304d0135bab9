"""The record of a conversion in a Hugging Face model's config: its format, and the writes that ``runtime.convert``,
``MemoryPlan.apply`` and ``runtime.unconvert`` make themselves (reading it back and restoring a model are
:mod:`.hf.config_record`'s). This module imports nothing of the runtime but the errors and the table format, so
that the converters can write the record without importing the Hugging Face side.

The record is one JSON object at ``model.config.fewbit``: ``{"format": "fewbit-hf/1", "version": ..., "convert":
{...} or [{...}, ...] or null, "plan": {...} or null}`` (one convert call as a dict, several as a list, replayed in
order).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from .._version import __version__
from ..errors import FewBitError, show

__all__ = ["FORMAT", "ATTRIBUTE", "json_form", "append_convert", "record_plan", "forget"]

FORMAT = "fewbit-hf/1"
#: the attribute of ``model.config`` that holds the record
ATTRIBUTE = "fewbit"


def json_form(where: str, value: Any) -> Any:
    """``value`` as JSON data (Tables as their JSON form, paths as strings, tuples as lists), or a FewBitError
    naming the first part that is not JSON."""
    from ..table import Table

    if isinstance(value, Table):
        return value.to_dict()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise FewBitError(f"{where} is {value!r}: a record in model.config must be finite JSON")
        return value
    if isinstance(value, list | tuple):
        return [json_form(f"{where}[{index}]", item) for index, item in enumerate(value)]
    if isinstance(value, Mapping):
        result = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise FewBitError(f"{where} has the key {show(key)}: a record in model.config needs string keys")
            result[key] = json_form(f"{where}[{key!r}]", item)
        return result
    kind = type(value).__name__
    raise FewBitError(f"{where} is {show(value)} ({kind}): a record in model.config holds JSON values only")


def _config_or_none(model: Any) -> Any:
    config = getattr(model, "config", None)
    return None if config is None or isinstance(config, dict) else config


def _current(config: Any) -> dict[str, Any] | None:
    data = getattr(config, ATTRIBUTE, None)
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def append_convert(model: Any, options: Mapping[str, Any]) -> None:
    """Add one ``runtime.convert`` call to the record of a model with a config (``runtime.convert`` calls this, with
    arguments it has checked); a call whose options JSON cannot hold (a ``filter`` callable) drops the record, so
    that restoring the model warns rather than replays half of it.

    Args:
        model: the converted model
        options: the call's keyword arguments (``example_inputs`` is not recorded: a probe, not a choice)
    """
    config = _config_or_none(model)
    if config is None:
        return
    data = _current(config)
    try:
        call = json_form("convert", {key: value for key, value in options.items() if key != "example_inputs"})
    except FewBitError:
        if data is not None:
            delattr(config, ATTRIBUTE)
        return
    calls = [] if data is None or data["convert"] is None else data["convert"]
    calls = [calls] if isinstance(calls, dict) else list(calls)
    recorded = call if not calls else calls + [call]
    plan = None if data is None else data["plan"]
    setattr(config, ATTRIBUTE, {"format": FORMAT, "version": __version__, "convert": recorded, "plan": plan})


def record_plan(model: Any, plan: Any) -> None:
    """Put the applied plan in the record of a model with a config (``MemoryPlan.apply`` calls this).

    Args:
        model: the planned model
        plan: the applied plan (its ``to_dict()`` is recorded)
    """
    config = _config_or_none(model)
    if config is None:
        return
    data = _current(config)
    saved = json.loads(json.dumps(plan.to_dict()))  # plain JSON (lists, not tuples), as save_pretrained writes
    convert = None if data is None else data["convert"]
    setattr(config, ATTRIBUTE, {"format": FORMAT, "version": __version__, "convert": convert, "plan": saved})


def forget(model: Any) -> None:
    """Remove the record from a model's config (``runtime.unconvert`` calls this).

    Args:
        model: the model
    """
    config = _config_or_none(model)
    if config is not None and hasattr(config, ATTRIBUTE):
        delattr(config, ATTRIBUTE)
