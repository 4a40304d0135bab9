"""Stock Hugging Face configs of every family plan and apply without error: each model from its
default config with tiny sizes, caches at their defaults. Planned with ``allow=("checkpoint",)`` to keep the test
fast (the full profile of every technique is what tests/runtime/planner/test_planner.py runs on GPT-2 and LLaMA)."""

from __future__ import annotations

import math

import pytest
import torch

from fewbit_design import runtime

transformers = pytest.importorskip("transformers")

TINY = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64, "num_hidden_layers": 2}
DECODERS = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 2, "pad_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"num_key_value_heads": 2, "head_dim": 16}),
}


def _build(family: str):
    """(model, inputs, keyword inputs) of one training step."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16))
    if family in DECODERS:
        config_name, model_name, extra = DECODERS[family]
        config = getattr(transformers, config_name)(vocab_size=64, max_position_embeddings=64, **TINY, **extra)
        return getattr(transformers, model_name)(config), (tokens,), {"labels": tokens}
    if family == "bert":
        config = transformers.BertConfig(vocab_size=64, max_position_embeddings=64, **TINY)
        return transformers.BertForMaskedLM(config), (tokens,), {"labels": tokens}
    if family == "t5":
        config = transformers.T5Config(
            vocab_size=64,
            d_model=32,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=2,
            decoder_start_token_id=0,  # as the released T5 checkpoints set it; T5Config() has none (HF cannot train)
        )
        return transformers.T5ForConditionalGeneration(config), (tokens,), {"labels": tokens}
    if family == "vit":
        config = transformers.ViTConfig(image_size=32, patch_size=8, **TINY)
        images = torch.randn(2, 3, 32, 32)
        return transformers.ViTForImageClassification(config), (images,), {"labels": torch.tensor([0, 1])}
    if family == "whisper":
        config = transformers.WhisperConfig(
            vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_source_positions=16, max_target_positions=16, pad_token_id=0, decoder_start_token_id=1,
        )  # fmt: skip
        features = torch.randn(2, 8, 32)
        return transformers.WhisperForConditionalGeneration(config), (features,), {"labels": tokens[:, :8]}
    if family == "clip":
        text = transformers.CLIPTextConfig(vocab_size=64, max_position_embeddings=16, **TINY)
        vision = transformers.CLIPVisionConfig(image_size=32, patch_size=8, **TINY)
        config = transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16)
        images = torch.randn(2, 3, 32, 32)
        return transformers.CLIPModel(config), (tokens,), {"pixel_values": images, "return_loss": True}
    raise AssertionError(family)


@pytest.mark.parametrize("family", [*DECODERS, "bert", "t5", "vit", "whisper", "clip"])
def test_stock_config_plans_and_applies(family):
    model, inputs, kwargs = _build(family)
    model.train()
    plan = runtime.plan_memory(model, *inputs, budget="min", allow=("checkpoint",), example_kwargs=kwargs, repeats=1)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    applied, _, _ = _build(family)
    applied = plan.apply(applied.train())
    loss = applied(*inputs, **kwargs).loss
    loss.backward()
    assert math.isfinite(loss.item())
    assert any(p.grad is not None for p in applied.parameters())
