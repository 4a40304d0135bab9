"""The planner chooses techniques whose scope is the whole model (the chunked LM head, outside every block of the
chain) when they lower the peak: ``budget="min"`` on a GPT-2 with its real vocabulary (50257) is the smallest peak
over everything allowed, the head included, and never above converting the head by hand plus the best block plan.
A model technique is used only where the budget needs it under the time objective."""

from __future__ import annotations

import pytest
import torch

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")

VOCAB, TOKENS = 50257, 32
x = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(1))
#: the block techniques allowed (checkpointing alone keeps the test fast; the head's choice does not depend on them)
BLOCK_TECHNIQUES = ("checkpoint",)
ALLOW = (*BLOCK_TECHNIQUES, "head")


def build():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=TOKENS, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


def measured_peak(model) -> int:
    """Live tensor bytes of one training step, parameters and inputs included."""
    with memory.peak(model, x) as result:
        model(x, labels=x).loss.backward()
    model.zero_grad(set_to_none=True)
    return result.max_bytes


def plan(model, **options):
    options.setdefault("allow", ALLOW)
    return runtime.plan_memory(model, x, example_kwargs={"labels": x}, repeats=1, **options)


def test_min_includes_the_head_and_is_no_higher_than_head_by_hand_plus_the_best_block_plan():
    chosen = plan(build(), budget="min")
    assert chosen.model_options == ("head",) and "head" in chosen.techniques_used()
    assert "whole model: head" in chosen.report()
    planned = chosen.apply(build())
    peak = measured_peak(planned)
    # predicted from the head's step as profiled: at most the measured peak plus the reserve the planner keeps
    assert chosen.predicted_peak_bytes - 4096 <= peak <= chosen.predicted_peak_bytes
    by_hand = runtime.head.convert(build())
    blocks = plan(by_hand, budget="min", allow=BLOCK_TECHNIQUES)
    assert peak <= measured_peak(blocks.apply(by_hand))
    logits = x.numel() * VOCAB * 4  # float32 logits of the batch: they no longer exist whole
    assert peak < measured_peak(build()) - logits


def test_the_head_is_left_out_where_the_budget_does_not_need_it_and_taken_where_it_does():
    unconverted = plan(build()).unconverted_peak_bytes
    roomy = plan(build(), budget=unconverted)  # the unconverted model fits
    native = plan(build(), allow=BLOCK_TECHNIQUES, budget="min")
    assert roomy.model_options == () and set(roomy.choices) == {"plain"}
    tight = plan(build(), budget=native.predicted_peak_bytes - 1)  # below what the blocks alone reach
    assert tight.model_options == ("head",) and tight.predicted_peak_bytes <= tight.budget_bytes


def test_a_plan_with_the_head_round_trips_applies_and_is_undone(tmp_path):
    chosen = plan(build(), budget="min")
    path = tmp_path / "plan.json"
    chosen.save(path)
    loaded = runtime.load_plan(path)
    assert loaded.model_options == ("head",)
    model = loaded.apply(build())
    assert hasattr(model, "head_report")
    native = runtime.unconvert(model)
    assert not hasattr(native, "head_report") and "forward" not in vars(native)
    data = chosen.to_dict()
    data["settings"]["allow"] = ["checkpoint"]
    data["choices"] = ["plain", "plain"]
    with pytest.raises(FewBitError, match=r"model_options\[0\] is 'head': a technique of settings.allow"):
        runtime.planner.MemoryPlan.from_dict(data)
