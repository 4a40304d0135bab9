"""Exact accounting of the bytes saved for the backward pass.

Every tensor that autograd saves for backward goes through ``torch.autograd.graph.saved_tensors_hooks``;
this module counts those tensors' storages once each (de-duplicated by storage), leaving out parameters and,
when a model is given, its buffers. Leaf tensors that require grad (parameters, or inputs the caller created with
``requires_grad=True``) are left out too: the caller keeps them alive whether or not autograd saves them, so they
are not memory that backward costs. It is how memory claims are measured on a machine without a GPU.

>>> import torch
>>> from fewbit_design.runtime import memory
>>> x = torch.randn(1000, requires_grad=True)
>>> with memory.saved_bytes() as m:
...     y = torch.sigmoid(x * 2)       # mul saves nothing of x's storage (x is a leaf), sigmoid saves its output
>>> m.total
4000
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["SavedBytes", "saved_bytes", "storage_key"]


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """An identifier of the storage behind ``tensor`` (device and base address)."""
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr())


def _storage_nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().nbytes())


@dataclass
class SavedBytes:
    """What :func:`saved_bytes` measured.

    Attributes:
        total: bytes of the distinct storages saved for backward (parameters and buffers excluded).
        by_module: bytes per module qualified name ("" is the model itself), attributed to the innermost module
            running when the tensor was saved; only filled when a model was given.
        tensors: number of distinct storages counted.
    """

    total: int = 0
    by_module: dict[str, int] = field(default_factory=dict)
    tensors: int = 0
    _seen: dict[tuple[str, int], int] = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        return f"{self.total} bytes saved for backward in {self.tensors} storages"


@contextmanager
def saved_bytes(model: torch.nn.Module | None = None) -> Iterator[SavedBytes]:
    """Count the bytes saved for backward by everything run inside the block.

    Args:
        model: optional module; its parameters and buffers are excluded, and bytes are attributed to its
            submodules in ``by_module``.
    """
    result = SavedBytes()
    excluded: set[tuple[str, int]] = set()
    stack: list[str] = []
    handles = []
    if model is not None:
        for tensor in list(model.parameters()) + list(model.buffers()):
            excluded.add(storage_key(tensor))
        by_module: defaultdict[str, int] = defaultdict(int)
        for name, module in model.named_modules():

            def pre_hook(_module, _inputs, _name=name):
                stack.append(_name)

            def post_hook(_module, _inputs, _outputs, _name=name):
                if stack and stack[-1] == _name:
                    stack.pop()

            handles.append(module.register_forward_pre_hook(pre_hook))
            handles.append(module.register_forward_hook(post_hook, always_call=True))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
            return tensor
        try:
            key = storage_key(tensor)
        except (RuntimeError, NotImplementedError):  # tensors without storage (fake, functional wrappers)
            return tensor
        if key in excluded or key in result._seen:
            return tensor
        nbytes = _storage_nbytes(tensor)
        result._seen[key] = nbytes
        result.total += nbytes
        result.tensors += 1
        if model is not None:
            by_module[stack[-1] if stack else ""] += nbytes
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield result
    finally:
        for handle in handles:
            handle.remove()
        if model is not None:
            result.by_module = dict(by_module)
