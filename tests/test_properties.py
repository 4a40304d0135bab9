"""Property-based tests (hypothesis) of table loading and the few-bit kernels (issue 16.3, 16.5)."""

import json

import pytest

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import nn as fnn


def relu_table(**overrides):
    document = {
        "format": "fewbit-table/1",
        "activation": "relu",
        "params": {},
        "bits": 1,
        "mode": "levelsets",
        "symmetric": False,
        "weight": {"kind": "uniform", "low": -10.0, "high": 10.0},
        "boundaries": [0.0],
        "codes": [0, 1],
        "levels": [0.0, 1.0],
        "error": 0.0,
        "snr_db": None,
    }
    document.update(overrides)
    return document


def test_regression_level_finite_in_float64_not_float32(tmp_path):
    path = tmp_path / "big-level.json"
    path.write_text(json.dumps(relu_table(levels=[0.0, 1e300])))
    with pytest.raises(FewBitError, match="levels"):
        fnn.ReLU(table=path)


def test_regression_deeply_nested_json(tmp_path):
    path = tmp_path / "nested.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FewBitError, match="nest"):
        fnn.ReLU(table=path)
