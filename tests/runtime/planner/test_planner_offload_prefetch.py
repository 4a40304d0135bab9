"""The planner with offload's transfers on a thread (``offload_prefetch > 0``): the plan's offload is
blockwise, each offloaded block's predicted peaks carry ``prefetch`` times its largest transfer, so the measured
peak never exceeds the prediction whatever the transfer thread's timing; the setting round-trips through plan.json."""

import pytest
import torch
from torch import nn

from fewbit_design import runtime
from fewbit_design.errors import FewBitError


def _blocks(count=6, width=64):
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)) for _ in range(count)]
    )


@pytest.mark.parametrize("prefetch", [1, 2])
def test_prefetch_plan_peak_stays_under_its_prediction(prefetch, tmp_path, one_torch_thread):
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    kwargs = dict(allow=("offload",), offload_min_bytes=0, repeats=1)
    synchronous = runtime.plan_memory(_blocks(), x, objective="memory", **kwargs)
    plan = runtime.plan_memory(_blocks(), x, objective="memory", offload_prefetch=prefetch, **kwargs)
    assert plan.settings["offload"]["prefetch"] == prefetch and plan.settings["offload"]["blockwise"] is True
    offloaded = [row for row in plan.rows() if row["technique"] == "offload"]
    assert offloaded
    # the allowance: every offloaded block's peaks carry prefetch x its largest transfer (128 KiB: a 512 x 64 input)
    assert plan.predicted_peak_bytes >= synchronous.predicted_peak_bytes + prefetch * 512 * 64 * 4 - 4096
    for _ in range(3):  # the thread's timing varies between steps: the bound holds at each
        model = plan.apply(_blocks())
        measured = plan.measure(model, x, steps=1)
        assert measured["peak_bytes"] <= plan.predicted_peak_bytes
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = runtime.load_plan(path)
    assert loaded.settings["offload"] == plan.settings["offload"]
    model = loaded.apply(_blocks())
    assert model.fewbit_offload._offloader.options.prefetch == prefetch
    assert model.fewbit_offload._offloader.options.blockwise is True


def test_bad_offload_prefetch():
    with pytest.raises(FewBitError, match="offload_prefetch"):
        runtime.plan_memory(_blocks(1), torch.randn(4, 64), offload_prefetch=-1)
