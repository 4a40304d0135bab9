"""The chunked LM head + cross-entropy: ``cross_entropy(hidden @ weight.T + bias, labels)`` whose logits never exist
whole.

Terms: ``hidden`` holds N rows of width H (any leading shape, flattened), ``weight`` is the head's (V, H) matrix (V
the vocabulary), ``labels`` one class per row (``ignore_index`` rows take no part), a *chunk* is ``chunk_rows``
consecutive rows. The *logits* of a chunk are ``linear(hidden_chunk, weight, bias)`` computed in the input dtype
(as the native head does) and then upcast to the compute dtype (float32, float64 for float64 input: Hugging Face
upcasts the logits before its loss the same way), then ``* logit_scale`` and, with ``softcap``,
``softcap * tanh(logits / softcap)`` (Cohere, Granite and Gemma 2 transform their logits so).

* forward: per chunk, its logits, their logsumexp (``lse``) and the labels' logits; the loss of a row is
  ``lse - logit[label]``. It saves ``hidden``, ``labels`` and the per-row ``lse`` (N compute-dtype values) for
  backward; ``weight`` and ``bias`` are parameters (alive anyway);
* backward: per chunk, the logits again, ``softmax - onehot`` scaled by the incoming gradient (over the number of
  counted rows for ``reduction="mean"``), then ``grad_hidden[chunk] = g @ weight`` and ``grad_weight += g.T @
  hidden_chunk``. ``grad_weight`` (and ``grad_bias``) are summed in the compute dtype and rounded once at the end.

Memory: one chunk's logits (a few of them at once: logsumexp's and softmax's temporaries) instead of the N x V
logits, their float32 copy and log-softmax output that native autograd keeps; in backward, the compute-dtype
accumulator of ``grad_weight`` (V x H). Time: the head's matmul runs twice (once more in backward).

Layers: :func:`lm_loss_reference` (``F.cross_entropy`` on the whole logits: the test oracle and the benchmark
baseline), the custom ops ``torch.ops.fewbit.lm_loss`` / ``torch.ops.fewbit.lm_loss_backward`` (with fake kernels,
so ``torch.compile`` treats the loop as one opaque op), and :func:`lm_loss`, the autograd entry point.

>>> import torch, torch.nn.functional as F
>>> hidden = torch.randn(6, 4, requires_grad=True)
>>> weight = torch.randn(10, 4, requires_grad=True)
>>> labels = torch.tensor([1, 2, -100, 3, 9, 0])
>>> loss = lm_loss(hidden, weight, labels, chunk_rows=4)
>>> torch.allclose(loss, F.cross_entropy(hidden @ weight.T, labels))
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import FewBitError, check_choice, check_integer, check_positive
from ..flops import register_flops, rows

__all__ = ["REDUCTIONS", "MIN_CHUNK_BYTES", "default_chunk_rows", "lm_loss", "lm_loss_reference"]

REDUCTIONS = ("mean", "sum")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: The automatic chunk never holds fewer float32 logits than this: below it each chunk's fixed cost (three matmul
#: calls, a logsumexp) grows. Measured on the 2-core dev machine (one thread, CPU seconds, 512 rows, H = 64,
#: V = 32000, forward + backward): native 0.28 s; chunks of 16 rows 0.22 s, 33 rows (4 MiB) 0.19 s, 128 rows 0.17 s.
MIN_CHUNK_BYTES = 4 << 20


def default_chunk_rows(rows: int, hidden_size: int, vocab_size: int) -> int:
    """The automatic chunk: its float32 logits take about as many bytes as the float32 hidden states of all rows
    (``rows * H / V`` rows, Liger-Kernel's rule: the head then costs about the size of its input), and at least
    :data:`MIN_CHUNK_BYTES`; never more than ``rows`` (at least 1).

    >>> default_chunk_rows(512, 64, 32000)   # the fewest rows whose float32 logits take 4 MiB
    33

    Args:
        rows: the rows of the call
        hidden_size: H
        vocab_size: V
    """
    by_input = -(-rows * hidden_size // max(vocab_size, 1))
    by_floor = -(-MIN_CHUNK_BYTES // (4 * max(vocab_size, 1)))
    return max(1, min(rows, max(by_input, by_floor)))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    logit_scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """One chunk's logits in the compute dtype (a fresh tensor: callers work on it in place)."""
    logits = F.linear(hidden, weight, bias)
    compute = _compute_dtype(hidden.dtype)
    logits = logits.to(compute) if logits.dtype != compute else logits
    if logit_scale != 1.0:
        logits.mul_(logit_scale)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits


def _chunks(rows: int, chunk_rows: int, hidden_size: int, vocab_size: int) -> tuple[range, int]:
    step = chunk_rows if chunk_rows > 0 else default_chunk_rows(rows, hidden_size, vocab_size)
    return range(0, rows, step), step


def _check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Every counted label is a class in [0, V) (one host synchronisation, as ``F.cross_entropy`` does on CPU)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if labels.numel() and bool(bad.any()):
        position = int(torch.nonzero(bad.reshape(-1))[0])
        raise FewBitError(
            f"lm_loss: label {int(labels.reshape(-1)[position])} at row {position} is not a class of the "
            f"vocabulary: labels must be in 0..{vocab_size - 1} or ignore_index ({ignore_index})"
        )


def _no_autocast_cache() -> None:
    """Why the ops run their bodies with autocast off (found while testing autocast).

    A custom op's body runs below autograd but still under an enclosing ``torch.autocast``: its ``F.linear`` would
    cast a float32 ``weight`` to the autocast dtype and *cache* that cast, made without autograd, in autocast's
    weight cache. A later ``F.linear`` of the same weight in the same autocast region (a tied embedding, an oracle
    loss) then reuses the cached copy and the weight silently gets no gradient from it. :func:`lm_loss` casts to the
    autocast dtype itself (with autograd, as ``F.linear`` would), and the bodies run with autocast off.
    """


@torch.library.custom_op("fewbit::lm_loss", mutates_args=())
def _lm_loss_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk_rows: int,
    ignore_index: int,
    reduction: str,
    logit_scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(hidden.device.type, enabled=False):  # see _no_autocast_cache
        return _lm_loss_forward(hidden, weight, bias, labels, chunk_rows, ignore_index, reduction, logit_scale, softcap)


def _lm_loss_forward(hidden, weight, bias, labels, chunk_rows, ignore_index, reduction, logit_scale, softcap):
    rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    _check_labels(labels, vocab_size, ignore_index)
    compute = _compute_dtype(hidden.dtype)
    lse = torch.empty(rows, dtype=compute, device=hidden.device)
    total = torch.zeros((), dtype=compute, device=hidden.device)
    starts, step = _chunks(rows, chunk_rows, hidden_size, vocab_size)
    for start in starts:
        stop = min(start + step, rows)
        logits = _chunk_logits(hidden[start:stop], weight, bias, logit_scale, softcap)
        chunk_lse = torch.logsumexp(logits, dim=1)
        lse[start:stop] = chunk_lse
        chunk_labels = labels[start:stop]
        counted = chunk_labels != ignore_index
        target = logits.gather(1, torch.where(counted, chunk_labels, 0).unsqueeze(1)).squeeze(1)
        del logits
        total += torch.where(counted, chunk_lse - target, 0).sum()
    if reduction == "mean":
        total = total / (labels != ignore_index).sum()
    return total, lse


@_lm_loss_op.register_fake
def _(hidden, weight, bias, labels, chunk_rows, ignore_index, reduction, logit_scale, softcap):
    compute = _compute_dtype(hidden.dtype)
    return hidden.new_empty((), dtype=compute), hidden.new_empty(hidden.shape[0], dtype=compute)


@torch.library.custom_op("fewbit::lm_loss_backward", mutates_args=())
def _lm_loss_backward_op(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    lse: torch.Tensor,
    chunk_rows: int,
    ignore_index: int,
    reduction: str,
    logit_scale: float,
    softcap: float | None,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(hidden.device.type, enabled=False):  # see _no_autocast_cache
        return _lm_loss_backward(
            grad_loss, hidden, weight, bias, labels, lse, chunk_rows, ignore_index, reduction, logit_scale, softcap,
            needs_grad,
        )  # fmt: skip


def _lm_loss_backward(
    grad_loss, hidden, weight, bias, labels, lse, chunk_rows, ignore_index, reduction, logit_scale, softcap, needs_grad
):
    needs_hidden, needs_weight, needs_bias = needs_grad
    rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    compute = lse.dtype
    counted_rows = labels != ignore_index
    row_grad = grad_loss.to(compute)
    if reduction == "mean":
        row_grad = row_grad / counted_rows.sum()
    # ignored rows get 0 (a select, not a product: their softmax times 0 would still be 0, and the mean over no
    # counted row, 1 / 0, never reaches a row)
    row_scale = torch.where(counted_rows, row_grad * logit_scale, torch.zeros((), dtype=compute, device=hidden.device))
    grad_hidden = torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0)
    grad_weight = torch.zeros(weight.shape, dtype=compute, device=weight.device) if needs_weight else None
    grad_bias = torch.zeros(vocab_size, dtype=compute, device=weight.device) if needs_bias else None
    starts, step = _chunks(rows, chunk_rows, hidden_size, vocab_size)
    for start in starts:
        stop = min(start + step, rows)
        chunk = hidden[start:stop]
        logits = _chunk_logits(chunk, weight, bias, logit_scale, softcap)
        # d softcap * tanh(z / softcap) / dz = 1 - (logits / softcap)^2, from the capped logits
        capped = (logits / softcap).square_().neg_().add_(1) if softcap is not None else None
        chunk_labels = labels[start:stop]
        counted = counted_rows[start:stop]
        # softmax - onehot (onehot only on counted rows), times the derivative of the cap
        grad_logits = logits.sub_(lse[start:stop].unsqueeze(1)).exp_()
        grad_logits.scatter_add_(
            1, torch.where(counted, chunk_labels, 0).unsqueeze(1), -counted.to(compute).unsqueeze(1)
        )
        if capped is not None:
            grad_logits.mul_(capped)
            del capped
        # times each row's share of the loss's gradient (and the logit scale): in float32 / float64 folded into the
        # small operands (chunk rows, grad_hidden rows) instead of a pass over the C x V chunk; 16-bit input scales
        # the chunk first, so that grad_hidden is rounded to its dtype once, as native autograd's is
        scale = row_scale[start:stop].unsqueeze(1)
        if compute != hidden.dtype:
            grad_logits.mul_(scale)
            scale = None
        if grad_bias is not None:
            grad_bias += grad_logits.sum(0) if scale is None else torch.mv(grad_logits.T, scale.squeeze(1))
        if grad_weight is not None:
            grad_weight.addmm_(grad_logits.T, chunk.to(compute) if scale is None else chunk * scale)
        if needs_hidden:
            # in the input dtype, as native autograd's matmul backward does (one rounding of each row's gradient)
            rows_out = grad_hidden[start:stop]
            torch.mm(grad_logits.to(hidden.dtype), weight, out=rows_out)
            if scale is not None:
                rows_out.mul_(scale)
    grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else weight.new_empty(0)
    grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else weight.new_empty(0)
    return grad_hidden, grad_weight, grad_bias


@_lm_loss_backward_op.register_fake
def _(grad_loss, hidden, weight, bias, labels, lse, chunk_rows, ignore_index, reduction, logit_scale, softcap, needs):
    needs_hidden, needs_weight, needs_bias = needs
    return (
        hidden.new_empty(hidden.shape) if needs_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if needs_weight else weight.new_empty(0),
        bias.new_empty(bias.shape) if needs_bias and bias is not None else weight.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, chunk_rows, ignore_index, reduction, logit_scale, softcap = inputs
    _, lse = output
    ctx.save_for_backward(hidden, weight, bias, labels, lse)
    ctx.options = (chunk_rows, ignore_index, reduction, logit_scale, softcap)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_loss, _grad_lse):
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]), bool(ctx.needs_input_grad[2])]
    if not any(needs):
        return None, None, None, None, None, None, None, None, None
    grad_hidden, grad_weight, grad_bias = torch.ops.fewbit.lm_loss_backward(
        grad_loss, hidden, weight, bias, labels, lse, *ctx.options, needs
    )
    return (
        grad_hidden if needs[0] else None,
        grad_weight if needs[1] else None,
        grad_bias if needs[2] else None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


_lm_loss_op.register_autograd(_backward, setup_context=_setup_context)
register_flops("lm_loss")(lambda arguments: 2.0 * rows(arguments["hidden"]) * arguments["weight"].numel())
# backward computes the logits again, then the hidden states' and the weight's gradients
register_flops("lm_loss_backward")(lambda arguments: 6.0 * rows(arguments["hidden"]) * arguments["weight"].numel())


def lm_loss_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """The same loss on the whole logits with native torch ops (the oracle): what a Hugging Face model computes.

    Args:
        hidden: hidden states (..., H)
        weight: the head's weight (V, H)
        labels: target ids (...)
        bias: the head's bias or None
        ignore_index: label value that takes no part
        reduction: ``'mean'`` or ``'sum'``
        logit_scale: logits are multiplied by it
        softcap: logits become ``softcap * tanh(logits / softcap)`` (None: no cap)
    """
    logits = F.linear(hidden, weight, bias).to(_compute_dtype(hidden.dtype)) * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(
        logits.reshape(-1, weight.shape[0]), labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )


def lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``linear(hidden, weight, bias)`` against ``labels``, computed a chunk of rows at a time.

    Equal to :func:`lm_loss_reference` (``F.cross_entropy`` of the whole logits, upcast to float32) up to rounding,
    with its gradients for ``hidden``, ``weight`` and ``bias``, but no N x V tensor is ever alive: see the module
    docstring. Returns the loss in float32 (float64 for float64 input).

    Args:
        hidden: (..., H) floating point (float32, float16, bfloat16 or float64).
        weight: (V, H), hidden's dtype and device; ``bias``: (V,) or None.
        labels: integer, ``hidden.shape[:-1]``; each a class in [0, V) or ``ignore_index``.
        chunk_rows: rows per chunk (default :func:`default_chunk_rows`).
        reduction: "mean" over the counted rows (NaN when there is none, as ``F.cross_entropy``) or "sum".
        logit_scale: factor on the logits; softcap: ``softcap * tanh(logits / softcap)`` after it, or None.

    Under ``torch.autocast`` the head's matmul runs in the autocast dtype, as the native ``F.linear`` would.
    """
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise FewBitError("lm_loss takes tensors: hidden (..., H) and weight (V, H)")
    device_type = hidden.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        # the head's linear in the autocast dtype, as F.linear runs there (custom ops are not autocast themselves)
        cast = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(cast), weight.to(cast)
        bias = bias.to(cast) if bias is not None else None
    if hidden.dtype not in SUPPORTED_DTYPES:
        raise FewBitError(f"lm_loss takes float32, float16, bfloat16 or float64 hidden states, got {hidden.dtype}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise FewBitError(
            f"lm_loss: weight must be (V, H) with H = hidden.shape[-1]; got hidden {tuple(hidden.shape)} and "
            f"weight {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise FewBitError(
            f"lm_loss: hidden, weight and bias must share a dtype, got {hidden.dtype}, {weight.dtype}"
            + (f", {bias.dtype}" if bias is not None else "")
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise FewBitError(f"lm_loss: bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype.is_complex:
        raise FewBitError(f"lm_loss: labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels))}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise FewBitError(
            f"lm_loss: labels {tuple(labels.shape)} must have the shape of hidden without its last dimension, "
            f"{tuple(hidden.shape[:-1])}"
        )
    check_choice("lm_loss reduction", reduction, REDUCTIONS)
    chunk = 0 if chunk_rows is None else check_integer("lm_loss chunk_rows", chunk_rows, low=1)
    ignore_index = check_integer("lm_loss ignore_index", ignore_index)
    scale = check_positive("lm_loss logit_scale", logit_scale)
    cap = None if softcap is None else check_positive("lm_loss softcap", softcap)
    loss, _ = torch.ops.fewbit.lm_loss(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        labels.reshape(-1).to(torch.int64),
        chunk,
        ignore_index,
        reduction,
        scale,
        cap,
    )
    return loss
