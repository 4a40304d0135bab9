"""A roofline time model: every operator run inside :func:`roofline` costs the longer of its arithmetic at the
device's peak FLOP/s and its memory traffic at the device's bandwidth, summed over the operators (forward, backward,
recomputation alike). Works on fake tensors (``FakeTensorMode``): shapes are all it reads.

* FLOPs: ``torch.utils.flop_counter``'s formulas (matrix products, convolutions, attention), and for the project's
  custom ops (opaque on fake tensors) the matrix products and attention they run, registered beside each op
  (:func:`~.flops.register_flops`); other operators count none (elementwise work is memory-bound on every device of
  :mod:`.devices`).
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
from .flops import FORMULAS

__all__ = ["RooflineCost", "roofline"]

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
        elif func._schema.name in FORMULAS:  # the project's custom ops (fewbit::...): opaque to torch
            names = [argument.name for argument in func._schema.arguments]
            flops = float(FORMULAS[func._schema.name]({**dict(zip(names, args, strict=False)), **kwargs}))
        elif packet in _CPU_FLASH:  # the CPU kernel fake tensors on "cpu" trace: a GPU runs the same attention
            flops = float(_CPU_FLASH[packet](*(list(t.shape) for t in args[: 3 + (packet is _CPU_BACKWARD)])))
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
