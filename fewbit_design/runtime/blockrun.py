"""One block run alone under the memory instruments: the measurement that both block profilers are built on
(:mod:`.checkpoint.profile`, which plans recomputation segments, and :mod:`.planner.profile`, which measures every
technique option of every block).

:func:`run_block` runs one forward and one backward of a block on a copy of its input, as the block would run
inside a chain (the input is a non-leaf view, so ``saved_bytes`` counts it when the block saves it), and returns
what :class:`BlockRun` lists: bytes from :func:`memory.peak` and :func:`memory.saved_bytes`, exact storage sizes.

The backward can be seeded two ways, because the two profilers model the chain's gradient differently:

* ``"ones"`` (checkpoint's cost model): a gradient of ones held alive through the backward, not counted in the
  backward figures; the output stays alive too. The backward figures are relative to the live bytes after the
  forward pass.
* ``"owned"`` (the planner's cost model): the incoming gradient is owned by autograd alone (freed once used, as
  inside a chain) and counted in the backward peak; the output is alive only when the block saved it. The backward
  peak is relative to the live bytes when the backward starts and ends when the input's gradient exists (what
  follows, accumulating into the copy's leaf, is an artefact of running the block alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FewBitError, check_choice
from . import memory

__all__ = [
    "BlockRun",
    "run_block",
    "block_input",
    "first_tensor",
    "storage_bytes",
    "synchronize",
    "training_state_kept",
]

SEEDS = ("ones", "owned")


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s whole storage (what keeping it alive costs)."""
    return int(tensor.untyped_storage().nbytes())


def first_tensor(output: Any) -> torch.Tensor:
    """The hidden state a block returns: the output, or the first element of a tuple or list output."""
    hidden = output[0] if isinstance(output, tuple | list) else output
    if not isinstance(hidden, torch.Tensor):
        kind = type(hidden).__name__
        raise FewBitError(f"a block of the chain must return a tensor or a tuple starting with one, got {kind}")
    return hidden


def block_input(x: torch.Tensor, *, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf, input): a leaf copy of ``x`` (requiring a gradient when ``needs_grad``) and the hidden state to run a
    block alone on, as the block receives it inside a chain: with a gradient, a non-leaf of its own storage (a clone
    of the leaf), so that ``saved_bytes`` counts it when saved and a region treats it as it treats the chain's
    hidden states. Not a view of the leaf: offload keeps a view of a leaf that requires a gradient in memory, as it
    keeps parameters, where it moves the chain's hidden state out (the profile then took a CNN block's offloaded
    input as kept). Without a gradient, the leaf itself (a model input that needs none is a leaf in the chain too).
    Make it before :func:`memory.peak` starts: the chain's hidden state exists before the block runs."""
    leaf = x.detach().requires_grad_(needs_grad)
    return leaf, (leaf.clone() if needs_grad else leaf)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so that a wall-clock interval covers it; nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def training_state_kept(module: torch.nn.Module, *, grads: str = "kept") -> Iterator[None]:
    """Run a measurement on ``module`` and put back its parameters' gradients and its buffers (batch-norm running
    statistics) afterwards. During the block the gradients are as they were (``grads="kept"``), None (``"none"``:
    the backward pass creates them) or zeros (``"zeros"``: it adds into them; parameters that need a gradient)."""
    grads = check_choice("grads", grads, ("kept", "none", "zeros"))
    saved = {p: p.grad for p in module.parameters()}
    buffers = {key: value.detach().clone() for key, value in module.named_buffers()}
    if grads != "kept":
        for parameter in saved:
            zeros = grads == "zeros" and parameter.requires_grad
            parameter.grad = torch.zeros_like(parameter) if zeros else None
    try:
        yield
    finally:
        for parameter, grad in saved.items():
            parameter.grad = grad
        with torch.no_grad():
            for key, value in module.named_buffers():
                value.copy_(buffers[key])


