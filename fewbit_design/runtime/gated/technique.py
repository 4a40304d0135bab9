"""The gated-MLP op as the runtime sees it: every gated MLP (``down(act(gate(x)) * up(x))``) keeps x, gate and up
for backward and recomputes the rest (exact gradients), or, in compressed mode, K-bit codes of x, gate and up,
recomputing act(gate) and act'(gate) from gate's (approximate gradients). Plan settings: ``gated_mode``
(``"exact"``, the default, or ``"compressed"``) and ``gated_bits`` (K, 2 to 8, default 8; read in compressed mode)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import check_choice, check_integer
from ..registry import ConvertRole, Technique
from .nn import MODES


@dataclass(frozen=True)
class GatedOptions:
    """Options of the gated-MLP op.

    Attributes:
        mode: ``"exact"`` or ``"compressed"``.
        bits: the compressed mode's code width, 2 to 8.
        rounding: the compressed mode's rounding, ``"stochastic"`` or ``"nearest"`` (not a plan setting).
    """

    mode: str = "exact"
    bits: int = 8
    rounding: str = field(default="stochastic", metadata={"setting": None})

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", check_choice("gated_mode", self.mode, MODES))
        object.__setattr__(self, "bits", check_integer("gated_bits", self.bits, low=2, high=8))
        check_choice("gated rounding", self.rounding, ("stochastic", "nearest"))


def _convert(model: torch.nn.Module, options: GatedOptions, probe: Any) -> torch.nn.Module:
    from .convert import convert

    return convert(model, mode=options.mode, bits=options.bits, rounding=options.rounding)


def _approximate(options: GatedOptions) -> str | None:
    if options.mode == "exact":
        return None
    return f"gradients of gated MLPs (compressed mode, {options.bits}-bit values)"


TECHNIQUE = Technique(
    name="gated",
    summary="gated MLPs (SwiGLU, GeGLU, fused gate_up) that keep x, gate and up and recompute the rest in backward",
    seam="module",
    options=GatedOptions,
    approximate=_approximate,
    convert=_convert,
    in_convert=ConvertRole(
        "gated_report",
        switch="gated",
        compress=lambda options, bits: GatedOptions("compressed", bits, options.rounding),
    ),
)
