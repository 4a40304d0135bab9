"""The technique contract: a technique is one folder and one registry line. A toy technique that lives only in
tests/toy_technique/ (registered here as a registry line would) goes through ``runtime.convert`` (applied, measured,
switched off by its own keyword, reported), ``plan_memory`` (profiled, chosen, its option in the plan), the plan file
(its setting saved and loaded, checked) and the plan's report, with no other file knowing it."""

from __future__ import annotations

import pytest
import torch
from toy_technique.technique import ExpSquare, ExpTwice

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import registry

TOY = "toy_technique.technique"


def chain() -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), ExpSquare()) for _ in range(3)]
    return torch.nn.Sequential(*blocks)


def test_the_toy_is_registered_only_inside_the_block():
    assert "toy" not in registry.names()
    with registry.registered(TOY) as toy:
        assert toy.name == "toy" and registry.names()[-1] == "toy"
        assert toy.exact and toy.settings == {"toy_scale": 2.0}
    assert "toy" not in registry.names()


def test_convert_applies_measures_reports_and_switches_off_the_toy():
    x = torch.randn(32, 64)
    with registry.registered(TOY):
        model = runtime.convert(chain(), example_inputs=x)
        entry = model.convert_report.technique("toy")
        assert entry.status == "applied" and entry.replaced == 3 and entry.after < entry.before, str(entry)
        assert entry.approximate is None and "toy: folded 3 exp(x) * exp(x)" in str(model.convert_report)
        assert all(type(block[2]) is ExpTwice for block in model)
        off = runtime.convert(chain(), example_inputs=x, toy=False)
        assert off.convert_report.technique("toy").reason == "switched off (toy=False)"
        assert all(type(block[2]) is ExpSquare for block in off)
        # exp(2 x) against exp(x) * exp(x): a few float32 roundings apart, through three blocks
        torch.testing.assert_close(model(x), chain()(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(FewBitError, match="unexpected keyword 'toy'"):
        runtime.convert(chain(), toy=False)


def test_plan_memory_chooses_the_toy_and_its_plan_file_round_trips(tmp_path):
    x = torch.randn(32, 64)
    with registry.registered(TOY):
        plan = runtime.plan_memory(
            chain(), x, budget="min", allow=("toy",), technique_settings={"toy_scale": 2.0}, repeats=1
        )
        assert set(plan.choices) == {"toy"}, plan.choices
        assert plan.settings["toy_scale"] == 2.0 and "toy" in plan.report()
        path = tmp_path / "plan.json"
        plan.save(path)
        loaded = runtime.load_plan(path)
        assert loaded.choices == plan.choices and loaded.settings["toy_scale"] == 2.0
        model = chain()
        loaded.apply(model)
        assert all(type(block[2]) is ExpTwice for block in model)
        with pytest.raises(FewBitError, match="toy_scale"):
            runtime.plan_memory(chain(), x, allow=("toy",), technique_settings={"toy_scale": -1.0})
