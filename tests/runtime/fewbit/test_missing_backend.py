"""A forced backend that is not installed (issue 20, item 18): one clear error, not a ModuleNotFoundError from the
middle of a forward pass."""

from __future__ import annotations

import pytest
import torch

from fewbit_design.errors import FewBitError
from fewbit_design.runtime.fewbit import backends
from fewbit_design.runtime.fewbit import ops as op


@pytest.mark.parametrize("backend", ["triton", "numba"])
def test_a_forced_backend_that_is_not_installed_is_one_error(monkeypatch, backend):
    monkeypatch.setattr(backends, "_importable", lambda module: module != backend)
    monkeypatch.setenv(op.BACKEND_ENV, backend)
    with pytest.raises(FewBitError, match=f"backend '{backend}' .* needs {backend}, which is not installed"):
        op.quantize(torch.randn(16), torch.zeros(1), torch.tensor([0, 1], dtype=torch.uint8), 1)
    monkeypatch.setenv(op.BACKEND_ENV, "auto")
    assert op.backend_for(torch.device("cpu")) in ("numba", "reference")
