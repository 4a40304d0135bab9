"""Reversible and layer-wise invertible networks: activations recomputed from outputs during backward.

Terms used in this module:

* **invertible module**: an ``nn.Module`` with ``forward(x)`` and an ``inverse(y)`` that gives ``x`` back from
  ``y = forward(x)`` (exactly in real arithmetic; up to rounding in floating point). All of them derive from
  :class:`InvertibleModule`.
* **coupling**: :class:`AdditiveCoupling` (RevNet, Gomez et al. 2017): ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``
  with ``x`` split in two halves; ``f`` and ``g`` are arbitrary (not necessarily invertible) modules.
* **layer-wise invertible layer** (section 4.2 of Hascoet et al., "Reversible designs for extreme memory cost
  reduction of CNN training", 2023): :class:`InvertibleBatchNorm2d`, :class:`InvertibleLeakyReLU`,
  :class:`InvertibleConv2d` (a coupling of two half-channel convolutions), :class:`ChannelPool2d` and
  :class:`BatchPool2d` (2x2 spatial blocks stacked into channels or into the batch).
* **reversible sequence**: :class:`ReversibleSequence` runs invertible blocks and keeps only its output (plus a
  few per-channel statistics and RNG states) for backward; in backward it walks the blocks from the last to the
  first, reconstructing each block's input from its output and back-propagating through that block alone.

Architectures: :func:`revnet` (couplings whose ``f``, ``g`` are BN-ReLU-conv stacks), :func:`layerwise_net`
(every layer inverted, section 4.3), :func:`hybrid_net` (couplings whose ``f``, ``g`` are layer-wise invertible
chains, section 4.4) and :func:`resnet` (a plain residual network of similar size: the memory baseline). Each
builder takes ``reconstruct=False`` to store everything with plain autograd (the oracle of tests and
benchmarks). The couplings of :func:`revnet` and :func:`hybrid_net` scale their branches by
``branch_scale = 1 / depth`` by default, which keeps the reconstruction error from growing with depth (see
:func:`hybrid_net`).

How backward works (the contract that the tests check):

* A custom ``torch.autograd.Function`` takes the sequence input and *all* parameters of the sequence as explicit
  inputs, runs the blocks under ``no_grad`` and saves the output (and the small per-block state) with
  ``ctx.save_for_backward``, so :func:`fewbit_design.runtime.memory.saved_bytes` sees exactly what is kept.
* Its backward never calls a nested ``.backward()``: each block recomputes its forward from the reconstructed
  input under ``enable_grad`` and takes a vector-Jacobian product with ``torch.autograd.grad``.
* BatchNorm running statistics update once per training step: the recomputation in backward runs with
  ``track_running_stats`` switched off on every BatchNorm module in training mode (which makes
  ``F.batch_norm`` use batch statistics without touching the buffers), then switched back on.
* Random ops (dropout) are replayed: a block containing a random module saves the CPU RNG state (and the CUDA
  RNG state of the devices its input lives on) before each random sub-module, and restores it around the
  recomputation; the caller's RNG stream is left untouched by backward.
* Autocast: the autocast state of the forward is recorded and re-entered in backward.

>>> import torch
>>> from fewbit_design.runtime import reversible, memory
>>> net = reversible.revnet(4, 16, input_size=(16, 16))
>>> x = torch.randn(2, 3, 16, 16)
>>> with memory.saved_bytes(net) as m:
...     loss = net(x).square().sum()
>>> loss.backward()
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FewBitError, check_choice, check_positive

__all__ = [
    "InvertibleModule",
    "AdditiveCoupling",
    "ReversibleSequence",
    "InvertibleBatchNorm2d",
    "InvertibleLeakyReLU",
    "InvertibleConv2d",
    "ChannelPool2d",
    "BatchPool2d",
    "ReversibleNet",
    "revnet",
    "layerwise_net",
    "hybrid_net",
    "resnet",
    "frozen_running_stats",
    "uses_rng",
    "LayerSNR",
    "reconstruction_snr",
    "inverse_snr_factor",
]

POOLING_KINDS = ("channel", "batch")
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


class InvertibleModule(nn.Module):
    """A module with ``forward(x)`` and ``inverse(y)``; the base of every block of a :class:`ReversibleSequence`.

    Subclasses implement ``forward`` and ``inverse``. Blocks whose inverse needs something from the forward pass
    (batch statistics, RNG states) override ``_forward_keep`` and ``_inverse_kept``; blocks with a cheaper
    backward than "invert, recompute, vector-Jacobian product" override ``_reverse``.
    """

    def inverse(self, y: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _forward_keep(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        """Forward (called under ``no_grad``) that also returns the tensors the reversal needs later."""
        return self(x), ()

    def _inverse_kept(self, y: torch.Tensor, state: State) -> torch.Tensor:
        """Inverse using what ``_forward_keep`` returned."""
        return self.inverse(y)

    def _reverse(
        self, y: torch.Tensor, grad_y: torch.Tensor, state: State, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        """From the output ``y`` and its gradient, give the input, its gradient and the gradients of ``params``.

        The default reconstructs the input with the inverse, recomputes the forward on it with autograd on, and
        takes one vector-Jacobian product. Only this block's graph is alive at a time.
        """
        with torch.no_grad():
            x = self._inverse_kept(y, state)
        with torch.enable_grad():
            x_leaf = x.detach().requires_grad_(True)
            output = self(x_leaf)
        grads = _vjp(output, [x_leaf, *params], grad_y)
        return x, grads[0], grads[1:]


def _split(x: torch.Tensor, dim: int, owner: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() <= dim:
        raise FewBitError(f"{owner} splits dimension {dim}, got an input of shape {tuple(x.shape)}")
    size = x.shape[dim]
    if size % 2:
        raise FewBitError(
            f"{owner} splits dimension {dim} into two equal halves, got an input of shape {tuple(x.shape)} "
            f"whose size {size} along it is odd"
        )
    return x.narrow(dim, 0, size // 2), x.narrow(dim, size // 2, size // 2)


class AdditiveCoupling(InvertibleModule):
    """RevNet's reversible block: ``y1 = x1 + h f(x2)``, ``y2 = x2 + h g(y1)``; inverse ``x2 = y2 - h g(y1)``,
    ``x1 = y1 - h f(x2)``, with ``x = cat(x1, x2)`` split in equal halves along ``split_dim`` and the branch scale
    ``h = scale`` (1 by default: RevNet's block).

    ``f`` and ``g`` map a half to a tensor of the same shape; they need not be invertible. When they are
    layer-wise invertible (:class:`InvertibleModule`, e.g. a :class:`ReversibleSequence` of invertible layers, as
    in the hybrid architecture), backward runs them forward without keeping anything and then reconstructs their
    hidden activations layer by layer from their output along the gradient (section 4.4, figure 9); otherwise it
    recomputes them with autograd on (RevNet).

    Args:
        f, g: the two residual functions.
        split_dim: the dimension split in two halves (channels for images).
        scale: the branch scale ``h > 0``, a fixed number: one step of size ``h`` of the flow ``dx/dt = (f, g)``
            (leapfrog form; Haber & Ruthotto 2017, Chang et al. 2018). The architectures set it to
            ``1 / depth`` so that a deep stack of couplings stays as well conditioned as a shallow one (see
            :func:`hybrid_net`). The inverse uses the same ``h``; with ``h = 1`` no multiplication is done.
        preserve_rng_state: replay the RNG of ``f`` and ``g`` in backward; ``None`` (default) does it when they
            contain a random module (see :func:`uses_rng`).

    >>> import torch
    >>> block = AdditiveCoupling(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), split_dim=-1).double()
    >>> x = torch.randn(3, 4, dtype=torch.float64)
    >>> torch.allclose(block.inverse(block(x)), x)
    True
    """

    def __init__(
        self,
        f: nn.Module,
        g: nn.Module,
        *,
        split_dim: int = 1,
        scale: float = 1.0,
        preserve_rng_state: bool | None = None,
    ):
        super().__init__()
        if not isinstance(f, nn.Module) or not isinstance(g, nn.Module):
            raise FewBitError(f"AdditiveCoupling needs two nn.Module, got {type(f).__name__} and {type(g).__name__}")
        self.f = f
        self.g = g
        self.split_dim = int(split_dim)
        self.scale = check_positive("AdditiveCoupling scale", scale)
        self.preserve_rng_state = preserve_rng_state

    def extra_repr(self) -> str:
        return f"split_dim={self.split_dim}" + (f", scale={self.scale:g}" if self.scale != 1.0 else "")

    def _scaled(self, branch_output: torch.Tensor) -> torch.Tensor:
        """``h * branch_output`` (the same expression in forward, inverse and backward, so they agree bitwise)."""
        return branch_output if self.scale == 1.0 else branch_output * self.scale

    def _halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.split_dim if self.split_dim >= 0 else x.dim() + self.split_dim
        return _split(x, dim, type(self).__name__)

    def _cat(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], dim=self.split_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self._halves(x)
        y1 = x1 + self._scaled(self.f(x2))
        y2 = x2 + self._scaled(self.g(y1))
        return self._cat(y1, y2)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        y1, y2 = self._halves(y)
        x2 = y2 - self._scaled(self.g(y1))
        x1 = y1 - self._scaled(self.f(x2))
        return self._cat(x1, x2)

    def _replays(self, module: nn.Module) -> bool:
        return uses_rng(module) if self.preserve_rng_state is None else bool(self.preserve_rng_state)

    def _forward_keep(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        devices = _cuda_device_indices([x.device])
        x1, x2 = self._halves(x)
        f_state = _capture_rng_state(devices) if self._replays(self.f) else ()
        y1 = x1 + self._scaled(self.f(x2))
        g_state = _capture_rng_state(devices) if self._replays(self.g) else ()
        y2 = x2 + self._scaled(self.g(y1))
        return self._cat(y1, y2), (f_state, g_state)

    def _inverse_kept(self, y: torch.Tensor, state: State) -> torch.Tensor:
        f_state, g_state = state
        devices = _cuda_device_indices([y.device])
        y1, y2 = self._halves(y)
        with _replayed_rng(g_state, devices):
            x2 = y2 - self._scaled(self.g(y1))
        with _replayed_rng(f_state, devices):
            x1 = y1 - self._scaled(self.f(x2))
        return self._cat(x1, x2)

    @staticmethod
    def _function_vjp(
        function: nn.Module, z: torch.Tensor, grad: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        """``function(z)`` and the vector-Jacobian product of ``grad`` w.r.t. ``z`` and ``params``."""
        if isinstance(function, InvertibleModule):
            # Layer-wise invertible inner function (hybrid): keep nothing but its output, then reconstruct its
            # hidden activations from the output while the gradient flows back through it.
            with torch.no_grad():
                output, state = function._forward_keep(z)
            _, grad_z, grads = function._reverse(output, grad, state, params)
            return output, grad_z, grads
        with torch.enable_grad():
            z_leaf = z.detach().requires_grad_(True)
            output = function(z_leaf)
        grads = _vjp(output, [z_leaf, *params], grad)
        return output.detach(), grads[0], grads[1:]

    def _reverse(
        self, y: torch.Tensor, grad_y: torch.Tensor, state: State, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        # RevNet's algorithm: one recomputation of g and of f, each used both for the inverse and for the
        # vector-Jacobian product. With y1 = x1 + h f(x2), y2 = x2 + h g(y1):
        #   dL/dy1 (total) = dy1 + (dg/dy1)^T (h dy2),   dL/dx1 = dL/dy1 (total),
        #   dL/dx2 = dy2 + (df/dx2)^T (h dL/dy1 (total)).
        f_state, g_state = state
        devices = _cuda_device_indices([y.device])
        y1, y2 = self._halves(y)
        grad_y1, grad_y2 = self._halves(grad_y)
        f_params, g_params = _select(params, self.f), _select(params, self.g)
        with _replayed_rng(g_state, devices):
            g_y1, grad_through_g, g_grads = self._function_vjp(self.g, y1, self._scaled(grad_y2), g_params)
        x2 = y2 - self._scaled(g_y1)
        grad_y1 = _add(grad_y1, grad_through_g)
        with _replayed_rng(f_state, devices):
            f_x2, grad_through_f, f_grads = self._function_vjp(self.f, x2, self._scaled(grad_y1), f_params)
        x1 = y1 - self._scaled(f_x2)
        grad_x2 = _add(grad_y2, grad_through_f)
        by_id: dict[int, torch.Tensor | None] = {}
        for p, grad in [*zip(g_params, g_grads, strict=True), *zip(f_params, f_grads, strict=True)]:
            by_id[id(p)] = _add(by_id.get(id(p)), grad)
        return self._cat(x1, x2), self._cat(grad_y1, grad_x2), [by_id.get(id(p)) for p in params]


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


class _ReversibleFunction(torch.autograd.Function):
    """Runs a :class:`ReversibleSequence` keeping only its output and per-block state for backward."""

    @staticmethod
    def forward(ctx, sequence: ReversibleSequence, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.sequence = sequence
        ctx.params = params
        ctx.autocast = _autocast_state(x.device.type)
        ctx.input_dtype = x.dtype
        with torch.no_grad():
            y, state = sequence._forward_keep(x)
        if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            y = y.clone()  # a pure reshaping sequence would return a view of its input
        flat: list[torch.Tensor] = []
        ctx.spec = _flatten(state, flat)
        ctx.save_for_backward(y, *flat)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y: torch.Tensor):
        y, *flat = ctx.saved_tensors
        state = _unflatten(ctx.spec, flat)
        with _autocast_context(ctx.autocast):
            _, grad_x, grads = ctx.sequence._reverse(y, grad_y, state, ctx.params)
        if grad_x is not None and ctx.needs_input_grad[1]:
            grad_x = grad_x.to(ctx.input_dtype)
        else:
            grad_x = None
        grads = [None if g is None else g.to(p.dtype) for g, p in zip(grads, ctx.params, strict=True)]
        return (None, grad_x, *grads)


class ReversibleSequence(InvertibleModule):
    """Invertible blocks in sequence, keeping only the output for backward (section 3.4 / 4.3 / 4.4).

    With couplings as blocks it is a RevNet stage; with single invertible layers it is the layer-wise invertible
    sequence of section 4.3; a sequence of layers can also serve as ``f`` or ``g`` of a coupling (hybrid).

    What is saved for backward: the output, plus for each :class:`InvertibleBatchNorm2d` in training mode its
    per-channel batch mean and variance (2 x channels numbers) and, for each random sub-module of a coupling, one
    RNG state (5056 bytes on CPU). Hidden activations are not saved.

    Args:
        *blocks: :class:`InvertibleModule` instances.
        reconstruct: ``False`` runs the blocks with plain autograd, storing every activation (the oracle).

    >>> import torch
    >>> seq = ReversibleSequence(InvertibleLeakyReLU(0.5), ChannelPool2d(), InvertibleBatchNorm2d(4))
    >>> x = torch.randn(2, 1, 4, 4, dtype=torch.float64)
    >>> seq.train(False) and torch.allclose(seq.inverse(seq(x)), x)
    True
    """

    def __init__(self, *blocks: nn.Module, reconstruct: bool = True):
        super().__init__()
        for index, block in enumerate(blocks):
            if not isinstance(block, InvertibleModule):
                raise FewBitError(
                    f"ReversibleSequence block {index} must be an invertible module (an InvertibleModule with "
                    f"forward and inverse), got {type(block).__name__}"
                )
        self.blocks = nn.ModuleList(blocks)
        self.reconstruct = bool(reconstruct)

    def extra_repr(self) -> str:
        return f"reconstruct={self.reconstruct}"

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> nn.Module:
        return self.blocks[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [p for p in self.parameters() if p.requires_grad]
        if (
            self.reconstruct
            and torch.is_grad_enabled()
            and len(self.blocks) > 0
            and (x.requires_grad or len(params) > 0)
        ):
            return _ReversibleFunction.apply(self, x, *params)
        for block in self.blocks:
            _record_forward(block, x)
            x = block(x)
        return x

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            y = block.inverse(y)
        return y

    def _forward_keep(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        states = []
        for block in self.blocks:
            _record_forward(block, x)
            x, state = block._forward_keep(x)
            states.append(state)
        return x, tuple(states)

    def _inverse_kept(self, y: torch.Tensor, state: State) -> torch.Tensor:
        for block, block_state in zip(reversed(self.blocks), reversed(state), strict=True):
            y = block._inverse_kept(y, block_state)
        return y

    def _reverse(
        self, y: torch.Tensor, grad_y: torch.Tensor, state: State, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        by_id: dict[int, torch.Tensor | None] = {}
        for block, block_state in zip(reversed(self.blocks), reversed(state), strict=True):
            block_params = _select(params, block)
            with frozen_running_stats(block):
                y, grad_y, grads = block._reverse(y, grad_y, block_state, block_params)
            _record_reverse(block, y)
            for p, grad in zip(block_params, grads, strict=True):
                by_id[id(p)] = _add(by_id.get(id(p)), grad)
            if grad_y is None:  # nothing downstream depends on the input: start a zero gradient
                grad_y = torch.zeros_like(y)
        return y, grad_y, [by_id.get(id(p)) for p in params]


# --------------------------------------------------------------------------------------------------------------
# Layer-wise invertible layers (section 4.2).


def _check_image(x: torch.Tensor, owner: str) -> None:
    if x.dim() != 4:
        raise FewBitError(f"{owner} expects a 4-D input (batch, channels, height, width), got shape {tuple(x.shape)}")


class InvertibleBatchNorm2d(InvertibleModule, nn.BatchNorm2d):
    """Batch normalization with an inverse (section 4.2.1) and a lower bound on the scale.

    Forward: ``y = s * (x - mean) / sqrt(var + eps) + beta`` per channel, where ``mean`` and ``var`` are the batch
    mean and *biased* variance in training mode (the running statistics in eval mode) and the effective scale is

        ``s = sign(gamma) * (|gamma| + gamma_floor)``   (sign(0) taken as +1)

    so ``|s| >= gamma_floor`` always: the floor of section 4.2.1 (the paper's epsilon_i added to |gamma|). It keeps
    the inverse finite as gamma crosses zero, and bounds the SNR reduction factor (see
    :func:`fewbit_design.snr.batchnorm_alpha`), since that factor grows with the spread of the |s| across channels.
    Its derivative with respect to gamma is 1 everywhere (gamma = 0 included), so training is unaffected otherwise.

    Inverse: ``x = (y - beta) * sqrt(var + eps) / s + mean``, with exactly the statistics used in forward: in
    training mode those of the most recent forward call (``last_mean``, ``last_var``; inside a
    :class:`ReversibleSequence` they are saved for backward per call), in eval mode the running statistics.

    Running statistics follow ``nn.BatchNorm2d`` (unbiased variance, ``momentum``, ``num_batches_tracked``).
    """

    def __init__(
        self,
        num_features: int,
        *,
        gamma_floor: float = 0.1,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
    ):
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise FewBitError(f"InvertibleBatchNorm2d num_features must be a positive integer, got {num_features!r}")
        floor = float(gamma_floor)
        if not math.isfinite(floor) or floor < 0:
            raise FewBitError(f"InvertibleBatchNorm2d gamma_floor must be a finite number >= 0, got {gamma_floor!r}")
        check_positive("InvertibleBatchNorm2d eps", eps)
        nn.BatchNorm2d.__init__(
            self,
            num_features,
            eps=eps,
            momentum=momentum,
            affine=True,
            track_running_stats=track_running_stats,
            device=device,
            dtype=dtype,
        )
        self.gamma_floor = floor
        self.last_mean: torch.Tensor | None = None
        self.last_var: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gamma_floor={self.gamma_floor}"

    def effective_weight(self) -> torch.Tensor:
        """The scale actually applied: ``sign(gamma) * (|gamma| + gamma_floor)``."""
        w = self.weight
        return torch.where(w >= 0, w + self.gamma_floor, w - self.gamma_floor)

    def _uses_batch_stats(self) -> bool:
        return self.training or self.running_mean is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_image(x, type(self).__name__)
        if x.shape[1] != self.num_features:
            raise FewBitError(
                f"InvertibleBatchNorm2d({self.num_features}) got an input with {x.shape[1]} channels "
                f"(shape {tuple(x.shape)})"
            )
        if self._uses_batch_stats():
            count = x.numel() // x.shape[1]
            if self.training and count < 2:
                raise FewBitError(
                    f"InvertibleBatchNorm2d needs more than 1 value per channel in training, got shape {tuple(x.shape)}"
                )
            mean = x.mean(dim=(0, 2, 3))
            var = (x - mean[None, :, None, None]).square().mean(dim=(0, 2, 3))  # biased
            if self.training and self.track_running_stats:
                self._update_running_stats(mean.detach(), var.detach(), count)
        else:
            mean, var = self.running_mean, self.running_var
        self.last_mean, self.last_var = mean.detach(), var.detach()
        return self._normalize(x, mean, var)

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
            unbiased = var * (count / (count - 1))
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

    def _normalize(self, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        scale = self.effective_weight() * torch.rsqrt(var + self.eps)
        return (x - mean[None, :, None, None]) * scale[None, :, None, None] + self.bias[None, :, None, None]

    def _invert(self, y: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        _check_image(y, type(self).__name__)
        factor = torch.sqrt(var + self.eps) / self.effective_weight()
        return (y - self.bias[None, :, None, None]) * factor[None, :, None, None] + mean[None, :, None, None]

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        if self._uses_batch_stats():
            if self.last_mean is None:
                raise FewBitError("InvertibleBatchNorm2d.inverse in training mode needs a forward call first")
            return self._invert(y, self.last_mean, self.last_var)
        return self._invert(y, self.running_mean, self.running_var)

    def _forward_keep(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        y = self(x)
        return y, ((self.last_mean, self.last_var) if self._uses_batch_stats() else ())

    def _inverse_kept(self, y: torch.Tensor, state: State) -> torch.Tensor:
        if state:
            return self._invert(y, *state)
        return self._invert(y, self.running_mean, self.running_var)


class InvertibleLeakyReLU(InvertibleModule):
    """Leaky ReLU with its inverse (section 4.2.2): ``y = x`` for ``x >= 0`` else ``n x``; ``x = y`` for
    ``y >= 0`` else ``y / n``.

    The slope ``n`` sets the SNR reduction factor of the inverse, ``(1 + n^2)^2 / (4 n^2)``
    (:func:`fewbit_design.snr.leaky_relu_alpha`): 1.56 for n = 0.5, 6.8 for 0.2, 26 for 0.1. Hence the default
    0.2 rather than torch's 0.01 (whose factor, 2500, leaves nothing of a float32 signal after 5 layers).
    """

    def __init__(self, negative_slope: float = 0.2):
        super().__init__()
        self.negative_slope = check_positive("InvertibleLeakyReLU negative_slope", negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, self.negative_slope)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return torch.where(y >= 0, y, y / self.negative_slope)


class InvertibleConv2d(AdditiveCoupling):
    """An invertible convolution (section 4.3.3): a coupling whose ``f`` and ``g`` are single convolutions of
    ``channels / 2`` to ``channels / 2`` channels, same padding, so the shape is kept.

    Raises :class:`FewBitError` at construction when ``channels`` is odd (the halves would not match) or the
    kernel size is even (the spatial size would change).
    """

    def __init__(
        self, channels: int, *, kernel_size: int = 3, bias: bool = True, device: Any = None, dtype: Any = None
    ):
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 2 or channels % 2:
            raise FewBitError(
                f"InvertibleConv2d couples two halves of the channels, so channels must be an even integer >= 2, "
                f"got {channels!r}"
            )
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise FewBitError(f"InvertibleConv2d kernel_size must be an odd positive integer, got {kernel_size!r}")
        half = channels // 2
        options = dict(padding=kernel_size // 2, bias=bias, device=device, dtype=dtype)
        super().__init__(nn.Conv2d(half, half, kernel_size, **options), nn.Conv2d(half, half, kernel_size, **options))
        self.channels = channels

    def extra_repr(self) -> str:
        return f"channels={self.channels}"


class _Pool2d(InvertibleModule):
    """Shared checks of the two volume-preserving 2x2 poolings."""

    def __init__(self, *, input_size: tuple[int, int] | None = None):
        super().__init__()
        if input_size is not None:
            _check_even_size(tuple(input_size), type(self).__name__)

    def _check(self, x: torch.Tensor) -> None:
        _check_image(x, type(self).__name__)
        h, w = x.shape[-2:]
        if h % 2 or w % 2:
            raise FewBitError(
                f"{type(self).__name__} stacks 2x2 blocks, so height and width must be even, "
                f"got an input of shape {tuple(x.shape)}"
            )

    def _reverse(self, y, grad_y, state, params):
        # A permutation of elements: its Jacobian transpose is its inverse.
        with torch.no_grad():
            return self.inverse(y), self.inverse(grad_y), []


def _check_even_size(size: tuple[int, ...], owner: str) -> None:
    if len(size) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 2 or s % 2 for s in size):
        raise FewBitError(f"{owner} stacks 2x2 blocks, so height and width must be even integers, got {size!r}")


class ChannelPool2d(_Pool2d):
    """Invertible pooling into channels (i-RevNet; section 4.2.4, P_c): ``(b, c, h, w) -> (b, 4c, h/2, w/2)``.

    Output channel ``4 k + 2 i + j`` holds the element at offset ``(i, j)`` of each 2x2 block of input channel
    ``k`` (``F.pixel_unshuffle``). Height and width must be even (not necessarily equal).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return F.pixel_unshuffle(x, 2)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        _check_image(y, type(self).__name__)
        if y.shape[1] % 4:
            raise FewBitError(f"ChannelPool2d.inverse needs channels divisible by 4, got shape {tuple(y.shape)}")
        return F.pixel_shuffle(y, 2)


class BatchPool2d(_Pool2d):
    """Invertible pooling into the batch (section 4.2.4, P_b): ``(b, c, h, w) -> (4b, c, h/2, w/2)``.

    Output sample ``(2 i + j) b + n`` is the sub-image at offset ``(i, j)`` of the 2x2 blocks of input sample
    ``n``: four quarter-resolution copies of the batch, one after another. Channels stay the same, so the
    parameters of later convolutions do not grow. Height and width must be even (not necessarily equal).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        b, c, h, w = x.shape
        blocks = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(3, 5, 0, 1, 2, 4)
        return blocks.reshape(4 * b, c, h // 2, w // 2)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        _check_image(y, type(self).__name__)
        b4, c, h, w = y.shape
        if b4 % 4:
            raise FewBitError(f"BatchPool2d.inverse needs a batch divisible by 4, got shape {tuple(y.shape)}")
        blocks = y.reshape(2, 2, b4 // 4, c, h, w).permute(2, 3, 4, 0, 5, 1)
        return blocks.reshape(b4 // 4, c, 2 * h, 2 * w)


# --------------------------------------------------------------------------------------------------------------
# Architectures.


class _ClassifierHead(nn.Module):
    """Not reversible: average over space and over the copies made by batch pooling, then a linear layer."""

    def __init__(self, channels: int, num_classes: int, batch_factor: int):
        super().__init__()
        self.batch_factor = batch_factor
        self.linear = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        features = x.reshape(self.batch_factor, n // self.batch_factor, c, h, w).mean(dim=(0, 3, 4))
        return self.linear(features)


class ReversibleNet(nn.Module):
    """A stem convolution (not reversible), a body and a classifier head.

    Attributes:
        arch: 'revnet', 'layerwise', 'hybrid' or 'resnet'.
        stem: ``nn.Conv2d(in_channels, channels, 3)``.
        body: a :class:`ReversibleSequence` (a plain ``nn.Sequential`` for 'resnet').
        head: average pooling (undoing batch pooling) and ``nn.Linear``.
    """

    def __init__(self, arch: str, stem: nn.Module, body: nn.Module, head: nn.Module):
        super().__init__()
        self.arch = arch
        self.stem = stem
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise FewBitError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _stage_depths(depth: int, stages: int) -> list[int]:
    """``depth`` units spread over ``stages`` stages, the earlier stages taking the remainder."""
    return [depth // stages + (1 if i < depth % stages else 0) for i in range(stages)]


def _plan(
    arch: str, depth: int, channels: int, pooling: Sequence[str], input_size: tuple[int, int] | None, multiple: int
) -> list[tuple[int, int, str | None]]:
    """Check the shape of every stage at construction; return (units, channels, pool after) per stage."""
    _check_int(f"{arch} depth", depth, 1)
    _check_int(f"{arch} channels", channels, 1)
    if isinstance(pooling, str):
        pooling = [p.strip() for p in pooling.split(",") if p.strip()]
    pooling = [check_choice(f"{arch} pooling kind", kind, POOLING_KINDS) for kind in pooling]
    size = None if input_size is None else tuple(input_size)
    if size is not None and (
        len(size) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in size)
    ):
        raise FewBitError(f"{arch} input_size must be (height, width), two positive integers, got {input_size!r}")
    plan = []
    width = channels
    for stage, units in enumerate(_stage_depths(depth, len(pooling) + 1)):
        if width % multiple:
            raise FewBitError(
                f"{arch} stage {stage} has {width} channels, which its invertible blocks cannot split: "
                f"channels must be divisible by {multiple}"
            )
        kind = pooling[stage] if stage < len(pooling) else None
        if kind is not None and size is not None:
            if size[0] % 2 or size[1] % 2:
                raise FewBitError(
                    f"{arch} pooling {stage} ({kind}) stacks 2x2 blocks, but stage {stage} has an odd spatial size "
                    f"{size[0]}x{size[1]} (input_size={tuple(input_size)})"
                )
            size = (size[0] // 2, size[1] // 2)
        plan.append((units, width, kind))
        if kind == "channel":
            width *= 4
    return plan


def _make_pool(kind: str) -> InvertibleModule:
    return ChannelPool2d() if kind == "channel" else BatchPool2d()


def _finish(arch: str, in_channels: int, channels: int, num_classes: int, plan, blocks, reconstruct: bool):
    _check_int(f"{arch} in_channels", in_channels, 1)
    _check_int(f"{arch} num_classes", num_classes, 1)
    stem = nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)
    out_channels = plan[-1][1]
    batch_factor = 4 ** sum(1 for _, _, kind in plan if kind == "batch")
    body = ReversibleSequence(*blocks, reconstruct=reconstruct) if arch != "resnet" else nn.Sequential(*blocks)
    return ReversibleNet(arch, stem, body, _ClassifierHead(out_channels, num_classes, batch_factor))


def _bn_relu_conv(channels: int, dropout: float) -> nn.Sequential:
    layers: list[nn.Module] = [nn.BatchNorm2d(channels), nn.ReLU()]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Conv2d(channels, channels, 3, padding=1, bias=False))
    return nn.Sequential(*layers)


def _check_dropout(arch: str, dropout: float) -> float:
    p = float(dropout)
    if not 0.0 <= p < 1.0:
        raise FewBitError(f"{arch} dropout must be in [0, 1), got {dropout!r}")
    return p


def _branch_scale(arch: str, branch_scale: float | None, depth: int) -> float:
    """The branch scale ``h`` of every coupling: ``1 / depth`` by default (a flow of total time 1)."""
    if branch_scale is None:
        return 1.0 / depth
    return check_positive(f"{arch} branch_scale", branch_scale)


def revnet(
    depth: int,
    channels: int,
    *,
    pooling: Sequence[str] = ("channel", "batch"),
    in_channels: int = 3,
    num_classes: int = 10,
    input_size: tuple[int, int] | None = None,
    dropout: float = 0.0,
    branch_scale: float | None = None,
    reconstruct: bool = True,
) -> ReversibleNet:
    """RevNet-style network: ``depth`` additive couplings whose ``f`` and ``g`` are BN-ReLU-conv-BN-ReLU-conv
    stacks on half the channels (dropout before the second convolution when ``dropout > 0``), in
    ``len(pooling) + 1`` stages separated by invertible poolings ('channel' multiplies the channels by 4,
    'batch' keeps them). Activation memory does not grow with ``depth``.

    Args:
        depth: number of couplings, spread over the stages.
        channels: channels after the stem (even).
        pooling: pooling kind after each stage but the last.
        input_size: (height, width) of the input; when given, odd spatial sizes at a pooling are rejected at
            construction (otherwise at the first forward).
        branch_scale: the scale ``h`` of ``f`` and ``g`` in every coupling (``y1 = x1 + h f(x2)``, ...);
            ``None`` (default) is ``1 / depth``, 1.0 is the unscaled RevNet block. See :func:`hybrid_net` for why:
            in float32 at initialisation the reconstructed input of the unscaled net loses about 5-11 dB per
            doubling of depth (138, 128, 114, 103, 92 dB at depth 1, 4, 16, 32, 64), the scaled one none
            (138, 142, 142, 142, 142 dB).
        reconstruct: ``False`` stores every activation with plain autograd (the oracle).
    """
    p = _check_dropout("revnet", dropout)
    plan = _plan("revnet", depth, channels, pooling, input_size, 2)
    h = _branch_scale("revnet", branch_scale, depth)
    blocks: list[nn.Module] = []
    for units, width, kind in plan:
        for _ in range(units):
            half = width // 2
            f = nn.Sequential(*_bn_relu_conv(half, 0.0), *_bn_relu_conv(half, p))
            g = nn.Sequential(*_bn_relu_conv(half, 0.0), *_bn_relu_conv(half, p))
            blocks.append(AdditiveCoupling(f, g, scale=h))
        if kind is not None:
            blocks.append(_make_pool(kind))
    return _finish("revnet", in_channels, channels, num_classes, plan, blocks, reconstruct)


def _invertible_unit(channels: int, negative_slope: float, gamma_floor: float) -> list[InvertibleModule]:
    return [
        InvertibleBatchNorm2d(channels, gamma_floor=gamma_floor),
        InvertibleLeakyReLU(negative_slope),
        InvertibleConv2d(channels),
    ]


def layerwise_net(
    depth: int,
    channels: int,
    *,
    pooling: Sequence[str] = ("channel", "batch"),
    negative_slope: float = 0.2,
    gamma_floor: float = 0.1,
    in_channels: int = 3,
    num_classes: int = 10,
    input_size: tuple[int, int] | None = None,
    reconstruct: bool = True,
) -> ReversibleNet:
    """Layer-wise invertible network (section 4.3): ``depth`` units of InvertibleBatchNorm2d ->
    InvertibleLeakyReLU -> InvertibleConv2d, with invertible poolings between stages, all in one
    :class:`ReversibleSequence` of single layers. Backward reconstructs every layer's input from the layer above,
    so errors compound over the 2 x depth batch-norm and leaky-ReLU inverses (SNR falls with depth).
    """
    check_positive("layerwise_net negative_slope", negative_slope)
    plan = _plan("layerwise_net", depth, channels, pooling, input_size, 2)
    blocks: list[nn.Module] = []
    for units, width, kind in plan:
        for _ in range(units):
            blocks.extend(_invertible_unit(width, negative_slope, gamma_floor))
        if kind is not None:
            blocks.append(_make_pool(kind))
    return _finish("layerwise", in_channels, channels, num_classes, plan, blocks, reconstruct)


def hybrid_net(
    depth: int,
    channels: int,
    *,
    pooling: Sequence[str] = ("channel", "batch"),
    negative_slope: float = 0.2,
    gamma_floor: float = 0.1,
    units_per_function: int = 2,
    in_channels: int = 3,
    num_classes: int = 10,
    input_size: tuple[int, int] | None = None,
    branch_scale: float | None = None,
    reconstruct: bool = True,
) -> ReversibleNet:
    """Hybrid network (section 4.4): ``depth`` additive couplings whose ``f`` and ``g`` are layer-wise invertible
    chains of ``units_per_function`` units (InvertibleBatchNorm2d -> InvertibleLeakyReLU -> InvertibleConv2d) on
    half the channels. Block inputs are reconstructed by the couplings' inverses (stable); hidden activations
    inside ``f`` and ``g`` by layer-wise inverses along the gradient, so no block keeps its hidden activations
    (no local bottleneck) and errors do not compound across blocks. Channels must be divisible by 4.

    Args:
        branch_scale: the scale ``h`` of ``f`` and ``g`` in every coupling: ``y1 = x1 + h f(x2)``,
            ``y2 = x2 + h g(y1)``. ``None`` (default) is ``1 / depth``; 1.0 is the unscaled block of the paper.
            Inverse, gradients (equal to the store-everything network's), saved bytes and running statistics do
            not depend on it; a 1-block net is the same either way.

    Why ``h = 1 / depth``. The couplings' inverse is exact in real arithmetic, but in floating point its error
    grows with depth unless the total size of the branches is bounded. Each branch starts with a batch norm, so
    its Jacobian with respect to its input is of order ``h G / sigma`` (``sigma`` the stream's per-channel
    spread, ``G`` the branch's gain): the inverse ``x1 = y1 - h f(x2)`` hands the error of ``x2`` on to ``x1``
    amplified by about ``1 + h G / sigma``, and every coupling adds a rounding error proportional to ``sigma``.
    Unscaled, every branch adds an O(1) term correlated with the stream (identity-plus convolutions fed by a
    normalised signal), so ``sigma`` grows linearly with depth and the error gains ``1 + G / sigma_k`` multiply
    to a power of the depth. Measured at initialisation (float32, 8 channels, batch 4, 8x8, slope 0.1, depth 32):
    the stream's RMS goes from 0.55 (first block) to 29 (last); the error gains of the first blocks are 6.0, 2.3,
    1.8, 1.4 and their product over the 32 blocks is 900 (59 dB), on top of the 34 dB by which the last
    rounding error (relative to a stream 53 times larger than the input) exceeds the input's; the SNR of the
    reconstructed input is 133, 119, 106, 90, 76, 64, 48 dB at depth 1, 2, 4, 8, 16, 32, 64 (14 dB per
    doubling; the paper's alpha_Rev, by noise injection in float64: 16 dB for the first block, 47 dB summed).
    With ``h = 1 / depth`` the couplings are steps of a flow of total time 1 (the leapfrog view of reversible
    networks, Haber & Ruthotto 2017, Chang et al. 2018), so the stream stays bounded (RMS 0.55 to 1.1) and the
    product of the error gains is at most ``exp(G / sigma_0)`` whatever the depth (measured: 21, 26 dB;
    alpha_Rev 0.1-0.2 dB per block, 7 dB summed): the SNR is 133, 131, 130, 128, 127, 127, 126 dB at the same
    depths, flat (over 30 seeds, depth 32 within -1.3 to 4.7 dB of depth 4, against 37 to 50 dB unscaled), as
    in the paper's figure 10. Like SkipInit or Fixup this starts a deep network nearer the identity; the
    branches' batch-norm scales stay learnable, so training can still grow them.
    """
    check_positive("hybrid_net negative_slope", negative_slope)
    units = _check_int("hybrid_net units_per_function", units_per_function, 1)
    plan = _plan("hybrid_net", depth, channels, pooling, input_size, 4)
    h = _branch_scale("hybrid_net", branch_scale, depth)
    blocks: list[nn.Module] = []
    for count, width, kind in plan:
        for _ in range(count):
            half = width // 2
            f = ReversibleSequence(
                *[m for _ in range(units) for m in _invertible_unit(half, negative_slope, gamma_floor)],
                reconstruct=reconstruct,
            )
            g = ReversibleSequence(
                *[m for _ in range(units) for m in _invertible_unit(half, negative_slope, gamma_floor)],
                reconstruct=reconstruct,
            )
            blocks.append(AdditiveCoupling(f, g, scale=h))
        if kind is not None:
            blocks.append(_make_pool(kind))
    return _finish("hybrid", in_channels, channels, num_classes, plan, blocks, reconstruct)


class _ResidualBlock(nn.Module):
    """``x + F(x)``, F = BN-ReLU-conv(c -> c/2)-BN-ReLU-conv(c/2 -> c): as many weights as a RevNet coupling."""

    def __init__(self, channels: int):
        super().__init__()
        half = channels // 2
        self.residual = nn.Sequential(
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, half, 3, padding=1, bias=False),
            nn.BatchNorm2d(half),
            nn.ReLU(),
            nn.Conv2d(half, channels, 3, padding=1, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.residual(x)


def resnet(
    depth: int,
    channels: int,
    *,
    pooling: Sequence[str] = ("channel", "batch"),
    in_channels: int = 3,
    num_classes: int = 10,
    input_size: tuple[int, int] | None = None,
) -> ReversibleNet:
    """A plain (vanilla) residual network with the stages and poolings of :func:`revnet` and as many weights:
    every activation is stored, so its memory grows linearly with ``depth``. The baseline of the benchmarks."""
    plan = _plan("resnet", depth, channels, pooling, input_size, 2)
    blocks: list[nn.Module] = []
    for units, width, kind in plan:
        blocks.extend(_ResidualBlock(width) for _ in range(units))
        if kind is not None:
            blocks.append(_make_pool(kind))
    return _finish("resnet", in_channels, channels, num_classes, plan, blocks, False)


# --------------------------------------------------------------------------------------------------------------
# Reconstruction SNR.


@dataclass(frozen=True)
class LayerSNR:
    """The reconstruction of one invertible block's input during backward.

    Attributes:
        name: qualified module name in the model.
        kind: the block's class name.
        snr_db: ``10 log10(mean(z^2) / mean((z - z_reconstructed)^2))``; ``inf`` when exact, ``nan`` when the
            reconstruction is not finite.
        signal: ``mean(z^2)``.
        noise: ``mean((z - z_reconstructed)^2)``.
        channel_mean, channel_var: per-channel mean and biased variance of the forward input ``z``.
        positive_fraction: fraction of elements of ``z`` that are >= 0.
        positive_energy: fraction of ``sum(z^2)`` carried by those elements.
        module: the block itself (for its parameters: batch-norm scales, leaky-ReLU slope).
        sequence: qualified name of the :class:`ReversibleSequence` the block belongs to.
        alpha: the block's SNR reduction factor measured by noise injection on ``z``
            (:func:`inverse_snr_factor`), when asked for with ``alphas=True``; else ``None``.
        roundtrip_snr_db: SNR of ``inverse(forward(z))`` against ``z`` for this block alone, in the model's dtype
            (its own rounding error), with ``alphas=True``; else ``None``.
    """

    name: str
    kind: str
    snr_db: float
    signal: float
    noise: float
    channel_mean: tuple[float, ...]
    channel_var: tuple[float, ...]
    positive_fraction: float
    positive_energy: float
    module: nn.Module
    sequence: str = ""
    alpha: float | None = None
    roundtrip_snr_db: float | None = None


def _snr_db(z: torch.Tensor, z_hat: torch.Tensor) -> tuple[float, float, float]:
    """(SNR in dB, signal power, noise power) of ``z_hat`` as an estimate of ``z``, computed in float64."""
    z = z.double()
    signal = float(z.square().mean())
    noise = float((z - z_hat.double()).square().mean())
    if not math.isfinite(noise):
        return math.nan, signal, noise
    if noise == 0:
        return math.inf, signal, noise
    return (10 * math.log10(signal / noise) if signal > 0 else -math.inf), signal, noise


def _roundtrip_snr_db(block: InvertibleModule, z: torch.Tensor) -> float:
    with torch.no_grad(), frozen_running_stats(block):
        y, state = block._forward_keep(z)
        return _snr_db(z, block._inverse_kept(y, state))[0]


def _layer_snr(
    name: str,
    block: nn.Module,
    z: torch.Tensor,
    z_hat: torch.Tensor,
    sequence: str,
    alpha: float | None,
    roundtrip: float | None,
) -> LayerSNR:
    snr_db, signal, noise = _snr_db(z, z_hat)
    z = z.double()
    dims = [d for d in range(z.dim()) if d != 1] if z.dim() > 1 else [0]
    channel_mean = z.mean(dim=dims).reshape(-1)
    channel_var = (z - z.mean(dim=dims, keepdim=True)).square().mean(dim=dims).reshape(-1)
    positive = z >= 0
    energy = float(z.square().sum())
    return LayerSNR(
        name=name,
        kind=type(block).__name__,
        snr_db=snr_db,
        signal=signal,
        noise=noise,
        channel_mean=tuple(channel_mean.tolist()),
        channel_var=tuple(channel_var.tolist()),
        positive_fraction=float(positive.double().mean()),
        positive_energy=float(z.square()[positive].sum()) / energy if energy > 0 else 0.5,
        module=block,
        sequence=sequence,
        alpha=alpha,
        roundtrip_snr_db=roundtrip,
    )


def reconstruction_snr(
    model: nn.Module,
    x: torch.Tensor,
    *,
    grad_output: torch.Tensor | None = None,
    seed: int = 0,
    alphas: bool = False,
    noise: float = 1e-4,
) -> list[LayerSNR]:
    """Per-block SNR of the activations reconstructed by backward, on one real forward and backward.

    Every block of every :class:`ReversibleSequence` in ``model`` is measured: its input ``z`` as computed in
    forward against the input ``z_reconstructed`` that backward rebuilt from the block's output. The errors come
    only from floating-point rounding in forward and in the inverses (run the model in float32 to see the
    paper's figures 10-11). Results are in forward order (for the hybrid, a coupling comes before the layers of
    its ``f`` and ``g``).

    The model's parameters, gradients (``.grad``) and buffers (running statistics) are left as they were;
    the gradient fed to the output is ``grad_output`` or a fixed random tensor drawn from ``seed``. With
    ``alphas=True`` each block's SNR reduction factor is also measured by injecting white noise of relative
    amplitude ``noise`` at its output (:func:`inverse_snr_factor`, on the block's forward input), and its own
    round-trip error ``inverse(forward(z))`` in the model's dtype.
    """
    global _RECORDER
    if not isinstance(model, nn.Module):
        raise FewBitError(f"reconstruction_snr needs an nn.Module, got {type(model).__name__}")
    sequences = [m for m in model.modules() if isinstance(m, ReversibleSequence)]
    if not any(s.reconstruct for s in sequences):
        raise FewBitError("reconstruction_snr needs a model with a ReversibleSequence built with reconstruct=True")
    names = {id(m): name for name, m in model.named_modules()}
    parents = {id(block): names.get(id(seq), "") for seq in sequences for block in seq.blocks}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    inputs = [p for p in model.parameters() if p.requires_grad]
    if x.requires_grad:
        inputs.append(x)
    if not inputs:
        raise FewBitError("reconstruction_snr needs parameters or an input that require grad, to run backward")
    recorder = _Recorder()
    previous, _RECORDER = _RECORDER, recorder
    try:
        with torch.enable_grad():
            output = model(x)
            if grad_output is None:
                generator = torch.Generator(device="cpu").manual_seed(seed)
                grad_output = torch.randn(output.shape, generator=generator, dtype=torch.float64)
            recorder.phase = "backward"
            torch.autograd.grad(output, inputs, grad_output.to(output.dtype).to(output.device), allow_unused=True)
    finally:
        _RECORDER = previous
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    results = []
    for block in recorder.order:
        forward_inputs = recorder.inputs[id(block)]
        rebuilt = list(reversed(recorder.reconstructed.get(id(block), [])))
        for call, z in enumerate(forward_inputs):
            if call >= len(rebuilt):
                continue  # not reconstructed (e.g. a sequence run with plain autograd)
            name = names.get(id(block), type(block).__name__)
            if len(forward_inputs) > 1:
                name = f"{name}[{call}]"
            alpha = roundtrip = None
            if alphas:
                alpha = inverse_snr_factor(block, z, noise=noise, seed=seed)
                roundtrip = _roundtrip_snr_db(block, z)
            results.append(_layer_snr(name, block, z, rebuilt[call], parents.get(id(block), ""), alpha, roundtrip))
    return results


def inverse_snr_factor(block: InvertibleModule, x: torch.Tensor, *, noise: float = 1e-6, seed: int = 0) -> float:
    """The SNR reduction factor ``alpha = SNR_y / SNR_x`` of ``block``'s inverse, measured by noise injection.

    The paper's definition (section 4.1) taken literally: ``y = block(x)``; white Gaussian noise ``e_y`` of
    standard deviation ``noise * rms(y)`` is added to ``y``; the inverse (with the statistics of this forward)
    gives ``x_hat``; ``SNR_y = |y|^2 / |e_y|^2`` and ``SNR_x = |x|^2 / |x_hat - x|^2``. Run it in float64 so that
    rounding is negligible against the injected noise. Running statistics are left untouched.
    """
    if not isinstance(block, InvertibleModule):
        raise FewBitError(f"inverse_snr_factor needs an InvertibleModule, got {type(block).__name__}")
    check_positive("noise", noise)
    with torch.no_grad(), frozen_running_stats(block):
        y, state = block._forward_keep(x)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        e = torch.randn(y.shape, generator=generator, dtype=y.dtype).to(y.device)
        e = e * (noise * y.double().square().mean().sqrt().item())
        x_hat = block._inverse_kept(y + e, state)
        snr_y = float(y.double().square().sum() / e.double().square().sum())
        snr_x = float(x.double().square().sum() / (x_hat.double() - x.double()).square().sum())
    return snr_y / snr_x
