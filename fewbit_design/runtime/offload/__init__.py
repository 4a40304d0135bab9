"""Activation offloading: saved tensors leave memory in forward and come back, prefetched, in backward.

Owns: the ``saved_tensors`` context manager, the module form ``apply``, the cost model ``cost``. May import torch,
the project's errors, and its own modules; never scipy, matplotlib, numba or the CLI. Layout of the package:

* ``region``: ``saved_tensors`` (one offload region: a step's hooks around a block), its options, ``empty_cache``;
  ``modules``: ``apply`` (regions around chosen modules' forward) and its ``OffloadHandle``.
* ``schedule``: the ordering logic as pure functions (what to prefetch when, when a buffer may be reused, size
  classes); ``cost``: the planner's cost model; ``layout``: the bytes of a saved tensor and how to restore it.
* ``session``: the pack/unpack hooks of one step, driving a target; ``staging``: reused buffers for packs of small
  tensors; ``worker``: the background I/O thread.
* ``disk``: CPU tensors to a file (one per step); ``cuda``: CUDA tensors to pinned host buffers on side streams.

>>> import torch
>>> from fewbit_design.runtime import offload
>>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
>>> x = torch.randn(512, 256)
>>> with offload.saved_tensors(min_bytes=0) as stats:     # CPU tensors go to a file in the temp folder
...     loss = model(x).sum()
>>> loss.backward()                                        # read back (prefetched) during backward
>>> stats.tensors, stats.bytes      # x, and the ReLU output (saved by ReLU and the last Linear: one record)
(2, 1048576)

Targets: ``"disk"`` (CPU tensors), ``"cuda-host"`` (CUDA tensors, pinned host memory), ``"auto"`` (each tensor
to the target of its device). Tensors smaller than ``min_bytes``, parameters, leaf tensors that require grad and
views of them stay where they are; so do tensors past the ``max_host_bytes`` cap. Tensors smaller than
``pack_bytes`` are packed: those of one block (a ``with`` block, or one call of a module under ``apply``) go out in
one transfer through a reused staging buffer, so their size is no floor (``stats.transfers`` counts transfers).
"""

from .cost import Cost, cost
from .modules import OffloadHandle, apply
from .region import TARGETS, empty_cache, saved_tensors
from .session import Stats

__all__ = ["saved_tensors", "apply", "cost", "Cost", "Stats", "OffloadHandle", "empty_cache", "TARGETS"]
