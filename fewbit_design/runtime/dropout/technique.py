"""Compact dropout as the runtime sees it: every ``torch.nn.Dropout`` with ``p > 0`` keeps its mask for backward as
1 bit per element (mode ``"bits"``, the default) or the random state that draws it again (``"seed"``) instead of
native's byte or float per element; the same draws, so exact (bitwise native forward and gradients). Plan setting:
``dropout_mode``. ``runtime.convert`` runs it (``dropout=False`` turns it off) and reports dropout functions called
in forward code, which it cannot reach."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import check_choice
from ..registry import ConvertRole, Technique
from .ops import MODES


@dataclass(frozen=True)
class DropoutOptions:
    """Options of compact dropout.

    Attributes:
        mode: what the replaced modules keep for backward, ``"bits"`` or ``"seed"`` (:mod:`.ops`).
    """

    mode: str = "bits"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", check_choice("dropout_mode", self.mode, MODES))


def _convert(model: torch.nn.Module, options: DropoutOptions, probe: Any) -> torch.nn.Module:
    from .convert import convert

    return convert(model, mode=options.mode)


def _unseen(model: torch.nn.Module, probe: Any, options: DropoutOptions) -> list[tuple[str, str, str, int]]:
    from .convert import functional_calls

    return functional_calls(model, probe, options)


TECHNIQUE = Technique(
    name="dropout",
    summary="dropout layers that keep their mask as 1 bit per element (or the random state) for backward",
    seam="module",
    options=DropoutOptions,
    convert=_convert,
    in_convert=ConvertRole("dropout_report", switch="dropout", unseen=_unseen),
)
