"""``fewbit-design memory --hf-config``: every way of training a Hugging Face model estimated from its config (bytes
measured under fake mode, times predicted); bad input is one line on stderr and exit status 2, with no output file."""

from __future__ import annotations

import json

import pytest

from fewbit_design.cli import main
from fewbit_design.runtime.estimate import VARIANTS, config_names

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
}


def _run(args, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["memory", *args])
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_memory_hf_config_writes_one_row_per_variant(tiny, tmp_path, capsys):
    rows_path = tmp_path / "rows.json"
    code, out, err = _run(
        ["--hf-config", tiny, "--seq", "256", "--batch", "2", "--dtype", "float32", "--device", "l4",
         "--json", str(rows_path)],
        capsys,
    )  # fmt: skip
    assert code in (0, None), err
    data = json.loads(rows_path.read_text())
    assert [row["name"] for row in data["rows"]] == list(VARIANTS)
    for row in data["rows"]:
        assert {"name", "bytes_per_token_per_layer", "peak_bytes", "fits", "max_seq", "predicted_step_s"} <= set(row)
        assert row["fits"] == (row["peak_bytes"] <= data["device"]["memory_bytes"])
        assert row["predicted"] == ["predicted_step_s"]
    rows = {row["name"]: row for row in data["rows"]}
    # checkpointing keeps a layer's input (batch x sequence x hidden float32 per token: 64 x 4 bytes) and nothing else
    assert rows["checkpointing"]["bytes_per_token_per_layer"] == 64 * 4
    assert rows["convert"]["bytes_per_token_per_layer"] < rows["eager"]["bytes_per_token_per_layer"]
    assert "predicted" in out and "measured under fake mode" in out


def test_memory_hf_config_draws_the_figure(tiny, tmp_path, capsys):
    figure = tmp_path / "fits.png"
    code, _, err = _run(["--hf-config", tiny, "--seq", "128", "--plot", str(figure)], capsys)
    assert code in (0, None), err
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_hf_config_ships_the_configs():
    assert set(config_names()) >= {
        "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b", "gpt2-xl", "bert-large", "vit-l-16",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ('{"hidden_size": 64}', ["--seq", "128"], 'is not a model config: it has no "model_type"'),
        ("not json {", ["--seq", "128"], "is not JSON"),
        ('{"model_type": "no-such-model"}', ["--seq", "128"], "is not a model config transformers knows"),
        (None, ["--seq", "128", "--device", "h100"], "unknown device 'h100'; did you mean"),
        (None, ["--seq", "2048"], "sequence 2048 is longer than the config allows (1024 tokens)"),
        (None, ["--seq", "128", "--gpus", "0"], "--gpus must be a positive number of GPUs, got 0"),
        (None, ["--seq", "128", "--fsdp"], "--fsdp shards over --gpus N"),
        (None, [], "--hf-config needs --seq"),
        (None, ["--seq", "128", "--input-shape", "4,8"], "--input-shape belongs to the MODULE:FACTORY form"),
    ],
    ids=["no-model-type", "not-json", "unknown-type", "device", "too-long", "gpus-0", "fsdp-1", "no-seq", "mixed"],
)
def test_memory_hf_config_bad_input_is_one_line(tmp_path, tiny, capsys, content, args, message):
    path = tiny
    if content is not None:
        path = str(tmp_path / "bad.json")
        (tmp_path / "bad.json").write_text(content)
    rows_path = tmp_path / "rows.json"
    code, out, err = _run(["--hf-config", path, *args, "--json", str(rows_path)], capsys)
    assert code == 2
    assert err.startswith("fewbit-design: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not rows_path.exists() and out == ""


def test_memory_without_a_model_says_what_it_takes(capsys):
    code, _, err = _run([], capsys)
    assert code == 2
    assert "memory takes MODULE:FACTORY (with --input-shape) or --hf-config FILE.json" in err
