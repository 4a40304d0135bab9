"""The planner's predictions against measurement: over a sweep of widths, batch sizes and budgets, the measured peak
of the applied plan (``memory.peak``) never exceeds the budget and the predicted peak is within 5% of it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from fewbit_design import runtime

TOLERANCE = 0.05


def _mlp(width: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(4)]
    )


def _check(plan, build, x) -> tuple[int, int]:
    model = plan.apply(build())
    measured = plan.measure(model, x, steps=0)["peak_bytes"]
    handle = getattr(model, "fewbit_offload", None)
    if handle is not None:
        handle.remove()
    predicted = plan.predicted_peak_bytes
    where = f"{plan.choices}: budget {plan.budget_bytes}, predicted {predicted}, measured {measured}"
    assert measured <= plan.budget_bytes, where
    assert abs(predicted - measured) <= TOLERANCE * measured, where
    return predicted, measured


@pytest.mark.parametrize(("width", "batch"), [(32, 64), (32, 256), (64, 128)])
def test_measured_peak_within_budget_and_prediction_over_a_sweep(width, batch):
    """The hidden state (batch x width floats) is under ``offload_min_bytes`` and the blocks' inner activations are
    over it, so an offloaded block keeps its input in memory: regression for the planner taking it as freed (its
    saved-tensor count could not see what the offload region kept), which put plans over their budget."""
    x = torch.randn(batch, width)
    min_bytes = 2 * batch * width * 4  # over the hidden state, under the inner activations (4 x wider)
    base = runtime.plan_memory(
        _mlp(width), x, budget=None, offload_min_bytes=min_bytes, approximate="allowed", repeats=1
    )
    unconverted, smallest = base.unconverted_peak_bytes, base.facts["minimum_budget_bytes"]
    plans = [base.replan(round(unconverted - k * (unconverted - smallest) / 3)) for k in range(4)]
    plans.append(base.replan("min", allow=("offload",)))  # every block offloaded
    assert "offload" in plans[-1].techniques_used()
    for plan in plans:
        _check(plan, lambda: _mlp(width), x)
    # fixed choices, whatever the timings: checkpointed blocks before one that saves its input, where the peak is a
    # checkpointed block's backward after the next block's backward freed the hidden state between them
    # (regression: the prediction kept it alive); every block offloaded; few-bit tables in every block
    for choices in [("checkpoint",) * 3 + ("plain",), ("offload",) * 4, ("fewbit+checkpoint",) * 3 + ("fewbit",)]:
        plan = dataclasses.replace(base, choices=choices, budget_bytes=base.unconverted_peak_bytes)
        _check(plan, lambda: _mlp(width), x)
