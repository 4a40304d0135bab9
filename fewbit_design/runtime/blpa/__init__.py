"""BLPA: backprop with approximate activations (Chakrabarti & Moseley), as fused BatchNorm-ReLU-Conv/Linear units.

The forward pass is exact. Each unit ``BatchNorm -> ReLU -> Conv2d/Linear`` keeps for backward only a K-bit
copy of its pre-ReLU activation ``A2`` (packed, K bits per element), the per-channel inverse standard deviation,
and its parameters; backward follows eqs. (5)-(8) of the paper:

* the gradient to W (and the bias) uses ``A3~ = relu(A2~)``;
* the gradient through the linear op, the ReLU (mask from the codes, exact by construction), to beta and through
  the scale to A1 are exact;
* the gradient to gamma uses ``A1~``; BatchNorm's input gradient uses ``A1~`` only in its variance term.

``bits=None`` is the paper's "exact" fused baseline (one full-precision tensor per unit: the normalized input A1,
from which A2 = gamma * A1 + beta is recomputed bitwise; storing A1 rather than A2 costs the same and stays exact
when gamma == 0). ``naive=True`` is the paper's naive baseline: the quantized activation also feeds the forward
pass (with the same backward), so errors accumulate across layers; the paper saw it fail at depth 164.

Layout: :mod:`.nn` (the fused units and their autograd function), :mod:`.models` (the paper's pre-activation
ResNet), :mod:`.fuse` (``convert``: fuse the groups of an existing model), :mod:`.quant` (quantization, packing and
the reference of every kernel) and :mod:`._numba_kernels` (the fused CPU kernels). It may import torch, numba lazily,
:mod:`fewbit_design.errors` and the shared :mod:`fewbit_design.runtime._packing`.

The quantizer (eqs. 9-10, made sign-preserving in every case) is documented in
:mod:`fewbit_design.runtime.blpa.quant`.

On CPU (float32/float64) the element-wise work runs in fused numba kernels that match the torch reference bitwise
on codes and forward outputs (:func:`set_backend` picks 'auto', 'torch' or 'numba'); elsewhere the reference runs.

In eval mode (with running statistics) a unit runs the plain exact forward through ``torch.nn.functional``
(nothing of its own is saved; if you backpropagate in eval mode, autograd saves what the plain ops need).

>>> import torch
>>> from fewbit_design.runtime import blpa
>>> unit = blpa.BNReLUConv2d(8, 16, 3, padding=1, bits=4)
>>> out = unit(torch.randn(2, 8, 5, 5))
>>> out.shape
torch.Size([2, 16, 5, 5])
>>> model = blpa.convert(torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 2)))
>>> type(model[0]).__name__
'BNReLULinear'
"""

from . import quant
from .fuse import convert
from .models import PreActBottleneck, PreActResNet, preact_resnet
from .nn import BNReLUConv2d, BNReLULinear, BNReLUPoolLinear, set_backend, unit_backward

__all__ = [
    "BNReLUConv2d",
    "BNReLULinear",
    "BNReLUPoolLinear",
    "PreActBottleneck",
    "PreActResNet",
    "preact_resnet",
    "convert",
    "set_backend",
    "unit_backward",
    "quant",
]
