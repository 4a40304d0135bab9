"""Tiny Hugging Face models (from configs, no downloads) with memory-sharing norms: one training step gives the
native loss and gradients, and a block saves fewer bytes for backward than the native one (measured)."""

from __future__ import annotations

import copy

import pytest
import torch

from fewbit_design.runtime import memory, norms
from fewbit_design.runtime.norms import MemorySharingNorm

transformers = pytest.importorskip("transformers")

# float32 through a whole model: each norm's gradients differ from torch's by rounding (~1e-7 relative, see
# test_norms_grads) and the layers after it carry that on; 1e-5 of the largest gradient of each parameter leaves
# room for that and fails on any real difference (a wrong norm gradient is off by O(1) of the norm's share)
TOLERANCE = 1e-5
VOCAB, TOKENS = 64, 12


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=TOKENS, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=TOKENS, attn_implementation="eager",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": (_llama, 5), "gpt2": (_gpt2, 5)}  # (builder, norms in the model: 2 per layer and the final one)


def _step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("name", list(MODELS))
def test_one_training_step_gives_native_loss_and_gradients(name):
    build, count = MODELS[name]
    torch.manual_seed(0)
    native = build()
    converted = norms.convert(copy.deepcopy(native))
    assert sum(isinstance(m, MemorySharingNorm) for m in converted.modules()) == count, converted.norms_report
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second step runs on the updated weights
        loss_native, grads_native = _step(native, ids)
        loss_converted, grads_converted = _step(converted, ids)
        assert torch.equal(loss_native, loss_converted) or abs(float(loss_native - loss_converted)) <= 1e-6
        assert grads_native.keys() == grads_converted.keys()
        for key, grad in grads_native.items():
            error = float((grad - grads_converted[key]).abs().max())
            assert error <= TOLERANCE * float(grad.abs().max()), f"{name} {key}: {error:.3g}"


def _block(name: str) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    model = MODELS[name][0]()
    if name == "llama":
        layer = model.model.layers[0]
        rotary = model.model.rotary_emb
        positions = torch.arange(TOKENS)[None]
        hidden = torch.randn(2, TOKENS, 32)
        return layer, {"position_embeddings": rotary(hidden, positions), "attention_mask": None}
    return model.transformer.h[0], {}


def block_saved_bytes(name: str) -> tuple[int, int]:
    """(native, converted) bytes saved for backward by one block on a (2, TOKENS, 32) float32 input."""
    results = []
    block, kwargs = _block(name)
    for module in (block, norms.convert(copy.deepcopy(block))):
        x = torch.randn(2, TOKENS, 32, generator=torch.Generator().manual_seed(2), requires_grad=True) * 1.0
        with memory.saved_bytes(module) as saved:
            out = module(x, **kwargs)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
        results.append(saved.total)
    return results[0], results[1]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_converted_block_saves_two_activations_less_per_norm(name):
    native, converted = block_saved_bytes(name)
    activation = 2 * TOKENS * 32 * 4
    # LlamaRMSNorm saves its input and the normalised input (2 activations) beside rstd, the next linear saves the
    # output; GPT-2's LayerNorm saves its input (1 activation) beside mean and rstd. Converted: output (shared) + rstd.
    freed_per_norm = {"llama": 2 * activation, "gpt2": activation + 2 * TOKENS * 4}[name]
    assert native - converted == 2 * freed_per_norm, (native, converted)
