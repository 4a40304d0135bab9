"""The compressed attention core: an exact SDPA forward whose backward reads K-bit group codes of q, k and v and
recomputes the attention (nothing of size seq x seq kept).

* :mod:`.ops`: the custom ops ``fewbit::compressed_attention`` / ``fewbit::compressed_attention_backward`` and
  :func:`compressed_attention`;
* :mod:`.convert`: :func:`convert` (Hugging Face attention modules through transformers' ``AttentionInterface``;
  report as ``model.attention_report``);
* :mod:`.technique`: the registry contract (``TECHNIQUE``).
"""

from .convert import AttentionReport, convert
from .ops import attention_backward_reference, compressed_attention

__all__ = ["convert", "AttentionReport", "compressed_attention", "attention_backward_reference"]
