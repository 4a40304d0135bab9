"""Reversible and layer-wise invertible networks: activations recomputed from outputs during backward.

Terms used in this module:

* **invertible module**: an ``nn.Module`` with ``forward(x)`` and an ``inverse(y)`` that gives ``x`` back from
  ``y = forward(x)`` (exactly in real arithmetic; up to rounding in floating point). All of them derive from
  :class:`InvertibleModule`.
* **coupling**: :class:`AdditiveCoupling` (RevNet, Gomez et al. 2017): ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``
  with ``x`` split in two halves; ``f`` and ``g`` are arbitrary (not necessarily invertible) modules.
* **layer-wise invertible layer** (section 4.2 of Hascoet et al., "Reversible designs for extreme memory cost
  reduction of CNN training", 2023): :class:`InvertibleBatchNorm2d`, :class:`InvertibleLeakyReLU`,
  :class:`InvertibleConv2d` (a coupling of two half-channel convolutions), :class:`ChannelPool2d` and
  :class:`BatchPool2d` (2x2 spatial blocks stacked into channels or into the batch).
* **reversible sequence**: :class:`ReversibleSequence` runs invertible blocks and keeps only its output (plus a
  few per-channel statistics and RNG states) for backward; in backward it walks the blocks from the last to the
  first, reconstructing each block's input from its output and back-propagating through that block alone.

Architectures: :func:`revnet` (couplings whose ``f``, ``g`` are BN-ReLU-conv stacks), :func:`layerwise_net`
(every layer inverted, section 4.3), :func:`hybrid_net` (couplings whose ``f``, ``g`` are layer-wise invertible
chains, section 4.4) and :func:`resnet` (a plain residual network of similar size: the memory baseline). Each
builder takes ``reconstruct=False`` to store everything with plain autograd (the oracle of tests and
benchmarks). The couplings of :func:`revnet` and :func:`hybrid_net` scale their branches by
``branch_scale = 1 / depth`` by default, which keeps the reconstruction error from growing with depth (see
:func:`hybrid_net`).

How backward works (the contract that the tests check):

* A custom ``torch.autograd.Function`` takes the sequence input and *all* parameters of the sequence as explicit
  inputs, runs the blocks under ``no_grad`` and saves the output (and the small per-block state) with
  ``ctx.save_for_backward``, so :func:`fewbit_design.runtime.memory.saved_bytes` sees exactly what is kept.
* Its backward never calls a nested ``.backward()``: each block recomputes its forward from the reconstructed
  input under ``enable_grad`` and takes a vector-Jacobian product with ``torch.autograd.grad``.
* BatchNorm running statistics update once per training step: the recomputation in backward runs with
  ``track_running_stats`` switched off on every BatchNorm module in training mode (which makes
  ``F.batch_norm`` use batch statistics without touching the buffers), then switched back on.
* Random ops (dropout) are replayed: a block containing a random module saves the CPU RNG state (and the CUDA
  RNG state of the devices its input lives on) before each random sub-module, and restores it around the
  recomputation; the caller's RNG stream is left untouched by backward.
* Autocast: the autocast state of the forward is recorded and re-entered in backward.

Layout: :mod:`._autograd` (RNG replay, frozen statistics, recording, vector-Jacobian products), :mod:`.couplings`
(the base class, the coupling and the sequence), :mod:`.layers` (layer-wise invertible layers and poolings),
:mod:`.architectures` (the network builders) and :mod:`.snr` (reconstruction SNR). It may import torch and
:mod:`fewbit_design.errors`; the SNR theory it is checked against is :mod:`fewbit_design.design.snr`.

>>> import torch
>>> from fewbit_design.runtime import reversible, memory
>>> net = reversible.revnet(4, 16, input_size=(16, 16))
>>> x = torch.randn(2, 3, 16, 16)
>>> with memory.saved_bytes(net) as m:
...     loss = net(x).square().sum()
>>> loss.backward()
"""

from ._autograd import frozen_running_stats, uses_rng
from .architectures import POOLING_KINDS, ReversibleNet, hybrid_net, layerwise_net, resnet, revnet
from .couplings import AdditiveCoupling, InvertibleModule, ReversibleSequence
from .layers import BatchPool2d, ChannelPool2d, InvertibleBatchNorm2d, InvertibleConv2d, InvertibleLeakyReLU
from .snr import LayerSNR, inverse_snr_factor, reconstruction_snr

__all__ = [
    "InvertibleModule",
    "AdditiveCoupling",
    "ReversibleSequence",
    "InvertibleBatchNorm2d",
    "InvertibleLeakyReLU",
    "InvertibleConv2d",
    "ChannelPool2d",
    "BatchPool2d",
    "ReversibleNet",
    "revnet",
    "layerwise_net",
    "hybrid_net",
    "resnet",
    "frozen_running_stats",
    "uses_rng",
    "LayerSNR",
    "reconstruction_snr",
    "inverse_snr_factor",
    "POOLING_KINDS",
]
