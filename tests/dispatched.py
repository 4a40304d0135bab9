"""A dispatch recorder for tests that count what an op runs below autograd (passes over memory, fresh tensors)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Dispatched(TorchDispatchMode):
    """Records (op name, output element counts) of every op dispatched below autograd, views left out (a view is no
    pass over memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, tuple | list) else (out,)
        if not func.is_view:
            self.calls.append((str(func), [o.numel() for o in outputs if isinstance(o, torch.Tensor)]))
        return out
