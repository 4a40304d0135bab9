"""Hugging Face integration: convert and plan memory at ``Trainer`` start, and restore a saved conversion.

* :class:`~.trainer.FewBitCallback`: a ``transformers.TrainerCallback`` that converts the model
  (``runtime.convert``) and/or plans and applies memory (``runtime.plan_memory`` on a batch of the train
  dataloader) when training starts, logs the report, and records what it did in ``model.config.fewbit``.
* :func:`~.config_record.record`: write that record for a model converted by hand (before ``save_pretrained``).
* :func:`~.config_record.restore`: after ``from_pretrained``, one call re-applies the recorded conversion and plan.

``save_pretrained`` writes ``model.config`` (and so the record) beside the weights; ``from_pretrained`` reads it
back as ``model.config.fewbit`` but builds the unconverted model: :func:`restore` converts it again.

>>> from fewbit_design.runtime.hf import FewBitCallback, restore                 # doctest: +SKIP
>>> trainer = Trainer(model, args, train_dataset=data,
...                   callbacks=[FewBitCallback(convert={"bits": 3}, plan={"budget": 0.5})])  # doctest: +SKIP
>>> trainer.train(); model.save_pretrained("out")                                # doctest: +SKIP
>>> model = restore(GPT2LMHeadModel.from_pretrained("out"))                      # doctest: +SKIP

Importing this package loads neither transformers nor the callback; ``FewBitCallback`` imports transformers when it
is first reached (transformers and accelerate are the ``models`` extra).
"""

from ..._lazy import lazy_getattr as _lazy_getattr
from ..._lazy import public_dir as _public_dir

_LAZY = {
    "FewBitCallback": (".trainer", "FewBitCallback"),
    "record": (".config_record", "record"),
    "restore": (".config_record", "restore"),
    "read_record": (".config_record", "read_record"),
    "FORMAT": (".config_record", "FORMAT"),
}

__all__ = list(_LAZY)
__getattr__ = _lazy_getattr(__name__, _LAZY)
__dir__ = _public_dir(__all__)
