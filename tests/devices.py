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


def norm_error(got, want) -> float:
    """||got - want|| / ||want|| over all the tensors together (float64, on CPU): a result on CUDA against CPU."""
    import torch

    got_all = torch.cat([g.detach().double().cpu().flatten() for g in got])
    want_all = torch.cat([w.detach().double().cpu().flatten() for w in want])
    return float((got_all - want_all).norm() / want_all.norm())
