"""A tiny Hugging Face GPT-2 for the tests of :mod:`fewbit_design.runtime.hf` (no dropout, so two runs of the same
weights on the same batch give the same loss and gradients), and its loss and gradients on a batch."""

from __future__ import annotations

import torch

VOCAB, POSITIONS = 64, 16


def tiny_gpt2(transformers, layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=POSITIONS, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


def tokens(batch: int = 4, length: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


class TokenDataset(torch.utils.data.Dataset):
    """16 rows of 8 tokens, each its own labels: the training data of the Trainer and Lightning callback tests."""

    def __init__(self) -> None:
        self.rows = tokens(batch=16, length=8)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def loss_and_gradients(model, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), gradients


def structure(model) -> list[tuple[str, str, str]]:
    """(name, module class, class of an instance-level forward: a checkpoint wrapper) of every module."""
    return [
        (name, type(module).__name__, type(module.__dict__.get("forward")).__name__)
        for name, module in model.named_modules()
    ]
