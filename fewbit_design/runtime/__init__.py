"""PyTorch runtime: few-bit activations that load design tables, BLPA, reversible layers, checkpointing, offloading,
a planner that combines them, and memory accounting.

Where things are (one folder per technique, each with its module API, functional API and kernels):

* :mod:`.fewbit`: few-bit activations (``nn``, ``functional``, ``convert``, table loading, the op and its kernels);
  :mod:`.nn`, :mod:`.functional`, :mod:`.convert` and :mod:`.tables` are its documented paths.
* :mod:`.blpa`: BLPA units, the paper's network, fusing an existing model, quantization kernels.
* :mod:`.reversible`: couplings, invertible layers, architectures, reconstruction SNR.
* :mod:`.checkpoint`: Chen et al.'s checkpoint planning (profile, plan, apply).
* :mod:`.offload`: saved-tensor offloading to disk (CPU) or pinned host memory (CUDA).
* :mod:`.planner`: :func:`plan_memory`, which combines the techniques under a memory budget.
* :mod:`.memory`: the instrument behind every memory claim (bytes saved for backward, peak of live bytes).
* :mod:`._packing` and :mod:`._numba_packing`: bit packing shared by the kernels of every technique.

The runtime imports torch, numba lazily (CPU kernels), triton lazily (CUDA kernels), and from the design side only
:mod:`fewbit_design.errors`, :mod:`fewbit_design.table` and :mod:`fewbit_design.design.activations`; never scipy,
matplotlib or the CLI.

Importing this package loads torch but never scipy or matplotlib, and numba only when a CPU kernel first runs.
Submodules load on first attribute access, so ``from fewbit_design import runtime`` stays cheap.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

try:
    import torch  # noqa: F401  (fail here, with the fix, rather than deep inside a submodule)
except ModuleNotFoundError as error:
    if error.name != "torch":
        raise
    raise ModuleNotFoundError(
        "fewbit_design.runtime needs PyTorch: pip install 'fewbit-design[runtime]' "
        "(or install the torch build for your machine first)",
        name="torch",
    ) from error

_SUBMODULES = (
    "fewbit",
    "nn",
    "functional",
    "convert",
    "tables",
    "memory",
    "blpa",
    "reversible",
    "checkpoint",
    "offload",
    "planner",
)
# name -> (absolute module, attribute or None for the module itself); see fewbit_design._lazy
_LAZY_ATTRIBUTES: dict[str, tuple[str, str | None]] = {name: (f"{__name__}.{name}", None) for name in _SUBMODULES}

__all__ = list(_SUBMODULES)


def _register(name: str, module: str, attribute: str | None = None) -> None:
    """Expose ``attribute`` (default ``name``) of the submodule ``module`` as ``fewbit_design.runtime.<name>``."""
    _LAZY_ATTRIBUTES[name] = (f"{__name__}.{module}", attribute or name)
    if name not in __all__:
        __all__.append(name)


_register("FewBit", "nn", "FewBit")
_register("load_table", "tables", "load_table")
_register("convert", "convert", "convert")
_register("calibrate", "fewbit.calibrate", "calibrate")
_register("plan_memory", "planner", "plan_memory")
_register("load_plan", "planner", "load_plan")


__getattr__ = lazy_getattr(__name__, _LAZY_ATTRIBUTES)
