"""A toy technique, registered by tests of the technique contract (``registry.registered``) to show that a technique
is one folder and one registry line: this folder and nothing else.

It replaces :class:`ExpSquare` (``exp(x) * exp(x)``: two exponentials, both saved by the product) with
:class:`ExpTwice` (``exp(2 x)``: one saved output), exact up to rounding. Plan setting ``toy_scale`` (the factor
of the exponent, 2 for the square)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fewbit_design.errors import check_number
from fewbit_design.runtime.registry import ConvertRole, Technique
from fewbit_design.runtime.report import Report


class ExpSquare(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x) * torch.exp(x)


class ExpTwice(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.scale * x)


@dataclass(kw_only=True)
class ToyReport(Report):
    def head(self) -> str:
        return f"toy: folded {self.count} exp(x) * exp(x)"


@dataclass(frozen=True)
class ToyOptions:
    scale: float = 2.0

    def __post_init__(self) -> None:
        check_number("toy_scale", self.scale, low=0.0)


def convert(model: torch.nn.Module, options: ToyOptions, probe: Any) -> torch.nn.Module:
    report = ToyReport()
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if type(child) is ExpSquare:
                parent._modules[name] = ExpTwice(options.scale)
                report.replaced.append((f"{parent_name}.{name}".strip("."), "ExpSquare"))
    model.toy_report = report
    return model


TECHNIQUE = Technique(
    name="toy",
    summary="exp(x) * exp(x) folded into exp(2 x)",
    seam="module",
    options=ToyOptions,
    convert=convert,
    in_convert=ConvertRole("toy_report", switch="toy"),
)
