"""The gated-MLP op: ``y = down(act(gate(x)) * up(x))`` as one autograd function that saves only x, gate and up.

Terms: ``x`` is the input (N, H) (leading dimensions flattened), ``gate = x W_gate^T + b_gate`` and
``up = x W_up^T + b_up`` (N, I), ``a = act(gate)``, the product ``h = a * up``, and ``y = h W_down^T + b_down``
(N, O). In the *fused* layout (Phi-3's ``gate_up_proj``) one weight of shape (2I, H) holds the gate rows first and the
up rows after them (``gate, up = (x W^T + b).chunk(2, dim=-1)``).

Native eager autograd keeps x, gate, a, up and h for backward (H + 4I elements per token; ReLU keeps a instead of
gate: H + 3I). This op keeps x, gate and up (H + 2I per token) and recomputes, in backward,

    a = act(gate),  h = a * up,
    dW_down = g^T h,  db_down = sum g,  dh = g W_down,
    d_up = dh * a,  d_gate = act'(gate) * (dh * up),
    dW_gate = d_gate^T x,  dW_up = d_up^T x,  db_* = sums,  dx = d_gate W_gate + d_up W_up,

with the very torch kernels native autograd runs (``silu_backward``, ``gelu_backward``, ``threshold_backward``,
``mm``), in the same dtype and order: exact mode, no approximation (a recomputed value is bitwise the one native
forward computed, so the gradients equal native's up to the order of two additions).

Layers: :func:`gated_mlp_reference` (pure torch, the forward oracle), the custom ops ``torch.ops.fewbit.gated_mlp``
(returns y and what backward keeps) and ``torch.ops.fewbit.gated_mlp_backward`` with fake kernels, so
``torch.compile`` and ``torch.library.opcheck`` work; :func:`gated_mlp`, the autograd entry point used by
:class:`~.nn.GatedMLP`.

>>> import torch
>>> x = torch.randn(3, 4, requires_grad=True)
>>> w_gate, w_up, w_down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
>>> y = gated_mlp(x, w_gate, None, w_up, None, w_down, None, "silu")
>>> torch.allclose(y, gated_mlp_reference(x, w_gate, None, w_up, None, w_down, None, "silu"))
True
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...errors import FewBitError, check_choice
from ..flops import register_flops, rows

__all__ = ["ACTIVATIONS", "gated_mlp", "gated_mlp_reference"]

#: the activations the op computes (``gelu``: erf form; ``gelu_tanh``: torch's tanh approximation)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")

SECOND_ORDER_MESSAGE = (
    "the gated-MLP op does not support higher-order gradients (backward with create_graph=True): its backward "
    "runs outside autograd; use the native module for double backward"
)


def _activation(gate: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate)
    if activation == "gelu":
        return F.gelu(gate)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    return F.relu(gate)


def _activation_backward(grad: torch.Tensor, gate: torch.Tensor, a: torch.Tensor, activation: str) -> torch.Tensor:
    """act'(gate) * grad, by the kernel torch's own autograd runs for ``activation`` (ReLU: from its output ``a``)."""
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, gate)
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, gate, approximate="none")
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, gate, approximate="tanh")
    return torch.ops.aten.threshold_backward(grad, a, 0)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _split(gate: torch.Tensor, up: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) from what the forward keeps: in the fused layout ``gate`` holds both halves and ``up`` is empty."""
    if fused:
        return gate.chunk(2, dim=-1)
    return gate, up


def gated_mlp_reference(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    w_down: torch.Tensor,
    b_down: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """The pattern in plain torch (native autograd; the oracle). ``w_up`` None: ``w_gate`` is the fused weight.

    Args:
        x: the input, shape (..., H)
        w_gate: gate weight (I, H), or the fused gate-then-up weight (2I, H) when ``w_up`` is None
        b_gate: gate bias or None
        w_up: up weight (I, H), or None (fused into ``w_gate``)
        b_up: up bias or None
        w_down: down weight (H, I)
        b_down: down bias or None
        activation: one of :data:`ACTIVATIONS`
    """
    return _gated_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)[0]


def _gated_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation):
    """``(y, gate, up)`` in plain torch, the arguments as :func:`gated_mlp_reference`'s (in the fused layout, gate and
    up are views of one projection)."""
    if w_up is None:
        gate, up = _linear(x, w_gate, b_gate).chunk(2, dim=-1)
    else:
        gate, up = _linear(x, w_gate, b_gate), _linear(x, w_up, b_up)
    return _linear(_activation(gate, activation) * up, w_down, b_down), gate, up


