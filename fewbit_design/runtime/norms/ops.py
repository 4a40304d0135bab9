"""The memory-sharing norm op: forward as the native norm, backward from the norm's OUTPUT and per-row statistics.

Terms: a norm maps each row x (the last ``normalized_ndim`` dimensions, D elements) to its *normalised input*
``xhat = (x - mean) * rstd`` (centred, LayerNorm) or ``xhat = x * rstd`` (RMSNorm), with ``rstd = 1 / sqrt(var +
eps)``, then to ``y = xhat * w + b``; ``w`` is the weight (``1 + weight`` for Gemma's ``kind``), ``b`` the bias.

Saved for backward: ``y`` itself (the tensor the next linear layer saves anyway: same storage, so
:func:`fewbit_design.runtime.memory.saved_bytes` counts it once), ``rstd`` (one float32 per row) and, for the
*kept* channels only, ``xhat`` (float32, ``[rows, k]``) with the channels' indices. Backward reconstructs
``xhat = (y - b) / w`` (the reversible-designs idea applied to the norm) and applies the exact norm gradient.

Kept channels: inverting multiplies the rounding error of ``y`` (unit roundoff ``u`` of y's dtype, ``u * (|w xhat|
+ |b|)``) by ``1 / |w|``, and ``y``'s underflow (``tiny``) too, so a channel is inverted only where ``|w| >= threshold
* (|b| + tiny / eps)``: the reconstruction error of ``xhat`` is then at most ``u * (|xhat| + 1 / threshold)``, i.e.
rounding. Weights at or near zero (exact zeros, subnormals, or small next to the bias) are kept. Without a bias,
any normal weight inverts to the last bits (``y / w`` has relative error ``u``), so only zeros and values near the
underflow limit are kept there.

Kinds (each forward is the original module's, op for op, so the output is bitwise the native one):

* ``layer_norm``: ``torch.nn.LayerNorm`` (affine with or without bias, or no affine);
* ``rms_norm``: ``torch.nn.RMSNorm``;
* ``llama``: ``weight * (x.float() * rstd).to(x.dtype)`` (LlamaRMSNorm, Mistral, Qwen2, Phi-3, ...);
* ``t5``: ``weight * (x * rstd)`` cast to the weight's dtype first when that is 16-bit (T5LayerNorm);
* ``gemma``: ``((x.float() * rstd) * (1 + weight.float())).type_as(x)`` (Gemma's RMSNorm).

Compressed mode (``bits``, opt-in through ``runtime.convert(compress=K)``): the output is kept as K-bit group codes
instead (op ``torch.ops.fewbit.norm_forward_compressed``), the same codes the compressed linear layers reading the
output keep (one set for the norm and q, k, v in eager); backward reconstructs xhat from the decoded output, so the
gradients are approximate (the decoded output is within one step of the exact one, unbiased).

Backward is computed in float32 (float64 for float64 tensors); gradients are returned in the input's and the
parameters' dtypes. Ops: ``torch.ops.fewbit.norm_forward`` and ``torch.ops.fewbit.norm_backward`` (fake kernels
registered, so ``torch.compile`` and ``torch.library.opcheck`` work); :func:`memory_sharing_norm` is the entry point.

>>> import torch
>>> x = torch.randn(2, 3, 8, requires_grad=True)
>>> w, b = torch.rand(8) + 0.5, torch.randn(8)
>>> y = memory_sharing_norm(x, w, b, kind="layer_norm", normalized_ndim=1, eps=1e-5)
>>> torch.equal(y, torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5))
True
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

from ...errors import FewBitError, check_choice
from .._eager import eager_twin, traced_body, tracing
from ..linear.quant import GROUP_SIZE, check_options, dequantize_codes, quantize_groups

__all__ = ["KINDS", "DEFAULT_THRESHOLD", "memory_sharing_norm", "forward_reference", "kept_channels"]

KINDS = ("layer_norm", "rms_norm", "llama", "t5", "gemma")
CENTRED = frozenset({"layer_norm"})
#: a channel is inverted only where |w| >= DEFAULT_THRESHOLD * (|b| + tiny / eps) (see the module docstring)
DEFAULT_THRESHOLD = 0.25


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _effective_weight(weight: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The factor each channel of xhat is multiplied by, in ``dtype`` (``1 + weight`` for Gemma)."""
    effective = weight.reshape(-1).to(dtype)
    return effective + 1.0 if kind == "gemma" else effective


