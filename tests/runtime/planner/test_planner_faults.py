"""Regression tests for memory-planner faults: the configured mode decides exactness (gated's compressed mode is
approximate), an applied plan runs as it was planned (without the key/value cache, with the arguments a
checkpoint holds), frozen blocks, the caller's grad mode, compiled models, and plan files' technique settings and
negative byte fields."""

from __future__ import annotations

import copy
import json
import logging
import math

import pytest
import torch
from torch import nn

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime.planner import TECHNIQUES, MemoryPlan
from fewbit_design.runtime.planner.model import BlockCosts, ChainCosts, OptionCost
from fewbit_design.runtime.planner.plan import choose

WIDTH = 8
EXACT_ONLY = ("checkpoint", "offload")


def _mlp(width: int = WIDTH, blocks: int = 3, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(blocks)]
    )


def _stock(kind: str) -> nn.Module:
    """A Hugging Face causal LM from its default config with tiny sizes; ``use_cache`` at its default (True)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=64, max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    assert model.config.use_cache is True
    return model.train()


def _loop_step_peak(model: nn.Module, *inputs: torch.Tensor, **kwargs: torch.Tensor) -> int:
    """The peak of live tensor bytes of one step of a plain training loop (gradients None before it, as after
    ``zero_grad()``), counted like the plan's budget: parameters and inputs included."""
    for parameter in model.parameters():
        parameter.grad = None
    with memory.peak(model, *inputs, *kwargs.values()) as result:
        output = model(*inputs, **kwargs)
        loss = output.loss if hasattr(output, "loss") else output.float().mean()
        del output
        loss.backward()
        del loss
    return result.max_bytes


# --- the configured mode decides exactness -------------------------------------------------------------------
def _gated_chain() -> ChainCosts:
    """One block whose gated option is the fastest and fits where plain does not; checkpoint fits too, slower."""
    plain = OptionCost("plain", 3000, 1000, 1000, saves_input=False, saves_output=False, seconds=1.0)
    gated = OptionCost("gated", 1100, 100, 1000, saves_input=False, saves_output=False, seconds=0.5)
    checkpoint = OptionCost("checkpoint", 2000, 0, 2000, saves_input=True, saves_output=False, seconds=2.0)
    return ChainCosts((BlockCosts("0", 100, 100, 0, (plain, gated, checkpoint)),))


@pytest.mark.parametrize(("mode", "expected"), [("exact", "gated"), ("compressed", "checkpoint")])
def test_if_needed_counts_gated_compressed_mode_as_approximate(mode, expected):
    """Regression: gated's compressed mode (K-bit codes of x, gate and up: approximate gradients) counted as exact,
    so the default "if-needed" rule took it where an exact plan fits, and the report said "no block (exact)"."""
    costs = _gated_chain()
    settings = {"objective": "time", "bits": 3, "blpa_bits": 4, "offload": {}, "gated_mode": mode, "gated_bits": 2}
    plan = choose("", costs, {}, baseline=0, step_seconds=1.0, settings={**settings, "approximate": "if-needed"},
                  budget=2100, allow=("gated", "checkpoint"))  # fmt: skip
    assert plan.choices == (expected,)
    assert plan.approximate_blocks() == []
    allowed = choose("", costs, {}, baseline=0, step_seconds=1.0, settings={**settings, "approximate": "allowed"},
                     budget=2100, allow=("gated", "checkpoint"))  # fmt: skip
    assert allowed.choices == ("gated",)  # the opt-in takes the fastest plan, and says so
    assert allowed.approximate_blocks() == ([] if mode == "exact" else ["0"])
    assert ("no block (exact)" in allowed.report()) == (mode == "exact")


@pytest.fixture(scope="module")
def llama_gated_plan():
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model = _stock("llama")
    plan = runtime.plan_memory(model, tokens, budget="min", allow=("gated", "checkpoint"),
                               example_kwargs={"labels": tokens}, repeats=1)  # fmt: skip
    return plan, tokens


