"""One report type: every technique's ``convert`` sets a :class:`~fewbit_design.runtime.report.Report` on the model,
which ``runtime.convert`` reads the same way (count, what was left alone, the lines), and a technique whose report is
anything else is refused with a line naming it."""

from __future__ import annotations

import pytest
import torch
import toy_technique.technique as toy
from families import build

from fewbit_design import runtime
from fewbit_design.runtime import registry
from fewbit_design.runtime.modules import Skipped
from fewbit_design.runtime.report import Report

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")


def _reports(model: torch.nn.Module) -> dict[str, Report]:
    return {item.name: item.report for item in model.convert_report.techniques if item.report is not None}


@pytest.mark.parametrize(("family", "compress"), [("llama", None), ("llama", 8), ("gpt2", 8)])
def test_every_technique_report_is_one_type(family, compress):
    model, batch = build(family, dropout=0.1 if family == "gpt2" else 0.0)
    model = runtime.convert(model, example_inputs=batch, compress=compress, dropout=True)
    reports = _reports(model)
    assert len(reports) >= 3, model.convert_report
    for name, report in reports.items():
        assert isinstance(report, Report), (name, type(report))
        text = str(report).splitlines()
        assert text[0] == report.head() and report.count == len(report.replaced), name
        assert model.convert_report.technique(name).replaced == report.count, name
        # what was left alone is (class path, reason) pairs whatever the technique's record of it
        assert all(isinstance(reason, str) and reason for _, reason in report.left_alone()), name


def test_the_base_lines_count_what_was_left_alone_per_class_and_reason():
    skipped = [Skipped((f"{i}",), "torch.nn.modules.linear.Linear", "no activation") for i in range(3)]
    report = Report(replaced=["a", "b"], skipped=[*skipped, ("x", "Conv", "groups")], already=1)
    assert str(report).splitlines() == [
        "replaced 2 module(s), left 4 alone",
        "  left alone: 3 x torch.nn.modules.linear.Linear: no activation",
        "  left alone: 1 x Conv: groups",
        "  1 module(s) were converted already",
    ]


def test_a_technique_whose_report_is_not_a_report_is_refused(monkeypatch):
    class NotAReport:
        replaced: list = []

    monkeypatch.setattr(toy, "ToyReport", NotAReport)
    blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), toy.ExpSquare())
    with registry.registered("toy_technique.technique"):
        with pytest.raises(TypeError, match="technique 'toy': its convert set model.toy_report to a NotAReport"):
            runtime.convert(blocks, example_inputs=torch.randn(2, 4))
