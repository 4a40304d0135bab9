"""The planner's measured step reports the process RSS beside the live tensor bytes, and plans keep it."""

import os

import pytest
import torch
from torch import nn

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime.planner.plan import MemoryPlan

LINUX_MARK = os.path.exists("/proc/self/clear_refs") and os.access("/proc/self/clear_refs", os.W_OK)


def test_measured_rss_is_reported_and_saved():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)])
    x = torch.randn(64, 32)
    plan = runtime.plan_memory(model, x, allow=("checkpoint",), repeats=1)
    plan.measure(plan.apply(model), x, steps=1)
    rss = plan.measured["rss_peak_bytes"]
    if LINUX_MARK:
        assert isinstance(rss, int) and rss >= 0
        assert "process RSS over the measured step: peak +" in plan.report()
    else:
        assert rss is None and "process RSS: not measurable here" in plan.report()
    data = plan.to_dict()
    assert MemoryPlan.from_dict(data).measured["rss_peak_bytes"] == rss
    data["measured"]["rss_peak_bytes"] = -1
    with pytest.raises(FewBitError, match="measured.rss_peak_bytes"):
        MemoryPlan.from_dict(data)
    del data["measured"]["rss_peak_bytes"]  # a plan measured before the field existed still loads
    assert "rss_peak_bytes" not in MemoryPlan.from_dict(data).measured
