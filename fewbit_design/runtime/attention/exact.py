"""The exact attention core that recomputes v: native SDPA forward and backward, with v rebuilt in backward from the
value projection's input (which q_proj and k_proj keep anyway) instead of being kept.

Terms. ``x`` is the attention module's input (the first norm's output), ``projection`` the linear layer producing v
(``v_proj``, a fused ``qkv_proj`` of which v is a slice, BERT's ``value``), ``v`` a view (``view`` / ``transpose`` /
slice) of ``projection(x)``. Native SDPA keeps q, k, v, its output and the row log-sum-exp; the linears before it keep
x. This op keeps q, k, x (shared with the linears: no new bytes), the output and the log-sum-exp: one hidden-sized
tensor per token fewer than native (v). Where v is not such a view (no value projection, as GPT-2's ``Conv1D``; a
key/value cache's copy, which a model with ``use_cache`` makes in training too) it keeps v itself. Either way k and v
stay at their key/value heads (grouped-query attention: the op repeats them, as ``repeat_kv``, only inside the
kernel call), where transformers' sdpa function repeats them whenever a mask is passed and native keeps the copies;
and a boolean mask is kept as the caller's object (one for all layers), where native SDPA keeps a float copy per
layer.

* forward: the same SDPA kernel native runs (``torch._fused_sdp_choice`` must name the CPU flash kernel, as native
  picks it for float CPU inputs without dropout; otherwise the caller runs native SDPA): bitwise native;
* backward: ``v = linear(x, W, b)`` viewed with v's size, strides and offset (one matmul into a fresh buffer, freed
  when the backward returns), then native's own backward kernel on the same tensors: gradients equal to native up to
  the matmul's determinism (bitwise on CPU). k and v repeated for GQA are summed back over each group's query heads,
  as autograd sums ``repeat_kv``.

Under ``torch.compile`` the op is opaque (custom op, fake kernels): the partitioner cannot keep v, since no backward
node reads it.

With attention dropout (training), :func:`dropout_attention`: the forward and backward of :mod:`.dropout` (the
math path's formula with a keep mask drawn from a seed, in blocks), which keep q, k, x (or v, where no value
projection makes it), the caller's mask and the seed; the keep mask is drawn again in backward, bit for bit. Gradients
equal native SDPA's given the same keep mask (native's math path with that mask passed in) to float32 rounding.

Custom ops (``torch.library``): ``fewbit::value_recompute_attention`` and ``fewbit::dropout_attention``, each with its
``_backward``; entry points :func:`value_recompute_attention` and :func:`dropout_attention`; :class:`ValueLinear` is
the projection that hands (x, its output) to the core.
"""

from __future__ import annotations

import functools

import torch

from ...errors import FewBitError
from .._torchscript import NotScriptable
from ..fake import kernel_device
from ..flops import attention_flops, register_flops
from .dropout import check_probability, draw_seed, dropout_attention_backward, dropout_attention_forward
from .ops import _native_picks_flash, _repeat, _sum_over_groups, flash_gradients_like, flash_layout

__all__ = ["value_recompute_attention", "dropout_attention", "ValueLinear", "take_recipe"]

#: the attribute of a :class:`ValueLinear` holding (input, output) of its last forward until the core takes it
RECIPE = "fewbit_recipe"


class ValueLinear(NotScriptable, torch.nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) that also leaves ``(input, output, output's version)`` of its
    forward on itself for the attention core of its module to take (:func:`take_recipe`); nothing else changes."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = torch.nn.functional.linear(input, self.weight, self.bias)
        setattr(self, RECIPE, (input, output, 0 if torch.compiler.is_compiling() else output._version))
        return output


def take_recipe(projection: torch.nn.Module | None) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """The (input, output, version) a :class:`ValueLinear` left, removed from it (so no tensor outlives the
    forward)."""
    recipe = getattr(projection, RECIPE, None)
    if recipe is not None:
        setattr(projection, RECIPE, None)
    return recipe


def _kernel_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as native SDPA hands it to the kernel: a boolean mask (True = attend) as 0 / -inf of q's dtype. Made
    here, in forward and again in backward, so that what is kept is the caller's mask (one boolean mask for every
    layer), not a float copy per layer."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), float("-inf"), 0.0).to(dtype)