def test_plan_memory_with_gated_compressed_mode_keeps_exact_plans_exact(llama_gated_plan):
    """``technique_settings={"gated_mode": "compressed"}`` with the default rule: where a plan of exact techniques
    fits, no block runs the compressed op; where one is used, the report names its block."""
    _, tokens = llama_gated_plan
    plan = runtime.plan_memory(
        _stock("llama"), tokens, budget="min", allow=("gated", "checkpoint"), example_kwargs={"labels": tokens},
        technique_settings={"gated_mode": "compressed", "gated_bits": 2}, repeats=1,
    )  # fmt: skip
    gated = [b.name for b, c in zip(plan.costs.blocks, plan.choices, strict=True) if "gated" in c]
    assert plan.approximate_blocks() == gated
    exact_minimum = plan.replan("min", allow=("checkpoint",)).predicted_peak_bytes
    at_exact_minimum = plan.replan(exact_minimum)
    assert not any("gated" in choice for choice in at_exact_minimum.choices), at_exact_minimum.choices
    assert "no block (exact)" in at_exact_minimum.report()


def test_plan_file_edited_to_gated_compressed_mode_reports_its_approximate_blocks(llama_gated_plan):
    plan, tokens = llama_gated_plan
    data = json.loads(plan.to_json())
    data["choices"] = ["gated"] * len(plan.choices)  # every block profiled the gated op (a LLaMA MLP)
    exact = MemoryPlan.from_dict(copy.deepcopy(data))
    assert exact.approximate_blocks() == [] and "no block (exact)" in exact.report()  # its exact mode
    gated = [block.name for block in plan.costs.blocks]
    data["settings"]["gated_mode"] = "compressed"
    edited = MemoryPlan.from_dict(data)
    assert edited.approximate_blocks() == gated
    report = edited.report()
    assert "no block (exact)" not in report and all(name in report for name in gated)
    model = edited.apply(_stock("llama"))
    assert math.isfinite(model(tokens, labels=tokens).loss.item())


