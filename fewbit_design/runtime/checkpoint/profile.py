"""Profile a chain of blocks: per block, the bytes it keeps for backward, its output bytes and its forward time.

Each block runs alone on the output of the previous one (detached), under :func:`memory.peak` and
:func:`memory.saved_bytes`, once in plain training mode (forward and backward) and once under
``torch.utils.checkpoint`` (forward only), then a few times for its forward time. Parameters' gradients, buffers
(batch-norm statistics) and the random number generator are restored afterwards: profiling leaves the model as it
found it.

By default the backward pass creates the parameters' gradients (``zero_grad(set_to_none=True)``, torch's default),
so they count in the step's peak. With ``grads_allocated=True`` the gradients exist before the step (zeroed in
place with ``zero_grad(set_to_none=False)``, gradient accumulation, DDP's gradient buckets): the backward pass adds
into them, and the peak is the feature maps' (what checkpointing reduces) plus one transient gradient.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ...errors import FewBitError
from .. import memory
from ..blockrun import run_block, synchronize, training_state_kept
from ..fingerprint import BlockFingerprint, fingerprint, fingerprint_from_json

__all__ = ["BlockProfile", "Profile", "profile", "training_state_kept"]


@dataclass(frozen=True)
class BlockProfile:
    """What one block costs (bytes are exact storage sizes, from :func:`memory.peak` and :func:`memory.saved_bytes`).

    Attributes:
        name: the block's name in its container ("0", "1", ...).
        input_bytes: bytes of the hidden-state input.
        output_bytes: bytes of the hidden-state output (the first element of a tuple output).
        saved_bytes: bytes saved for backward (parameters and buffers excluded; the input counts if saved).
        saves_input: whether the input's storage is among the tensors saved for backward.
        saves_output: whether the output's storage is among them (ReLU, sigmoid and tanh save their output).
        retained_bytes: bytes allocated by the forward pass that stay alive after it besides the output: what the
            block holds for backward beyond its input and output.
        forward_peak_bytes: peak during the forward pass above its start (output included), plain training mode.
        checkpoint_forward_peak_bytes: the same under ``torch.utils.checkpoint`` (nothing kept for backward).
        backward_peak_bytes: peak during the backward pass above the bytes alive after the forward pass (the
            incoming gradient not counted).
        backward_delta_bytes: bytes alive after the backward pass minus those after the forward pass (the output
            still held): the parameter and input gradients it creates minus the saved tensors it frees.
        input_grad_bytes: bytes of the gradient it computes for its input (0 when the input needs none).
        forward_seconds: median forward time (training mode, building the graph).
    """

    name: str
    input_bytes: int
    output_bytes: int
    saved_bytes: int
    saves_input: bool
    saves_output: bool
    retained_bytes: int
    forward_peak_bytes: int
    checkpoint_forward_peak_bytes: int
    backward_peak_bytes: int
    backward_delta_bytes: int
    input_grad_bytes: int
    forward_seconds: float

    @property
    def gradient_bytes(self) -> int:
        """Bytes its backward pass leaves alive for the rest of the step besides its input gradient (parameter
        gradients)."""
        return self.backward_delta_bytes + self.retained_bytes - self.input_grad_bytes


@dataclass(frozen=True)
class Profile:
    """A profiled chain: the blocks in order and how the chain can be cut.

    Attributes:
        blocks: one :class:`BlockProfile` per block.
        per_block: True for an ``nn.ModuleList`` that a model loops over: it can only be checkpointed block by
            block (segments of one block); False for an ``nn.Sequential`` or a list, which run as one chain.
        device: the device the blocks ran on.
        grads_allocated: whether the parameters' gradients were allocated before the backward pass (see the module
            docstring); a step must run the same way for the plan's predictions to hold.
        fingerprint: per block, its class and parameter shapes (:mod:`.fingerprint`), carried into plans so that
            applying one to other blocks fails; empty in profiles saved before fingerprints existed.
    """

    blocks: tuple[BlockProfile, ...]
    per_block: bool = False
    device: str = "cpu"
    grads_allocated: bool = False
    fingerprint: tuple[BlockFingerprint, ...] = ()

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def forward_seconds(self) -> float:
        """Forward time of the whole chain."""
        return sum(block.forward_seconds for block in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dictionary (see :meth:`from_dict`)."""
        return {
            "blocks": [asdict(b) for b in self.blocks],
            "per_block": self.per_block,
            "device": self.device,
            "grads_allocated": self.grads_allocated,
            "fingerprint": [block.to_json() for block in self.fingerprint],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """The profile that :meth:`to_dict` wrote."""
        return cls(
            tuple(BlockProfile(**b) for b in data["blocks"]),
            bool(data["per_block"]),
            str(data["device"]),
            bool(data.get("grads_allocated", False)),
            fingerprint_from_json(data.get("fingerprint", []), "profile fingerprint"),
        )


def _measure(block: torch.nn.Module, name: str, x: torch.Tensor, args: tuple, kwargs: dict, repeats: int):
    """Profile one block on input ``x``; return its :class:`BlockProfile` and its output (detached)."""
    needs_grad = x.requires_grad
    run, result = run_block(block, x, args, kwargs, needs_grad=needs_grad, seed="ones")
    with memory.peak() as c:
        output = torch_checkpoint(block, x.detach().requires_grad_(needs_grad), *args, use_reentrant=False, **kwargs)
    checkpoint_peak = c.peak_bytes
    del output
    times = []
    for _ in range(repeats):
        synchronize(x.device)
        start = time.perf_counter()
        output = block(x.detach().requires_grad_(needs_grad), *args, **kwargs)
        synchronize(x.device)
        times.append(time.perf_counter() - start)
        del output
    block_profile = BlockProfile(
        name=name,
        input_bytes=run.input_bytes,
        output_bytes=run.output_bytes,
        saved_bytes=run.saved_bytes,
        saves_input=run.saves_input,
        saves_output=run.saves_output,
        retained_bytes=run.kept,
        forward_peak_bytes=run.forward_peak,
        checkpoint_forward_peak_bytes=checkpoint_peak,
        backward_peak_bytes=run.backward_peak,
        backward_delta_bytes=run.backward_delta,
        input_grad_bytes=run.input_grad_bytes,
        forward_seconds=statistics.median(times),
    )
    return block_profile, result


def _has_grad(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _blocks_of(blocks: Any) -> tuple[list[torch.nn.Module], list[str], bool]:
    if isinstance(blocks, torch.nn.ModuleList):
        return list(blocks), [str(i) for i in range(len(blocks))], True
    if isinstance(blocks, torch.nn.Sequential):
        names = list(blocks._modules)
        return list(blocks), names, False
    if isinstance(blocks, Sequence) and all(isinstance(b, torch.nn.Module) for b in blocks):
        return list(blocks), [str(i) for i in range(len(blocks))], False
    raise FewBitError(
        f"blocks must be an nn.Sequential, an nn.ModuleList or a list of modules, got {type(blocks).__name__}"
    )


def profile(
    blocks: Any, *example_inputs: Any, repeats: int = 3, grads_allocated: bool = False, **example_kwargs: Any
) -> Profile:
    """Run each block once on example inputs and measure what it costs (see :class:`BlockProfile`).

    Args:
        blocks: an ``nn.Sequential`` or a list of modules (a chain: one input, the output of block i is the input of
            block i + 1), or an ``nn.ModuleList`` of blocks that take extra arguments (attention masks, position
            ids): ``example_inputs[1:]`` and ``example_kwargs`` are passed to every block unchanged, and the output
            of block i (the first element of a tuple) is the first input of block i + 1.
        example_inputs: the chain's input (a tensor), then the extra positional arguments of a ModuleList's blocks.
        repeats: forward runs per block for the median time.
        grads_allocated: measure the backward pass with the parameters' gradients already allocated (zeros), as in
            a step after ``zero_grad(set_to_none=False)`` or during gradient accumulation; default False: they are
            None before the step and created by it.
        example_kwargs: keyword arguments of a ModuleList's blocks.

    The example should have the shapes of training (batch, sequence length): bytes scale with them.
    """
    modules, names, per_block = _blocks_of(blocks)
    if not modules:
        raise FewBitError("profile needs at least one block, got an empty container")
    if not example_inputs or not isinstance(example_inputs[0], torch.Tensor):
        raise FewBitError("profile needs the chain's input tensor as its first example input")
    if not per_block and (len(example_inputs) > 1 or example_kwargs):
        raise FewBitError(
            f"an nn.Sequential or list takes one input, got {len(example_inputs)} inputs and "
            f"{sorted(example_kwargs)} keyword arguments (use an nn.ModuleList for blocks with extra arguments)"
        )
    if not isinstance(repeats, int) or repeats < 1:
        raise FewBitError(f"repeats must be a positive integer, got {repeats!r}")
    if not isinstance(grads_allocated, bool):
        raise FewBitError(f"grads_allocated must be True or False, got {grads_allocated!r}")
    x = example_inputs[0]
    args = tuple(example_inputs[1:])
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    results = []
    with torch.random.fork_rng(devices=devices):
        for module, name in zip(modules, names, strict=True):
            with training_state_kept(module, grads="zeros" if grads_allocated else "none"):
                block_profile, output = _measure(module, name, x, args, example_kwargs, repeats)
                x = output.requires_grad_(output.is_floating_point() and (x.requires_grad or _has_grad(module)))
            results.append(block_profile)
    device = str(example_inputs[0].device)
    return Profile(
        tuple(results),
        per_block=per_block,
        device=device,
        grads_allocated=grads_allocated,
        fingerprint=fingerprint(modules),
    )
