"""The gated-MLP op as the runtime sees it: every gated MLP (``down(act(gate(x)) * up(x))``) keeps x, gate and up
for backward and recomputes the rest (exact gradients); in compressed mode, K-bit codes of x, gate and up,
recomputing act(gate) and act'(gate) from gate's; in recompute mode, K-bit codes of x alone, recomputing gate and up
from them (approximate gradients both). Plan settings: ``gated_mode`` (``"exact"``, the default, ``"compressed"`` or
``"recompute"``) and ``gated_bits`` (K, 2 to 8, default 8; read in the compressed and recompute modes)."""

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
        mode: ``"exact"``, ``"compressed"`` or ``"recompute"``.
        bits: the code width of the compressed and recompute modes, 2 to 8.
        rounding: their rounding, ``"stochastic"`` or ``"nearest"`` (not a plan setting).
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
    return f"gradients of gated MLPs ({options.mode} mode, {options.bits}-bit values)"


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
        compress=lambda options, bits: GatedOptions("recompute", bits, options.rounding),
    ),
)
