"""The gated-MLP op's compressed mode: an exact forward, and a backward from K-bit codes (approximate gradients).

Terms as in :mod:`.ops` (x (N, H), gate and up (N, I), a = act(gate), h = a * up, y = h W_down^T + b_down). Backward
needs

    dW_down = g^T h,  dh = g W_down,  d_up = dh * a,  d_gate = act'(gate) * (dh * up),
    dW_gate = d_gate^T x,  dW_up = d_up^T x,  dx = d_gate W_gate + d_up W_up   (biases: sums of the gradients),

so the values it reads are a, up, act'(gate) and x (h is a * up). This mode keeps ``bits`` = K-bit group codes
(2 to 8 bits; :mod:`fewbit_design.runtime.linear.quant`: per-group low and step, float32, 8 bytes per group of
``group_size``) of

* gate, from which backward recomputes both a~ = act(gate~) and act'(gate~) (the kernels of the exact mode), so
  every error term shrinks with K: |act(gate~) - act(gate)| <= max|act'| |gate~ - gate| and |act'(gate~) -
  act'(gate)| <= max|act''| |gate~ - gate|, and |gate~ - gate| is below one step, the group's range / (2^K - 1);
* up, with rounding independent of gate's (its own seed), so the recomputed product h~ = act(gate~) * up~ carries
  no correlated rounding of its two factors;
* x, once for both weight gradients, through the compressed linear layers' codes (:func:`fewbit_design.runtime.
  linear.ops` keeps one set of codes per input tensor in eager, so a compressed linear reading the same x would
  share them). Not kept when neither gate nor up weight needs a gradient.

Why gate and not a = act(gate) with few-bit codes of act'(gate) (the first version of this mode): the few-bit codes
(3 bits) have a fixed error whatever K is, and it dominated. Measured on one step of the byte-level LLaMA of
``benchmarks/transformer_loss.py`` (``benchmarks/gated_error.py``, relative parameter-gradient error against native,
each compression on alone): the 3-bit act' codes 0.014 against 0.0008 or less for each K = 8 value code, so the first
version's 8-bit mode had the gradient error of a 3-bit one; keeping gate instead gives 0.0012 for the whole mode at
K = 8 (0.014 before) and 0.022 at K = 4 (0.026 before), and drops the I * 3 / 8 bytes of act' codes. Two I-wide
tensors is the least (d_up reads a, d_gate reads up); h is recomputed rather than kept (keeping h instead of up needs
up = h / a, unstable where a is near 0).

Saved bytes per token, for I and H multiples of 8 and of ``group_size`` (in general: ``ceil(n / 8) * bits`` bytes
for n codes plus 8 bytes per group; :func:`saved_nbytes_per_token` counts it exactly for any shape):

    (H + 2 I) * K / 8 + 8 * (H + 2 I) / group_size

e.g. H = 128, I = 256, group 64: 720 bytes at K = 8 and 400 at K = 4, against exact mode's (H + 2 I) * 4 = 2560
(float32) and native eager's (H + 4 I) * 4 = 4608.

Rounding: ``"stochastic"`` (default: every code unbiased, as the linear technique's) or ``"nearest"`` (half the
worst-case error per element, biased; the measured one-step gradient error of gate codes alone at K = 4 is 0.010
nearest against 0.013 stochastic).

Non-finite values: a group of gate or up that holds a non-finite value decodes to NaN (:mod:`..linear.quant`), so
every gradient that reads it is NaN: never a finite gradient from a non-finite forward.

Backward kernels: on the CPU, for float32 and bfloat16 and the ``silu``, ``gelu_tanh`` and ``relu`` activations, two
numba passes over the (rows, I) tensors from the codes (:mod:`._numba_gated`: h~, then d_gate and d_up) instead of
the torch path's seven (decode gate, decode up, act, the product, two products with dh, act's backward); the same
gradients within the dtype's rounding (the kernels round once, in float32; tests/runtime/gated/
test_gated_compressed_kernels.py). Elsewhere the torch path.

Custom ops (fake kernels, ``register_autograd``): ``fewbit::gated_mlp_compressed`` and
``fewbit::gated_mlp_compressed_backward``; :func:`gated_mlp_compressed` is the entry point used by
:class:`~.nn.GatedMLP` (``mode="compressed"``).
"""

from __future__ import annotations

import torch

from ...errors import FewBitError
from .._eager import eager_twin, tracing
from .._packing import _numba_available
from ..flops import register_flops
from ..linear.ops import _codes as input_codes
from ..linear.quant import (
    GROUP_SIZE,
    check_options,
    dequantize_groups,
    dequantize_shared,
    quantize_groups,
    saved_nbytes,
)
from .ops import (
    SECOND_ORDER_MESSAGE,
    _activation,
    _activation_backward,
    _gated_forward,
    _wanted_grads,
    backward_flops,
    mode_entry,
    product_flops,
)