def forward_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    normalized_ndim: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: y exactly as the original module computes it, rstd (float32, or float64 for float64 input) of
    shape ``[rows]``. Pure torch ops, so it runs on fake tensors too."""
    shape = tuple(x.shape[x.dim() - normalized_ndim :])
    compute = _compute_dtype(x.dtype)
    rows = math.prod(x.shape[: x.dim() - normalized_ndim])
    if kind == "layer_norm":
        # 16-bit input and parameters: torch returns 16-bit statistics, the very rstd its own backward uses; kept
        # widened to float32 (recomputing it in float32 cost a Tensor.var, ~10x the norm itself on CPU)
        y, _, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        return y, rstd.reshape(rows).to(compute)
    if kind == "rms_norm":
        y, rstd = torch.ops.aten._fused_rms_norm(x, list(shape), weight, eps)
        return y, rstd.reshape(rows).to(compute)
    dims = tuple(range(-normalized_ndim, 0))
    if kind == "t5":
        variance = x.to(torch.float32).pow(2).mean(dims, keepdim=True)
        rstd = torch.rsqrt(variance + eps)
        hidden = x * rstd
        if weight.dtype in (torch.float16, torch.bfloat16):
            hidden = hidden.to(weight.dtype)
        return weight * hidden, rstd.reshape(rows).to(compute)
    hidden = x.to(torch.float32)
    rstd = torch.rsqrt(hidden.pow(2).mean(dims, keepdim=True) + eps)
    hidden = hidden * rstd
    if kind == "llama":
        return weight * hidden.to(x.dtype), rstd.reshape(rows).to(compute)
    assert kind == "gemma", kind
    return (hidden * (1.0 + weight.float())).type_as(x), rstd.reshape(rows).to(compute)


def kept_channels(
    y_dtype: torch.dtype, weight: torch.Tensor | None, bias: torch.Tensor | None, kind: str, threshold: float
) -> torch.Tensor:
    """Bool mask ``[D]`` of the channels that cannot be inverted to rounding (all False without a weight)."""
    if weight is None:
        return torch.zeros(0, dtype=torch.bool)
    compute = _compute_dtype(y_dtype)
    magnitude = _effective_weight(weight.detach(), kind, compute).abs()
    info = torch.finfo(y_dtype)
    floor = info.tiny / info.eps
    limit = torch.full_like(magnitude, floor) if bias is None else bias.detach().reshape(-1).to(compute).abs() + floor
    return ~(magnitude >= threshold * limit)  # NaN weights are kept too


def _selected_channels(
    y_dtype: torch.dtype,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    threshold: float,
    capacity: int,
) -> torch.Tensor:
    """Indices (int64) of the channels whose normalised input is kept.

    ``capacity < 0`` (eager): exactly the channels :func:`kept_channels` marks, a data-dependent count. ``capacity
    >= 0`` (under ``torch.compile``, a static shape, so the op needs no graph break): the ``capacity`` channels of
    smallest ``|w|`` margin, which include every marked one; keeping an unmarked channel too is exact (its xhat is
    taken from x), but a marked channel beyond ``capacity`` could not be inverted to rounding, so that raises."""
    mask = kept_channels(y_dtype, weight, bias, kind, threshold)
    if capacity < 0:
        if is_fake(mask):  # no values to compare (FakeTensorMode): as for any weights not near zero, none is kept
            return torch.zeros(0, dtype=torch.int64, device=mask.device)
        return torch.nonzero(mask).reshape(-1)
    needed = int(mask.sum())
    if needed > capacity:
        raise FewBitError(
            f"memory-sharing {kind} norm under torch.compile: {needed} channels have weights too small to invert "
            f"(|w| < threshold * (|b| + tiny / eps)) but the compiled graph keeps {capacity}: run the model once "
            f"eagerly (MemorySharingNorm re-counts them) or set the module's compiled_capacity to at least {needed}, "
            "then compile again"
        )
    if capacity == 0 or weight is None:
        return torch.zeros(0, dtype=torch.int64)
    magnitude = _effective_weight(weight.detach(), kind, _compute_dtype(y_dtype)).abs()
    order = torch.where(mask, torch.full_like(magnitude, -math.inf), magnitude)  # marked ones first
    return torch.topk(order, capacity, largest=False).indices.sort().values


def _forward_exact(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    normalized_ndim: int,
    eps: float,
    threshold: float,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, rstd, channels, kept)``: the output, the rows' rstd, the kept channels' indices and their xhat
    (``[rows, k]``); the body of the exact forward, eager fast path and custom op alike."""
    y, rstd = forward_reference(x, weight, bias, kind, normalized_ndim, eps)
    rows = rstd.numel()
    channels = _selected_channels(y.dtype, weight, bias, kind, threshold, capacity).to(x.device)
    if channels.numel() == 0:
        kept = torch.empty(rows, 0, dtype=rstd.dtype, device=x.device)
    else:
        flat = x.detach().reshape(rows, -1)
        selected = flat[:, channels].to(rstd.dtype)
        if kind in CENTRED:
            selected = selected - flat.to(rstd.dtype).mean(-1, keepdim=True)
        kept = selected * rstd.reshape(rows, 1)
    return y, rstd, channels, kept


