"""Where each predicted event ends in a measured step (``MemoryPlan.measure`` -> ``measured["marks"]``), so the
``memory`` figure draws the predicted and the measured live bytes on one x axis."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime.planner import MemoryPlan
from fewbit_design.runtime.planner.model import replay


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])


@pytest.fixture(scope="module")
def measured_plan() -> MemoryPlan:
    x = torch.randn(32, 16)
    plan = runtime.plan_memory(_model(), x, budget="min", allow=("checkpoint",), repeats=1)
    plan.measure(plan.apply(_model()), x, steps=0)
    return plan


def test_marks_follow_the_predicted_events_in_order(measured_plan):
    marks, timeline = measured_plan.measured["marks"], measured_plan.measured["timeline"]
    labels = [label for label, _ in replay(measured_plan.costs, measured_plan._selected()).timeline]
    names = [block.name for block in measured_plan.costs.blocks]
    # every event is marked but block 0's backward (the input x needs no gradient)
    assert set(marks) == set(labels) - {f"backward {names[0]}"}
    ordered = [marks[label] for label in labels if label in marks]
    assert ordered == sorted(ordered), "the events end in the order of the predicted timeline"
    assert marks["modules before the chain (backward)"] == len(timeline)
    # the blocks' forwards run before any backward, each forward runs operators (two linears, a GELU)
    forwards = [marks[f"forward {name}"] for name in names]
    assert all(b > a for a, b in zip(forwards, forwards[1:], strict=False))
    assert marks["loss and modules after the chain"] > forwards[-1]


def test_marks_are_checked_on_load(measured_plan):
    data = measured_plan.to_dict()
    assert MemoryPlan.from_dict(data) == measured_plan  # a plan with marks loads back equal
    data["measured"]["marks"] = {"forward 0": -1}
    with pytest.raises(FewBitError, match=r"measured.marks\['forward 0'\]"):
        MemoryPlan.from_dict(data)
    del data["measured"]["marks"]  # plans measured before marks existed load
    assert MemoryPlan.from_dict(data).measured.get("marks") is None