__all__ = ["gated_mlp_compressed", "saved_nbytes_per_token"]


def saved_nbytes_per_token(hidden: int, width: int, *, bits: int, group_size: int = GROUP_SIZE, tokens: int = 1) -> int:
    """Bytes the compressed mode keeps for ``tokens`` tokens (x: hidden features, gate and up: width each): K-bit
    codes and scales of x, gate and up (per token when ``tokens`` is 1).

    Args:
        hidden: H, the features of x.
        width: I, the features of gate and up.
        bits: bits of the value codes.
        group_size: elements per group sharing one scale and offset.
        tokens: how many tokens.
    """
    return saved_nbytes((tokens, hidden), bits, group_size) + 2 * saved_nbytes((tokens, width), bits, group_size)


# ----------------------------------------------------------------------------------------------------------------------
# Custom ops


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
    stochastic: bool,
    seed: torch.Tensor,
    x_packed: torch.Tensor,
    x_scales: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, gate's packed codes and scales, up's packed codes and scales) for a 2-D x. x's codes are not read here:
    they are inputs so that autograd's setup keeps them for backward."""
    y, gate, up = _gated_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)
    gate_packed, gate_scales = quantize_groups(gate, bits, group_size, stochastic=stochastic, seed=int(seed))
    # an independent stream for up (seed + 1): correlated rounding of gate and up would correlate a~ and up~
    up_packed, up_scales = quantize_groups(up, bits, group_size, stochastic=stochastic, seed=int(seed) + 1)
    return y, gate_packed, gate_scales, up_packed, up_scales


_forward_op = torch.library.custom_op("fewbit::gated_mlp_compressed", mutates_args=())(_forward_impl)


