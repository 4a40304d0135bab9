"""The attention cores: an exact SDPA forward whose backward reads K-bit group codes of q, k and v and recomputes the
attention (compressed), or keeps the value projection's input instead of v (exact); with attention dropout both draw
the keep mask from a kept seed and draw it again in backward (nothing of size seq x seq kept).

* :mod:`.ops`: the custom ops ``fewbit::compressed_attention`` / ``fewbit::compressed_attention_backward`` and
  :func:`compressed_attention`;
* :mod:`.exact`: ``fewbit::value_recompute_attention`` and ``fewbit::dropout_attention`` (exact mode) and
  :func:`dropout_attention`;
* :mod:`.dropout`: the formula with dropout, its keep mask (:func:`~.dropout.dropout_keep`) and seed;
* :mod:`.convert`: :func:`convert` (Hugging Face attention modules through transformers' ``AttentionInterface``;
  report as ``model.attention_report``);
* :mod:`.technique`, :mod:`.exact_technique`: the registry contract (``TECHNIQUE``).
"""

from .convert import AttentionReport, convert
from .exact import dropout_attention
from .ops import attention_backward_reference, compressed_attention

__all__ = ["convert", "AttentionReport", "compressed_attention", "dropout_attention", "attention_backward_reference"]
