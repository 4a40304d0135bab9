"""The dropout op: ``y = x * mask / (1 - p)``, drawn exactly as torch's own dropout draws it, keeping for backward
the mask as 1 bit per element (mode ``"bits"``) or the random generator's state to draw it again (mode ``"seed"``).

Terms: ``p`` is the probability of dropping an element; the *mask* holds 1 where an element is kept and 0 where it
is dropped; the *noise* is ``mask / (1 - p)`` in x's dtype; the *packed mask* is the mask as 1 bit per element, in
the layout of :mod:`fewbit_design.runtime._packing` (elements in logical row-major order, element k of a group of 8
in bit k of its byte): ``ceil(n / 8)`` bytes.

How torch draws it, and so how this op does (the same calls on the same generator, so ``y`` is bitwise native's and
the random stream after the call is native's: a training run draws every later number as it would natively):

* CPU (and any device without a fused kernel): ``noise = empty_like(x).bernoulli_(1 - p); noise.div_(1 - p);
  y = x * noise`` (ATen's ``_dropout_impl``); native autograd keeps ``noise``, x's dtype, 2 to 8 bytes per element.
* CUDA, XPU, lazy and PrivateUse1 devices (:func:`fused`): ``y, mask = native_dropout(x, p, True)``; native keeps the
  bool mask, 1 byte per element.

Backward multiplies the gradient by the very noise native multiplies it by: on CPU ``grad * noise`` with the noise
rebuilt as ``mask.to(dtype).div_(1 - p)`` (the same two operations on the same 0 / 1 values), on fused devices
``native_dropout_backward(grad, mask, 1 / (1 - p))``. So the gradients are bitwise native's for the same random state.

Modes. ``"bits"`` packs the mask: 8x fewer bytes than the CUDA bool mask, 16x / 32x / 64x fewer than CPU's 16-bit /
float32 / float64 noise, for a pack in forward and an unpack in backward (numba kernels on CPU, torch byte ops
elsewhere). ``"seed"`` keeps the state of the default generator of x's device before the draw (5056 bytes on CPU,
16 on CUDA: fewer than the packed mask from about 40,000 elements on CPU and 128 on CUDA) and draws the mask again
in backward from a generator set to it: a second ``bernoulli_`` draw, as costly as the forward's. It draws with
``bernoulli_`` on every device, so on CPU it is native's draw; on fused devices it is not native's kernel (another
mask for the same seed, and the device's random stream advances by another amount).

Eval mode, ``p`` of 0 or 1, an empty or non-float input, nothing that needs a gradient, or a ``torch.func``
transform: torch's own dropout runs (nothing kept, or nothing worth packing: ``p = 1`` keeps one zero scalar).

Ops: ``torch.ops.fewbit.dropout_bits`` and ``dropout_bits_backward``, ``dropout_seed`` and ``dropout_seed_backward``
(fake kernels registered, so ``torch.compile`` and ``torch.library.opcheck`` work; the random draw runs inside the
op, so a compiled graph draws as eager does); eager calls run the same code as ``autograd.Function`` twins
(:mod:`.._eager`). Each backward op is its own backward (it is linear in the gradient): higher-order gradients work.
:func:`dropout` is the entry point.

>>> import torch
>>> x = torch.randn(4, 8, requires_grad=True)
>>> _ = torch.manual_seed(0); y = dropout(x, 0.25)
>>> _ = torch.manual_seed(0); native = torch.nn.functional.dropout(x, 0.25)
>>> torch.equal(y, native)
True
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...errors import FewBitError, check_choice, check_number
from .. import _packing
from .._eager import eager_twin, tracing

__all__ = [
    "MODES",
    "dropout",
    "dropout_reference",
    "pack_mask",
    "unpack_mask",
    "pack_mask_reference",
    "unpack_mask_reference",
    "fused",
    "state_nbytes",
]

#: what the op keeps for backward: the packed mask, or the generator state to draw it again
MODES = ("bits", "seed")
_FUSED_TYPES = frozenset({"cuda", "xpu", "lazy"})
_BIT_SHIFTS = tuple(range(8))


def check_probability(p: object) -> float:
    """``p`` as a float in [0, 1]; :class:`FewBitError` naming it otherwise.

    Args:
        p: the dropout probability
    """
    value = check_number("dropout probability p", p, low=0.0)
    if value > 1.0:
        raise FewBitError(f"dropout probability p must be in [0, 1], got {p!r}")
    return value


def fused(device: torch.device) -> bool:
    """Whether torch's dropout runs its fused kernel (``native_dropout``, a bool mask) on ``device``: CUDA, XPU, lazy
    and PrivateUse1 devices, as ATen's ``is_fused_kernel_acceptable``.

    Args:
        device: the input's device
    """
    return device.type in _FUSED_TYPES or device.type == torch._C._get_privateuse1_backend_name()


def dropout_reference(x: torch.Tensor, p: float, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """Torch's own dropout (``torch.nn.functional.dropout``): the oracle, and what runs when nothing is kept."""
    return F.dropout(x, p, training, inplace)


