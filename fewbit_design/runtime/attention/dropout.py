"""Attention with dropout on the probabilities, whose mask is drawn from a seed and drawn again in backward: what the
exact and the compressed attention cores compute when the model's attention dropout is on (pure torch, any device).

Terms. ``q`` (B, H, S, D); ``k`` and ``v`` (B, H_kv, S_kv, D) at the key/value heads, never repeated in memory
(``repeat = H / H_kv`` query heads per key/value head, grouped as Hugging Face's ``repeat_kv`` groups them); ``p`` the
dropout probability; a mask (boolean, True = attend, or additive float, broadcastable to (B, H, S, S_kv)) or
``is_causal`` (upper-left, as SDPA). ``seed`` is an int64 drawn from torch's default generator of the tensors'
device (:func:`draw_seed`, as torch's own dropout draws there), so ``torch.manual_seed`` makes runs reproducible;
it is all the randomness a core keeps for backward (8 bytes).

The keep mask (:func:`dropout_keep`): for batch b and query head h, ``bernoulli(1 - p)`` of shape (S, S_kv) from a
fresh generator of the device seeded with ``seed + b * H + h``; any head can be drawn alone, so forward and backward
draw the same bits in the same blocks. On CUDA that generator is torch's Philox generator of the device (seed,
offset 0), and the cores read the seed to the host once per call; the CUDA path has not run on a GPU.

Formula, native SDPA's math path with a dropout mask (computed in float32, float64 for float64 inputs):
``P = softmax(q k^T scale + mask)`` (a row whose every key is masked: zeros), ``P~ = P * keep / (1 - p)``,
``O = P~ v``; backward ``dV = P~^T g``, ``dP = (g v^T) * keep / (1 - p)``, ``dS = P (dP - rowsum(P dP))``,
``dQ = dS k scale``, ``dK = dS^T q scale``, key/value gradients summed over the query heads of each group. Both
directions run in blocks of one batch element and whole key/value-head groups, at most :data:`BLOCK_ELEMENTS`
scores at once: the S x S temporaries exist only inside a block, and nothing of that size is kept.
"""

from __future__ import annotations

import torch

from ...errors import FewBitError, check_number

__all__ = ["draw_seed", "dropout_keep", "dropout_attention_forward", "dropout_attention_backward", "BLOCK_ELEMENTS"]

#: the most scores (S x S_kv elements over a block's heads) computed at once; a block holds at least one group
BLOCK_ELEMENTS = 1 << 24
#: seeds are drawn below this bound, so that ``seed + b * H + h`` stays a valid int64 generator seed
SEED_BOUND = 1 << 62


def draw_seed(device: torch.device | str) -> torch.Tensor:
    """A 0-d int64 seed drawn from torch's default generator of ``device`` (a graph input under ``torch.compile``,
    never a constant baked into it).

    Args:
        device: the attention tensors' device
    """
    return torch.randint(0, SEED_BOUND, (), dtype=torch.int64, device=device)


def check_probability(p: object) -> float:
    """The dropout probability as a float in [0, 1), or one :class:`FewBitError`.

    Args:
        p: the value to check
    """
    probability = check_number("attention dropout probability", p, low=0.0)
    if probability >= 1.0:
        raise FewBitError(f"attention dropout probability must be in [0, 1), got {probability:g}")
    return probability


def _keep_heads(seed: int, first: int, count: int, rows: int, columns: int, p: float, device) -> torch.Tensor:
    """Keep masks (count, rows, columns) of the consecutive (batch, query head) pairs ``first .. first + count - 1``
    (pair index ``b * H + h``), each from its own seeded generator (module docstring)."""
    keep = torch.empty((count, rows, columns), dtype=torch.bool, device=device)
    generator = torch.Generator(device=device)
    for index in range(count):
        generator.manual_seed(seed + first + index)
        keep[index].bernoulli_(1.0 - p, generator=generator)
    return keep


def dropout_keep(seed: int, shape: tuple[int, int, int, int], p: float, device: torch.device | str) -> torch.Tensor:
    """The whole keep mask the cores draw for ``seed``: boolean (B, H, S, S_kv), True where a probability is kept.

    Args:
        seed: the seed the core drew (``int`` of :func:`draw_seed`'s tensor)
        shape: (B, H, S, S_kv): batch, query heads, queries, keys
        p: the dropout probability
        device: where to draw
    """
    batch, heads, rows, columns = shape
    return _keep_heads(seed, 0, batch * heads, rows, columns, p, device).view(batch, heads, rows, columns)