def _value(v, x, weight, bias, v_size: list[int], v_stride: list[int], v_offset: int) -> torch.Tensor:
    """v as the backward reads it: ``v`` itself where the forward kept it, else the projection of x seen through the
    forward's view of it (size, stride and offset)."""
    if v is not None:
        return v
    return torch.nn.functional.linear(x, weight, bias).as_strided(v_size, v_stride, v_offset)


@torch.library.custom_op("fewbit::value_recompute_attention", mutates_args=())
def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    scale: float | None,
    is_causal: bool,
    repeat: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = _repeat(k, repeat), _repeat(v, repeat)
    # the kernel's output follows q's layout: q in (B, S, H, D) memory order (a no-op for HF's RoPE output, which is
    # laid out so) gives an output whose transpose(1, 2).contiguous() for o_proj is the same storage, so o_proj and
    # this op's backward keep one tensor, compiled as in eager
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=_kernel_mask(mask, q.dtype), scale=scale
    )


@_attention.register_fake
def _(q, k, v, x, weight, bias, mask, scale, is_causal, repeat):
    batch, heads, length, _ = q.shape
    # the CPU kernel's layouts: the output follows q's, here (B, S, H, D) memory order; the log-sum-exp is (B, S, H)
    # transposed
    log_sum_exp = q.new_empty((batch, length, heads), dtype=torch.float32).transpose(1, 2)
    return flash_layout(q, q.shape), log_sum_exp


@torch.library.custom_op("fewbit::value_recompute_attention_backward", mutates_args=())
def _attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    x: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    output: torch.Tensor,
    log_sum_exp: torch.Tensor,
    mask: torch.Tensor | None,
    v_size: list[int],
    v_stride: list[int],
    v_offset: int,
    scale: float | None,
    is_causal: bool,
    repeat: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v = _value(v, x, weight, bias, v_size, v_stride, v_offset)  # the one matmul this op adds, where v is not kept
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad,
        q,
        _repeat(k, repeat),
        _repeat(v, repeat),
        output,
        log_sum_exp,
        0.0,
        is_causal,
        attn_mask=_kernel_mask(mask, q.dtype),
        scale=scale,
    )
    return grad_q, _sum_over_groups(grad_k, k.shape[1]), _sum_over_groups(grad_v, k.shape[1])


@_attention_backward.register_fake
def _(grad, q, k, v, x, weight, bias, output, log_sum_exp, mask, v_size, v_stride, v_offset, scale, is_causal, repeat):
    return flash_gradients_like(grad, list(q.shape), list(k.shape), v_size)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, x, weight, bias, mask, scale, is_causal, repeat = inputs
    ctx.save_for_backward(q, k, v if x is None else None, x, weight, bias, output[0], output[1], mask)
    ctx.view = (list(v.size()), list(v.stride()), v.storage_offset())
    ctx.options = (scale, is_causal, repeat)


def _backward(ctx, grad: torch.Tensor, _grad_log_sum_exp: torch.Tensor | None):
    q, k, v, x, weight, bias, output, log_sum_exp, mask = ctx.saved_tensors
    scale, is_causal, repeat = ctx.options
    grad_q, grad_k, grad_v = torch.ops.fewbit.value_recompute_attention_backward(
        grad, q, k, v, x, weight, bias, output, log_sum_exp, mask, *ctx.view, scale, is_causal, repeat
    )
    return grad_q, grad_k, grad_v, None, None, None, None, None, None, None


_attention.register_autograd(_backward, setup_context=_setup_context)


def _views(v: torch.Tensor, projected: torch.Tensor, version: int) -> bool:
    """Whether ``v`` is a view of ``projected`` whose size, strides and offset hold for a recomputed ``projected``.

    A linear's 3-D output may itself be a view of a 2-D product, so ``v``'s base is compared with ``projected``'s
    root; the root must be laid out as ``projected`` (both contiguous with the same elements, so the same bytes from
    the root's start), which is how a fresh ``linear`` lays out its output. Views are known by their ``_base``,
    which eager autograd and the fake tensors of ``torch.compile`` both track (a copy such as a KV cache's
    ``torch.cat`` has none). In eager, the version counter (``version``: the projection output's when it was made)
    also says whether anything wrote into the storage since; under ``torch.compile`` the counter is runtime state
    that Dynamo cannot compare without breaking the graph, so an in-place write into v between its projection and
    the attention core (which no supported model makes) is seen in eager only. Every test made under compile is one
    Dynamo traces (``storage_offset()`` is not: it would break the graph at every layer)."""
    root = projected if projected._base is None else projected._base
    return (
        v._base is root
        and root.is_contiguous()
        and projected.is_contiguous()
        and projected.numel() == root.numel()
        and (torch.compiler.is_compiling() or v._version == version)
    )


