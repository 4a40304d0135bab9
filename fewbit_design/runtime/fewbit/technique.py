"""Few-bit activations as the runtime sees it: every supported activation module keeps b-bit codes of its derivative
for backward (approximate activation gradients). Plan settings: ``bits`` (``plan_memory(bits=...)``),
``fewbit_weight``, ``fewbit_mode``; ``runtime.convert`` also takes the converter's ``filter``, ``tables``,
``only_if_smaller`` and ``strict``, and ``activations=False`` turns it off."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import check_boolean, check_choice, check_integer
from ...table import MODES
from ..registry import ConvertRole, Technique
from .lookup import WEIGHTS


@dataclass(frozen=True)
class FewbitOptions:
    """Options of the few-bit activations (:func:`.convert.convert`'s).

    Attributes:
        bits: bits per element of the shipped tables, 1 to 8.
        weight: the weight the shipped tables were designed for.
        mode: the design mode of the shipped tables.
        filter: which modules get which table (not a plan setting).
        tables: per-module tables by qualified name (not a plan setting).
        only_if_smaller: leave alone activations whose replacement would not reduce the bytes saved.
        strict: raise when an activation module without few-bit support is present.
    """

    bits: int = field(default=3, metadata={"setting": "bits"})
    weight: str = "uniform"
    mode: str = "levelsets"
    filter: Any = field(default=None, metadata={"setting": None})
    tables: Mapping[str, Any] | None = field(default=None, metadata={"setting": None})
    only_if_smaller: bool = field(default=True, metadata={"setting": None})
    strict: bool = field(default=False, metadata={"setting": None})

    def __post_init__(self) -> None:
        from .convert import _check_filter

        object.__setattr__(self, "bits", check_integer("bits", self.bits, low=1, high=8))
        check_choice("weight", self.weight, WEIGHTS)
        check_choice("mode", self.mode, MODES)
        check_boolean("only_if_smaller", self.only_if_smaller)
        check_boolean("strict", self.strict)
        _check_filter(self.filter)


def _convert(model: torch.nn.Module, options: FewbitOptions, probe: Any) -> torch.nn.Module:
    from .convert import convert

    measure = probe if options.only_if_smaller else None
    return convert(
        model,
        bits=options.bits,
        weight=options.weight,
        mode=options.mode,
        filter=options.filter,
        tables=options.tables,
        only_if_smaller=options.only_if_smaller,
        example_inputs=measure,
        strict=options.strict,
    )


def _check(model: torch.nn.Module, options: FewbitOptions) -> None:
    """Every name in ``tables`` is a module of the model (before anything changes)."""
    from .convert import _check_table_names, _check_tables
    from .matching import _slots

    _check_table_names(model, _check_tables(options.tables), _slots(model, root=True))


def _unseen(model: torch.nn.Module, probe: Any) -> list[tuple[str, str, str, int]]:
    from .unseen import functional_calls

    return functional_calls(model, probe)


TECHNIQUE = Technique(
    name="fewbit",
    summary="activations that keep b-bit codes of their derivative for backward",
    seam="module",
    options=FewbitOptions,
    approximate=lambda options: "activation gradients (few-bit tables)",
    convert=_convert,
    aliases={"bits": "bits"},
    in_convert=ConvertRole(
        "fewbit_report",
        switch="activations",
        keywords=("bits", "weight", "mode", "filter", "tables", "only_if_smaller", "strict"),
        check=_check,
        unseen=lambda model, probe, options: _unseen(model, probe),
    ),
)