# --- an applied plan runs as planned ---------------------------------------------------------------------------
@pytest.mark.parametrize("allow", [EXACT_ONLY, TECHNIQUES], ids=["exact", "all"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_plan_applied_to_a_stock_config_keeps_a_plain_loop_within_budget(kind, allow, caplog):
    """Regression: profiling and ``measure`` turned the key/value cache off, ``apply`` left it on, so in a plain
    training loop the cache kept every layer's keys and values alive past checkpointed blocks (GPT-2's "min" plan
    measured 1.09x its budget here); and a checkpoint keeps its block's other arguments (LLaMA's position ids)
    alive until its backward, which the plain step frees after the chain (256 bytes over the budget here). The
    budget is an upper bound of the live bytes: no tolerance."""
    tokens = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    plan = runtime.plan_memory(_stock(kind), tokens, budget="min", allow=allow, example_kwargs={"labels": tokens},
                               repeats=1)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="fewbit_design.runtime.planner"):
        model = plan.apply(_stock(kind))
    for _ in range(2):  # the first step and a later one
        peak = _loop_step_peak(model, tokens, labels=tokens)
        assert peak <= plan.budget_bytes, (peak / plan.budget_bytes, peak - plan.budget_bytes, plan.choices)
    # apply says what it changed, once, and keeps the previous value
    assert model.config.use_cache is False and model.fewbit_use_cache == {"": True}
    assert len([r for r in caplog.records if "use_cache=False" in r.getMessage()]) == 1


# --- frozen blocks -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("allow", [EXACT_ONLY, TECHNIQUES], ids=["exact", "all"])
def test_a_frozen_first_block_plans_applies_and_trains(allow):
    """Regression: with the first block frozen (its input needs no gradient either), timing its options ran a
    backward of an output without a gradient: a raw "element 0 of tensors does not require grad"."""

    def frozen() -> nn.Sequential:
        model = _mlp(width=16, blocks=4)
        model[0].requires_grad_(False)
        return model

    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    plan = runtime.plan_memory(frozen(), x, allow=allow, budget="min", offload_min_bytes=0, repeats=1)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    model, reference = plan.apply(frozen()), frozen()
    assert _loop_step_peak(model, x) <= plan.budget_bytes
    _loop_step_peak(reference, x)
    for (name, got), (_, expected) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert (got.grad is None) == (expected.grad is None) == name.startswith("0."), name
        if got.grad is not None and not plan.approximate_blocks():  # exact techniques: the same operators
            torch.testing.assert_close(got.grad, expected.grad, rtol=0, atol=0)


def test_frozen_embeddings_and_first_block_of_gpt2_plan():
    """LoRA-like: GPT-2's embeddings and first block frozen, the rest trained."""

    def frozen() -> nn.Module:
        model = _stock("gpt2")
        for module in (model.transformer.wte, model.transformer.wpe, model.transformer.h[0]):
            module.requires_grad_(False)
        return model

    tokens = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    plan = runtime.plan_memory(frozen(), tokens, budget="min", allow=EXACT_ONLY, example_kwargs={"labels": tokens},
                               repeats=1)  # fmt: skip
    model = plan.apply(frozen())
    assert _loop_step_peak(model, tokens, labels=tokens) <= plan.budget_bytes
    assert model.transformer.h[0].attn.c_attn.weight.grad is None
    assert model.transformer.h[1].attn.c_attn.weight.grad is not None


# --- the caller's grad mode ------------------------------------------------------------------------------------
def _bytes_only(costs: ChainCosts) -> ChainCosts:
    """``costs`` without the measured times (the bytes are exact; the times are noise)."""
    import dataclasses

    blocks = tuple(
        dataclasses.replace(b, options=tuple(dataclasses.replace(o, seconds=0.0, spread=0.0) for o in b.options))
        for b in costs.blocks
    )
    return dataclasses.replace(costs, blocks=blocks)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_plan_memory_under_no_grad_or_inference_mode_plans_the_training_step(context):
    """Regression: under ``torch.no_grad()`` plan_memory said "no parameter of the model requires a gradient".
    plan_memory and measure plan and measure a training step whatever the caller's mode (as runtime.convert's
    probe does): the same bytes as outside it, the example input made under inference mode included."""
    x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(0))
    reference = runtime.plan_memory(_mlp(), x, budget="min", allow=EXACT_ONLY, offload_min_bytes=0, repeats=1)
    expected = reference.measure(reference.apply(_mlp()), x, steps=1)["peak_bytes"]
    mode = torch.no_grad if context == "no_grad" else torch.inference_mode
    planned, model = _mlp(), reference.apply(_mlp())
    with mode():
        inside = x.clone()  # an inference tensor under inference_mode
        plan = runtime.plan_memory(planned, inside, budget="min", allow=EXACT_ONLY, offload_min_bytes=0, repeats=1)
        measured = reference.measure(model, inside, steps=1)["peak_bytes"]
        if context == "inference_mode":  # parameters made under inference mode cannot train: one clear error
            with pytest.raises(FewBitError, match=r"parameters .* made under torch\.inference_mode"):
                runtime.plan_memory(_mlp(), inside, allow=EXACT_ONLY, repeats=1)
    assert _bytes_only(plan.costs) == _bytes_only(reference.costs)
    assert plan.baseline_bytes == reference.baseline_bytes and plan.budget_bytes == reference.budget_bytes
    assert measured == expected
    assert all(p.grad is None for p in model.parameters())


# --- compiled models -------------------------------------------------------------------------------------------
def test_a_compiled_model_is_refused_with_the_fix():
    """Regression: a plan applied to ``torch.compile(model)`` said the model had no chain '' of the plan's blocks
    (its modules are named ``_orig_mod.*``). Plan and apply before compiling."""
    x = torch.randn(8, WIDTH)
    plan = runtime.plan_memory(_mlp(), x, allow=("checkpoint",), budget="min", repeats=1)
    model = _mlp()
    compiled = torch.compile(model)
    before = [(type(m), type(m.__dict__.get("forward"))) for m in model.modules()]
    with pytest.raises(FewBitError, match=r"before torch\.compile"):
        plan.apply(compiled)
    assert [(type(m), type(m.__dict__.get("forward"))) for m in model.modules()] == before
    assert getattr(model, "fewbit_memory_plan", None) is None
    with pytest.raises(FewBitError, match="before compiling"):
        runtime.plan_memory(compiled, x, allow=("checkpoint",), repeats=1)
    torch.compile(plan.apply(model))  # the order that works