def value_recompute_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    recipe: tuple[torch.Tensor, torch.Tensor, int] | None,
    projection: torch.nn.Module | None,
    *,
    scale: float | None,
    is_causal: bool,
    kv_repeat: int,
    enable_gqa: bool,
) -> torch.Tensor | None:
    """``F.scaled_dot_product_attention`` (no dropout, ``repeat_kv`` by ``kv_repeat`` or ``enable_gqa``) that keeps
    the projection's input instead of v (module docstring), or v itself where v is not a view of the recipe's output
    (a key/value cache's copy): k and v at their key/value heads either way, where native repeats them whenever a
    mask is passed. None where it does not apply (no gradient to compute, or native would not run the CPU flash
    kernel): the caller then runs native SDPA.

    Args:
        q: queries (B, H, S, D)
        k: keys (B, H_kv, S, D)
        v: values (B, H_kv, S, D)
        mask: SDPA's mask or None
        recipe: (x, projection(x), its version) from :func:`take_recipe`, or None
        projection: the linear whose weight and bias made v, or None
    """
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
        return None
    if mask is not None and mask.requires_grad:
        return None
    if v.shape[-1] != q.shape[-1] or kernel_device(q) != "cpu":
        return None
    # query heads per key/value head, repeated by this op as repeat_kv does (or SDPA under enable_gqa)
    repeat = q.shape[1] // k.shape[1] if enable_gqa else kv_repeat
    if q.shape[1] != k.shape[1] * repeat:
        return None
    # the kernel native picks (the choice reads shapes, dtypes and the mask: unrepeated k and v with enable_gqa ask
    # the same question without the copy)
    if not _native_picks_flash(q, k, v, mask, scale, is_causal, repeat):
        return None
    x, weight, bias = _rebuild(v, recipe, projection)
    output, _ = torch.ops.fewbit.value_recompute_attention(q, k, v, x, weight, bias, mask, scale, is_causal, repeat)
    return output


