"""convert always returns the model; its report is the attribute ``fewbit_report`` (``report=True`` used to
change the return type to a tuple)."""

import pytest
import torch

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import nn as fnn
from fewbit_design.runtime.fewbit.convert import ConversionReport


def test_convert_returns_the_model_and_sets_its_report(tables_dir):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4), torch.nn.PReLU())
    returned = runtime.convert(model, bits=2)
    assert returned is model and isinstance(model[1], fnn.GELU)
    report = model.fewbit_report
    assert isinstance(report, ConversionReport)
    assert [(item.names, item.bits) for item in report.replaced] == [(("1",), 2)]
    assert report.skipped[0].names == ("3",) and "trainable slope" in report.skipped[0].reason


def test_every_call_overwrites_the_report(tables_dir):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    first = runtime.convert(model).fewbit_report
    second = runtime.convert(model).fewbit_report
    assert second is not first and len(first.replaced) == 1
    assert second.replaced == [] and second.already_fewbit == 1


def test_an_activation_given_alone_carries_the_report_on_its_replacement(tables_dir):
    converted = runtime.convert(torch.nn.GELU())
    assert isinstance(converted, fnn.GELU) and converted.fewbit_report.replaced[0].names == ("",)


@pytest.mark.parametrize("value", [True, 1, "yes"])
def test_report_argument_raises_one_line_naming_the_attribute(tables_dir, value):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    with pytest.raises(FewBitError, match=r"model\.fewbit_report") as raised:
        runtime.convert(model, report=value)
    assert "\n" not in str(raised.value)
    assert isinstance(model[1], torch.nn.GELU) and not hasattr(model, "fewbit_report")  # nothing was done