# ----------------------------------------------------------------------------------------------------------------------
# Custom ops


@torch.library.custom_op("fewbit::norm_forward", mutates_args=())
def _norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    normalized_ndim: int,
    eps: float,
    threshold: float,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward_exact(x, weight, bias, kind, normalized_ndim, eps, threshold, capacity)


@_norm_forward.register_fake
def _norm_forward_fake(x, weight, bias, kind, normalized_ndim, eps, threshold, capacity):
    y, rstd = forward_reference(x, weight, bias, kind, normalized_ndim, eps)
    if weight is None:
        count = 0
    elif capacity >= 0:  # a static count: no data-dependent shape, so torch.compile keeps one graph
        count = min(capacity, weight.numel())
    else:
        count = torch.library.get_ctx().new_dynamic_size()
    channels = x.new_empty(count, dtype=torch.int64)
    kept = x.new_empty(rstd.numel(), count, dtype=rstd.dtype)
    return y, rstd, channels, kept


def _backward_reference(
    grad: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    channels: torch.Tensor,
    kept: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    x_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    compute = rstd.dtype
    rows = rstd.numel()
    width = y.numel() // rows if rows else 0
    g = grad.reshape(rows, width).to(compute)
    xhat = y.detach().reshape(rows, width).to(compute)
    if weight is not None:
        effective = _effective_weight(weight.detach(), kind, compute)
        if bias is not None:
            xhat = xhat - bias.detach().reshape(-1).to(compute)
        divisor = effective.index_fill(0, channels, 1.0)  # kept channels are not divided (their weight may be 0)
        xhat = xhat / divisor
        xhat.index_copy_(1, channels, kept)
        dxhat = g * effective
    else:
        dxhat = g
    projection = (dxhat * xhat).mean(-1, keepdim=True)
    inner = dxhat - xhat * projection
    if kind in CENTRED:
        inner = inner - dxhat.mean(-1, keepdim=True)
    grad_x = (inner * rstd.reshape(rows, 1)).to(x_dtype).reshape(y.shape)
    grad_weight = (g * xhat).sum(0).to(weight.dtype).reshape(weight.shape) if weight is not None else _none(y)
    grad_bias = g.sum(0).to(bias.dtype).reshape(bias.shape) if bias is not None else _none(y)
    return grad_x, grad_weight, grad_bias


def _none(like: torch.Tensor) -> torch.Tensor:
    """The gradient output of an absent parameter: an empty tensor of its own (custom op outputs may not alias)."""
    return torch.empty(0, dtype=torch.float32, device=like.device)


@torch.library.custom_op("fewbit::norm_backward", mutates_args=())
def _norm_backward(
    grad: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    channels: torch.Tensor,
    kept: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    x_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the eager path's fused backward (:func:`_backward_fast`), so a compiled norm's backward is as fast as an eager
    # one and gives the same gradients (it ran the ~12-pass reference before); absent weight/bias: empty tensors
    needs = (True, weight is not None, bias is not None)
    grad_x, grad_weight, grad_bias = _backward_fast(grad, y, rstd, channels, kept, weight, bias, kind, x_dtype, needs)
    return grad_x, _none(y) if grad_weight is None else grad_weight, _none(y) if grad_bias is None else grad_bias


@_norm_backward.register_fake
def _(grad, y, rstd, channels, kept, weight, bias, kind, x_dtype):
    grad_x = torch.empty(y.shape, dtype=x_dtype, device=y.device)
    grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format) if weight is not None else _none(y)
    grad_bias = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias is not None else _none(y)
    return grad_x, grad_weight, grad_bias


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, kind, _, _, _, _ = inputs
    y, rstd, channels, kept = output
    ctx.mark_non_differentiable(rstd, channels, kept)
    ctx.save_for_backward(y, rstd, channels, kept, weight, bias)
    ctx.kind = kind
    ctx.x_dtype = x.dtype


def _backward(ctx, grad, *_):
    y, rstd, channels, kept, weight, bias = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = torch.ops.fewbit.norm_backward(
        grad, y, rstd, channels, kept, weight, bias, ctx.kind, ctx.x_dtype
    )
    return (
        grad_x if ctx.needs_input_grad[0] else None,
        grad_weight if weight is not None and ctx.needs_input_grad[1] else None,
        grad_bias if bias is not None and ctx.needs_input_grad[2] else None,
        None,
        None,
        None,
        None,
        None,
    )


_norm_forward.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------------
# Eager fast path (exact mode, not compiling): the same forward without torch.library's dispatch, and a backward in
# three or four passes over the rows (reconstruct xhat, torch's fused LayerNorm backward kernel, scale by rstd) where
# the reference takes about twelve. Under torch.compile the custom ops above run instead (one graph, fake kernels).


def _backward_fast(
    grad: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    channels: torch.Tensor,
    kept: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    x_dtype: torch.dtype,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of :func:`_backward_reference` (None where ``needs`` says so), from torch's fused kernel.

    ``aten.native_layer_norm_backward`` given the reconstructed ``xhat`` as its input, mean 0 and rstd 1 computes
    ``d = dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)`` (``dxhat = g * w``), ``sum g * xhat`` and ``sum g`` in one
    pass; the input gradient is ``rstd * d`` for a LayerNorm and ``rstd * (d + mean(dxhat))`` for an RMSNorm (no
    centring term), one fused multiply-add. ``xhat = (y - b) * (1 / w)`` is one pass, two with a bias (the reciprocal
    rounds once more than the reference's division: within the reconstruction's own rounding, tests/tolerances.py).
    So three passes over the rows, four with a bias, against the reference's twelve."""
    compute = rstd.dtype
    rows = rstd.numel()
    width = y.numel() // rows if rows else 0
    if rows == 0 or width == 0:
        grad_x, grad_weight, grad_bias = _backward_reference(grad, y, rstd, channels, kept, weight, bias, kind, x_dtype)
        return (grad_x if needs[0] else None, grad_weight if needs[1] else None, grad_bias if needs[2] else None)
    g = grad.reshape(rows, width).to(compute)
    flat = y.detach().reshape(rows, width)
    effective = None
    if weight is None:
        xhat = flat.to(compute)
    else:
        effective = _effective_weight(weight.detach(), kind, compute)
        inverse = effective.reciprocal().index_fill_(0, channels, 0.0)  # kept channels: taken from `kept` below
        if bias is None:
            xhat = torch.mul(flat, inverse) if flat.dtype == compute else flat.to(compute).mul_(inverse)
        else:  # the subtraction first: y - b is exact where they are close (y = b gives xhat = 0 exactly)
            shift = bias.detach().reshape(-1).to(compute)
            # 16-bit y: converted first, as mixed-dtype arithmetic is several times slower on CPU
            xhat = torch.sub(flat, shift) if flat.dtype == compute else flat.to(compute).sub_(shift)
            xhat.mul_(inverse)
        if channels.numel():
            xhat.index_copy_(1, channels, kept)
    centred = kind in CENTRED
    unit = torch.ones(rows, 1, dtype=compute, device=y.device)
    d, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
        g,
        xhat,
        [width],
        torch.zeros(rows, 1, dtype=compute, device=y.device),
        unit,
        effective,
        None if bias is None else effective,  # only its shape and dtype are read (the bias gradient's)
        [needs[0], needs[1] and weight is not None, needs[2] and bias is not None],
    )
    grad_x = None
    if needs[0]:
        scale = rstd.reshape(rows, 1)
        if centred:
            grad_x = d.mul_(scale)  # d is the kernel's own output
        else:  # rstd * (d + mean(dxhat)): mean(dxhat) = g @ w / width, a matrix-vector product
            mean = (g.mv(effective) if effective is not None else g.sum(-1)).div_(width).reshape(rows, 1)
            grad_x = torch.addcmul(mean * scale, d, scale)
        grad_x = grad_x.to(x_dtype).reshape(y.shape)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype).reshape(weight.shape)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype).reshape(bias.shape)
    return grad_x, grad_weight, grad_bias


