"""What a saved tensor is, apart from its bytes: :class:`Layout`, and the byte span that holds it.

A saved tensor may be a view (non-contiguous, channels_last, transposed, expanded with stride 0, offset into a
larger storage). Only the **span** of its storage that its elements can reach is moved: from the first element to
the last, ``1 + sum((size - 1) * stride)`` elements. It is restored with the same sizes, strides, dtype and
conjugate/negative bits at storage offset 0 of a fresh storage, so autograd sees the tensor it saved, bit for
bit (a zero-size tensor moves no bytes). Needs torch; imports nothing else from the project.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Layout", "describe", "raw_bytes", "restore"]


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

    @property
    def nbytes(self) -> int:
        return self.span * self.itemsize


def describe(tensor: torch.Tensor) -> Layout:
    """The :class:`Layout` of a strided tensor."""
    size, stride = tuple(tensor.shape), tuple(tensor.stride())
    span = 0 if tensor.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    return Layout(size, stride, tensor.dtype, span, tensor.element_size(), tensor.is_conj(), tensor.is_neg())


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
    tensor = typed.as_strided(layout.size, layout.stride, typed.storage_offset())  # offset is absolute
    if layout.conj:
        tensor = tensor.conj()
    if layout.neg:
        tensor = torch._neg_view(tensor)
    return tensor
