"""The machinery of reversible backward: RNG replay, frozen running statistics, recording of reconstructions,
vector-Jacobian products and autocast state (see :mod:`fewbit_design.runtime.reversible`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

State = tuple  # nested tuples of tensors: what a block keeps from forward for its reversal


# --------------------------------------------------------------------------------------------------------------
# RNG replay. The CUDA-only part is isolated in these small functions; their getters and setters can be replaced
# so that the logic is tested on a machine without a GPU.


def _cuda_device_indices(devices: Iterable[torch.device]) -> list[int]:
    """Distinct CUDA device indices among ``devices``, in first-seen order (empty on a CPU-only run)."""
    indices: list[int] = []
    for device in devices:
        device = torch.device(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index not in indices:
                indices.append(index)
    return indices


def _capture_rng_state(
    cuda_devices: Sequence[int], *, get_cuda_state: Callable[[int], torch.Tensor] | None = None
) -> tuple[torch.Tensor, ...]:
    """The CPU RNG state followed by the RNG state of each CUDA device in ``cuda_devices``."""
    states = [torch.get_rng_state()]
    if cuda_devices:
        getter = get_cuda_state if get_cuda_state is not None else torch.cuda.get_rng_state
        states.extend(getter(index) for index in cuda_devices)
    return tuple(states)


def _set_rng_state(
    states: Sequence[torch.Tensor],
    cuda_devices: Sequence[int],
    *,
    set_cuda_state: Callable[[torch.Tensor, int], None] | None = None,
) -> None:
    """Inverse of :func:`_capture_rng_state`."""
    assert len(states) == 1 + len(cuda_devices), "one CPU state plus one state per CUDA device"
    torch.set_rng_state(states[0])
    if cuda_devices:
        setter = set_cuda_state if set_cuda_state is not None else torch.cuda.set_rng_state
        for state, index in zip(states[1:], cuda_devices, strict=True):
            setter(state, index)


@contextlib.contextmanager
def _replayed_rng(
    states: Sequence[torch.Tensor] | None,
    cuda_devices: Sequence[int],
    *,
    get_cuda_state: Callable[[int], torch.Tensor] | None = None,
    set_cuda_state: Callable[[torch.Tensor, int], None] | None = None,
) -> Iterator[None]:
    """Run the block with the RNG set to ``states``, then give the caller its own RNG state back."""
    if not states:
        yield
        return
    outer = _capture_rng_state(cuda_devices, get_cuda_state=get_cuda_state)
    _set_rng_state(states, cuda_devices, set_cuda_state=set_cuda_state)
    try:
        yield
    finally:
        _set_rng_state(outer, cuda_devices, set_cuda_state=set_cuda_state)


_RANDOM_MODULES: tuple[type[nn.Module], ...] = (nn.modules.dropout._DropoutNd, nn.RReLU)


def uses_rng(module: nn.Module) -> bool:
    """Whether ``module`` (or a sub-module) draws random numbers in forward: dropout, RReLU, or any module with a
    true ``uses_rng`` attribute."""
    return any(isinstance(m, _RANDOM_MODULES) or getattr(m, "uses_rng", False) is True for m in module.modules())


@contextlib.contextmanager
def frozen_running_stats(module: nn.Module) -> Iterator[None]:
    """Within the block, BatchNorm modules in training mode keep using batch statistics but leave their running
    statistics (and ``num_batches_tracked``) alone: ``track_running_stats`` is switched off and back on.

    This is how the recomputation in backward avoids updating the statistics a second time.
    """
    switched = []
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats:
            m.track_running_stats = False
            switched.append(m)
    try:
        yield
    finally:
        for m in switched:
            m.track_running_stats = True


# --------------------------------------------------------------------------------------------------------------
# Recording of forward activations and their reconstructions (for reconstruction_snr).


class _Recorder:
    """Keeps, per invertible block, its forward inputs and its inputs as reconstructed in backward."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.order: list[nn.Module] = []
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.reconstructed: dict[int, list[torch.Tensor]] = {}

    def forward(self, block: nn.Module, x: torch.Tensor) -> None:
        if self.phase != "forward":
            return  # recomputations in backward are not new activations
        if id(block) not in self.inputs:
            self.order.append(block)
            self.inputs[id(block)] = []
        self.inputs[id(block)].append(x.detach().clone())

    def reverse(self, block: nn.Module, x: torch.Tensor) -> None:
        if self.phase == "backward":
            self.reconstructed.setdefault(id(block), []).append(x.detach().clone())


_RECORDER: _Recorder | None = None


def _record_forward(block: nn.Module, x: torch.Tensor) -> None:
    if _RECORDER is not None:
        _RECORDER.forward(block, x)


def _record_reverse(block: nn.Module, x: torch.Tensor) -> None:
    if _RECORDER is not None:
        _RECORDER.reverse(block, x)


# --------------------------------------------------------------------------------------------------------------
# Base class and the helpers of backward.


def _vjp(output: torch.Tensor, inputs: Sequence[torch.Tensor], grad_output: torch.Tensor) -> list[torch.Tensor | None]:
    """Vector-Jacobian product ``grad_output^T d output / d inputs`` (None where an input is unused)."""
    if not output.requires_grad:
        return [None] * len(inputs)
    grads = torch.autograd.grad(output, list(inputs), grad_output.to(output.dtype), allow_unused=True)
    return list(grads)


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _select(params: Sequence[torch.Tensor], module: nn.Module) -> list[torch.Tensor]:
    """The entries of ``params`` that belong to ``module`` (in ``params`` order)."""
    own = {id(p) for p in module.parameters()}
    return [p for p in params if id(p) in own]


# --------------------------------------------------------------------------------------------------------------
# The sequence and its autograd Function.


def _flatten(state: Any, out: list[torch.Tensor]) -> Any:
    """Flatten nested tuples of tensors into ``out``; return the structure (ints mark tensor positions)."""
    if isinstance(state, torch.Tensor):
        out.append(state)
        return len(out) - 1
    return tuple(_flatten(item, out) for item in state)


def _unflatten(spec: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(spec, int):
        return tensors[spec]
    return tuple(_unflatten(item, tensors) for item in spec)


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype | None, bool]:
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        return device_type, False, None, True
    dtype = torch.get_autocast_dtype(device_type) if enabled else None
    return device_type, enabled, dtype, torch.is_autocast_cache_enabled()


def _autocast_context(state: tuple[str, bool, torch.dtype | None, bool]) -> contextlib.AbstractContextManager:
    device_type, enabled, dtype, cache = state
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, enabled=True, cache_enabled=cache)


@contextlib.contextmanager
def recording(recorder: _Recorder) -> Iterator[_Recorder]:
    """Record forward inputs and backward reconstructions of every invertible block into ``recorder``."""
    global _RECORDER
    previous, _RECORDER = _RECORDER, recorder
    try:
        yield recorder
    finally:
        _RECORDER = previous