class _ExactNorm(torch.autograd.Function):
    """The exact op in eager mode: :func:`_forward_exact` and :func:`_backward_fast`, no ``torch.library`` dispatch.
    Returns ``(y, channels)``; saves what the custom op saves (y shares its storage with the next layer's input)."""

    @staticmethod
    def forward(ctx, x, weight, bias, kind, normalized_ndim, eps, threshold):
        y, rstd, channels, kept = _forward_exact(x, weight, bias, kind, normalized_ndim, eps, threshold, -1)
        ctx.mark_non_differentiable(channels)
        ctx.save_for_backward(y, rstd, channels, kept, weight, bias)
        ctx.kind, ctx.x_dtype = kind, x.dtype
        return y, channels

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _):
        y, rstd, channels, kept, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x, grad_weight, grad_bias = _backward_fast(
            grad, y, rstd, channels, kept, weight, bias, ctx.kind, ctx.x_dtype, (needs[0], needs[1], needs[2])
        )
        return grad_x, grad_weight, grad_bias, None, None, None, None


# ----------------------------------------------------------------------------------------------------------------------
# Compressed mode: the output kept as K-bit group codes


def _norm_forward_compressed_impl(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    normalized_ndim: int,
    eps: float,
    threshold: float,
    bits: int,
    group_size: int,
    seed: torch.Tensor,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, rstd, channels, kept = _norm_forward(x, weight, bias, kind, normalized_ndim, eps, threshold, capacity)
    packed, scales = quantize_groups(y.detach(), bits, group_size, stochastic=True, seed=int(seed))
    return y, rstd, channels, kept, packed, scales


_norm_forward_compressed = torch.library.custom_op("fewbit::norm_forward_compressed", mutates_args=())(
    _norm_forward_compressed_impl
)


@_norm_forward_compressed.register_fake
def _(x, weight, bias, kind, normalized_ndim, eps, threshold, bits, group_size, seed, capacity):
    y, rstd, channels, kept = _norm_forward_fake(x, weight, bias, kind, normalized_ndim, eps, threshold, capacity)
    packed, scales = torch.ops.fewbit.group_quantize(y, bits, group_size, True, seed)
    return y, rstd, channels, kept, packed, scales


def _setup_context_compressed(ctx, inputs, output) -> None:
    x, weight, bias, kind, _, _, _, bits, group_size, _, _ = inputs
    y, rstd, channels, kept, packed, scales = output
    ctx.mark_non_differentiable(rstd, channels, kept, packed, scales)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the five outputs above (codes: bits / 8 per value)
    ctx.save_for_backward(rstd, channels, kept, packed, scales, weight, bias)
    ctx.kind, ctx.x_dtype, ctx.y_shape, ctx.y_dtype = kind, x.dtype, y.shape, y.dtype
    ctx.options = (bits, group_size)


def _backward_compressed(ctx, grad, *_):
    """The exact norm's backward on the decoded output: the custom op ``fewbit::norm_backward`` when traced (one
    graph under ``torch.compile``), :func:`_backward_fast` in eager (torch's fused LayerNorm backward kernel, three or
    four passes over the rows where the reference takes about twelve; the decoded tensor, shared with the linear
    layers that read the same codes, is only read)."""
    if grad is None:  # the output was not used
        return (None,) * 11
    rstd, channels, kept, packed, scales, weight, bias = ctx.saved_tensors
    bits, group_size = ctx.options
    features = ctx.y_shape[-1] if len(ctx.y_shape) else 1
    decoded = dequantize_codes(packed, scales, features, bits, group_size, ctx.y_dtype).reshape(ctx.y_shape)
    needs = ctx.needs_input_grad
    if traced_body(grad, packed):
        grad_x, grad_weight, grad_bias = torch.ops.fewbit.norm_backward(
            grad, decoded, rstd, channels, kept, weight, bias, ctx.kind, ctx.x_dtype
        )
    else:
        grad_x, grad_weight, grad_bias = _backward_fast(
            grad, decoded, rstd, channels, kept, weight, bias, ctx.kind, ctx.x_dtype, (needs[0], needs[1], needs[2])
        )
    return (
        grad_x if needs[0] else None,
        grad_weight if weight is not None and needs[1] else None,
        grad_bias if bias is not None and needs[2] else None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


_norm_forward_compressed.register_autograd(_backward_compressed, setup_context=_setup_context_compressed)
_NormCompressedEager = eager_twin(_norm_forward_compressed_impl, _setup_context_compressed, _backward_compressed)


def memory_sharing_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    kind: str,
    normalized_ndim: int,
    eps: float,
    threshold: float = DEFAULT_THRESHOLD,
    capacity: int | None = None,
    bits: int | None = None,
    group_size: int = GROUP_SIZE,
) -> torch.Tensor:
    """The norm of ``kind`` over the last ``normalized_ndim`` dimensions of ``x``; for backward it keeps only its
    output, the rows' rstd and the kept channels' xhat (see the module docstring). With ``bits`` (compressed mode)
    it keeps the output as ``bits``-bit group codes (:mod:`fewbit_design.runtime.linear.quant`, stochastic rounding)
    instead, and hands them to the compressed linear layers that read the output (one set of codes; eager), so
    gradients are approximate.

    Args:
        x: the input
        weight: the norm's weight (None: no affine weight)
        bias: the norm's bias (None: no bias)
        kind: one of :data:`KINDS` (``'layer_norm'``, ``'rms_norm'`` and the LLaMA, T5 and Gemma RMSNorm variants)
        normalized_ndim: how many trailing dimensions are normalised
        eps: the norm's epsilon
        threshold: channels with ``|w| < threshold * (|b| + tiny / eps)`` keep their normalised input (see the module
            docstring)
        capacity: how many channels keep their normalised input, a static count (so ``torch.compile`` traces the
            op without a graph break); None keeps exactly the channels that need it, a data-dependent count (eager).
            Under compile, more channels needing it than ``capacity`` raises :class:`FewBitError`.
        bits: None (exact: keep the output), or 2..8: keep the output as that many bits of group codes
        group_size: values per (low, step) group of the codes (compressed mode)
    """
    return norm_and_kept_count(
        x,
        weight,
        bias,
        kind=kind,
        normalized_ndim=normalized_ndim,
        eps=eps,
        threshold=threshold,
        capacity=capacity,
        bits=bits,
        group_size=group_size,
    )[0]


def norm_and_kept_count(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    kind: str,
    normalized_ndim: int,
    eps: float,
    threshold: float = DEFAULT_THRESHOLD,
    capacity: int | None = None,
    bits: int | None = None,
    group_size: int = GROUP_SIZE,
) -> tuple[torch.Tensor, int | None]:
    """:func:`memory_sharing_norm` and the number of channels kept (None when nothing is saved for backward, and
    a symbolic size under ``torch.compile``): the eager op knows it without another device sync."""
    check_choice("norm kind", kind, KINDS)
    if not _needs_grad(x, weight, bias):
        return forward_reference(x, weight, bias, kind, normalized_ndim, eps)[0], None
    static = -1 if capacity is None or weight is None else min(int(capacity), weight.numel())
    if bits is None:
        if static < 0 and not torch.compiler.is_compiling():  # eager: the same op without torch.library's dispatch
            y, channels = _ExactNorm.apply(x, weight, bias, kind, normalized_ndim, eps, threshold)
            return y, channels.shape[0]
        y, _, channels, _ = torch.ops.fewbit.norm_forward(
            x, weight, bias, kind, normalized_ndim, eps, threshold, static
        )
        return y, channels.shape[0]
    from ..linear.ops import share_codes

    bits, group_size, _ = check_options(bits, group_size, "stochastic")
    # the seed comes from torch's default CPU generator, as the compressed linears' (torch.manual_seed reproduces)
    seed = torch.randint(0, 2**62, (), dtype=torch.int64)
    if static < 0 and is_fake(x):  # the custom op on fake tensors: no values, none kept (as _selected_channels)
        static = 0
    arguments = (x, weight, bias, kind, normalized_ndim, eps, threshold, bits, group_size, seed, static)
    operator = torch.ops.fewbit.norm_forward_compressed if tracing(x, weight) else _NormCompressedEager.apply
    y, _, channels, _, packed, scales = operator(*arguments)
    if torch.compiler.is_compiling():  # a tensor of one op's output, on which dynamo tracks the codes (linear.ops)
        y = y.view(y.shape)
    share_codes(y, (packed, scales), bits=bits, group_size=group_size, rounding="stochastic")
    return y, channels.shape[0]


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records this call (grad mode on and some input requires a gradient)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