@dataclass(frozen=True)
class BlockRun:
    """What one forward + backward of a block alone measured (see the module docstring for the two seeds).

    Attributes:
        input_bytes: bytes of the hidden-state input.
        output_bytes: bytes of the hidden-state output (the first element of a tuple output).
        new_output: whether the output is a new storage (not the input's, as an in-place block returns).
        saved_bytes: bytes saved for backward (parameters and buffers excluded; the input counts if saved; what a
            region moved out of memory counts too: the region's value says how much that was).
        saves_input, saves_output: whether the input's / output's storage is saved and stays in memory for
            backward (:meth:`memory.SavedBytes.keeps`: not when the region moved it out of memory).
        forward_peak: peak of the forward pass above its start (output included).
        after_forward: live bytes after the forward pass above its start (output included).
        backward_peak: peak of the backward pass (see the seeds); 0 when the output needs no gradient.
        backward_delta: ``"ones"`` only: live bytes after the backward pass minus those after the forward pass,
            the incoming gradient not counted.
        input_grad_bytes: bytes of the gradient of the input (0 when it needs none).
        gradient_bytes: bytes of the parameters' gradients after the run.
        region: the value of the ``region`` context the forward ran under (None without one).
    """

    input_bytes: int
    output_bytes: int
    new_output: bool
    saved_bytes: int
    saves_input: bool
    saves_output: bool
    forward_peak: int
    after_forward: int
    backward_peak: int
    backward_delta: int
    input_grad_bytes: int
    gradient_bytes: int
    region: Any = None

    @property
    def kept(self) -> int:
        """Bytes the forward pass left alive besides its output: what the block holds for backward beyond its
        input and output."""
        return self.after_forward - (self.output_bytes if self.new_output else 0)


class _Owned(torch.autograd.Function):
    """A scalar whose backward hands a gradient of ones to its input, owned by autograd alone."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype, ctx.device = hidden.shape, hidden.dtype, hidden.device
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor) -> torch.Tensor:
        return torch.ones(ctx.shape, dtype=ctx.dtype, device=ctx.device)


def run_block(
    block: torch.nn.Module,
    x: torch.Tensor,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    needs_grad: bool,
    seed: str,
    region: contextlib.AbstractContextManager | None = None,
) -> tuple[BlockRun, torch.Tensor | None]:
    """Run ``block(x, *args, **kwargs)`` forward and backward once on a copy of ``x`` (requiring a gradient when
    ``needs_grad``), the forward under ``region`` when given; return the measurement and, for the ``"ones"`` seed,
    the output (detached; None for ``"owned"``, whose output must not outlive the forward)."""
    seed = check_choice("seed", seed, SEEDS)
    kwargs = kwargs or {}
    leaf, inp = block_input(x, needs_grad=needs_grad)
    backward_peak = backward_delta = 0
    with memory.peak() as p:
        # the region outside, so that saved_bytes sees what the block saves before the region's hooks take it
        with region or contextlib.nullcontext() as region_value, memory.saved_bytes(block) as saved:
            output = block(inp, *args, **kwargs)
        hidden = first_tensor(output)
        forward_peak, after_forward = p.peak_bytes, p.live_bytes
        output_bytes = storage_bytes(hidden)
        new_output = memory.storage_key(hidden) != memory.storage_key(inp)  # (fake tensors have no address)
        # kept in memory for backward (a region such as offload keeps what is under its size threshold)
        saves_input, saves_output = saved.keeps(inp), saved.keeps(hidden)
        result = hidden.detach() if seed == "ones" else None  # "owned": the output lives only if the block saved it
        if hidden.requires_grad and seed == "ones":
            p.reset_peak()
            grad = torch.ones_like(hidden)
            torch.autograd.backward(hidden, grad)
            # relative to the end of the forward pass, without the incoming gradient (the chain has its own)
            backward_peak = p.peak_bytes - after_forward - storage_bytes(grad)
            backward_delta = p.live_bytes - after_forward - storage_bytes(grad)
            del grad
        elif hidden.requires_grad:
            owned = _Owned.apply(hidden)
            del output, hidden
            start = p.live_bytes
            p.reset_peak()
            ends: list[int] = []
            if inp.requires_grad:
                inp.register_hook(lambda _grad: ends.append(p.peak_bytes))
            owned.backward()
            backward_peak = max((ends[0] if ends else p.peak_bytes) - start, 0)
            del owned
    run = BlockRun(
        input_bytes=storage_bytes(x),
        output_bytes=output_bytes,
        new_output=new_output,
        saved_bytes=saved.total,
        saves_input=saves_input,
        saves_output=saves_output,
        forward_peak=int(forward_peak),
        after_forward=int(after_forward),
        backward_peak=int(backward_peak),
        backward_delta=int(backward_delta),
        input_grad_bytes=storage_bytes(leaf.grad) if leaf.grad is not None else 0,
        gradient_bytes=sum(storage_bytes(q.grad) for q in block.parameters() if q.grad is not None),
        region=region_value,
    )
    return run, result
