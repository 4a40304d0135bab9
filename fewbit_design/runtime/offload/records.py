"""What the offload hooks hand to autograd: the records of written tensors (:class:`_Record`, :class:`_Pack` of
small tensors, and the :class:`_Member` and :class:`_View` objects that point into them) and the step's
:class:`Stats`. Plain data, used by :mod:`.session`."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .layout import Layout

__all__ = ["Stats"]


@dataclass
class Stats:
    """What a step offloaded: ``tensors``/``bytes`` moved out (packed small tensors included), ``kept_tensors``/
    ``kept_bytes`` left in place by the cap (``max_host_bytes``), ``transfers`` the writes issued (one per large
    tensor, one per pack of small ones), ``largest_transfer`` the bytes of the largest; tensors under
    ``min_bytes``, parameters and leaves are not counted, and a tensor saved twice, or several views of one
    storage written once as that storage (the synchronous path), count once."""

    tensors: int = 0
    bytes: int = 0
    kept_tensors: int = 0
    kept_bytes: int = 0
    transfers: int = 0
    largest_transfer: int = 0


class _Record:
    __slots__ = (
        "position",
        "target",
        "location",
        "layout",
        "uses",
        "served",
        "kept",
        "fetch",
        "write",
        "alias",
        "version",
        "poisoned",
        "block",
        "__weakref__",
    )

    def __init__(self, position: int, target: Any, layout: Layout) -> None:
        self.position = position
        self.target = target
        self.location: Any = None
        self.layout = layout
        self.uses = 1
        self.served = 0
        self.kept: torch.Tensor | None = None
        self.fetch: Any = None
        self.write: Any = None
        self.alias: torch.Tensor | None = None
        self.version = 0
        self.poisoned: str | None = None
        self.block = 0  # the block (region entry) that wrote it: blockwise sessions prefetch within a block


class _Pack(_Record):
    """A record whose bytes are the packed small tensors of one block. Before its flush ``members`` holds weak
    references to its members (the tensors are still in memory); after it, ``kept`` holds the bytes read back
    while members remain to be served (``remaining`` of ``uses``, all members' uses together)."""

    __slots__ = ("members", "nbytes", "lease", "remaining")

    def __init__(self, target: Any) -> None:
        super().__init__(-1, target, Layout((0,), (1,), torch.uint8, 0, 1))
        self.uses = 0
        self.members: list[weakref.ref] = []
        self.nbytes = 0  # bytes of the pack so far, members aligned
        self.lease: Any = None  # the staging buffer's lease (CPU pool) while its write is in flight
        self.remaining = 0


class _Member:
    """What pack returns for a packed small tensor: its pack, where its bytes lie in it, and (until the flush, or
    for good when the cap kept the pack in memory) the tensor itself."""

    __slots__ = ("pack", "offset", "layout", "uses", "alias", "version", "poisoned", "__weakref__")

    def __init__(self, pack: _Pack, offset: int, layout: Layout, tensor: torch.Tensor) -> None:
        self.pack = pack
        self.offset = offset
        self.layout = layout
        self.uses = 1
        self.alias: torch.Tensor | None = tensor.detach()
        self.version = tensor._version
        self.poisoned: str | None = None


class _View:
    """What pack returns on the synchronous path for a tensor whose whole storage went to the target as one record
    (see :meth:`Session._pack_now`): the record, shared by every saved view of that storage with the same version,
    and the tensor's layout and storage offset in it."""

    __slots__ = ("record", "offset", "layout", "__weakref__")

    def __init__(self, record: _Record, offset: int, layout: Layout) -> None:
        self.record = record
        self.offset = offset
        self.layout = layout


class _RecordRef(weakref.ref):
    """The session's weak reference to a record; what the target must release once the record is freed."""

    __slots__ = ("position", "target", "location")
