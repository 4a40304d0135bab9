"""Devices for tests that run on CPU and, on a machine with a GPU, on CUDA too (imported by the test modules).

``pytest.param("cuda", marks=pytest.mark.cuda)``: a test parametrised over :data:`DEVICES` runs on CPU everywhere and
on CUDA where a GPU is present (conftest.py skips ``cuda``-marked tests without one; ``pytest -m cuda`` selects them).
"""

import pytest

CUDA = pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")
DEVICES = [pytest.param("cpu", id="cpu"), CUDA]


def on_cuda(*values, id=None):
    """A ``pytest.param`` of ``values`` for a CUDA-only case (marked ``cuda``)."""
    return pytest.param(*values, marks=pytest.mark.cuda, id=id)
