"""FLOP formulas of the project's custom ops, which are opaque to torch (a fake tensor runs their fake kernel, not
their products): each technique registers, beside its ops, the matrix products and attention they run, and
:func:`~.roofline.roofline` counts them. Elementwise ops need none (memory-bound on every device). Light to import
(the ops modules import it): ``torch.utils.flop_counter`` loads only when an attention formula runs."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["FORMULAS", "register_flops", "rows", "attention_flops"]

#: op name with its namespace (``"fewbit::compressed_linear"``) -> formula(arguments by schema name) -> FLOPs
FORMULAS: dict[str, Callable[[dict], float]] = {}


def register_flops(*names: str) -> Callable[[Callable[[dict], float]], Callable[[dict], float]]:
    """Decorator: ``formula(arguments) -> FLOPs`` counts the matrix products and attention of the custom ops
    ``fewbit::<name>``, called with the op's arguments by their schema names.

    Args:
        names: the ops' names without their namespace (``"compressed_linear"``)
    """

    def register(formula: Callable[[dict], float]) -> Callable[[dict], float]:
        for name in names:
            FORMULAS[f"fewbit::{name}"] = formula
        return formula

    return register


def rows(tensor: torch.Tensor) -> int:
    """The rows of ``tensor`` (its elements over its last dimension): the M of the matrix products it enters."""
    return tensor.numel() // max(tensor.shape[-1], 1) if tensor.dim() else 1


def _shape(arguments: dict, name: str) -> list[int] | None:
    value = arguments.get(name)
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    for key in (f"{name}_shape", f"{name}_size"):
        value = arguments.get(key)
        if isinstance(value, list | tuple):
            return [int(size) for size in value]
    return None


def attention_flops(arguments: dict, backward: bool = False) -> float:
    """SDPA's FLOPs (torch's formulas) for q (B, H, S, D) and k, v at their key/value heads (repeated to H), and
    in backward the value projection a recomputing core runs again (``x`` and ``weight``). q, k and v are tensors
    or their shapes (``q_shape``, ``v_size``)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count  # (it loads triton)

    q, k, v = (_shape(arguments, name) for name in ("q", "k", "v"))
    if q is None or k is None or v is None:
        return 0.0
    k, v = [*q[:2], *k[2:]], [*q[:2], *v[2:]]
    if not backward:
        return float(sdpa_flop_count(q, k, v))
    flops = float(sdpa_backward_flop_count([*q[:3], v[-1]], q, k, v))
    x, weight = arguments.get("x"), arguments.get("weight")
    if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor):
        flops += 2.0 * rows(x) * weight.numel()
    return flops