# --- plan files: technique settings and negative bytes -----------------------------------------------------------
@pytest.fixture(scope="module")
def mlp_plan() -> MemoryPlan:
    return runtime.plan_memory(_mlp(), torch.randn(64, WIDTH), budget="min", offload_min_bytes=0, repeats=1)


def _edited(plan: MemoryPlan) -> dict:
    return json.loads(plan.to_json())


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("norms_threshold", "x"),
        ("norms_threshold", float("nan")),
        ("norms_threshold", -1.0),
        ("norms_threshold", 0.0),
        ("gated_mode", "fast"),
        ("gated_bits", 9),
        ("attention_bits", 1),
        ("linear_bits", "8"),
        ("head_chunk_rows", 0),
    ],
)
def test_plan_file_technique_settings_are_checked_at_load_naming_the_field(mlp_plan, key, value):
    """Regression: ``settings.norms_threshold: "x"`` raised a raw ValueError; NaN or -1 loaded and failed at apply,
    naming a block instead of the field."""
    assert key in mlp_plan.settings
    data = _edited(mlp_plan)
    data["settings"][key] = value
    with pytest.raises(FewBitError, match=rf"settings\b.*\b{key}\b"):
        MemoryPlan.from_dict(data)
    with pytest.raises(FewBitError, match=rf"\b{key}\b"):
        runtime.plan_memory(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), torch.randn(2, 2),
                            technique_settings={key: value})  # fmt: skip


def test_plan_file_technique_settings_of_techniques_outside_allow_are_checked(mlp_plan):
    data = _edited(mlp_plan)
    data["settings"]["allow"] = ["checkpoint"]
    data["choices"] = ["checkpoint" if "checkpoint" in c else "plain" for c in data["choices"]]
    data["settings"]["norms_threshold"] = "x"
    with pytest.raises(FewBitError, match=r"settings\.norms_threshold is 'x'"):
        MemoryPlan.from_dict(data)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["costs"]["blocks"][0]["options"][0].update(kept=-(10**9)), r"options\[0\]\.kept must be >= -"),
        (lambda d: d["costs"].update(post_bytes=-(10**9)), r"costs\.post_bytes must be >= -"),
        (lambda d: d["costs"].update(post_forward_peak=-(10**9)), r"costs\.post_forward_peak must be >= -"),
        (lambda d: d["costs"].update(argument_bytes=-1), r"costs\.argument_bytes must be an integer >= 0"),
        (lambda d: d["costs"]["blocks"][0]["options"][0].update(holds_arguments=1), "holds_arguments must be true"),
    ],
)
def test_plan_file_negative_bytes_beyond_what_can_be_freed_are_refused(mlp_plan, edit, message):
    """Regression: negative cost bytes loaded (a plan whose prediction went below zero). ``kept`` and the two
    post-chain fields are differences of live bytes: negative down to the bytes that could be freed, no further."""
    data = _edited(mlp_plan)
    edit(data)
    with pytest.raises(FewBitError, match=message):
        MemoryPlan.from_dict(data)


def test_plan_file_negative_bytes_at_their_bounds_load(mlp_plan):
    data = _edited(mlp_plan)
    costs = data["costs"]
    block = costs["blocks"][0]
    block["options"][0]["kept"] = -block["output_bytes"]
    freeable = costs["entry_bytes"] + costs["blocks"][-1]["input_bytes"] + costs["blocks"][-1]["output_bytes"]
    costs.update(post_bytes=-freeable, post_forward_peak=-freeable)
    plan = MemoryPlan.from_dict(copy.deepcopy(data))
    assert plan.costs.post_bytes == -freeable
    block["options"][0]["kept"] -= 1
    with pytest.raises(FewBitError, match=r"kept must be >= -"):
        MemoryPlan.from_dict(data)