@_forward_op.register_fake
def _(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, bits, group_size, stochastic, seed, x_packed,
      x_scales):  # fmt: skip
    rows, width = x.shape[0], w_down.shape[1]
    groups = (width + group_size - 1) // group_size

    def codes():
        return x.new_empty(((rows * width + 7) // 8) * bits, dtype=torch.uint8)

    def scales():
        return x.new_empty((rows, groups, 2), dtype=torch.float32)

    return x.new_empty(rows, w_down.shape[0]), codes(), scales(), codes(), scales()


def _empty(like: torch.Tensor) -> torch.Tensor:
    """A fresh empty tensor for a gradient that is not computed (a custom op's outputs may not alias each other)."""
    return like.new_empty(0)


def _fused_kernels(grad: torch.Tensor, activation: str, bits: int):
    """The numba module of the two-pass backward (:mod:`._numba_gated`) when it applies (a CPU float32 or bfloat16
    gradient, an activation it has, codes on the CPU, numba installed), else None (the torch path)."""
    if grad.device.type != "cpu" or grad.dtype not in (torch.float32, torch.bfloat16) or grad.shape[0] == 0:
        return None
    if activation not in ("silu", "gelu_tanh", "relu") or not _numba_available():
        return None
    from . import _numba_gated

    return _numba_gated


def _numpy(tensor: torch.Tensor):
    """A flat numpy view of a contiguous CPU tensor (bfloat16 as its uint16 bits)."""
    flat = tensor.reshape(-1)
    return (flat.view(torch.uint16) if flat.dtype == torch.bfloat16 else flat).numpy()


def _fused_passes(kernels, gate_packed, gate_scales, up_packed, up_scales, width, bits, group_size, activation,
                  grad):  # fmt: skip
    """``(h~, gradients)``: h~ = act(gate~) * up~ (rows, I) from the codes in one pass, and ``gradients(dh)``, the
    second pass: (rows, 2I) with d_gate = act'(gate~) * (dh * up~) in the first half and d_up = dh * a~ in the second
    (:mod:`._numba_gated`)."""
    from .. import _numba_packing

    rows, dtype = grad.shape[0], grad.dtype
    codes = (
        gate_packed.detach().reshape(-1).contiguous().numpy(),
        gate_scales.detach().to(torch.float32).contiguous().numpy(),
        up_packed.detach().reshape(-1).contiguous().numpy(),
        up_scales.detach().to(torch.float32).contiguous().numpy(),
    )
    options = (width, group_size, bits, kernels.ACTIVATIONS[activation])
    launch = {"grain": 8, "min_task": max(8, _numba_packing.MIN_TASK // max(width, 1))}
    h = torch.empty(rows, width, dtype=dtype)
    _numba_packing.run(kernels.product, rows, *codes, *options, _numpy(h), **launch)

    def gradients(grad_h: torch.Tensor) -> torch.Tensor:
        kept = torch.empty(rows, 2 * width, dtype=dtype)
        _numba_packing.run(kernels.gradients, rows, *codes, *options, _numpy(grad_h.contiguous()), _numpy(kept),
                           **launch)  # fmt: skip
        return kept

    return h, gradients


def _backward_impl(
    grad: torch.Tensor,
    x_packed: torch.Tensor,
    x_scales: torch.Tensor,
    gate_packed: torch.Tensor,
    gate_scales: torch.Tensor,
    up_packed: torch.Tensor,
    up_scales: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    activation: str,
    bits: int,
    group_size: int,
    input_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW_gate, db_gate, dW_up, db_up, dW_down, db_down) for a 2-D grad; dx is empty unless ``input_grad``, the
    gate and up weight gradients empty unless ``weight_grad``, the bias gradients empty unless ``bias_grad`` (no
    sums over the rows for a model without biases, as LLaMA's), dW_up and db_up empty in the fused layout."""

    def sums(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.sum(0) if bias_grad else _empty(tensor)

    hidden, width, dtype = w_gate.shape[1], w_down.shape[1], grad.dtype
    fused = w_up is None
    kernels = _fused_kernels(grad, activation, bits)
    grad_kept = None
    if kernels is not None:  # two passes over the (rows, I) tensors (module _numba_gated)
        h, gradients = _fused_passes(
            kernels, gate_packed, gate_scales, up_packed, up_scales, width, bits, group_size, activation, grad
        )
        grad_w_down = grad.t().mm(h)  # h~ = a~ * up~, recomputed
        del h
        grad_b_down = sums(grad)
        grad_kept = gradients(grad.mm(w_down))  # [d_gate, d_up] from dh = g W_down
        grad_gate, grad_up = grad_kept[:, :width], grad_kept[:, width:]
    else:
        gate = dequantize_groups(gate_packed, gate_scales, width, bits, group_size, dtype)
        up = dequantize_groups(up_packed, up_scales, width, bits, group_size, dtype)
        a = _activation(gate, activation)  # a~ = act(gate~)
        grad_w_down = grad.t().mm(a * up)  # h~ = a~ * up~, recomputed
        grad_b_down = sums(grad)
        grad_h = grad.mm(w_down)
        # d_up = dh * a~ and dh * up~ in place where a~ is not read again (ReLU's backward reads it): the same values
        grad_up = grad_h * a if activation == "relu" else a.mul_(grad_h)
        grad_gate = _activation_backward(grad_h.mul_(up), gate, a, activation)  # act'(gate~) * (dh * up~)
        del a, up, gate, grad_h
    if fused:
        if grad_kept is None:
            grad_kept = torch.cat([grad_gate, grad_up], dim=-1)
        grad_x = grad_kept.mm(w_gate) if input_grad else _empty(grad)
        if not weight_grad:
            return grad_x, _empty(grad), _empty(grad), _empty(grad), _empty(grad), grad_w_down, grad_b_down
        x = dequantize_shared(x_packed, x_scales, hidden, bits, group_size, dtype)  # read by the norm too
        return grad_x, grad_kept.t().mm(x), sums(grad_kept), _empty(grad), _empty(grad), grad_w_down, grad_b_down
    grad_x = grad_gate.mm(w_gate).add_(grad_up.mm(w_up)) if input_grad else _empty(grad)
    if not weight_grad:
        return grad_x, _empty(grad), _empty(grad), _empty(grad), _empty(grad), grad_w_down, grad_b_down
    x = dequantize_shared(x_packed, x_scales, hidden, bits, group_size, dtype)  # read by the norm too
    return (
        grad_x,
        grad_gate.t().mm(x),
        sums(grad_gate),
        grad_up.t().mm(x),
        sums(grad_up),
        grad_w_down,
        grad_b_down,
    )


_backward_op = torch.library.custom_op("fewbit::gated_mlp_compressed_backward", mutates_args=())(_backward_impl)


@_backward_op.register_fake
def _(grad, x_packed, x_scales, gate_packed, gate_scales, up_packed, up_scales, w_gate, w_up, w_down, activation,
      bits, group_size, input_grad, weight_grad, bias_grad):  # fmt: skip
    rows = grad.shape[0]

    def sums(size: int) -> torch.Tensor:
        return grad.new_empty(size) if bias_grad else _empty(grad)

    grad_x = grad.new_empty(rows, w_gate.shape[1]) if input_grad else _empty(grad)
    grad_w_down, grad_b_down = grad.new_empty(w_down.shape), sums(w_down.shape[0])
    if not weight_grad:
        return grad_x, _empty(grad), _empty(grad), _empty(grad), _empty(grad), grad_w_down, grad_b_down
    grad_w_gate, grad_b_gate = grad.new_empty(w_gate.shape), sums(w_gate.shape[0])
    if w_up is None:
        return grad_x, grad_w_gate, grad_b_gate, _empty(grad), _empty(grad), grad_w_down, grad_b_down
    grad_w_up, grad_b_up = grad.new_empty(w_up.shape), sums(w_up.shape[0])
    return grad_x, grad_w_gate, grad_b_gate, grad_w_up, grad_b_up, grad_w_down, grad_b_down


# ----------------------------------------------------------------------------------------------------------------------
# Autograd

_INPUTS = 14  # the forward op's arguments


def _setup_context(ctx, inputs, output) -> None:
    x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, bits, group_size = inputs[:10]
    x_packed, x_scales = inputs[12:14]
    _, gate_packed, gate_scales, up_packed, up_scales = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x_packed, x_scales, gate_packed, gate_scales, up_packed, up_scales, w_gate, w_up, w_down)
    ctx.options = (activation, bits, group_size)
    ctx.biases = (b_gate is not None, b_up is not None, b_down is not None)


def _backward(ctx, grad, *_):
    if torch.is_grad_enabled():
        raise FewBitError(SECOND_ORDER_MESSAGE)
    if grad is None:
        return (None,) * _INPUTS
    x_packed, x_scales, gate_packed, gate_scales, up_packed, up_scales, w_gate, w_up, w_down = ctx.saved_tensors
    needs = ctx.needs_input_grad
    weight_grad = bool(needs[1] or needs[2] or needs[3] or needs[4])
    has_b_gate, has_b_up, has_b_down = ctx.biases
    bias_grad = bool(has_b_gate and needs[2] or has_b_up and needs[4] or has_b_down and needs[6])
    operator = torch.ops.fewbit.gated_mlp_compressed_backward if tracing(grad, x_packed) else _backward_impl
    grads = operator(
        grad.contiguous(),
        x_packed,
        x_scales,
        gate_packed,
        gate_scales,
        up_packed,
        up_scales,
        w_gate,
        w_up,
        w_down,
        *ctx.options,
        bool(needs[0]),
        weight_grad,
        bias_grad,
    )  # fmt: skip
    return (*_wanted_grads(grads, needs, ctx.biases, w_up is None), *(None,) * (_INPUTS - 7))


torch.library.register_autograd("fewbit::gated_mlp_compressed", _backward, setup_context=_setup_context)
register_flops("gated_mlp_compressed")(product_flops)
register_flops("gated_mlp_compressed_backward")(backward_flops)
_GatedCompressedEager = eager_twin(_forward_impl, _setup_context, _backward)


# ----------------------------------------------------------------------------------------------------------------------
# Entry point


def gated_mlp_compressed(
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
    """``down(act(gate(x)) * up(x))`` for x of shape (..., H), bitwise the exact op's output, keeping ``bits``-bit
    group codes of x, gate and up for backward, which recomputes act(gate) and act'(gate) from gate's codes (module
    docstring).

    Args:
        x: the input (..., H), as :func:`~.ops.gated_mlp`.
        w_gate: the gate projection's weight (I, H), or the fused gate_up weight (2I, H) with ``w_up`` None.
        b_gate: its bias, or None.
        w_up: the up projection's weight (I, H), or None with a fused ``w_gate``.
        b_up: its bias, or None.
        w_down: the down projection's weight (H, I).
        b_down: its bias, or None.
        activation: the activation's name, as :func:`~.ops.gated_mlp`.
        bits: bits of the value codes (2-8).
        group_size: elements per group sharing one scale and offset.
        rounding: ``"stochastic"`` (unbiased) or ``"nearest"``.
    """

    def run(x, rows, weights):
        stochastic = rounding == "stochastic"
        if any(t is not None and t.requires_grad for t in weights[:4]):
            x_packed, x_scales = input_codes(x, bits, group_size, stochastic)  # shared with a compressed linear
        else:  # no gate or up weight gradient: x is not needed
            x_packed, x_scales = rows.new_empty(0, dtype=torch.uint8), rows.new_empty(0, 0, 2, dtype=torch.float32)
        # the seed comes from torch's default CPU generator: torch.manual_seed makes the codes reproducible
        seed = torch.randint(0, 2**62, (), dtype=torch.int64)
        operator = torch.ops.fewbit.gated_mlp_compressed if tracing(rows, weights[0]) else _GatedCompressedEager.apply
        return operator(rows, *weights, activation, bits, group_size, stochastic, seed, x_packed, x_scales)[0]

    bits, group_size, rounding = check_options(bits, group_size, rounding)
    return mode_entry(x, (w_gate, b_gate, w_up, b_up, w_down, b_down), activation, run)
