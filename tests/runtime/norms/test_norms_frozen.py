"""Memory-sharing norms over frozen parameters (LoRA / PEFT fine-tuning, frozen LayerNorms): the converter's probe
checks the formula on a copy whose parameters all require grad, so a frozen norm is replaced like any other (sharing
its frozen parameters), by ``norms.convert`` and by the planner's technique, and ``plan_memory`` profiles a chain
with a frozen block."""

from __future__ import annotations

import pytest
import torch

from fewbit_design import runtime
from fewbit_design.runtime import norms
from fewbit_design.runtime.norms import MemorySharingNorm
from fewbit_design.runtime.norms.ops import DEFAULT_THRESHOLD
from fewbit_design.runtime.norms.technique import TECHNIQUE, NormsOptions

WIDTH = 16

FROZEN = {
    "LayerNorm": lambda: torch.nn.LayerNorm(WIDTH).requires_grad_(False),
    "LayerNorm-weight": lambda: _freeze(torch.nn.LayerNorm(WIDTH), "weight"),
    "LayerNorm-bias": lambda: _freeze(torch.nn.LayerNorm(WIDTH), "bias"),
    "RMSNorm": lambda: torch.nn.RMSNorm(WIDTH, eps=1e-6).requires_grad_(False),
}


def _freeze(module: torch.nn.Module, name: str) -> torch.nn.Module:
    getattr(module, name).requires_grad_(False)
    return module


@pytest.mark.parametrize("name", list(FROZEN))
def test_norms_convert_replaces_a_frozen_norm_sharing_its_frozen_parameters(name):
    norm = FROZEN[name]()
    parameters = dict(norm.named_parameters())
    model = norms.convert(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), norm))
    assert isinstance(model[1], MemorySharingNorm), str(model.norms_report)
    shared = dict(model[1].named_parameters())
    assert shared.keys() == parameters.keys() and all(shared[key] is parameters[key] for key in parameters)
    assert [p.requires_grad for p in shared.values()] == [p.requires_grad for p in parameters.values()]


@pytest.mark.parametrize("name", list(FROZEN))
def test_the_planner_technique_converts_a_block_with_a_frozen_norm(name):
    block = torch.nn.Sequential(FROZEN[name](), torch.nn.Linear(WIDTH, WIDTH))
    converted = TECHNIQUE.apply(block, NormsOptions(DEFAULT_THRESHOLD))
    assert isinstance(converted[0], MemorySharingNorm)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.fc = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_plan_memory_with_the_norms_technique_profiles_a_chain_with_a_frozen_block():
    torch.manual_seed(0)
    model = _Chain()
    model.layers[1].requires_grad_(False)  # its input requires grad (block 0 trains): its norm runs backward
    plan = runtime.plan_memory(model, torch.randn(4, WIDTH), budget="min", allow=("norms",), repeats=1)
    assert len(plan.choices) == 3 and set(plan.choices) <= {"plain", "norms"}
