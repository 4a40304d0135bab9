"""The module of the memory-sharing norm: holds the original norm's parameters (the same Parameter objects) and
calls :func:`.ops.memory_sharing_norm`; no math here."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ...errors import FewBitError, check_bits, check_choice
from .._torchscript import NotScriptable
from .ops import DEFAULT_THRESHOLD, KINDS, _compute_dtype, kept_channels, norm_and_kept_count

__all__ = ["MemorySharingNorm"]


class MemorySharingNorm(NotScriptable, torch.nn.Module):
    """A LayerNorm / RMSNorm that keeps for backward only its output, the rows' rstd and the normalised input of the
    channels it cannot invert (see :mod:`.ops`); its forward is bitwise the original's.

    Args:
        normalized_shape: the trailing dimensions normalised over.
        kind: one of :data:`.ops.KINDS`, the original module's formula.
        eps: the epsilon added to the variance; ``None`` (``torch.nn.RMSNorm``'s default) is the machine epsilon of
            the compute dtype (float32 for 16-bit input, as torch does).
        weight: the original module's weight (shared, not copied), or None.
        bias: the original module's bias (shared, not copied), or None.
        threshold: channels with ``|w| < threshold * (|b| + tiny / eps)`` keep their normalised input.
        bits: None (exact), or 2..8: compressed mode, the output kept as that many bits of group codes (shared
            with the compressed linear layers reading it; approximate gradients).

    Under ``torch.compile`` the number of kept channels must be static (a data-dependent count would split the
    graph at every norm, and each piece would save its own copies of shared tensors such as the attention mask):
    the traced graph keeps ``compiled_capacity`` channels, the count the weights needed when the module was built
    or last ran eagerly (in the input's dtype), whichever is larger. Keeping a channel that did not need it is exact;
    if training drives more weights to zero than that, the compiled forward raises one :class:`FewBitError` line
    rather than inverting them inexactly.

    >>> norm = MemorySharingNorm((8,), kind="rms_norm", eps=1e-6, weight=torch.nn.Parameter(torch.ones(8)))
    >>> norm(torch.randn(2, 8)).shape
    torch.Size([2, 8])
    """

    def __init__(
        self,
        normalized_shape: tuple[int, ...],
        *,
        kind: str,
        eps: float | None,
        weight: torch.nn.Parameter | None = None,
        bias: torch.nn.Parameter | None = None,
        threshold: float = DEFAULT_THRESHOLD,
        bits: int | None = None,
    ) -> None:
        super().__init__()
        self.kind = check_choice("norm kind", kind, KINDS)
        self.normalized_shape = tuple(int(size) for size in normalized_shape)
        self.eps = eps
        self.threshold = float(threshold)
        self.weight = weight
        self.bias = bias
        #: how many channels a compiled graph keeps (a Python int, so dynamo guards on it and recompiles on change)
        self.compiled_capacity = 0
        # in the weight's dtype (an eager run counts in the input's); a fake weight has no values: none counted
        if weight is not None and not weight.is_meta and not is_fake(weight):
            self.compiled_capacity = int(kept_channels(weight.dtype, weight, bias, self.kind, self.threshold).sum())
        self.bits = None if bits is None else check_bits(bits, low=2, high=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ndim = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - ndim :]) != self.normalized_shape or x.dim() < ndim:
            raise FewBitError(
                f"{self.kind} norm over the last dimensions {self.normalized_shape} got an input of shape "
                f"{tuple(x.shape)}: its trailing dimensions must be {self.normalized_shape}"
            )
        # torch.nn.RMSNorm's eps=None is the machine epsilon of the dtype it computes in (float32 for 16-bit input)
        eps = torch.finfo(_compute_dtype(x.dtype)).eps if self.eps is None else float(self.eps)
        compiling = torch.compiler.is_compiling()
        y, kept = norm_and_kept_count(
            x,
            self.weight,
            self.bias,
            kind=self.kind,
            normalized_ndim=ndim,
            eps=eps,
            threshold=self.threshold,
            capacity=self.compiled_capacity if compiling else None,  # eager: exactly the channels that need it
            bits=getattr(self, "bits", None),  # compressed mode: approximate, codes shared with the linears
        )
        if not compiling and kept is not None:  # counted for a later compile, from the op's own output shape
            self.compiled_capacity = max(self.compiled_capacity, int(kept))
        return y

    def extra_repr(self) -> str:
        text = f"{self.normalized_shape}, kind={self.kind!r}, eps={self.eps}, threshold={self.threshold}"
        return text if getattr(self, "bits", None) is None else f"{text}, bits={self.bits}"
