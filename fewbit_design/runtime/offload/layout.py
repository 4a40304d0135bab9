"""What a saved tensor is, apart from its bytes: :class:`Layout`, and the byte span that holds it.

A saved tensor may be a view (non-contiguous, channels_last, transposed, expanded with stride 0, offset into a
larger storage). Only the **span** of its storage that its elements can reach is moved: from the first element to
the last, ``1 + sum((size - 1) * stride)`` elements. It is restored with the same sizes, strides, dtype and
conjugate/negative bits at storage offset 0 of a fresh storage, so autograd sees the tensor it saved, bit for
bit (a zero-size tensor moves no bytes). Needs torch; imports nothing else from the project.

The synchronous disk path (a step offloads hundreds of tensors, so the hooks' Python can be most of the cost)
moves the bytes without a torch view: :func:`address_bytes` is a ``memoryview`` of a CPU tensor's span at its
address, and :func:`empty` allocates the restored tensor itself (sizes, strides, dtype; its storage is exactly the
span), so a read goes straight into it. Layouts are cached per (sizes, strides, dtype, flags).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

__all__ = ["Layout", "describe", "raw_bytes", "restore", "empty", "with_flags", "address_bytes"]


@dataclass(frozen=True)
class Layout:
    """Sizes, strides, dtype and flags of a saved tensor; ``nbytes`` is the size of its storage span."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    span: int
    itemsize: int
    conj: bool = False
    neg: bool = False
    nbytes: int = field(init=False, repr=False, compare=False)  # ``span * itemsize`` (read once per hook or more)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", self.span * self.itemsize)


_LAYOUTS: dict[tuple, Layout] = {}  # (sizes, strides, dtype, conj, neg) -> its Layout (a model has a few dozen)
_MAX_LAYOUTS = 4096  # (cleared when full: shapes that change every step never grow it without bound)


def describe(tensor: torch.Tensor) -> Layout:
    """The :class:`Layout` of a strided tensor."""
    key = (tensor.shape, tensor.stride(), tensor.dtype, tensor.is_conj(), tensor.is_neg())
    layout = _LAYOUTS.get(key)
    if layout is None:
        size, stride = tuple(key[0]), key[1]
        span = 0 if tensor.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        layout = Layout(size, stride, key[2], span, tensor.element_size(), key[3], key[4])
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


def raw_bytes(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A 1-D uint8 view (no copy) of the bytes of ``tensor``'s storage span; it keeps that storage alive."""
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    if layout.nbytes == 0:
        return raw
    with torch.no_grad():
        raw.set_(tensor.untyped_storage(), tensor.storage_offset() * layout.itemsize, (layout.nbytes,), (1,))
    return raw


def restore(raw: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The tensor described by ``layout`` over the bytes ``raw`` (1-D uint8 holding exactly its span)."""
    assert raw.dtype == torch.uint8 and raw.numel() == layout.nbytes, (raw.shape, layout)
    if layout.nbytes == 0:
        typed = torch.empty(0, dtype=layout.dtype, device=raw.device)
    else:
        typed = raw.view(layout.dtype)
    return with_flags(typed.as_strided(layout.size, layout.stride, typed.storage_offset()), layout)  # (absolute)


def empty(layout: Layout, device: torch.device | str = "cpu") -> torch.Tensor:
    """A new tensor with ``layout``'s sizes, strides and dtype whose storage is exactly its span (at offset 0, as
    :func:`restore` makes it), its flags not applied yet: fill its bytes, then :func:`with_flags`."""
    return torch.empty_strided(layout.size, layout.stride, dtype=layout.dtype, device=device)


def with_flags(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``tensor`` (from :func:`empty`) as the saved tensor: with its conjugate and negative bits."""
    if layout.conj:
        tensor = tensor.conj()
    if layout.neg:
        tensor = torch._neg_view(tensor)
    return tensor


_CHARS: dict[int, type] = {}  # byte count -> ctypes array type (a model saves a few dozen distinct sizes)


def address_bytes(address: int, nbytes: int) -> memoryview:
    """A writable ``memoryview`` of ``nbytes`` (> 0) bytes of host memory at ``address`` (a CPU tensor's
    ``data_ptr()``). No torch view is made and nothing is kept alive: only for a call that ends while the caller
    holds the memory (a synchronous ``os.pwrite``/``os.preadv``)."""
    chars = _CHARS.get(nbytes)
    if chars is None:
        if len(_CHARS) >= _MAX_LAYOUTS:
            _CHARS.clear()
        chars = _CHARS[nbytes] = ctypes.c_char * nbytes
    return memoryview(chars.from_address(address))
