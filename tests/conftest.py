"""Shared test fixtures (keep this file small).

There is no GPU on the development machines: Triton kernels run under the Triton interpreter in tests. Triton reads
``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before any test module imports a kernel module
(only by default: ``TRITON_INTERPRET=0 pytest -m cuda`` runs the compiled kernels on a GPU, see
scripts/gpu_suite.sh). Tests marked ``cuda`` are skipped where ``torch.cuda.is_available()`` is False.
"""

import functools
import json
import os
import signal
import threading

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["pytester"]  # tests of this file itself (test_isolation.py)


@pytest.fixture(autouse=True)
def _restore_sigint():
    """Every test leaves SIGINT's handler as it found it: ``cli.main`` in-process on an interrupted command ignores
    SIGINT (for the exit of a real process), which would take KeyboardInterrupt from later tests (test_isolation.py)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGINT)
    yield
    if handler is not None:  # (None: set outside Python, nothing to restore it with)
        signal.signal(signal.SIGINT, handler)


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked ``cuda`` when there is no CUDA GPU (torch is imported only if such tests were
    collected)."""
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in marked:
        item.add_marker(skip)


def _levelset_table(name, bits, params=None, weight="uniform"):
    return _cached_levelset_table(name, bits, tuple(sorted((params or {}).items())), weight)


@functools.cache
def _cached_levelset_table(name, bits, params, weight):
    """A hand-made level-set table (independent of the design engine): 1-D k-means of f'(x) on a uniform grid of
    [-10, 10] (Lloyd from quantile starts), then boundaries where the nearest level changes along the grid."""
    from fewbit_design.design import activations
    from fewbit_design.table import Table

    bound = activations.bind(name, dict(params))
    xs = np.linspace(-10.0, 10.0, 40001)
    derivative = bound.df(xs)
    k = 2**bits
    levels = np.quantile(derivative, (np.arange(k) + 0.5) / k)
    for _ in range(50):
        assignment = np.searchsorted((levels[1:] + levels[:-1]) / 2, derivative)
        levels = np.array(
            [derivative[assignment == c].mean() if np.any(assignment == c) else levels[c] for c in range(k)]
        )
        levels = np.sort(levels)
    assignment = np.searchsorted((levels[1:] + levels[:-1]) / 2, derivative)
    changes = np.nonzero(np.diff(assignment))[0]
    boundaries = (xs[changes] + xs[changes + 1]) / 2
    codes = np.concatenate([assignment[:1], assignment[changes + 1]])
    return Table(
        activation=bound.name,
        params=dict(bound.params),
        bits=bits,
        mode="levelsets",
        symmetric=False,
        weight={"kind": weight, "low": -10.0, "high": 10.0},
        boundaries=boundaries,
        codes=codes,
        levels=levels,
        error=0.0,
        snr_db=None,
    )


@pytest.fixture(scope="session")
def make_table():
    """``make_table(name, bits, params=None)``: a hand-made level-set table for a registry activation."""
    return _levelset_table


@pytest.fixture
def tables_dir(tmp_path, monkeypatch):
    """A temporary shipped-table folder (index + hand-made tables for gelu, silu, relu, leaky_relu at 1-3 bits and
    gelu at 3 bits with the normal weight), installed through FEWBIT_TABLES_DIR."""
    entries = []
    specs = [(name, bits, "uniform") for name in ("gelu", "silu", "relu", "leaky_relu") for bits in (1, 2, 3)]
    for name, bits, weight in specs + [("gelu", 3, "normal")]:
        table = _levelset_table(name, bits, weight=weight)
        file = f"{name}/levelsets-{weight}-{bits}bit.json"
        (tmp_path / name).mkdir(exist_ok=True)
        table.save(tmp_path / file)
        entries.append(
            {
                "file": file,
                "activation": name,
                "params": table.params,
                "bits": bits,
                "mode": "levelsets",
                "symmetric": False,
                "weight": weight,
                "error": 0.0,
            }
        )
    (tmp_path / "index.json").write_text(json.dumps({"format": "fewbit-index/1", "tables": entries}))
    monkeypatch.setenv("FEWBIT_TABLES_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def one_torch_thread():
    """Run a test with one torch thread (reproducible float reductions), restoring the setting afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_tf32():
    """float32 matrix products and convolutions in full float32 (cuDNN convolutions use TF32 by default)."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