# ----------------------------------------------------------------------------------------------------------------------
# The mask as 1 bit per element


def pack_mask_reference(mask: torch.Tensor) -> torch.Tensor:
    """The bool ``mask`` (any shape, logical order) as ``ceil(n / 8)`` uint8 bytes, bit k of byte j holding element
    8 j + k; pure torch byte operations (any device)."""
    flat = mask.reshape(-1)
    count = flat.numel()
    groups = -(-count // 8)
    padded = torch.zeros(groups * 8, dtype=torch.uint8, device=mask.device)
    padded[:count] = flat.to(torch.uint8)
    weights = torch.tensor([1 << k for k in _BIT_SHIFTS], dtype=torch.uint8, device=mask.device)
    # the bits of a group are disjoint, so their sum is their OR and fits a byte
    return (padded.view(groups, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_mask_reference(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask_reference`: the first ``numel`` elements as a flat bool tensor."""
    shifts = torch.tensor(_BIT_SHIFTS, dtype=torch.uint8, device=packed.device)
    return ((packed.reshape(-1, 1) >> shifts) & 1).reshape(-1)[:numel].to(torch.bool)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """:func:`pack_mask_reference` by the shared numba packing kernel on CPU (the reference elsewhere)."""
    if mask.device.type != "cpu" or not _packing._numba_available():
        return pack_mask_reference(mask)
    return _packing.pack(mask.reshape(-1).view(torch.uint8), 1)


def unpack_mask(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """:func:`unpack_mask_reference` by the shared numba unpacking kernel on CPU (the reference elsewhere), into
    bytes (not the int64 codes of :func:`.._packing.unpack`)."""
    if packed.device.type != "cpu" or not _packing._numba_available():
        return unpack_mask_reference(packed, numel)
    from .. import _numba_packing as kernels

    out = torch.empty(int(numel), dtype=torch.uint8)
    kernels.run(kernels.unpack_codes, int(numel), packed.contiguous().numpy(), 1, out.numpy())
    return out.view(torch.bool)


# ----------------------------------------------------------------------------------------------------------------------
# Drawing and applying the mask as torch does


def _draw(x: torch.Tensor, p: float, on_fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, mask)`` drawn as torch's dropout draws them on x's device (module docstring), on the default generator."""
    if on_fused:
        return torch.native_dropout(x, p, True)
    noise = torch.empty_like(x).bernoulli_(1.0 - p)
    mask = noise.bool()
    noise.div_(1.0 - p)
    return x * noise, mask


def _apply_mask(grad: torch.Tensor, mask: torch.Tensor, p: float, on_fused: bool) -> torch.Tensor:
    """The gradient through dropout with this mask, by native's own operations (module docstring)."""
    if on_fused:
        return torch.ops.aten.native_dropout_backward(grad, mask, 1.0 / (1.0 - p))
    return grad * mask.to(grad.dtype).div_(1.0 - p)


@functools.cache
def _cpu_state_nbytes() -> int:
    return torch.get_rng_state().numel()


def state_nbytes(device: torch.device) -> int:
    """Bytes of the default generator's state on ``device`` (what mode ``"seed"`` keeps per call): 5056 on CPU.

    Args:
        device: the input's device
    """
    if device.type == "cpu":
        return _cpu_state_nbytes()
    return _generator_state(device).numel()


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _redraw_mask(
    grad: torch.Tensor, state: torch.Tensor, p: float, stride: list[int] | tuple[int, ...]
) -> torch.Tensor:
    """The forward's mask drawn again: the same ``bernoulli_`` into a tensor of the same layout, from a generator set
    to the state the default generator had before the forward drew."""
    generator = torch.Generator(device=grad.device)
    generator.set_state(state)
    noise = torch.empty_strided(grad.shape, stride, dtype=grad.dtype, device=grad.device)
    return noise.bernoulli_(1.0 - p, generator=generator).bool()


def _layout(x: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``empty_like(x)``, the tensor the forward draws into (a seed is replayed into the same layout:
    a generator fills a tensor in its memory order)."""
    return tuple(torch.empty_like(x, device="meta").stride())


# ----------------------------------------------------------------------------------------------------------------------
# Mode "bits": the custom ops and their eager twins


def _dropout_bits_impl(x: torch.Tensor, p: float, on_fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    y, mask = _draw(x, p, on_fused)
    return y, pack_mask(mask)


_dropout_bits = torch.library.custom_op("fewbit::dropout_bits", mutates_args=())(_dropout_bits_impl)


@_dropout_bits.register_fake
def _(x, p, on_fused):
    y, _ = _draw(x, p, on_fused)
    return y, x.new_empty((x.numel() + 7) // 8, dtype=torch.uint8)


def _dropout_bits_backward_impl(grad: torch.Tensor, packed: torch.Tensor, p: float, on_fused: bool) -> torch.Tensor:
    mask = unpack_mask(packed, grad.numel()).reshape(grad.shape)
    return _apply_mask(grad, mask, p, on_fused)


_dropout_bits_backward = torch.library.custom_op("fewbit::dropout_bits_backward", mutates_args=())(
    _dropout_bits_backward_impl
)


@_dropout_bits_backward.register_fake
def _(grad, packed, p, on_fused):
    return _apply_mask(grad, grad.new_empty(grad.shape, dtype=torch.bool), p, on_fused)


def _setup_bits(ctx, inputs, output) -> None:
    _, p, on_fused = inputs
    _, packed = output
    ctx.mark_non_differentiable(packed)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(packed)
    ctx.p, ctx.on_fused = p, on_fused


def _bits_gradient(ctx, grad: torch.Tensor | None, inputs: int) -> tuple[torch.Tensor | None, ...]:
    """The backward of both bits-mode ops (dropout is linear in x and its backward in grad: each one's gradient is
    grad scaled by the kept mask), then None for the op's other ``inputs - 1`` inputs."""
    if grad is None:
        return (None,) * inputs
    (packed,) = ctx.saved_tensors
    operator = torch.ops.fewbit.dropout_bits_backward if tracing(grad, packed) else _BitsBackwardEager.apply
    return operator(grad, packed, ctx.p, ctx.on_fused), *(None,) * (inputs - 1)


def _backward_bits(ctx, grad, *_):
    return _bits_gradient(ctx, grad, 3)


def _setup_bits_backward(ctx, inputs, output) -> None:
    _, packed, p, on_fused = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(packed)
    ctx.p, ctx.on_fused = p, on_fused


def _backward_bits_backward(ctx, grad):
    return _bits_gradient(ctx, grad, 4)


_dropout_bits.register_autograd(_backward_bits, setup_context=_setup_bits)
_dropout_bits_backward.register_autograd(_backward_bits_backward, setup_context=_setup_bits_backward)
_BitsEager = eager_twin(_dropout_bits_impl, _setup_bits, _backward_bits)
_BitsBackwardEager = eager_twin(_dropout_bits_backward_impl, _setup_bits_backward, _backward_bits_backward)


# ----------------------------------------------------------------------------------------------------------------------
# Mode "seed": the custom ops and their eager twins


def _dropout_seed_impl(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    state = _generator_state(x.device)
    y, _ = _draw(x, p, False)
    return y, state


_dropout_seed = torch.library.custom_op("fewbit::dropout_seed", mutates_args=())(_dropout_seed_impl)


@_dropout_seed.register_fake
def _(x, p):
    y, _ = _draw(x, p, False)
    return y, torch.empty(state_nbytes(x.device), dtype=torch.uint8)


def _dropout_seed_backward_impl(grad: torch.Tensor, state: torch.Tensor, p: float, stride: list[int]) -> torch.Tensor:
    return _apply_mask(grad, _redraw_mask(grad, state, p, stride), p, False)


_dropout_seed_backward = torch.library.custom_op("fewbit::dropout_seed_backward", mutates_args=())(
    _dropout_seed_backward_impl
)


@_dropout_seed_backward.register_fake
def _(grad, state, p, stride):
    return _apply_mask(grad, grad.new_empty(grad.shape, dtype=torch.bool), p, False)


def _setup_seed(ctx, inputs, output) -> None:
    x, p = inputs
    _, state = output
    ctx.mark_non_differentiable(state)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(state)
    ctx.p, ctx.stride = p, _layout(x)


def _seed_gradient(ctx, grad: torch.Tensor | None, inputs: int) -> tuple[torch.Tensor | None, ...]:
    """The backward of both seed-mode ops (as :func:`_bits_gradient`, the mask drawn again from the saved state),
    then None for the op's other ``inputs - 1`` inputs."""
    if grad is None:
        return (None,) * inputs
    (state,) = ctx.saved_tensors
    operator = torch.ops.fewbit.dropout_seed_backward if tracing(grad, state) else _SeedBackwardEager.apply
    return operator(grad, state, ctx.p, list(ctx.stride)), *(None,) * (inputs - 1)


def _backward_seed(ctx, grad, *_):
    return _seed_gradient(ctx, grad, 2)


def _setup_seed_backward(ctx, inputs, output) -> None:
    _, state, p, stride = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(state)
    ctx.p, ctx.stride = p, stride


def _backward_seed_backward(ctx, grad):
    return _seed_gradient(ctx, grad, 4)


_dropout_seed.register_autograd(_backward_seed, setup_context=_setup_seed)
_dropout_seed_backward.register_autograd(_backward_seed_backward, setup_context=_setup_seed_backward)
_SeedEager = eager_twin(_dropout_seed_impl, _setup_seed, _backward_seed)
_SeedBackwardEager = eager_twin(_dropout_seed_backward_impl, _setup_seed_backward, _backward_seed_backward)


# ----------------------------------------------------------------------------------------------------------------------
# Entry point


def _functorch_transforming() -> bool:
    """Whether a ``torch.func`` transform (grad, vjp, vmap, ...) is running, outside ``torch.compile``: torch's own
    dropout runs there (the same numbers; the transforms keep their own tensors, and the ops' autograd twins are
    not functorch Functions)."""
    return not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()


def dropout(
    x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, mode: str = "bits"
) -> torch.Tensor:
    """``torch.nn.functional.dropout(x, p, training, inplace)``, bitwise (on CPU in both modes, on fused devices in
    mode ``"bits"``), keeping for backward the mask as 1 bit per element (``"bits"``) or the generator state that
    draws it again (``"seed"``) instead of native's noise or byte mask (module docstring).

    Args:
        x: the input, any float dtype and shape
        p: the probability of dropping an element, in [0, 1]
        training: False returns ``x`` (torch's dropout in eval mode)
        inplace: write the result into ``x`` (as torch's in-place dropout, which autograd allows where it does)
        mode: one of :data:`MODES`
    """
    p = check_probability(p)
    mode = check_choice("dropout mode", mode, MODES)
    keeps = training and 0.0 < p < 1.0 and x.is_floating_point() and x.numel() > 0
    if not (keeps and torch.is_grad_enabled() and x.requires_grad) or _functorch_transforming():
        return dropout_reference(x, p, training, inplace)
    traced = tracing(x)
    if mode == "bits":
        operator = torch.ops.fewbit.dropout_bits if traced else _BitsEager.apply
        y, _ = operator(x, p, fused(x.device))
    else:
        operator = torch.ops.fewbit.dropout_seed if traced else _SeedEager.apply
        y, _ = operator(x, p)
    return x.copy_(y) if inplace else y
