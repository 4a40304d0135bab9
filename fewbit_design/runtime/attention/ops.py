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

With dropout (``dropout`` > 0, training): the forward and the backward formula are :mod:`.dropout`'s (native SDPA's
math path with a keep mask drawn from a seed, in blocks), the backward at (q~, k~, v~) with the forward's keep mask
drawn again from the seed the op keeps (8 bytes): still nothing of size S x S kept.

Shared output (``output_codes``, eager, float32 on the CPU without a mask: how ``hf_attention_forward`` calls it when
the output projection is a compressed linear): the forward runs the CPU flash kernel itself (the kernel native SDPA
dispatches to, so bitwise the same output) and keeps its log-sum-exp (B, H, S float32) and the output projection's
codes of the output, made here and handed to the projection (``linear.ops.share_codes``: one set for both). The
backward decodes O~ (free: the projection's backward has just decoded the same codes) and runs the flash backward at
(q~, k~, v~, O~, exact lse): ``P = exp(q~ k~^T scale - lse)``, ``dS = P (dP - rowsum(g O~))``, without running the
forward again (the recomputing path runs it in backward for O and lse). Saved: ``4 H`` bytes per token more (the
lse); the output's codes are the projection's (without sharing, the projection would keep them). The rows of P
need not sum exactly to 1; the gradient error against native stays the recomputing path's order
(tests/runtime/attention/test_attention_shared_output.py).

Saved bytes per token and layer at D a multiple of 8: ``(H + 2 H_kv) * D * K / 8 + 8 * (H + 2 H_kv) * ceil(D /
group_size)`` (e.g. H = H_kv = 4, D = 64, K = 8: 864 bytes, against native float32's 4 * 4 * 256 + 4 * H = 4112).

Custom ops (``torch.library``, fake kernels, ``register_autograd``): ``fewbit::compressed_attention`` and
``fewbit::compressed_attention_backward``, ``fewbit::compressed_attention_flash`` and its ``_backward`` (the shared
output call); :func:`compressed_attention` is the entry point.
"""

from __future__ import annotations

import functools

import torch

from .._eager import eager_twin, tracing
from ..fake import is_fake, kernel_device
from ..flops import attention_flops, register_flops
from ..linear.ops import share_codes
from ..linear.quant import GROUP_SIZE, check_options, dequantize_groups, dequantize_shared, quantize_codes
from .dropout import check_probability, draw_seed, dropout_attention_backward, dropout_attention_forward

__all__ = ["compressed_attention", "attention_backward_reference", "attention_backward_flash", "native_attention"]


def _repeat(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """Hugging Face's ``repeat_kv``: (B, H_kv, S, D) -> (B, H_kv * repeat, S, D), each head ``repeat`` times."""
    if repeat == 1:
        return x
    batch, heads, length, dim = x.shape
    return x[:, :, None, :, :].expand(batch, heads, repeat, length, dim).reshape(batch, heads * repeat, length, dim)


def flash_layout(like: torch.Tensor, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """An empty (B, H, S, D) tensor like ``like`` laid out as the CPU flash kernel lays out its outputs and
    gradients: (B, S, H, D) in memory, transposed (fake kernels say so)."""
    batch, heads, length, dim = shape
    return like.new_empty((batch, length, heads, dim)).transpose(1, 2)


def to_flash_layout(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (B, H, S, D) in :func:`flash_layout`'s layout: itself when it is laid out so, else a copy."""
    return tensor.transpose(1, 2).contiguous().transpose(1, 2)


def flash_gradients_like(
    grad: torch.Tensor, q_shape: list[int], k_shape: list[int], v_shape: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (dq, dk, dv) as the CPU flash backward (then the sum over each group's query heads, which is
    contiguous, for grouped k and v) gives them: the fake of every op whose backward runs that kernel."""
    summed = q_shape[1] != k_shape[1]
    key, value = (grad.new_empty(shape) if summed else flash_layout(grad, shape) for shape in (k_shape, v_shape))
    return flash_layout(grad, q_shape), key, value


def native_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    kv_repeat: int,
    enable_gqa: bool,
    dropout: float = 0.0,
) -> torch.Tensor:
    """The native call: ``repeat_kv`` then SDPA (or SDPA with ``enable_gqa``), no dropout unless ``dropout``."""
    k, v = _repeat(k, kv_repeat), _repeat(v, kv_repeat)
    extra = {"enable_gqa": True} if enable_gqa else {}
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scale, **extra
    )


_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _native_picks_flash(q, k, v, mask, scale, is_causal, repeat) -> bool:
    """Whether native SDPA would run the CPU flash kernel. In eager, torch's own choice; under torch.compile that
    call returns a Python int, which dynamo cannot trace (a graph break at every layer), so the checks it makes for
    CPU flash on these inputs are made here: 4-d dense inputs of a supported dtype, one head size, non-empty
    sequences, unit stride along the head dimension (the ``torch.backends.cuda.enable_flash_sdp`` switch breaks the
    graph too when read, so a compiled model ignores it)."""
    if not torch.compiler.is_compiling():
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, scale=scale, enable_gqa=repeat > 1)
        return choice == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    tensors = (q, k, v)
    return (
        all(t.dim() == 4 and t.dtype in _FLASH_DTYPES and t.stride(-1) == 1 and t.shape[-2] > 0 for t in tensors)
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
    )


def native_keeps_probabilities(q, k, v, mask, p, scale, is_causal, enable_gqa) -> bool:
    """Whether native SDPA with dropout ``p`` runs its math path, which keeps the S x S probabilities and dropout mask
    for backward: always on CPU (its flash kernel takes no dropout); elsewhere only where torch picks no fused
    kernel (on CUDA flash, memory-efficient and cuDNN attention take dropout and draw the mask again in backward).
    Fake tensors follow :func:`~..fake.kernel_device`; under torch.compile, which cannot trace torch's choice, a
    fused kernel is assumed off the CPU."""
    device = kernel_device(q)
    if device == "cpu":
        return True
    if torch.compiler.is_compiling() or is_fake(q):
        return False
    choice = torch._fused_sdp_choice(q, k, v, mask, p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return choice == int(torch.nn.attention.SDPBackend.MATH)


def attention_backward_reference(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    *,
    output: torch.Tensor | None = None,
    log_sum_exp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of SDPA at (q, k, v) for the output gradient ``grad`` (float32 arithmetic, float64 for
    float64 inputs; results in the inputs' dtypes); k and v may have fewer heads than q (GQA: their gradients are
    summed over each group's query heads).

    With ``output`` and ``log_sum_exp`` (the flash backward's inputs, no mask): ``P = exp(q k^T scale - lse)`` and
    ``dS = P (dP - rowsum(g output))`` with those, instead of the softmax and ``P v`` of (q, k, v): the formula of
    the flash kernel's backward, the oracle of the compressed op's shared-output call (decoded q, k, v, the decoded
    output and the forward's exact log-sum-exp, which need not agree with each other).

    Args:
        grad: gradient of the output, (B, H, S, D)
        q: queries (B, H, S, D)
        k: keys (B, H_kv, S_kv, D)
        v: values (B, H_kv, S_kv, D_v)
        mask: boolean (True = attend) or additive float mask broadcastable to (B, H, S, S_kv), or None
        scale: the score scale, None for 1 / sqrt(D)
        is_causal: upper-left causal mask (as SDPA)
        output: the attention output (B, H, S, D_v) for ``rowsum(g output)``, or None for ``P v``
        log_sum_exp: the rows' log-sum-exp (B, H, S) that normalises ``P``, or None for the softmax
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
    if log_sum_exp is None:
        # a row with every key masked has no distribution: zero probabilities, so zero gradients
        probabilities = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    else:
        probabilities = scores.sub_(log_sum_exp.to(compute)[..., None]).exp_()
    del scores
    output = torch.matmul(probabilities, v32) if output is None else output.to(compute)
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
    seed: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    # in the CPU flash kernel's layout whichever kernel ran (its output follows q's; the math kernel's is
    # contiguous), so that the fake kernel can say it: free for Hugging Face's q, which is laid out so, and for the
    # ``transpose(1, 2).contiguous()`` Hugging Face applies to the output
    if dropout > 0.0:  # k and v at their key/value heads, whichever GQA form the caller named
        output = flash_layout(q, (*q.shape[:3], v.shape[-1]))
        return dropout_attention_forward(q, k, v, mask, int(seed), dropout, scale, is_causal, out=output)
    return to_flash_layout(native_attention(q, k, v, mask, scale, is_causal, kv_repeat, enable_gqa))


_compressed_attention = torch.library.custom_op("fewbit::compressed_attention", mutates_args=())(
    _compressed_attention_impl
)


@_compressed_attention.register_fake
def _(q, k, v, mask, codes, scale, is_causal, kv_repeat, enable_gqa, bits, group_size, seed, dropout):
    batch, heads, length, _ = q.shape
    return flash_layout(q, (batch, heads, length, v.shape[-1]))


def _decode_qkv(
    codes: list[torch.Tensor], shapes: tuple[list[int], ...], bits: int, group_size: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """q, k and v decoded from their group codes (``codes``: packed and scales of each, in turn) to their ``shapes``."""
    return [
        dequantize_groups(packed, scales, shape[-1], bits, group_size, dtype).reshape(shape)
        for packed, scales, shape in zip(codes[0::2], codes[1::2], shapes, strict=True)
    ]


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
    seed: torch.Tensor | None,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    decoded = _decode_qkv(codes, (q_shape, k_shape, v_shape), bits, group_size, grad.dtype)
    if dropout > 0.0:  # the forward's keep mask, drawn again from its seed
        gradients = flash_gradients_like(grad, q_shape, k_shape, v_shape)
        return dropout_attention_backward(grad, *decoded, mask, int(seed), dropout, scale, is_causal, out=gradients)
    if _takes_flash_backward(grad, mask):
        return attention_backward_flash(grad, *decoded, scale, is_causal)
    return attention_backward_reference(grad, *decoded, mask, scale, is_causal)


def _takes_flash_backward(grad: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the compressed backward runs :func:`attention_backward_flash` (else the reference)."""
    return mask is None and grad.dtype == torch.float32 and grad.device.type == "cpu"


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
def _(grad, mask, codes, q_shape, k_shape, v_shape, scale, is_causal, bits, group_size, seed, dropout):
    if dropout > 0.0 or _takes_flash_backward(grad, mask):
        return flash_gradients_like(grad, q_shape, k_shape, v_shape)
    return tuple(grad.new_empty(shape) for shape in (q_shape, k_shape, v_shape))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, codes, scale, is_causal, kv_repeat, enable_gqa, bits, group_size, seed, dropout = inputs
    ctx.save_for_backward(mask, seed, *codes)
    ctx.shapes = (list(q.shape), list(k.shape), list(v.shape))
    ctx.options = (scale, is_causal, bits, group_size)
    ctx.dropout = dropout


def _backward(ctx, grad: torch.Tensor):
    mask, seed, *codes = ctx.saved_tensors
    operator = (
        torch.ops.fewbit.compressed_attention_backward if tracing(grad, *codes) else _compressed_attention_backward_impl
    )
    grad_q, grad_k, grad_v = operator(grad.contiguous(), mask, codes, *ctx.shapes, *ctx.options, seed, ctx.dropout)
    return grad_q, grad_k, grad_v, None, [None] * len(codes), None, None, None, None, None, None, None, None


_compressed_attention.register_autograd(_backward, setup_context=_setup_context)
_CompressedAttentionEager = eager_twin(_compressed_attention_impl, _setup_context, _backward)


# ----------------------------------------------------------------------------------------------------------------------
# The float32 CPU call without a mask whose output feeds a compressed linear (the output projection): the forward
# keeps the flash kernel's log-sum-exp and the codes of the output that the projection keeps anyway, so the backward
# runs no forward


def _sum_over_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Autograd of ``repeat_kv``: (B, H, S, D) -> (B, H_kv, S, D), the sum over each group's query heads."""
    batch, heads, length, _ = grad.shape
    if heads == kv_heads:
        return grad
    return grad.reshape(batch, kv_heads, heads // kv_heads, length, -1).sum(2)


def _output_rows(output: torch.Tensor) -> torch.Tensor:
    """The attention output (B, H, S, D_v) as the output projection reads it: (B, S, H * D_v), a view of the flash
    kernel's output (laid out (B, S, H, D_v))."""
    batch, heads, length, dim = output.shape
    return output.transpose(1, 2).reshape(batch, length, heads * dim)


def _flash_attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    codes: list[torch.Tensor],
    seed: torch.Tensor,
    scale: float | None,
    is_causal: bool,
    repeat: int,
    bits: int,
    group_size: int,
    output_bits: int,
    output_group_size: int,
    output_stochastic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # the kernel native SDPA runs for these inputs (the caller checked it), k and v repeated as native repeats them
    output, log_sum_exp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _repeat(k, repeat), _repeat(v, repeat), 0.0, is_causal, scale=scale
    )
    packed, scales = quantize_codes(_output_rows(output), output_bits, output_group_size, output_stochastic, seed)
    return output, log_sum_exp, packed, scales


_flash_attention = torch.library.custom_op("fewbit::compressed_attention_flash", mutates_args=())(_flash_attention_impl)


@_flash_attention.register_fake
def _(q, k, v, codes, seed, scale, is_causal, repeat, bits, group_size, output_bits, output_group_size, stochastic):
    batch, heads, length, dim = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
    # the CPU kernel's layouts: the output (B, S, H, D_v) and the log-sum-exp (B, S, H) in memory, both transposed
    output = flash_layout(q, (batch, heads, length, dim))
    log_sum_exp = q.new_empty((batch, length, heads), dtype=torch.float32).transpose(1, 2)
    groups = (heads * dim + output_group_size - 1) // output_group_size
    packed = q.new_empty(((batch * length * heads * dim + 7) // 8) * output_bits, dtype=torch.uint8)
    return output, log_sum_exp, packed, q.new_empty((batch * length, groups, 2), dtype=torch.float32)


def _flash_attention_backward_impl(
    grad: torch.Tensor,
    log_sum_exp: torch.Tensor,
    codes: list[torch.Tensor],
    q_shape: list[int],
    k_shape: list[int],
    v_shape: list[int],
    scale: float | None,
    is_causal: bool,
    bits: int,
    group_size: int,
    output_bits: int,
    output_group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    *qkv, output_packed, output_scales = codes
    batch, heads, length, dim = q_shape[0], q_shape[1], q_shape[2], v_shape[-1]
    # O~: the output projection's backward has just decoded these codes (dequantize_shared returns its tensor)
    output = dequantize_shared(output_packed, output_scales, heads * dim, output_bits, output_group_size, grad.dtype)
    output = output.view(batch, length, heads, dim).transpose(1, 2)
    q, k, v = _decode_qkv(qkv, (q_shape, k_shape, v_shape), bits, group_size, grad.dtype)
    repeat = heads // k_shape[1]
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, _repeat(k, repeat), _repeat(v, repeat), output, log_sum_exp, 0.0, is_causal, scale=scale
    )
    return grad_q, _sum_over_groups(grad_k, k_shape[1]), _sum_over_groups(grad_v, k_shape[1])


_flash_attention_backward = torch.library.custom_op("fewbit::compressed_attention_flash_backward", mutates_args=())(
    _flash_attention_backward_impl
)


@_flash_attention_backward.register_fake
def _(grad, log_sum_exp, codes, q_shape, k_shape, v_shape, scale, is_causal, bits, group_size, *output_options):
    return flash_gradients_like(grad, q_shape, k_shape, v_shape)


def _flash_setup_context(ctx, inputs, output) -> None:
    q, k, v, codes, seed, scale, is_causal, repeat, bits, group_size, output_bits, output_group_size, _ = inputs
    _, log_sum_exp, packed, scales = output
    # no gradient flows into them; non-differentiable outputs are saved as themselves, so the backward unpacks the
    # very tensors the output projection keeps and dequantize_shared finds its decode of them
    ctx.mark_non_differentiable(log_sum_exp, packed, scales)
    ctx.save_for_backward(log_sum_exp, *codes, packed, scales)
    ctx.shapes = (list(q.shape), list(k.shape), list(v.shape))
    ctx.options = (scale, is_causal, bits, group_size, output_bits, output_group_size)


def _flash_backward(ctx, grad: torch.Tensor, *_unused: torch.Tensor | None):
    log_sum_exp, *codes = ctx.saved_tensors
    operator = (
        torch.ops.fewbit.compressed_attention_flash_backward
        if tracing(grad, *codes)
        else _flash_attention_backward_impl
    )
    grad_q, grad_k, grad_v = operator(grad, log_sum_exp, codes, *ctx.shapes, *ctx.options)
    return grad_q, grad_k, grad_v, [None] * (len(codes) - 2), None, None, None, None, None, None, None, None, None


_flash_attention.register_autograd(_flash_backward, setup_context=_flash_setup_context)
register_flops("compressed_attention", "compressed_attention_flash")(attention_flops)
register_flops("compressed_attention_backward", "compressed_attention_flash_backward")(
    functools.partial(attention_flops, backward=True)
)
_FlashAttentionEager = eager_twin(_flash_attention_impl, _flash_setup_context, _flash_backward)


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
    output_codes: tuple[int, int, str] | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, mask, is_causal=..., scale=..., dropout_p=dropout)`` (k and v
    repeated ``kv_repeat`` times per head first, or ``enable_gqa``) that keeps q, k and v for backward as
    ``bits``-bit group codes (module docstring). Without a gradient to compute (grad mode off, or none of q, k, v
    requires grad, or a mask that requires grad) it is the native call. With ``dropout`` the keep mask is drawn from a
    seed the op keeps (:mod:`.dropout`) and drawn again in backward; k and v stay at their key/value heads.

    ``output_codes``, the ``(bits, group_size, rounding)`` of a compressed linear that reads this output as
    (B, S, H * D_v) (Hugging Face's output projection): in eager, for float32 CPU inputs without a mask on which
    native SDPA runs the flash kernel, the op runs that kernel itself and keeps its log-sum-exp (4 bytes per query
    and head) and the output's codes with those options, which it hands to the linear (``share_codes``: one set
    for both, the linear quantizes nothing); its backward then decodes O~ instead of running the forward again, and
    gives the flash backward at (q~, k~, v~, O~, the exact log-sum-exp). If the linear is fed another tensor, the
    op keeps the codes alone (correct, 1.125 bytes per output element more at 8 bits).

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
        output_codes: ``(bits, group_size, rounding)`` of the compressed linear reading the output, or None
        dropout: the dropout probability on the attention probabilities, in [0, 1)
    """
    bits, group_size, _ = check_options(bits, group_size, "nearest")
    dropout = check_probability(dropout)
    needs_grad = any(t.requires_grad for t in (q, k, v)) and not (mask is not None and mask.requires_grad)
    if not (torch.is_grad_enabled() and needs_grad):
        return native_attention(q, k, v, mask, scale, is_causal, kv_repeat, enable_gqa, dropout)
    seed = torch.zeros((), dtype=torch.int64)  # nearest rounding draws no noise
    codes: list[torch.Tensor] = []
    for tensor in (q, k, v):
        codes.extend(quantize_codes(tensor, bits, group_size, False, seed))
    repeat = q.shape[1] // k.shape[1] if enable_gqa else kv_repeat
    if (
        output_codes is not None
        and dropout == 0.0
        and mask is None
        and q.dtype == torch.float32
        and q.device.type == "cpu"
        and not tracing(q, k, v)
        and _native_picks_flash(q, k, v, None, scale, is_causal, repeat)
    ):
        return _flash_attention_shared(q, k, v, codes, scale, is_causal, repeat, bits, group_size, output_codes)
    dropout_seed = draw_seed(q.device) if dropout > 0.0 else None
    arguments = (q, k, v, mask, codes, scale, is_causal, kv_repeat, enable_gqa, bits, group_size, dropout_seed, dropout)
    if tracing(q, k, v, mask):
        return torch.ops.fewbit.compressed_attention(*arguments)
    return _CompressedAttentionEager.apply(*arguments)


def _flash_attention_shared(q, k, v, codes, scale, is_causal, repeat, bits, group_size, output_codes) -> torch.Tensor:
    """:func:`compressed_attention`'s call with ``output_codes`` (its docstring): the flash op, its output's codes
    handed to the compressed linear that reads the output."""
    output_bits, output_group_size, rounding = check_options(*output_codes)
    stochastic = rounding == "stochastic"
    # stochastic codes draw their seed as a compressed linear does (torch.manual_seed makes them reproducible)
    seed = torch.randint(0, 2**62, (), dtype=torch.int64) if stochastic else torch.zeros((), dtype=torch.int64)
    arguments = (q, k, v, codes, seed, scale, is_causal, repeat, bits, group_size)
    output, _, packed, scales = _FlashAttentionEager.apply(*arguments, output_bits, output_group_size, stochastic)
    share_codes(
        _output_rows(output), (packed, scales), bits=output_bits, group_size=output_group_size, rounding=rounding
    )
    return output
