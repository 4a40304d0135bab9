"""runtime.calibrate: the streaming histogram (exact counts, bounded memory, growing range) and per-layer tables
that convert(tables=...) loads; the saved samples design through the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import nn as fnn
from fewbit_design.runtime.fewbit.calibrate import StreamingHistogram


def test_histogram_counts_match_numpy_after_the_range_grew():
    rng = np.random.default_rng(0)
    batches = [rng.normal(0, 0.5, 1000), rng.normal(0, 3.0, 1000), np.array([40.0, -17.0, np.nan, np.inf])]
    histogram = StreamingHistogram(bins=64, initial_range=1.0)
    for batch in batches:
        histogram.update(batch)
    assert histogram.range == 64.0 and histogram.counts.size == 64  # grew 1 -> 64, same memory
    finite = np.concatenate(batches)[np.isfinite(np.concatenate(batches))]
    expected, _ = np.histogram(finite, bins=histogram.edges)
    assert histogram.counts.tolist() == expected.tolist()  # integer counts: exact
    assert histogram.non_finite == 2 and histogram.total == finite.size


def test_quantile_samples_follow_the_distribution():
    histogram = StreamingHistogram(bins=2048, initial_range=8.0)
    histogram.update(torch.randn(200_000, generator=torch.Generator().manual_seed(0)))
    samples = histogram.quantile_samples(10_000)
    assert np.all(np.diff(samples) >= 0)
    assert abs(samples.mean()) < 0.02 and abs(samples.std() - 1.0) < 0.02
    with pytest.raises(FewBitError, match="no finite value"):
        StreamingHistogram().quantile_samples()


def test_bad_bins_raise():
    with pytest.raises(FewBitError, match="bins must be an even integer"):
        StreamingHistogram(bins=3)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act1 = torch.nn.Linear(8, 32), torch.nn.GELU()
        self.fc2, self.act2 = torch.nn.Linear(32, 32), torch.nn.SiLU()
        self.fc3 = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x) * 4.0))))


def test_calibrate_designs_a_table_per_layer_that_convert_loads(tmp_path):
    torch.manual_seed(0)
    model = MLP()
    batches = [torch.randn(64, 8) for _ in range(4)]
    tables = runtime.calibrate(model, batches, bits=2, save_dir=tmp_path)
    assert set(tables) == {"act1", "act2"}
    assert tables["act1"].activation == "gelu" and tables["act2"].activation == "silu"
    assert tables["act1"].weight["kind"] == "empirical" and tables["act1"].bits == 2
    assert (tmp_path / "act1.npy").exists() and (tmp_path / "act1.npz").exists()
    x = torch.randn(16, 8, requires_grad=True)
    expected = model(x)
    runtime.convert(model, tables=tables, bits=3)
    assert isinstance(model.act1, fnn.GELU) and model.act1.table is tables["act1"] and model.act1.bits == 2
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_calibrated_table_fits_the_recorded_range_better_than_a_uniform_one():
    """The pre-activations of act1 are spread over about [-12, 12] (x4 scale): the empirical design puts boundaries
    where the data are, so its weighted error on the data is below that of a table designed for a narrow normal."""
    from fewbit_design.design import activations, design

    torch.manual_seed(0)
    model = MLP()
    batches = [torch.randn(256, 8) for _ in range(2)]
    tables = runtime.calibrate(model, batches, bits=2)
    with torch.no_grad():
        pre = (model.fc1(batches[0]) * 4.0).numpy().ravel()
    narrow = design("gelu", 2, weight="normal", scale=0.5)
    derivative = activations.bind("gelu").df(pre)

    def error(table):
        interval = np.searchsorted(table.boundaries, pre, side="right")
        return float(np.mean((table.levels[table.codes[interval]] - derivative) ** 2))

    assert error(tables["act1"]) < error(narrow)


def test_calibrate_without_activations_or_batches_raises():
    with pytest.raises(FewBitError, match="no activation module"):
        runtime.calibrate(torch.nn.Linear(2, 2), [torch.randn(1, 2)])
    with pytest.raises(FewBitError, match="batches is empty"):
        runtime.calibrate(MLP(), [])


def test_the_cli_designs_from_the_saved_samples(tmp_path):
    from click.testing import CliRunner

    from fewbit_design.cli import cli
    from fewbit_design.table import load

    torch.manual_seed(0)
    runtime.calibrate(MLP(), [torch.randn(64, 8)], bits=1, save_dir=tmp_path)
    out = tmp_path / "gelu.json"
    args = ["gelu", "--bits", "1", "--weight", "empirical", "--samples", str(tmp_path / "act1.npy"), "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert load(out).weight["kind"] == "empirical"


_CALIBRATE = (
    "from fewbit_design import runtime\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())\n"
    "runtime.calibrate(model, [torch.randn(32, 4)], bits=2)\n"
)
_DESIGN = "from fewbit_design.design import design\ndesign('gelu', 3, weight='normal')\n"


@pytest.mark.parametrize("work", [_CALIBRATE, _DESIGN], ids=["calibrate", "design"])
def test_torchs_thread_count_survives_designing(work):
    # numba's parallel design shares the OpenMP runtime with torch and reset its thread count (found by the
    # real-model benchmark: two 1-thread training processes ran 9x slower after calibrating); design() puts it back.
    # A fresh interpreter, so numba's threading layer starts inside the call as it would for a user
    import subprocess
    import sys

    code = (
        "import torch; torch.set_num_threads(1); torch.get_num_threads()\n"  # as after training: the pool exists
        + work
        + "print(torch.get_num_threads())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "1"
