"""blpa.convert always returns the model; its report is the attribute ``blpa_report`` (``report=True`` used to
change the return type to a tuple)."""

import pytest
from torch import nn

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import blpa
from fewbit_design.runtime.blpa.fuse import FuseReport


def _model() -> nn.Sequential:
    model = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, affine=False))
    return model.append(nn.ReLU()).append(nn.Conv2d(4, 4, 1))


def test_blpa_convert_returns_the_model_and_sets_its_report():
    model = _model()
    returned = blpa.convert(model, bits=8)
    assert returned is model and isinstance(model[0], blpa.BNReLUConv2d)
    report = model.blpa_report
    assert isinstance(report, FuseReport)
    assert report.fused == [("0", "1", "2")] and report.skipped[0][0] == "3"


def test_every_call_overwrites_the_report():
    model = _model()
    first = blpa.convert(model).blpa_report
    second = blpa.convert(model).blpa_report  # the first run is fused already: nothing new, no warning
    assert second is not first and first.fused and second.fused == []


@pytest.mark.parametrize("value", [True, 1])
def test_report_argument_raises_one_line_naming_the_attribute(value):
    model = _model()
    with pytest.raises(FewBitError, match=r"model\.blpa_report") as raised:
        blpa.convert(model, report=value)
    assert "\n" not in str(raised.value)
    assert isinstance(model[0], nn.BatchNorm2d) and not hasattr(model, "blpa_report")  # nothing was done
