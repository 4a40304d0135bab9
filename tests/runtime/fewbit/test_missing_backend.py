"""A forced backend that is not installed, or Triton forced on CPU tensors without its interpreter: one clear error,
not a ModuleNotFoundError or Triton's driver error from the middle of a forward pass."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fewbit_design.errors import FewBitError
from fewbit_design.runtime.fewbit import backends


@pytest.mark.parametrize("backend", ["triton", "numba"])
def test_a_forced_backend_that_is_not_installed_is_one_error(monkeypatch, backend):
    monkeypatch.setattr(backends, "_importable", lambda module: module != backend)
    monkeypatch.setenv(backends.BACKEND_ENV, backend)
    with pytest.raises(FewBitError, match=f"backend '{backend}' .* needs {backend}, which is not installed"):
        backends.quantize(torch.randn(16), torch.zeros(1), torch.tensor([0, 1], dtype=torch.uint8), 1)
    monkeypatch.setenv(backends.BACKEND_ENV, "auto")
    assert backends.backend_for(torch.device("cpu")) in ("numba", "reference")


TRITON_ON_CPU = """
import torch
from fewbit_design.errors import FewBitError
from fewbit_design.runtime.fewbit import nn as fnn
try:
    fnn.GELU(bits=3)(torch.randn(16, requires_grad=True))
except FewBitError as error:
    print("FewBitError:", error)
"""


def test_triton_forced_on_cpu_tensors_without_the_interpreter_is_one_error():
    pytest.importorskip("triton", reason="triton is not installed")
    environment = {**os.environ, "FEWBIT_BACKEND": "triton", "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, "-c", TRITON_ON_CPU], env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FewBitError: backend 'triton' (FEWBIT_BACKEND or use_backend) runs on CUDA tensors, got cpu" in done.stdout