# ----------------------------------------------------------------------------------------------------------------------
# Custom ops


@torch.library.custom_op("fewbit::gated_mlp", mutates_args=())
def _gated_mlp_op(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    w_down: torch.Tensor,
    b_down: torch.Tensor | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, gate, up) for a 2-D x; fused layout (``w_up`` None): (y, gate and up side by side, an empty tensor)."""
    return _forward_exact(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)


def _forward_exact(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation):
    """The body of the exact forward, custom op and eager fast path alike (see :func:`_gated_mlp_op`)."""
    fused = w_up is None
    if fused:
        kept = _linear(x, w_gate, b_gate)
        gate, up = kept.chunk(2, dim=-1)
        spare = x.new_empty(0)
    else:
        gate = kept = _linear(x, w_gate, b_gate)
        up = spare = _linear(x, w_up, b_up)
    y = _linear(_activation(gate, activation) * up, w_down, b_down)
    return y, kept, spare


@_gated_mlp_op.register_fake
def _(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation):
    rows = x.shape[0]
    y = x.new_empty(rows, w_down.shape[0])
    if w_up is None:
        return y, x.new_empty(rows, w_gate.shape[0]), x.new_empty(0)
    return y, x.new_empty(rows, w_gate.shape[0]), x.new_empty(rows, w_up.shape[0])


@torch.library.custom_op("fewbit::gated_mlp_backward", mutates_args=())
def _gated_mlp_backward_op(
    grad: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    activation: str,
    input_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW_gate, db_gate, dW_up, db_up, dW_down, db_down) for 2-D tensors; dx is empty unless ``input_grad``,
    dW_up and db_up are empty in the fused layout (``w_up`` None: dW_gate and db_gate cover both halves)."""
    grads = _backward_exact(grad, x, gate, up, w_gate, w_up, w_down, activation, (input_grad, True, True, True))
    return tuple(x.new_empty(0) if g is None else g for g in grads)  # one empty each: outputs may not alias


def _backward_exact(
    grad: torch.Tensor,
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    activation: str,
    needs: tuple[bool, bool, bool, bool],
) -> tuple[torch.Tensor | None, ...]:
    """The backward of the exact op: ``(dx, dW_gate, db_gate, dW_up, db_up, dW_down, db_down)``, None where not
    computed; ``needs`` = (dx, db_gate, db_up, db_down) (the weight gradients are always computed).

    The recomputed ``a = act(gate)`` becomes ``h = a * up`` in place once ``d_up = dh * a`` and the activation's
    backward (ReLU reads ``a``) have used it, and ``dh * up`` is formed in ``dh``'s buffer: the same kernels on the same
    values as native autograd (bitwise), two passes more than native's backward (act and the product: the price of
    not keeping them) and no other allocation; bias sums only for the biases present."""
    input_grad, need_b_gate, need_b_up, need_b_down = needs
    fused = w_up is None
    gate, up = _split(gate, up, fused)
    a = _activation(gate, activation)
    grad_h = grad.mm(w_down)
    grad_up = grad_h * a
    grad_gate = _activation_backward(grad_h.mul_(up), gate, a, activation)
    del grad_h
    h = a.mul_(up)
    grad_w_down = grad.t().mm(h)
    del h, a  # backward's peak: the gradients, not the product as well
    grad_b_down = grad.sum(0) if need_b_down else None
    if fused:
        grad_kept = torch.cat([grad_gate, grad_up], dim=-1)
        del grad_gate, grad_up
        grad_x = grad_kept.mm(w_gate) if input_grad else None
        grad_b_kept = grad_kept.sum(0) if need_b_gate else None
        return grad_x, grad_kept.t().mm(x), grad_b_kept, None, None, grad_w_down, grad_b_down
    grad_x = grad_gate.mm(w_gate).add_(grad_up.mm(w_up)) if input_grad else None
    return (
        grad_x,
        grad_gate.t().mm(x),
        grad_gate.sum(0) if need_b_gate else None,
        grad_up.t().mm(x),
        grad_up.sum(0) if need_b_up else None,
        grad_w_down,
        grad_b_down,
    )


