"""Memory-sharing norms: LayerNorm / RMSNorm (torch.nn and the Hugging Face forms) that keep for backward only their
output, which the next linear layer saves anyway, and per-row statistics, and reconstruct the normalised input in
backward (:mod:`.ops`: the op; :mod:`.nn`: the module; :mod:`.convert`: replacing a model's norms)."""

from .convert import NormsReport, convert
from .nn import MemorySharingNorm
from .ops import DEFAULT_THRESHOLD, KINDS, memory_sharing_norm

__all__ = ["convert", "NormsReport", "MemorySharingNorm", "memory_sharing_norm", "KINDS", "DEFAULT_THRESHOLD"]
