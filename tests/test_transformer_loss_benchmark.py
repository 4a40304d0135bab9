"""benchmarks/transformer_loss.py --quick (the smoke test of the held-out loss runs): every variant trains,
the ratios are against the native run of the same seed, and the converted models keep fewer bytes for backward."""

import csv
import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "transformer_loss.py"


def test_quick_run_writes_ratios_against_native(tmp_path):
    spec = importlib.util.spec_from_file_location("transformer_loss", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "loss.csv"
    module.main(["--quick", "--models", "llama", "--jobs", "1", "--out", str(out)])
    rows = list(csv.DictReader(open(tmp_path / "loss-quick.csv")))
    assert [row["variant"] for row in rows] == ["native", "exact", "compressed8", "compressed4"]
    ratios = {
        row["variant"]: {key: float(value) for key, value in row.items() if key.endswith("_ratio")} for row in rows
    }
    assert ratios["native"]["held_out_loss_ratio"] == 1.0
    assert all(
        math.isfinite(r["held_out_loss_ratio"]) and abs(r["held_out_loss_ratio"] - 1) < 0.05 for r in ratios.values()
    )
    # exact modes: the gradient at initialisation is native's (float32 rounding); compressed: fewer bytes still
    assert float(rows[1]["grad_rel_error"]) < 1e-5
    saved = [ratios[variant]["saved_bytes_ratio"] for variant in ("native", "exact", "compressed8", "compressed4")]
    assert saved == sorted(saved, reverse=True) and saved[1] < 1


def test_seeds_give_mean_and_spread_and_merge_keeps_the_other_rows(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("transformer_loss", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "loss.csv"
    common = ["--quick", "--models", "llama", "--jobs", "1", "--out", str(out)]
    module.main([*common, "--variants", "native,compressed8", "--seeds", "0,1"])
    printed = capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "loss-quick.csv")))
    assert [(row["seed"], row["variant"]) for row in rows] == [
        ("0", "native"), ("0", "compressed8"), ("1", "native"), ("1", "compressed8"),
    ]  # fmt: skip
    ratios = [float(row["held_out_loss_ratio"]) for row in rows if row["variant"] == "compressed8"]
    mean, spread = sum(ratios) / 2, abs(ratios[0] - ratios[1]) / 2
    line = next(line for line in printed.splitlines() if "compressed8  seeds 0,1:" in line)
    assert f"held_out_loss {mean:.4f} +- {spread:.4f}" in line and "target <= 1.01" in line
    # --merge: a re-run of seed 1 replaces that seed's rows and keeps seed 0's
    module.main([*common, "--variants", "native,exact", "--seeds", "1", "--merge"])
    merged = list(csv.DictReader(open(tmp_path / "loss-quick.csv")))
    assert [(row["seed"], row["variant"]) for row in merged] == [
        ("0", "native"), ("0", "compressed8"), ("1", "native"), ("1", "exact"), ("1", "compressed8"),
    ]  # fmt: skip
    assert merged[2]["held_out_loss"] == rows[2]["held_out_loss"]  # the native run is deterministic
    module.main([*common, "--report"])
    assert "exact        seeds 1:" in capsys.readouterr().out


def test_dropout_builds_the_models_with_dropout_and_convert_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("transformer_loss", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "loss.csv"
    argv = ["--quick", "--models", "gpt2-gelu_new,bert", "--jobs", "1", "--out", str(out)]
    module.main([*argv, "--dropout", "0.1", "--variants", "native,convert,convert8"])
    rows = list(csv.DictReader(open(tmp_path / "loss-quick.csv")))
    assert [(row["model"], row["variant"]) for row in rows] == [
        (model, variant) for model in ("bert", "gpt2-gelu_new") for variant in ("native", "convert", "convert8")
    ]
    for row in rows:
        assert math.isfinite(float(row["held_out_loss"])) and abs(float(row["held_out_loss_ratio"]) - 1) < 0.05
    # with dropout the converted models keep 1-bit masks and no sequence x sequence attention tensors: fewer bytes
    assert all(float(row["saved_bytes_ratio"]) < 1 for row in rows if row["variant"] != "native")
    model = module.real_models.build("bert", 1, 64, 8, dropout=0.1)
    assert model.config.hidden_dropout_prob == model.config.attention_probs_dropout_prob == 0.1
    assert module.real_models.build("gpt2-gelu_new", 1, 64, 8).config.attn_pdrop == 0.0  # the default is unchanged
    with pytest.raises(SystemExit):
        module.main([*argv, "--models", "t5"])
