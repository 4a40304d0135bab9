"""The gated-MLP op: ``down(act(gate(x)) * up(x))`` (SwiGLU, GeGLU, gelu-tanh GLU; separate or fused ``gate_up``
projections) as one autograd function that keeps x, gate and up for backward and recomputes ``act(gate)`` and the
product there: exact gradients, H + 2I elements per token saved instead of native eager's H + 4I. Its compressed
mode (:mod:`.compressed`, ``mode="compressed"``) keeps K-bit group codes of x, gate and up
instead and recomputes act(gate) and act'(gate) from gate's: an exact forward and approximate gradients.

Layout: :mod:`.ops` (the ``torch.library`` custom ops ``fewbit::gated_mlp`` / ``fewbit::gated_mlp_backward`` with
fake kernels, their autograd and the pure-torch reference), :mod:`.nn` (:class:`GatedMLP`, which holds the original
linears), :mod:`.convert` (find gated MLPs by structure, probe, replace, report) and :mod:`.technique` (the registry
entry). It may import torch, :mod:`fewbit_design.errors`, the few-bit runtime (activation recognition, the table
lookup and kernels, for the compressed mode) and the linear technique's group quantizer.

>>> import torch, transformers                                                     # doctest: +SKIP
>>> from fewbit_design.runtime import gated                                         # doctest: +SKIP
>>> model = gated.convert(transformers.LlamaForCausalLM(config))                    # doctest: +SKIP
>>> print(model.gated_report)                                                       # doctest: +SKIP
"""

from .compressed import gated_mlp_compressed, saved_nbytes_per_token
from .convert import GatedReport, convert
from .nn import LAYOUTS, MODES, GatedMLP, Layout
from .ops import ACTIVATIONS, gated_mlp, gated_mlp_reference

__all__ = [
    "ACTIVATIONS",
    "GatedMLP",
    "GatedReport",
    "LAYOUTS",
    "Layout",
    "MODES",
    "convert",
    "gated_mlp",
    "gated_mlp_compressed",
    "gated_mlp_reference",
    "saved_nbytes_per_token",
]
