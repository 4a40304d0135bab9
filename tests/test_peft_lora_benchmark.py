"""benchmarks/peft_lora.py --quick (the smoke test of the LoRA runs): the variants train, the ratios are against the
unconverted PEFT model of the same seed, Hugging Face checkpointing and the exact conversion keep its LoRA gradient,
and every variant keeps fewer bytes for backward."""

import csv
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")
pytest.importorskip("peft", reason="peft is not installed (the 'peft' extra)")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peft_lora.py"


def test_quick_run_writes_ratios_against_the_unconverted_peft_model(tmp_path):
    spec = importlib.util.spec_from_file_location("peft_lora", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    variants = "native,hf-checkpointing,exact,compress8"
    module.main(["--quick", "--models", "llama", "--variants", variants, "--out", str(tmp_path / "peft.csv")])
    rows = {row["variant"]: row for row in csv.DictReader(open(tmp_path / "peft-quick.csv"))}
    assert list(rows) == variants.split(",")
    assert float(rows["native"]["saved_bytes_ratio"]) == 1.0 and float(rows["native"]["held_out_loss_ratio"]) == 1.0
    # exact: checkpointing recomputes the same forward; the exact conversion differs by float32 rounding only
    assert float(rows["hf-checkpointing"]["lora_grad_rel_error"]) == 0.0
    assert float(rows["exact"]["lora_grad_rel_error"]) < 1e-5
    assert all(float(rows[variant]["saved_bytes_ratio"]) < 1 for variant in variants.split(",")[1:])
