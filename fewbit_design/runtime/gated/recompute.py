"""The gated-MLP op's recompute mode: an exact forward, and a backward that rebuilds gate and up from K-bit codes of x
(approximate gradients).

Terms as in :mod:`.ops`. This mode keeps one thing: ``bits`` = K-bit group codes of x (2 to 8 bits, the codes of
:mod:`fewbit_design.runtime.linear.quant`), the very codes a compressed norm or linear layer reading the same x keeps
(:func:`fewbit_design.runtime.linear.ops.share_codes`: one set per tensor). Backward decodes x~, recomputes

    gate~ = x~ W_gate^T + b_gate,  up~ = x~ W_up^T + b_up     (2 I H multiply-adds per token: the forward's two)

and runs the exact mode's backward (:func:`.ops._backward_exact`, the kernels native autograd runs) on x~, gate~ and
up~. Every value backward reads derives from x~, whose error is below one quantization step of x's group; the weight
gradients read x~ as the compressed mode's do.

Saved bytes per token: those of x's codes, ``H * K / 8 + 8 * H / group_size`` (none more where a compressed norm
before the MLP keeps them already), against the compressed mode's ``(H + 2 I) * K / 8 + 8 * (H + 2 I) /
group_size``: for Llama-3-8B (H 4096, I 14336) at K = 8, 4.5 KiB per token against 36 KiB. The price is time: two
matmuls more in backward, about 2/9 more of the MLP's multiply-adds (forward 3, backward 6), and no quantization of
gate and up in forward.

Custom ops (fake kernels, ``register_autograd``): ``fewbit::gated_mlp_recompute`` and
``fewbit::gated_mlp_recompute_backward``; :func:`gated_mlp_recompute` is the entry point used by
:class:`~.nn.GatedMLP` (``mode="recompute"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import FewBitError
from .._eager import eager_twin, traced_body, tracing
from ..flops import register_flops
from ..linear.ops import _codes as input_codes
from ..linear.quant import GROUP_SIZE, check_options, dequantize_codes, saved_nbytes
from .ops import (
    SECOND_ORDER_MESSAGE,
    _backward_exact,
    _gated_forward,
    _wanted_grads,
    backward_flops,
    fake_parameter_grads,
    mode_entry,
    product_flops,
)

__all__ = ["gated_mlp_recompute", "saved_nbytes_per_token"]

_INPUTS = 12  # the forward op's arguments


def saved_nbytes_per_token(hidden: int, *, bits: int, group_size: int = GROUP_SIZE, tokens: int = 1) -> int:
    """Bytes the recompute mode keeps for ``tokens`` tokens: the K-bit codes and scales of x (hidden features).

    Args:
        hidden: H, the features of x.
        bits: bits of the codes.
        group_size: elements per group sharing one scale and offset.
        tokens: how many tokens.
    """
    return saved_nbytes((tokens, hidden), bits, group_size)


def _forward_impl(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    w_down: torch.Tensor,
    b_down: torch.Tensor | None,
    activation: str,
    bits: int,
    group_size: int,
    x_packed: torch.Tensor,
    x_scales: torch.Tensor,
) -> torch.Tensor:
    """y for a 2-D x. x's codes are not read here: they are inputs so that autograd's setup keeps them."""
    return _gated_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)[0]


_forward_op = torch.library.custom_op("fewbit::gated_mlp_recompute", mutates_args=())(_forward_impl)


@_forward_op.register_fake
def _(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, bits, group_size, x_packed, x_scales):
    return x.new_empty(x.shape[0], w_down.shape[0])


def _recomputed_backward(
    grad, x_packed, x_scales, w_gate, b_gate, w_up, b_up, w_down, activation, bits, group_size, needs
) -> tuple[torch.Tensor | None, ...]:
    """The exact backward on x~ and on gate~ and up~ recomputed from it (``needs``: as :func:`.ops._backward_exact`)."""
    x = dequantize_codes(x_packed, x_scales, w_gate.shape[1], bits, group_size, grad.dtype)  # read by the norm too
    gate = F.linear(x, w_gate, b_gate)  # the fused layout: both halves, as the exact mode keeps them
    up = x.new_empty(0) if w_up is None else F.linear(x, w_up, b_up)
    return _backward_exact(grad, x, gate, up, w_gate, w_up, w_down, activation, needs)


@torch.library.custom_op("fewbit::gated_mlp_recompute_backward", mutates_args=())
def _backward_op(
    grad: torch.Tensor,
    x_packed: torch.Tensor,
    x_scales: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    w_down: torch.Tensor,
    activation: str,
    bits: int,
    group_size: int,
    input_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW_gate, db_gate, dW_up, db_up, dW_down, db_down) for a 2-D grad, as ``fewbit::gated_mlp_backward``'s."""
    arguments = (grad, x_packed, x_scales, w_gate, b_gate, w_up, b_up, w_down, activation, bits, group_size)
    grads = _recomputed_backward(*arguments, (input_grad, True, True, True))
    return tuple(grad.new_empty(0) if g is None else g for g in grads)  # one empty each: outputs may not alias


