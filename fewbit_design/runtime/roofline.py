"""A roofline time model: every operator run inside :func:`roofline` costs the longer of its arithmetic at the
device's peak FLOP/s and its memory traffic at the device's bandwidth, summed over the operators (forward, backward,
recomputation alike). Works on fake tensors (``FakeTensorMode``): shapes are all it reads.

* FLOPs: ``torch.utils.flop_counter``'s formulas (matrix products, convolutions, attention), and for the project's
  custom ops (opaque on fake tensors) the matrix products and attention they run (:func:`custom_op_flops`); other
  operators count none (elementwise work is memory-bound on every device of :mod:`.devices`).
* Bytes: each operator reads its tensor inputs and writes its outputs once (``numel x element size``); views and
  in-place results of an input move nothing new beyond what they read. The project's custom ops count their inputs
  and outputs too.
* Rates: the 16-bit FLOP/s for operators whose output is 16-bit, the float32 rate otherwise.

The sum is a *predicted* time, a lower bound (peaks are not reached; kernels are not fused as assumed; launch
overhead, communication and the optimizer step are not in it). Ratios between two variants of one model are what it
is meant for.

>>> import torch
>>> from fewbit_design.runtime.devices import device
>>> with roofline(device("h100-80gb")) as cost:
...     y = torch.randn(64, 64) @ torch.randn(64, 64)
>>> cost.flops
524288.0
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from .devices import Device

__all__ = ["RooflineCost", "roofline", "custom_op_flops"]

_FREE = {
    torch.ops.aten.detach.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int,
    torch.ops.aten.alias.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.unbind.int,
    torch.ops.aten.lift_fresh.default,
}


_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
#: SDPA's CPU flash kernel, which torch's formulas leave out: (query, key, value) forward, (grad, query, key, value)
#: backward
_CPU_FLASH = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop_count,
    _CPU_BACKWARD: sdpa_backward_flop_count,
}


@dataclass
class RooflineCost:
    """What :func:`roofline` counted: ``flops``, ``bytes`` moved, ``seconds`` (the sum of each operator's
    ``max(flops / FLOP/s, bytes / bandwidth)``) and ``operators`` counted."""

    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    operators: int = 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _rows(tensor: torch.Tensor) -> int:
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


def _attention_flops(arguments: dict, backward: bool) -> float:
    """SDPA's FLOPs (torch's formulas) for q (B, H, S, D) and k, v at their key/value heads (repeated to H), and
    in backward the value projection a recomputing core runs again."""
    q, k, v = (_shape(arguments, name) for name in ("q", "k", "v"))
    if q is None or k is None or v is None:
        return 0.0
    k, v = [*q[:2], *k[2:]], [*q[:2], *v[2:]]
    if not backward:
        return float(sdpa_flop_count(q, k, v))
    flops = float(sdpa_backward_flop_count([*q[:3], v[-1]], q, k, v))
    x, weight = arguments.get("x"), arguments.get("weight")
    if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor):
        flops += 2.0 * _rows(x) * weight.numel()
    return flops


def custom_op_flops(name: str, arguments: dict) -> float:
    """The matrix-product and attention FLOPs of the project's custom op ``name`` (``fewbit::...``) called with
    ``arguments`` (by the schema's names); 0 for the others (elementwise: memory-bound).

    Args:
        name: the op's name without its namespace (``compressed_linear``)
        arguments: its arguments by name
    """
    backward = name.endswith("_backward")
    if "attention" in name:
        return _attention_flops(arguments, backward)
    if name == "compressed_linear":
        return 2.0 * _rows(arguments["x"]) * arguments["weight"].numel()
    weights = [arguments.get(key) for key in ("w_gate", "w_up", "w_down", "weight")]
    size = sum(w.numel() for w in weights if isinstance(w, torch.Tensor))
    rows = next((_rows(arguments[k]) for k in ("x", "grad", "hidden") if isinstance(arguments.get(k), torch.Tensor)), 0)
    if name.startswith("gated_mlp"):
        flops = (4.0 if backward else 2.0) * rows * size
        if name == "gated_mlp_recompute_backward":  # gate and up again, from x's codes
            flops += 2.0 * rows * sum(w.numel() for w in weights[:2] if isinstance(w, torch.Tensor))
        return flops
    if name.startswith("lm_loss"):  # the chunked head computes its logits again in backward
        return (6.0 if backward else 2.0) * rows * size
    return 0.0


class _RooflineMode(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self, device: Device, cost: RooflineCost) -> None:
        super().__init__()
        self.device, self.cost = device, cost

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FREE or not isinstance(func, torch._ops.OpOverload) or func.namespace == "prim":
            return out  # (prim: metadata such as a tensor's device)
        packet = func.overloadpacket
        flops = 0.0
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        elif packet in _CPU_FLASH:  # the CPU kernel fake tensors on "cpu" trace: a GPU runs the same attention
            flops = float(_CPU_FLASH[packet](*(list(t.shape) for t in args[: 3 + (packet is _CPU_BACKWARD)])))
        elif func.namespace == "fewbit":
            names = [argument.name for argument in func._schema.arguments][: len(args)]
            arguments = {**dict(zip(names, args, strict=True)), **kwargs}
            flops = custom_op_flops(func._schema.name.split("::")[-1], arguments)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        moved = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
        dtype = str(outputs[0].dtype).removeprefix("torch.") if outputs else "float32"
        cost = self.cost
        cost.flops += flops
        cost.bytes += moved
        cost.seconds += max(flops / self.device.flops(dtype), moved / self.device.memory_bandwidth)
        cost.operators += 1
        return out


@contextmanager
def roofline(device: Device) -> Iterator[RooflineCost]:
    """Count the operators run inside the block on ``device``'s roofline (module docstring); the result fills in as
    they run.

    Args:
        device: the device whose peak FLOP/s and bandwidth price each operator
    """
    cost = RooflineCost()
    with _RooflineMode(device, cost):
        yield cost