def fake_parameter_grads(
    w_gate: torch.Tensor, w_up: torch.Tensor | None, w_down: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The fake kernels' (dW_gate, db_gate, dW_up, db_up, dW_down, db_down) of a backward that computes every
    parameter gradient: empty tensors (of ``like``) for the up projection's in the fused layout."""

    def pair(weight: torch.Tensor | None) -> list[torch.Tensor]:
        if weight is None:
            return [like.new_empty(0), like.new_empty(0)]
        return [weight.new_empty(weight.shape), weight.new_empty(weight.shape[0])]

    return (*pair(w_gate), *pair(w_up), *pair(w_down))


@_gated_mlp_backward_op.register_fake
def _(grad, x, gate, up, w_gate, w_up, w_down, activation, input_grad):
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if input_grad else x.new_empty(0)
    return (grad_x, *fake_parameter_grads(w_gate, w_up, w_down, x))


def _wanted_grads(
    grads: tuple[torch.Tensor | None, ...], needs: tuple[bool, ...], biases: tuple[bool, bool, bool], fused: bool
) -> tuple[torch.Tensor | None, ...]:
    """The autograd gradients of ``(x, w_gate, b_gate, w_up, b_up, w_down, b_down)`` from a backward's seven
    ``grads``: None where autograd does not need one (``needs``, its ``needs_input_grad``) or the parameter is
    absent (``biases``: whether b_gate, b_up and b_down are given; ``fused``: no w_up). Every mode's backward ends
    here."""
    grad_x, grad_w_gate, grad_b_gate, grad_w_up, grad_b_up, grad_w_down, grad_b_down = grads
    has_b_gate, has_b_up, has_b_down = biases
    return (
        grad_x if needs[0] else None,
        grad_w_gate if needs[1] else None,
        grad_b_gate if has_b_gate and needs[2] else None,
        grad_w_up if not fused and needs[3] else None,
        grad_b_up if has_b_up and needs[4] else None,
        grad_w_down if needs[5] else None,
        grad_b_down if has_b_down and needs[6] else None,
    )


def _setup_context(ctx, inputs, output) -> None:
    x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation = inputs
    _, gate, up = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
    ctx.activation = activation
    ctx.biases = (b_gate is not None, b_up is not None, b_down is not None)


def _backward_common(ctx, grad: torch.Tensor | None, traced: bool) -> tuple[torch.Tensor | None, ...]:
    """The exact op's backward: the custom op ``fewbit::gated_mlp_backward`` when ``traced`` (one graph under
    ``torch.compile``), else its body :func:`_backward_exact` computing only the bias gradients autograd needs."""
    if torch.is_grad_enabled():
        raise FewBitError(SECOND_ORDER_MESSAGE)
    if grad is None:
        return (None,) * 8
    x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
    needs = ctx.needs_input_grad
    arguments = (grad.contiguous(), x, gate, up, w_gate, w_up, w_down, ctx.activation)
    if traced:
        grads = torch.ops.fewbit.gated_mlp_backward(*arguments, bool(needs[0]))
    else:
        has_b_gate, has_b_up, has_b_down = ctx.biases
        grads = _backward_exact(
            *arguments, (needs[0], has_b_gate and needs[2], has_b_up and needs[4], has_b_down and needs[6])
        )
    return (*_wanted_grads(grads, needs, ctx.biases, w_up is None), None)


def _backward(ctx, grad, *_):
    return _backward_common(ctx, grad, traced=True)


torch.library.register_autograd("fewbit::gated_mlp", _backward, setup_context=_setup_context)


def product_flops(arguments: dict, weights: tuple[str, ...] = ("w_gate", "w_up", "w_down"), passes: int = 1) -> float:
    """The FLOPs of ``passes`` products of the MLP's rows (of ``x``, or of ``grad`` in backward) with each of the
    ``weights`` given (a fused gate_up weight is one): a gated op's formula for :func:`~..flops.register_flops`.
    Forward runs one pass, backward two (the input's and the weights' gradients)."""
    first = arguments["x"] if isinstance(arguments.get("x"), torch.Tensor) else arguments["grad"]
    size = sum(weight.numel() for key in weights if isinstance(weight := arguments.get(key), torch.Tensor))
    return 2.0 * passes * rows(first) * size


#: the backward's formula: two passes (the input's and the weights' gradients)
backward_flops = functools.partial(product_flops, passes=2)
register_flops("gated_mlp")(product_flops)
register_flops("gated_mlp_backward")(backward_flops)


class _ExactGatedMLP(torch.autograd.Function):
    """The exact op in eager mode: :func:`_forward_exact` and :func:`_backward_exact` without ``torch.library``'s
    dispatch (under ``torch.compile`` the custom ops run instead: one graph); saves what the custom op saves."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_exact(*inputs)
        _setup_context(ctx, inputs, output)
        return output[0]

    @staticmethod
    def backward(ctx, grad):
        return _backward_common(ctx, grad, traced=False)


# ----------------------------------------------------------------------------------------------------------------------
# Entry point


def _check_shapes(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor | None, w_down: torch.Tensor) -> None:
    width = w_gate.shape[0] // 2 if w_up is None else w_gate.shape[0]
    if x.dim() == 0 or x.shape[-1] != w_gate.shape[-1]:
        raise FewBitError(
            f"gated MLP: the input's last dimension must be the gate projection's {w_gate.shape[-1]} features, "
            f"got shape {tuple(x.shape)}"
        )
    if w_up is None and w_gate.shape[0] % 2:
        raise FewBitError(f"gated MLP: a fused gate_up weight needs an even number of rows, got {w_gate.shape[0]}")
    if w_up is not None and w_up.shape != w_gate.shape:
        raise FewBitError(f"gated MLP: w_up {tuple(w_up.shape)} must have w_gate's shape {tuple(w_gate.shape)}")
    if w_down.shape[-1] != width:
        raise FewBitError(f"gated MLP: w_down takes {w_down.shape[-1]} features but the product has {width}")


def prepare_inputs(
    x: torch.Tensor, weights: tuple[torch.Tensor | None, ...], activation: str
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """``(x, (w_gate, b_gate, w_up, b_up, w_down, b_down))`` checked (activation, one dtype, shapes) and cast to the
    autocast dtype under ``torch.autocast``, as ``torch.nn.Linear`` is; every mode's entry point starts here."""
    check_choice("gated MLP activation", activation, ACTIVATIONS)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x = x.to(dtype)
        weights = tuple(None if w is None else w.to(dtype) for w in weights)
    for name, tensor in zip(("w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down"), weights, strict=True):
        if tensor is not None and tensor.dtype != x.dtype:
            raise FewBitError(
                f"gated MLP: {name} is {tensor.dtype} but the input is {x.dtype}: give them one dtype "
                "(model.to(dtype)) or run under torch.autocast"
            )
    w_gate, _, w_up, _, w_down, _ = weights
    _check_shapes(x, w_gate, w_up, w_down)
    return x, weights


def gated_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor | None,
    b_up: torch.Tensor | None,
    w_down: torch.Tensor,
    b_down: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` for x of shape (..., H), keeping only x, gate and up for backward.

    ``w_up`` None: ``w_gate`` (and ``b_gate``) is the fused (2I, H) gate-then-up weight (Phi-3's ``gate_up_proj``).
    Weights follow ``torch.nn.Linear`` (out_features, in_features). Under ``torch.autocast`` the inputs are cast to
    the autocast dtype first, as ``torch.nn.Linear`` is.

    Args:
        x: the input, shape (..., H)
        w_gate: gate weight (I, H), or the fused gate-then-up weight (2I, H) when ``w_up`` is None
        b_gate: gate bias or None
        w_up: up weight (I, H), or None (fused into ``w_gate``)
        b_up: up bias or None
        w_down: down weight (H, I)
        b_down: down bias or None
        activation: one of :data:`ACTIVATIONS`
    """

    def run(x, rows, weights):
        if torch.compiler.is_compiling():  # the custom op: one graph, fake kernels
            return torch.ops.fewbit.gated_mlp(rows, *weights, activation)[0]
        return _ExactGatedMLP.apply(rows, *weights, activation)  # eager: the same kernels without the dispatch

    return mode_entry(x, (w_gate, b_gate, w_up, b_up, w_down, b_down), activation, run)


def mode_entry(x: torch.Tensor, weights: tuple, activation: str, run) -> torch.Tensor:
    """Every mode's entry point: ``x`` and ``weights`` checked and cast (:func:`prepare_inputs`), the leading
    dimensions flattened, autocast off; the reference forward when nothing needs a gradient (nothing to save: the
    same kernels without the custom op's dispatch), else ``run(x, rows, weights)``, the mode's op on the rows.

    Args:
        x: the input (..., H).
        weights: ``(w_gate, b_gate, w_up, b_up, w_down, b_down)``.
        activation: the activation's name.
        run: the mode's call, returning y for the rows.
    """
    x, weights = prepare_inputs(x, weights, activation)
    leading, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])
    with torch.autocast(x.device.type, enabled=False):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *weights)):
            y = run(x, rows, weights)
        else:
            y = gated_mlp_reference(rows, *weights, activation)
    return y.reshape(*leading, y.shape[-1])
