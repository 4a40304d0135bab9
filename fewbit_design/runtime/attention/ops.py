"""The compressed attention core: the exact SDPA forward, and a backward from K-bit codes of q, k and v.

Terms. ``q`` (B, H, S, D), ``k`` and ``v`` (B, H_kv, S_kv, D) with H a multiple of H_kv (grouped-query attention:
``kv_repeat = H / H_kv`` query heads per key/value head); ``scale`` (default ``1 / sqrt(D)``); a mask (boolean,
True = attend, or additive float) or ``is_causal`` (upper-left aligned, as SDPA). Native SDPA keeps q, k, v, its
output and the row log-sum-exp for backward (about 4 values per element of q). This op keeps q, k and v as K-bit
group codes (:mod:`fewbit_design.runtime.linear.quant`: groups of ``group_size`` along D, float32 (low, step) per
group, nearest rounding) and nothing else of size S x S or of the output:

* forward: ``F.scaled_dot_product_attention`` with the caller's arguments (GQA by ``enable_gqa`` or by the same
  expand-and-reshape as Hugging Face's ``repeat_kv``): bitwise the native call;
* backward (flash-attention style, from the decoded q~, k~, v~; computed in float32, float64 for float64; float32
  without a mask on the CPU through torch's flash-attention kernels, :func:`attention_backward_flash`):
  ``P = softmax(q~ k~^T scale + mask)``, ``O~ = P v~``, ``dV = P^T g``, ``dP = g v~^T``, ``dS = P (dP - rowsum(g
  O~))``, ``dQ = dS k~ scale``, ``dK = dS^T q~ scale``; key/value gradients summed over the query heads of each
  group. The scores exist only while the backward runs. Rows whose every key is masked give zero gradients.

Gradients are approximate (the decoded values are within half a step of the exact ones): the error falls with K
(tests/runtime/attention/test_attention_op.py measures it per K against native).

Saved bytes per token and layer at D a multiple of 8: ``(H + 2 H_kv) * D * K / 8 + 8 * (H + 2 H_kv) * ceil(D /
group_size)`` (e.g. H = H_kv = 4, D = 64, K = 8: 864 bytes, against native float32's 4 * 4 * 256 + 4 * H = 4112).

Custom ops (``torch.library``, fake kernels, ``register_autograd``): ``fewbit::compressed_attention`` and
``fewbit::compressed_attention_backward``; :func:`compressed_attention` is the entry point.
"""

from __future__ import annotations

import torch

from .._eager import eager_twin, tracing
from ..linear.quant import GROUP_SIZE, check_options, dequantize_groups, quantize_codes

__all__ = ["compressed_attention", "attention_backward_reference", "attention_backward_flash", "native_attention"]


def _repeat(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """Hugging Face's ``repeat_kv``: (B, H_kv, S, D) -> (B, H_kv * repeat, S, D), each head ``repeat`` times."""
    if repeat == 1:
        return x
    batch, heads, length, dim = x.shape
    return x[:, :, None, :, :].expand(batch, heads, repeat, length, dim).reshape(batch, heads * repeat, length, dim)


def native_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    kv_repeat: int,
    enable_gqa: bool,
) -> torch.Tensor:
    """The native call: ``repeat_kv`` then SDPA (or SDPA with ``enable_gqa``), no dropout."""
    k, v = _repeat(k, kv_repeat), _repeat(v, kv_repeat)
    extra = {"enable_gqa": True} if enable_gqa else {}
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=is_causal, scale=scale, **extra
    )