@_backward_op.register_fake
def _(grad, x_packed, x_scales, w_gate, b_gate, w_up, b_up, w_down, activation, bits, group_size, input_grad):
    grad_x = grad.new_empty(grad.shape[0], w_gate.shape[1]) if input_grad else grad.new_empty(0)
    return (grad_x, *fake_parameter_grads(w_gate, w_up, w_down, grad))


def _setup_context(ctx, inputs, output) -> None:
    x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, bits, group_size, x_packed, x_scales = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x_packed, x_scales, w_gate, b_gate, w_up, b_up, w_down)
    ctx.options = (activation, bits, group_size)
    ctx.biases = (b_gate is not None, b_up is not None, b_down is not None)


def _backward(ctx, grad):
    if torch.is_grad_enabled():
        raise FewBitError(SECOND_ORDER_MESSAGE)
    if grad is None:
        return (None,) * _INPUTS
    saved = ctx.saved_tensors
    needs = ctx.needs_input_grad
    arguments = (grad.contiguous(), *saved, *ctx.options)
    if traced_body(grad, saved[0]):
        grads = torch.ops.fewbit.gated_mlp_recompute_backward(*arguments, bool(needs[0]))
    else:
        has_b_gate, has_b_up, has_b_down = ctx.biases
        wanted = (needs[0], has_b_gate and needs[2], has_b_up and needs[4], has_b_down and needs[6])
        grads = _recomputed_backward(*arguments, wanted)
    w_up = saved[4]
    return (*_wanted_grads(grads, needs, ctx.biases, w_up is None), *(None,) * (_INPUTS - 7))


torch.library.register_autograd("fewbit::gated_mlp_recompute", _backward, setup_context=_setup_context)
register_flops("gated_mlp_recompute")(product_flops)


@register_flops("gated_mlp_recompute_backward")
def _backward_flops(arguments: dict) -> float:
    """Backward's two passes, and gate and up again from x's codes."""
    return backward_flops(arguments) + product_flops(arguments, ("w_gate", "w_up"))


_GatedRecomputeEager = eager_twin(_forward_impl, _setup_context, _backward)


def gated_mlp_recompute(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    w_down: torch.Tensor,
    b_down: torch.Tensor | None,
    activation: str,
    *,
    bits: int = 8,
    group_size: int = GROUP_SIZE,
    rounding: str = "stochastic",
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` for x of shape (..., H), bitwise the exact op's output, keeping only ``bits``-bit
    group codes of x for backward, which recomputes gate and up from them (module docstring).

    Args:
        x: the input (..., H), as :func:`~.ops.gated_mlp`.
        w_gate: the gate projection's weight (I, H), or the fused gate_up weight (2I, H) with ``w_up`` None.
        b_gate: its bias, or None.
        w_up: the up projection's weight (I, H), or None with a fused ``w_gate``.
        b_up: its bias, or None.
        w_down: the down projection's weight (H, I).
        b_down: its bias, or None.
        activation: the activation's name, as :func:`~.ops.gated_mlp`.
        bits: bits of x's codes (2-8).
        group_size: elements per group sharing one scale and offset.
        rounding: ``"stochastic"`` (unbiased) or ``"nearest"``.
    """

    def run(x, rows, weights):
        x_packed, x_scales = input_codes(x, bits, group_size, rounding == "stochastic")  # shared with a norm, linears
        operator = torch.ops.fewbit.gated_mlp_recompute if tracing(rows, weights[0]) else _GatedRecomputeEager.apply
        return operator(rows, *weights, activation, bits, group_size, x_packed, x_scales)

    bits, group_size, rounding = check_options(bits, group_size, rounding)
    return mode_entry(x, (w_gate, b_gate, w_up, b_up, w_down, b_down), activation, run)
