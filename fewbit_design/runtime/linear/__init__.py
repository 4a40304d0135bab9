"""Compressed saved inputs for linear layers: an exact forward, and a weight gradient computed from K-bit group
codes of the input (BLPA's K-bit activations generalised to any ``nn.Linear`` / Hugging Face ``Conv1D``).

* :mod:`.quant`: the group quantizer (per-group low and step, stochastic or nearest rounding, the shared packing)
  and its custom ops ``fewbit::group_quantize`` / ``fewbit::group_dequantize``;
* :mod:`.ops`: the custom op ``fewbit::compressed_linear`` (fake kernel, ``register_autograd``) and
  :func:`compressed_linear`;
* :mod:`.nn`: :class:`CompressedLinear`, :class:`CompressedConv1D`;
* :mod:`.convert`: :func:`convert` (in place, report as ``model.linear_report``);
* :mod:`.technique`: the registry contract (``TECHNIQUE``).
"""

from .convert import LinearReport, convert
from .nn import CompressedConv1D, CompressedLinear
from .ops import compressed_linear
from .quant import GROUP_SIZE, dequantize_groups, quantize_groups, saved_nbytes

__all__ = [
    "convert",
    "LinearReport",
    "CompressedLinear",
    "CompressedConv1D",
    "compressed_linear",
    "GROUP_SIZE",
    "quantize_groups",
    "dequantize_groups",
    "saved_nbytes",
]