def attention_backward_reference(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of SDPA at (q, k, v) for the output gradient ``grad`` (float32 arithmetic, float64 for
    float64 inputs; results in the inputs' dtypes); k and v may have fewer heads than q (GQA: their gradients are
    summed over each group's query heads).

    Args:
        grad: gradient of the output, (B, H, S, D)
        q: queries (B, H, S, D)
        k: keys (B, H_kv, S_kv, D)
        v: values (B, H_kv, S_kv, D_v)
        mask: boolean (True = attend) or additive float mask broadcastable to (B, H, S, S_kv), or None
        scale: the score scale, None for 1 / sqrt(D)
        is_causal: upper-left causal mask (as SDPA)
    """
    dtype = q.dtype
    compute = torch.promote_types(dtype, torch.float32)  # float32, float64 for float64 inputs
    heads, kv_heads = q.shape[1], k.shape[1]
    repeat = heads // kv_heads
    q32, g32 = q.to(compute), grad.to(compute)
    k32, v32 = _repeat(k.to(compute), repeat), _repeat(v.to(compute), repeat)
    factor = scale if scale is not None else q.shape[-1] ** -0.5
    # the S x S temporaries are updated in place (the same values as out-of-place ops, fewer passes and allocations)
    scores = torch.matmul(q32, k32.transpose(-2, -1)).mul_(factor)
    if is_causal:
        above = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(above, float("-inf"))
    if mask is not None:
        scores = (
            scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask.to(compute))
        )
    # a row with every key masked has no distribution: zero probabilities, so zero gradients
    probabilities = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    del scores
    output = torch.matmul(probabilities, v32)
    grad_v = torch.matmul(probabilities.transpose(-2, -1), g32)
    # dS = P * (dP - rowsum(g * O)): the softmax Jacobian
    grad_s = torch.matmul(g32, v32.transpose(-2, -1)).sub_((g32 * output).sum(-1, keepdim=True))
    grad_s.mul_(probabilities).mul_(factor)
    del probabilities
    grad_q = torch.matmul(grad_s, k32)
    grad_k = torch.matmul(grad_s.transpose(-2, -1), q32)
    if repeat > 1:
        batch, _, length, _ = grad_k.shape
        grad_k = grad_k.reshape(batch, kv_heads, repeat, length, -1).sum(2)
        grad_v = grad_v.reshape(batch, kv_heads, repeat, length, -1).sum(2)
    return grad_q.to(dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _compressed_attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    codes: list[torch.Tensor],
    scale: float | None,
    is_causal: bool,
    kv_repeat: int,
    enable_gqa: bool,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    return native_attention(q, k, v, mask, scale, is_causal, kv_repeat, enable_gqa)


_compressed_attention = torch.library.custom_op("fewbit::compressed_attention", mutates_args=())(
    _compressed_attention_impl
)


@_compressed_attention.register_fake
def _(q, k, v, mask, codes, scale, is_causal, kv_repeat, enable_gqa, bits, group_size):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _compressed_attention_backward_impl(
    grad: torch.Tensor,
    mask: torch.Tensor | None,
    codes: list[torch.Tensor],
    q_shape: list[int],
    k_shape: list[int],
    v_shape: list[int],
    scale: float | None,
    is_causal: bool,
    bits: int,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    decoded = [
        dequantize_groups(packed, scales, shape[-1], bits, group_size, grad.dtype).reshape(shape)
        for packed, scales, shape in zip(codes[0::2], codes[1::2], (q_shape, k_shape, v_shape), strict=True)
    ]
    if mask is None and grad.dtype == torch.float32 and grad.device.type == "cpu":
        return attention_backward_flash(grad, *decoded, scale, is_causal)
    return attention_backward_reference(grad, *decoded, mask, scale, is_causal)


def attention_backward_flash(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attention_backward_reference` without a mask, through torch's CPU flash-attention kernels: the forward
    recomputed for its log-sum-exp, then its backward (blockwise: no S x S tensor; float32 accumulation as the
    reference, the sums in another order, so equal to it to float32 rounding). The compressed op's backward takes
    it for float32 on the CPU without a mask (1.3x faster than the reference at B, H, S, D = 4, 4, 128, 64); for
    bfloat16 the reference is faster, and a mask may leave rows without keys, which the reference handles.

    Args:
        grad: gradient of the output, (B, H, S, D), contiguous
        q: queries (B, H, S, D)
        k: keys (B, H_kv, S_kv, D)
        v: values (B, H_kv, S_kv, D_v)
        scale: the score scale, None for 1 / sqrt(D)
        is_causal: upper-left causal mask (as SDPA)
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    repeat = heads // kv_heads
    k_all, v_all = _repeat(k, repeat).contiguous(), _repeat(v, repeat).contiguous()
    output, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k_all, v_all, 0.0, is_causal, scale=scale
    )
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k_all, v_all, output, logsumexp, 0.0, is_causal, scale=scale
    )
    if repeat > 1:
        batch, _, length, _ = grad_k.shape
        grad_k = grad_k.reshape(batch, kv_heads, repeat, length, -1).sum(2)
        grad_v = grad_v.reshape(batch, kv_heads, repeat, length, -1).sum(2)
    return grad_q, grad_k, grad_v


_compressed_attention_backward = torch.library.custom_op("fewbit::compressed_attention_backward", mutates_args=())(
    _compressed_attention_backward_impl
)


@_compressed_attention_backward.register_fake
def _(grad, mask, codes, q_shape, k_shape, v_shape, scale, is_causal, bits, group_size):
    return tuple(grad.new_empty(shape) for shape in (q_shape, k_shape, v_shape))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, codes, scale, is_causal, kv_repeat, enable_gqa, bits, group_size = inputs
    ctx.save_for_backward(mask, *codes)
    ctx.shapes = (list(q.shape), list(k.shape), list(v.shape))
    ctx.options = (scale, is_causal, bits, group_size)


def _backward(ctx, grad: torch.Tensor):
    mask, *codes = ctx.saved_tensors
    scale, is_causal, bits, group_size = ctx.options
    operator = (
        torch.ops.fewbit.compressed_attention_backward if tracing(grad, *codes) else _compressed_attention_backward_impl
    )
    grad_q, grad_k, grad_v = operator(grad.contiguous(), mask, codes, *ctx.shapes, scale, is_causal, bits, group_size)
    return grad_q, grad_k, grad_v, None, [None] * len(codes), None, None, None, None, None, None


_compressed_attention.register_autograd(_backward, setup_context=_setup_context)
_CompressedAttentionEager = eager_twin(_compressed_attention_impl, _setup_context, _backward)


def compressed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    kv_repeat: int = 1,
    enable_gqa: bool = False,
    bits: int = 8,
    group_size: int = GROUP_SIZE,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, mask, is_causal=..., scale=...)`` (no dropout; k and v repeated
    ``kv_repeat`` times per head first, or ``enable_gqa``) that keeps q, k and v for backward as ``bits``-bit group
    codes (module docstring). Without a gradient to compute (grad mode off, or none of q, k, v requires grad, or a
    mask that requires grad) it is the native call.

    >>> q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    >>> native = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.equal(compressed_attention(q, k, v, is_causal=True), native)
    True

    Args:
        q: queries (B, H, S, D)
        k: keys (B, H_kv, S_kv, D)
        v: values (B, H_kv, S_kv, D_v)
        mask: boolean (True = attend) or additive float mask, or None
        scale: the score scale (None: 1 / sqrt(D))
        is_causal: SDPA's causal flag
        kv_repeat: query heads per key/value head, applied by repeating k and v (Hugging Face's ``repeat_kv``)
        enable_gqa: SDPA's grouped-query flag (instead of ``kv_repeat``)
        bits: bits per saved code, 2 to 8
        group_size: values per (low, step) group along the head dimension
    """
    bits, group_size, _ = check_options(bits, group_size, "nearest")
    needs_grad = any(t.requires_grad for t in (q, k, v)) and not (mask is not None and mask.requires_grad)
    if not (torch.is_grad_enabled() and needs_grad):
        return native_attention(q, k, v, mask, scale, is_causal, kv_repeat, enable_gqa)
    seed = torch.zeros((), dtype=torch.int64)  # nearest rounding draws no noise
    codes: list[torch.Tensor] = []
    for tensor in (q, k, v):
        codes.extend(quantize_codes(tensor, bits, group_size, False, seed))
    arguments = (q, k, v, mask, codes, scale, is_causal, kv_repeat, enable_gqa, bits, group_size)
    if tracing(q, k, v, mask):
        return torch.ops.fewbit.compressed_attention(*arguments)
    return _CompressedAttentionEager.apply(*arguments)
