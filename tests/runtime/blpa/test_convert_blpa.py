"""blpa.convert: report, strict mode when nothing was fused, the no-fusion warning, and Hugging Face ResNet (the
BN -> ReLU -> conv pattern spans two ResNetConvLayers)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import blpa


def test_strict_raises_when_nothing_was_fused_and_the_default_warns():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.GELU(), nn.Conv2d(4, 4, 1))
    with pytest.raises(FewBitError, match=r"strict=True.*nothing fused in Sequential.*BatchNorm -> ReLU"):
        blpa.convert(model, strict=True)
    with pytest.warns(UserWarning, match="nothing fused in Sequential"):
        report = blpa.convert(model).blpa_report
    assert report.fused == [] and isinstance(model[1], nn.BatchNorm2d)


def test_report_names_the_fused_runs_and_logs(caplog):
    model = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, affine=False))
    model.append(nn.ReLU()).append(nn.Conv2d(4, 4, 1))
    with caplog.at_level(logging.INFO, logger="fewbit_design"):
        report = blpa.convert(model).blpa_report
    assert report.fused == [("0", "1", "2")]
    assert report.skipped[0][0] == "3" and "affine=True" in report.skipped[0][1]
    assert "fused 1 BatchNorm -> ReLU -> op run" in caplog.text


transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")


@pytest.mark.parametrize("layer_type", ["basic", "bottleneck"])
def test_hugging_face_resnet_is_fused_across_conv_layers_with_an_exact_forward(layer_type):
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type=layer_type)
    model = transformers.ResNetModel(config).double()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    report = blpa.convert(model, bits=8, strict=True).blpa_report
    assert len(report.fused) == (2 if layer_type == "basic" else 4)  # one per pair of consecutive ResNetConvLayers
    assert report.fused[0] == (
        "encoder.stages.0.layers.0.layer.0.normalization",
        "encoder.stages.0.layers.0.layer.0.activation",
        "encoder.stages.0.layers.0.layer.1.convolution",
    )
    assert isinstance(model.encoder.stages[0].layers[0].layer[0].normalization, blpa.BNReLUConv2d)
    for mode in ("train", "eval"):  # training: batch statistics; eval: running statistics, the unit follows the mode
        getattr(model, mode)(), getattr(reference, mode)()
        torch.testing.assert_close(
            model(x).last_hidden_state, reference(x).last_hidden_state, rtol=0, atol=1e-12, msg=mode
        )
    model.train()
    model(x).last_hidden_state.sum().backward()
    assert model.encoder.stages[0].layers[0].layer[-1].normalization.weight.grad is not None