def _rebuild(
    v: torch.Tensor, recipe: tuple[torch.Tensor, torch.Tensor, int] | None, projection: torch.nn.Module | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(x, weight, bias)`` to rebuild v from, when v is a view of the recipe's output (:func:`_views`), else
    ``(None, None, None)``: v is kept."""
    if recipe is None or projection is None or not _views(v, recipe[1], recipe[2]) or v.dtype != recipe[1].dtype:
        return None, None, None
    return recipe[0], projection.weight, projection.bias


# ----------------------------------------------------------------------------------------------------------------------
# With attention dropout: the math path's formula in blocks (.dropout), the keep mask drawn from a seed both ways


@torch.library.custom_op("fewbit::dropout_attention", mutates_args=())
def _dropout_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    seed: torch.Tensor,
    p: float,
    scale: float | None,
    is_causal: bool,
) -> torch.Tensor:
    # the output laid out as the flash kernel's (B, S, H, D_v): Hugging Face's transpose(1, 2).contiguous() is free
    output = flash_layout(q, (*q.shape[:3], v.shape[-1]))
    return dropout_attention_forward(q, k, v, mask, int(seed), p, scale, is_causal, out=output)


@_dropout_attention.register_fake
def _(q, k, v, x, weight, bias, mask, seed, p, scale, is_causal):
    return flash_layout(q, (*q.shape[:3], v.shape[-1]))


@torch.library.custom_op("fewbit::dropout_attention_backward", mutates_args=())
def _dropout_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    x: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    seed: torch.Tensor,
    v_size: list[int],
    v_stride: list[int],
    v_offset: int,
    p: float,
    scale: float | None,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v = _value(v, x, weight, bias, v_size, v_stride, v_offset)
    gradients = flash_gradients_like(grad, list(q.shape), list(k.shape), v_size)
    return dropout_attention_backward(grad, q, k, v, mask, int(seed), p, scale, is_causal, out=gradients)


@_dropout_attention_backward.register_fake
def _(grad, q, k, v, x, weight, bias, mask, seed, v_size, v_stride, v_offset, p, scale, is_causal):
    return flash_gradients_like(grad, list(q.shape), list(k.shape), v_size)


def _dropout_setup_context(ctx, inputs, output) -> None:
    q, k, v, x, weight, bias, mask, seed, p, scale, is_causal = inputs
    ctx.save_for_backward(q, k, v if x is None else None, x, weight, bias, mask, seed)
    ctx.view = (list(v.size()), list(v.stride()), v.storage_offset())
    ctx.options = (p, scale, is_causal)


def _dropout_backward(ctx, grad: torch.Tensor):
    q, k, v, x, weight, bias, mask, seed = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.fewbit.dropout_attention_backward(
        grad, q, k, v, x, weight, bias, mask, seed, *ctx.view, *ctx.options
    )
    return grad_q, grad_k, grad_v, None, None, None, None, None, None, None, None


_dropout_attention.register_autograd(_dropout_backward, setup_context=_dropout_setup_context)
register_flops("value_recompute_attention", "dropout_attention")(attention_flops)
register_flops("value_recompute_attention_backward", "dropout_attention_backward")(
    functools.partial(attention_flops, backward=True)
)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """One :class:`FewBitError` naming the shapes when q, k, v and the mask do not make one attention call."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise FewBitError(f"attention takes 4-D q, k, v (batch, heads, length, head dim), got {shapes}")
    batch, heads, rows, dim = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != batch or k.shape[-1] != dim or heads % max(1, k.shape[1]):
        raise FewBitError(
            f"attention needs k and v of q's batch, the same heads and length, k's head dim equal to q's and q's "
            f"heads a multiple of k's, got {shapes}"
        )
    if len({q.dtype, k.dtype, v.dtype}) > 1 or len({q.device, k.device, v.device}) > 1:
        raise FewBitError(f"attention needs q, k, v of one dtype and device, got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None:
        full = (batch, heads, rows, k.shape[2])
        trailing = zip(mask.shape[::-1], full[::-1], strict=False)  # broadcasting aligns the trailing sizes
        if mask.dim() > 4 or any(size not in (1, wanted) for size, wanted in trailing):
            raise FewBitError(f"the attention mask {tuple(mask.shape)} does not broadcast to {full} ({shapes})")
        if mask.requires_grad:
            raise FewBitError("the attention mask must not require grad (the dropout core gives it no gradient)")


def dropout_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    p: float,
    scale: float | None = None,
    is_causal: bool = False,
    recipe: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    projection: torch.nn.Module | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, mask, dropout_p=p, is_causal=..., scale=..., enable_gqa=True)`` whose
    keep mask is drawn from a seed it keeps and drawn again in backward (:mod:`.dropout`): it keeps q, k, v (or, with
    ``recipe`` and ``projection`` and v a view of the recipe's output, the projection's input instead of v), the
    caller's mask and the seed, nothing of size S x S. k and v stay at their key/value heads.

    >>> q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    >>> dropout_attention(q, k, v, p=0.1, is_causal=True).shape
    torch.Size([1, 2, 5, 8])

    Args:
        q: queries (B, H, S, D)
        k: keys (B, H_kv, S_kv, D), H a multiple of H_kv
        v: values (B, H_kv, S_kv, D_v)
        mask: boolean (True = attend) or additive float mask broadcastable to (B, H, S, S_kv), or None
        p: the dropout probability, in [0, 1)
        scale: the score scale (None: 1 / sqrt(D))
        is_causal: SDPA's causal flag (upper-left)
        recipe: (x, projection(x), its version) from :func:`take_recipe`, or None: v is kept
        projection: the linear whose weight and bias made v from x
    """
    p = check_probability(p)
    _check_inputs(q, k, v, mask)
    x, weight, bias = _rebuild(v, recipe, projection)
    seed = draw_seed(q.device)
    return torch.ops.fewbit.dropout_attention(q, k, v, x, weight, bias, mask, seed, p, scale, bool(is_causal))
