"""The whole-step estimate (runtime.estimate), the device descriptions and the roofline: the bytes it predicts for a
model that runs here equal what a real step measures, its parameter count is the model's, its searches are
consistent with its own rows, and the roofline counts the FLOPs of what it runs."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import transformers

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime.devices import PRESETS, device
from fewbit_design.runtime.estimate import SEQUENCE_STEP, estimate, parameter_bytes
from fewbit_design.runtime.fake import fake_mode
from fewbit_design.runtime.roofline import roofline

BATCH, TOKENS = 2, 128


def _config(family: str, layers: int):
    if family == "llama":
        return transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=layers, vocab_size=256, max_position_embeddings=1024,
            architectures=["LlamaForCausalLM"],
        )  # fmt: skip
    return transformers.GPT2Config(
        n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, architectures=["GPT2LMHeadModel"],
    )  # fmt: skip


def _measured_step(config, variant: str) -> int:
    """The peak of one real training step above its start, as the Hugging Face Trainer runs it (the output dropped
    before backward)."""
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config).train()
    model.config.use_cache = False
    if variant == "checkpointing":
        with warnings.catch_warnings():  # (renamed activation_checkpointing_enable in transformers 5)
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif variant == "convert":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = runtime.convert(model)
    ids = torch.randint(0, config.vocab_size, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    with memory.peak(model, ids, labels) as peak:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        del loss
    return peak.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_estimated_step_peak_is_the_measured_one(family):
    # two layers profiled under fake mode, replayed over eight: within 2% of a real eight-layer step (eager and
    # checkpointing measured equal to 4 bytes; convert's custom ops' scratch is what fake mode cannot see)
    config = _config(family, 8)
    variants = ("eager", "checkpointing", "convert")
    result = estimate(config, batch=BATCH, sequence=TOKENS, device="cpu", dtype="float32", variants=variants,
                      search=False)  # fmt: skip
    for variant in variants:
        predicted, measured = result.variant(variant).memory.step, _measured_step(config, variant)
        assert abs(predicted - measured) <= 0.02 * measured, (variant, predicted, measured)


def test_estimate_counts_every_parameter_of_the_model():
    config = _config("llama", 5)
    result = estimate(config, batch=1, sequence=64, device="l4", dtype="float32", variants=("eager",), search=False)
    model = transformers.LlamaForCausalLM(config)
    assert result.parameters == sum(p.numel() for p in model.parameters())


def test_fsdp_divides_the_state_and_adds_the_layers_in_flight():
    config = _config("llama", 4)
    kwargs = dict(batch=1, sequence=64, device="l4", dtype="bfloat16", variants=("eager",), search=False)
    single = estimate(config, **kwargs).variant("eager").memory
    sharded = estimate(config, gpus=4, fsdp=True, **kwargs).variant("eager").memory
    parameters = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    assert (single.weights, single.master_weights, single.optimizer_states) == (2 * parameters, 4 * parameters,
                                                                               8 * parameters)  # fmt: skip
    assert sharded.optimizer_states == -(-8 * parameters // 4)
    assert sharded.weights == -(-2 * parameters // 4)
    layer = sum(p.numel() for p in transformers.LlamaForCausalLM(config).model.layers[0].parameters())
    root = parameters - 4 * layer
    assert sharded.in_flight == 2 * (3 * layer + root - -(-root // 4))
    assert single.in_flight == 0
    assert sharded.step <= single.step  # the layers' gradients are reduce-scattered


def test_parameter_bytes_without_master_weights_keeps_the_float32_states():
    assert parameter_bytes(10, dtype_size=2, master_weights=False, shards=1) == {
        "weights": 20, "master_weights": 0, "optimizer_states": 80,
    }  # fmt: skip
    assert parameter_bytes(10, dtype_size=4, master_weights=True, shards=2)["master_weights"] == 0


@pytest.mark.slow
def test_longest_sequence_and_largest_batch_are_the_edges_of_fitting():
    # a device just large enough for some sequences: the reported max_seq fits, one step more does not
    config = _config("llama", 4)
    base = dataclasses.replace(device("l4"))
    probe = estimate(config, batch=1, sequence=512, device=base, dtype="float32", variants=("eager",), search=False)
    small = dataclasses.replace(base, name="small", memory_bytes=probe.variant("eager").peak_bytes)
    found = estimate(config, batch=1, sequence=512, device=small, dtype="float32", variants=("eager",))
    row = found.variant("eager")
    assert row.fits and SEQUENCE_STEP <= row.max_seq < 1024 and row.max_batch >= 1
    for sequence, fits in ((row.max_seq, True), (row.max_seq + SEQUENCE_STEP, False)):
        at = estimate(config, batch=1, sequence=sequence, device=small, dtype="float32", variants=("eager",),
                      search=False)  # fmt: skip
        assert at.variant("eager").fits == fits, (sequence, at.variant("eager").peak_bytes, small.memory_bytes)
    wider = estimate(config, batch=row.max_batch + 1, sequence=512, device=small, dtype="float32",
                     variants=("eager",), search=False)  # fmt: skip
    assert not wider.variant("eager").fits


def test_sequence_longer_than_the_config_allows_is_refused():
    with pytest.raises(FewBitError, match="sequence 2048 is longer than the config allows \\(1024 tokens\\)"):
        estimate(_config("gpt2", 2), batch=1, sequence=2048)


def test_devices_have_the_presets_and_refuse_unknown_names():
    assert set(PRESETS) == {"h100-80gb", "h200", "a100-80gb", "l4", "rtx-4090"}
    assert device("H100_80GB") is PRESETS["h100-80gb"]
    with pytest.raises(FewBitError, match="unknown device 'tpu'"):
        device("tpu")


def test_roofline_counts_the_compressed_linears_matrix_products():
    # the project's custom ops are opaque on fake tensors; their FLOPs are those of the matrix products they run
    flops = []
    for compress in (None, 4):
        with fake_mode():
            model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
            if compress is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = runtime.convert(model, compress=compress, activations=False)
                assert "linear" in model.convert_report.applied
            x = torch.randn(64, 256, requires_grad=True)
            with roofline(device("h100-80gb")) as cost:
                model(x).sum().backward()
        flops.append(cost.flops)
    assert flops[1] == flops[0] == 3 * 2 * 64 * (256 * 512 * 2)  # forward, input and weight gradients, 2 layers


@pytest.mark.parametrize("mode", ["exact", "compressed", "recompute"])
def test_roofline_counts_the_gated_modes_matrix_products(mode):
    # native: 3 products forward, 6 backward; the recompute mode runs gate's and up's forward products again
    from fewbit_design.runtime.gated import LAYOUTS, GatedMLP

    rows, hidden, width = 32, 64, 128
    with fake_mode():
        children = {
            "gate_proj": torch.nn.Linear(hidden, width, bias=False),
            "up_proj": torch.nn.Linear(hidden, width, bias=False),
            "down_proj": torch.nn.Linear(width, hidden, bias=False),
        }
        module = GatedMLP(children, LAYOUTS[0], "silu", mode=mode)
        x = torch.randn(rows, hidden, requires_grad=True)
        with roofline(device("h100-80gb")) as cost:
            module(x).sum().backward()
    product = 2 * rows * hidden * width
    assert cost.flops == (9 + (2 if mode == "recompute" else 0)) * product