def _blocks(batch: int, kv_heads: int, repeat: int, rows: int, columns: int):
    """``(b, first, last)``: batch element and key/value-head range of each block, in order."""
    step = max(1, min(kv_heads, BLOCK_ELEMENTS // max(1, repeat * rows * columns)))
    for b in range(batch):
        for first in range(0, kv_heads, step):
            yield b, first, min(kv_heads, first + step)


class _Grouped:
    """q, the mask and the output gradient seen as (B, H_kv, repeat, ...) (views, no copy), and the shapes."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> None:
        self.batch, self.heads, self.rows, _ = q.shape
        self.kv_heads, self.columns = k.shape[1], k.shape[2]
        self.repeat = self.heads // self.kv_heads
        self.compute = torch.promote_types(q.dtype, torch.float32)  # float32, float64 for float64 inputs
        self.q = q.unflatten(1, (self.kv_heads, self.repeat))
        self.mask = None
        if mask is not None:
            self.mask = mask.expand(self.batch, self.heads, self.rows, self.columns)
            self.mask = self.mask.unflatten(1, (self.kv_heads, self.repeat))

    def blocks(self):
        return _blocks(self.batch, self.kv_heads, self.repeat, self.rows, self.columns)

    def probabilities(self, q_block, k_block, b, first, last, factor, is_causal) -> torch.Tensor:
        """``softmax(q k^T scale + mask)`` of one block: (heads, repeat, S, S_kv), rows without keys zero."""
        scores = torch.matmul(q_block, k_block.transpose(-2, -1)).mul_(factor)
        if is_causal:
            above = torch.ones(self.rows, self.columns, dtype=torch.bool, device=scores.device).triu_(1)
            scores.masked_fill_(above, float("-inf"))
        if self.mask is not None:
            mask = self.mask[b, first:last]
            if mask.dtype == torch.bool:
                scores.masked_fill_(mask.logical_not(), float("-inf"))
            else:
                scores.add_(mask.to(self.compute))
        return torch.softmax(scores, dim=-1).nan_to_num_(0.0)

    def keep(self, seed: int, b: int, first: int, last: int, p: float, device) -> torch.Tensor:
        """The block's keep mask, (heads, repeat, S, S_kv)."""
        start, count = b * self.heads + first * self.repeat, (last - first) * self.repeat
        keep = _keep_heads(seed, start, count, self.rows, self.columns, p, device)
        return keep.view(last - first, self.repeat, self.rows, self.columns)


def dropout_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seed: int,
    p: float,
    scale: float | None,
    is_causal: bool,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention output ``P~ v`` (module docstring) in q's dtype, (B, H, S, D_v).

    Args:
        q: queries (B, H, S, D)
        k: keys (B, H_kv, S_kv, D)
        v: values (B, H_kv, S_kv, D_v)
        mask: boolean (True = attend) or additive float mask broadcastable to (B, H, S, S_kv), or None
        seed: the seed of the keep mask (:func:`dropout_keep`)
        p: the dropout probability, in [0, 1)
        scale: the score scale, None for 1 / sqrt(D)
        is_causal: upper-left causal mask (as SDPA)
        out: the tensor to write the output into (any layout), or None for a new contiguous one
    """
    grouped = _Grouped(q, k, mask)
    factor = scale if scale is not None else q.shape[-1] ** -0.5
    if out is None:
        out = q.new_empty((*q.shape[:3], v.shape[-1]))
    heads = out.unflatten(1, (grouped.kv_heads, grouped.repeat))
    for b, first, last in grouped.blocks():
        q_block = grouped.q[b, first:last].to(grouped.compute)
        k_block, v_block = (t[b, first:last, None].to(grouped.compute) for t in (k, v))
        dropped = grouped.probabilities(q_block, k_block, b, first, last, factor, is_causal)
        dropped.mul_(grouped.keep(seed, b, first, last, p, q.device)).mul_(1.0 / (1.0 - p))
        heads[b, first:last].copy_(torch.matmul(dropped, v_block))
    return out


def dropout_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seed: int,
    p: float,
    scale: float | None,
    is_causal: bool,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`dropout_attention_forward` for the output gradient ``grad``, with the forward's keep
    mask drawn again from ``seed`` (arguments as there); results in the inputs' dtypes.

    Args:
        grad: gradient of the output, (B, H, S, D_v)
        out: the three tensors to write the gradients into (any layout), or None for new contiguous ones
    """
    grouped = _Grouped(q, k, mask)
    factor = scale if scale is not None else q.shape[-1] ** -0.5
    if out is None:
        out = (torch.empty_like(q, memory_format=torch.contiguous_format), k.new_empty(k.shape), v.new_empty(v.shape))
    grad_q, grad_k, grad_v = out
    grad_q_heads = grad_q.unflatten(1, (grouped.kv_heads, grouped.repeat))
    grad_heads = grad.unflatten(1, (grouped.kv_heads, grouped.repeat))
    for b, first, last in grouped.blocks():
        q_block = grouped.q[b, first:last].to(grouped.compute)
        k_block, v_block = (t[b, first:last, None].to(grouped.compute) for t in (k, v))
        g = grad_heads[b, first:last].to(grouped.compute)
        probabilities = grouped.probabilities(q_block, k_block, b, first, last, factor, is_causal)
        keep = grouped.keep(seed, b, first, last, p, q.device)
        dropped = probabilities.mul(keep).mul_(1.0 / (1.0 - p))
        grad_v[b, first:last].copy_(torch.matmul(dropped.transpose(-2, -1), g).sum(1))
        del dropped
        # dP = (g v^T) * keep / (1 - p); dS = P (dP - rowsum(P dP)) scale: the softmax Jacobian
        grad_s = torch.matmul(g, v_block.transpose(-2, -1)).mul_(keep).mul_(1.0 / (1.0 - p))
        grad_s.sub_((grad_s * probabilities).sum(-1, keepdim=True)).mul_(probabilities).mul_(factor)
        del probabilities, keep
        grad_q_heads[b, first:last].copy_(torch.matmul(grad_s, k_block))
        grad_k[b, first:last].copy_(torch.matmul(grad_s.transpose(-2, -1), q_block).sum(1))
    return grad_q, grad_k, grad_v
