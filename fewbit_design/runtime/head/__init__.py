"""The chunked LM head + cross-entropy: the loss of a causal LM without its logits (exact gradients).

:func:`lm_loss` is the op (see :mod:`.ops`); :func:`convert` makes a Hugging Face causal LM compute its loss through
it when called with ``labels`` (then ``logits`` is None: no logits exist); :func:`remove` undoes it.
"""

from __future__ import annotations

from .convert import HeadReport, convert, is_causal_lm, remove
from .ops import default_chunk_rows, lm_loss, lm_loss_reference

__all__ = ["lm_loss", "lm_loss_reference", "default_chunk_rows", "convert", "remove", "is_causal_lm", "HeadReport"]
