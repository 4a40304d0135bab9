"""Tiny Hugging Face models of every family the runtime is tested on (configs, no downloads), one builder for all
the test modules: LLaMA, Mistral, Qwen2, Phi-3, Gemma (decoders with a gated MLP), GPT-2, BERT, T5, ViT, Whisper,
CLIP. Seeded, dropout off unless asked for, so two builds are the same model; each comes with a batch for it."""

from __future__ import annotations

import torch

HIDDEN, WIDTH, VOCAB, BATCH, TOKENS = 32, 64, 64, 2, 8
#: the decoder families (gated MLP, SDPA attention with q/k/v projections, KV cache)
DECODERS = ("llama", "mistral", "qwen2", "phi3", "gemma")
FAMILIES = (*DECODERS, "gpt2", "bert", "t5", "vit", "whisper", "clip")


def build(
    family: str, layers: int = 1, *, heads: int = 2, kv_heads: int = 2, dropout: float = 0.0
) -> tuple[torch.nn.Module, dict]:
    """A tiny model of ``family`` (seeded) and a batch for it; the decoder families with ``heads`` query heads and
    ``kv_heads`` key/value heads (fewer: grouped-query attention); ``dropout``: every dropout probability of the GPT-2,
    BERT, T5, ViT and Whisper configs, the decoders' ``attention_dropout`` (0: off)."""
    torch.manual_seed(0)
    import transformers as t

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, TOKENS), generator=generator)
    tokens = {"input_ids": ids}
    decoder = dict(
        num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=WIDTH, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attention_dropout=dropout,
    )  # fmt: skip
    if family in ("llama", "mistral", "qwen2", "phi3", "gemma"):
        classes = {
            "llama": (t.LlamaConfig, t.LlamaForCausalLM), "mistral": (t.MistralConfig, t.MistralForCausalLM),
            "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM), "phi3": (t.Phi3Config, t.Phi3ForCausalLM),
            "gemma": (t.GemmaConfig, t.GemmaForCausalLM),
        }  # fmt: skip
        config_class, model_class = classes[family]
        extra = {"head_dim": 16} if family == "gemma" else {}
        return model_class(config_class(**decoder, **extra)), tokens
    if family == "gpt2":
        config = t.GPT2Config(
            n_layer=layers, n_embd=HIDDEN, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        )  # fmt: skip
        return t.GPT2LMHeadModel(config), tokens
    if family == "bert":
        config = t.BertConfig(
            num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=WIDTH, num_attention_heads=2,
            vocab_size=VOCAB, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        )  # fmt: skip
        return t.BertModel(config), tokens
    if family == "t5":
        config = t.T5Config(
            d_model=HIDDEN, d_ff=WIDTH, num_layers=layers, num_decoder_layers=layers, num_heads=2, d_kv=16,
            vocab_size=VOCAB, feed_forward_proj="gated-gelu", dropout_rate=dropout, decoder_start_token_id=0,
        )  # fmt: skip
        return t.T5ForConditionalGeneration(config), {**tokens, "decoder_input_ids": ids}
    if family == "vit":
        config = t.ViTConfig(
            num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=WIDTH, num_attention_heads=2,
            image_size=16, patch_size=8, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
        )  # fmt: skip
        return t.ViTModel(config), {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=generator)}
    if family == "whisper":
        config = t.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=8, encoder_layers=layers, decoder_layers=layers, d_model=HIDDEN,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=WIDTH, decoder_ffn_dim=WIDTH,
            max_source_positions=8, max_target_positions=16, pad_token_id=0, bos_token_id=0, eos_token_id=0,
            decoder_start_token_id=0, dropout=dropout, attention_dropout=dropout, activation_dropout=dropout,
        )  # fmt: skip
        features = torch.randn(BATCH, 8, 16, generator=generator)
        return t.WhisperForConditionalGeneration(config), {"input_features": features, "decoder_input_ids": ids}
    if family == "clip":
        text = dict(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=WIDTH, num_hidden_layers=layers,
            num_attention_heads=2, max_position_embeddings=TOKENS,
        )  # fmt: skip
        vision = dict(
            hidden_size=HIDDEN, intermediate_size=WIDTH, num_hidden_layers=layers, num_attention_heads=2,
            image_size=16, patch_size=8,
        )  # fmt: skip
        config = t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
        pixels = torch.randn(BATCH, 3, 16, 16, generator=generator)
        return t.CLIPModel(config), {**tokens, "pixel_values": pixels}
    raise AssertionError(family)


def output(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The main float output of one forward: logits, CLIP's image logits or the last hidden state."""
    out = model(**inputs)
    for key in ("logits", "logits_per_image", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key)
    raise AssertionError(type(out))
