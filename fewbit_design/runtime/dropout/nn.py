"""The dropout module: ``torch.nn.Dropout`` (a subclass, so code that looks for dropout modules still finds it) whose
forward runs :func:`.ops.dropout`; it holds ``p``, ``inplace`` and the mode, and no math."""

from __future__ import annotations

import torch

from ...errors import check_boolean, check_choice
from .._torchscript import NotScriptable
from .ops import MODES, check_probability, dropout

__all__ = ["CompactDropout"]


class CompactDropout(NotScriptable, torch.nn.Dropout):
    """``torch.nn.Dropout`` that keeps its mask for backward as 1 bit per element (``mode="bits"``) or the random
    generator's state to draw it again (``mode="seed"``); the same draws as torch's, so its output, its gradients and
    the random stream are native's (see :mod:`.ops`). In eval mode, or where nothing needs a gradient, it is
    torch's dropout.

    Args:
        p: the probability of dropping an element, in [0, 1]
        inplace: write the result into the input, as ``torch.nn.Dropout(inplace=True)``
        mode: one of :data:`.ops.MODES`

    >>> layer = CompactDropout(0.1)
    >>> layer(torch.randn(2, 8, requires_grad=True)).shape
    torch.Size([2, 8])
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, mode: str = "bits") -> None:
        super().__init__(check_probability(p), check_boolean("dropout inplace", inplace))
        self.mode = check_choice("dropout mode", mode, MODES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.inplace, mode=self.mode)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
