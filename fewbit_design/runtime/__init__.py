"""PyTorch runtime: few-bit activations that load design tables, BLPA, reversible layers, checkpointing, offloading,
a planner that combines them, and memory accounting.

Where things are (one folder per technique, each with its module API, functional API and kernels):

* :mod:`.fewbit`: few-bit activations (``nn``, ``functional``, ``convert``, the table ``lookup``, the op and its
  kernels); :mod:`.nn`, :mod:`.functional` and :mod:`.tables` (the lookup's) are the documented paths of its public
  names; :func:`~.fewbit.convert.convert` is the few-bit-only converter.
* :mod:`.conversion`: ``runtime.convert``, the one converter over the registry's techniques (memory-sharing norms,
  the gated-MLP op, the exact attention core and few-bit activations by default, K-bit forms with ``compress=``),
  each measured on a probe and undone where it does not reduce memory; its report is ``model.convert_report``;
  ``runtime.unconvert`` undoes every conversion and plan.
* :mod:`.norms`: memory-sharing LayerNorm / RMSNorm (keep their output and row statistics, invert in backward).
* :mod:`.linear`: linear layers (``nn.Linear``, Hugging Face ``Conv1D``) that keep K-bit group codes of their input
  for the weight gradient (exact forward and input gradient).
* :mod:`.gated`: the gated-MLP op (SwiGLU, GeGLU, fused gate_up): keeps x, gate and up, recomputes the rest.
* :mod:`.head`: the chunked LM head + cross-entropy (:func:`~.head.ops.lm_loss`): the logits never exist whole.
* :mod:`.blpa`: BLPA units, the paper's network, fusing an existing model, quantization kernels.
* :mod:`.reversible`: couplings, invertible layers, architectures, reconstruction SNR.
* :mod:`.checkpoint`: Chen et al.'s checkpoint planning (profile, plan, apply).
* :mod:`.offload`: saved-tensor offloading to disk (CPU) or pinned host memory (CUDA).
* :mod:`.planner`: :func:`plan_memory`, which combines the techniques under a memory budget.
* :mod:`.hf`: the Hugging Face ``Trainer`` callback (convert and plan at train start) and ``restore`` of a converted
  model after ``from_pretrained`` (not a technique; transformers loads only when the callback is reached).
* :mod:`.registry`: the technique contract (:class:`~.registry.Technique`: seam, exactness, config, ``apply``, cost
  model) and the list of techniques the planner combines; each technique folder's ``technique.py`` fills it in.
* :mod:`.memory`: the instrument behind every memory claim (bytes saved for backward, peak of live bytes);
  :mod:`.blockrun`: one block run alone under it, the measurement both block profilers (checkpoint's, the
  planner's) are built on.
* :mod:`._packing` and :mod:`._numba_packing`: bit packing shared by the kernels of every technique.

The runtime imports torch, numba lazily (CPU kernels), triton lazily (CUDA kernels), and from the design side only
:mod:`fewbit_design.errors`, :mod:`fewbit_design.table` and :mod:`fewbit_design.design.activations`; never scipy,
matplotlib or the CLI.

Importing this package loads torch but never scipy or matplotlib, and numba only when a CPU kernel first runs.
Submodules load on first attribute access, so ``from fewbit_design import runtime`` stays cheap; ``dir(runtime)``
lists them all before they load.
"""

from .._lazy import lazy_getattr as _lazy_getattr
from .._lazy import public_dir as _public_dir

try:
    import torch as _torch  # noqa: F401  (fail here, with the fix, rather than deep inside a submodule)
except ModuleNotFoundError as _error:
    if _error.name != "torch":
        raise
    raise ModuleNotFoundError(
        "fewbit_design.runtime needs PyTorch: pip install 'fewbit-design[runtime]' "
        "(or install the torch build for your machine first)",
        name="torch",
    ) from _error

# public name -> (module relative to this package, attribute or None for the module itself); see fewbit_design._lazy
_LAZY = {
    **{
        name: (f".{name}", None)
        for name in ("fewbit", "nn", "functional", "tables", "memory")
        + ("blpa", "reversible", "checkpoint", "offload", "planner", "registry", "norms", "linear", "gated", "head")
        + ("hf", "conversion", "attention", "probe", "modules", "dropout", "report")
    },
    "FewBit": (".fewbit.nn", "FewBit"),
    "MemorySharingNorm": (".norms.nn", "MemorySharingNorm"),
    "CompressedLinear": (".linear.nn", "CompressedLinear"),
    "GatedMLP": (".gated.nn", "GatedMLP"),
    "lm_loss": (".head.ops", "lm_loss"),
    "load_table": (".fewbit.lookup", "load_table"),
    "convert": (".conversion", "convert"),
    "unconvert": (".conversion", "unconvert"),
    "ConvertReport": (".conversion", "ConvertReport"),
    "Report": (".report", "Report"),
    "calibrate": (".fewbit.calibrate", "calibrate"),
    "plan_memory": (".planner", "plan_memory"),
    "load_plan": (".planner", "load_plan"),
}

__all__ = list(_LAZY)
__getattr__ = _lazy_getattr(__name__, _LAZY)
__dir__ = _public_dir(__all__)
