"""Dropout that keeps its mask as 1 bit per element, or the random state that draws it again, where torch's dropout
keeps a byte (CUDA's bool mask) or a float (CPU's noise) per element: the same draws, so the forward, the gradients
and the random stream are native's (:mod:`.ops`: the op; :mod:`.nn`: the module; :mod:`.convert`: replacing a
model's ``torch.nn.Dropout`` modules)."""

from .convert import DropoutReport, convert
from .nn import CompactDropout
from .ops import MODES, dropout, dropout_reference

__all__ = ["convert", "DropoutReport", "CompactDropout", "dropout", "dropout_reference", "MODES"]
