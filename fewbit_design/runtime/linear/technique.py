"""Compressed linear inputs as the runtime sees it: every ``nn.Linear`` / ``Conv1D`` keeps its input for the weight
gradient as K-bit group codes (approximate weight gradients; forward and input gradients exact). Plan setting:
``linear_bits`` (default 8). ``runtime.convert`` runs it under ``compress=K`` only, and leaves alone the linears
whose module runs them itself (the gated-MLP op), those whose weight is frozen (a LoRA base layer: nothing of its
input is kept for it) and those whose input another module keeps anyway (measured on the probe: compressing them
would add codes and free nothing)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import check_choice, check_integer
from .. import memory
from ..probe import example_errors, no_side_effects, run_example
from ..registry import ConvertRole, Technique
from .quant import GROUP_SIZE

SHARED_INPUT_REASON = (
    "measured on the probe: its input is saved for backward by another module too (a memory-sharing norm keeps its "
    "output): its codes would add bytes and free none"
)

FROZEN_WEIGHT_REASON = (
    "its weight does not require grad (frozen, as a LoRA base layer is): backward needs none of its input, and the "
    "native layer keeps none"
)


@dataclass(frozen=True)
class LinearOptions:
    """Options of the compressed linear inputs.

    Attributes:
        bits: code width, 2 to 8.
        group_size: values per (low, step) group along the feature dimension (not a plan setting).
        rounding: ``"stochastic"`` or ``"nearest"`` (not a plan setting).
    """

    bits: int = 8
    group_size: int = field(default=GROUP_SIZE, metadata={"setting": None})
    rounding: str = field(default="stochastic", metadata={"setting": None})

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_integer("linear_bits", self.bits, low=2, high=8))
        object.__setattr__(self, "group_size", check_integer("linear group_size", self.group_size, low=1))
        check_choice("linear rounding", self.rounding, ("stochastic", "nearest"))


def _convert(model: torch.nn.Module, options: LinearOptions, probe: Any) -> torch.nn.Module:
    from .convert import convert, owned_linears

    kw = dict(bits=options.bits, group_size=options.group_size, rounding=options.rounding)
    owned = owned_linears(model)  # left alone by convert with their reason
    frozen = _frozen(model, owned)
    shared = _shared_inputs(model, probe) if probe is not None else {}
    # the frozen and the owned: their own reasons
    shared = {key: value for key, value in shared.items() if key not in frozen and key not in owned}
    left = frozen.keys() | shared.keys()
    converted = convert(model, **kw, filter=lambda _, module: id(module) not in left)
    for reason, layers in ((FROZEN_WEIGHT_REASON, frozen), (SHARED_INPUT_REASON, shared)):
        converted.linear_report.skipped.extend(
            (name, type(module).__name__, reason) for name, module in layers.values()
        )
    return converted


def _frozen(model: torch.nn.Module, owned: set[int]) -> dict[int, tuple[str, torch.nn.Module]]:
    """The layers :func:`.convert.convert` would compress (``nn.Linear``, ``Conv1D``; by id: (name, module)) whose
    weight does not require grad: their op would keep nothing (:func:`.ops.compressed_linear`), so they stay native."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return {
        id(module): (name, module)
        for name, module in _linears(model).items()
        if type(module) in (torch.nn.Linear, conv1d) and id(module) not in owned and not module.weight.requires_grad
    }


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) or (conv1d is not None and type(module) is conv1d)
    }


def _shared_inputs(model: torch.nn.Module, probe: Any) -> dict[int, tuple[str, torch.nn.Module]]:
    """The linear layers (by id: (name, module)) whose saved input a module other than the linear layers saves too
    (one forward on the probe, :meth:`memory.SavedBytes.savers`): compressing them frees nothing. Linear layers that
    share an input among themselves alone (q, k and v after a norm in compressed mode) are not listed: converted,
    they keep one set of codes (:func:`.ops.share_codes`) instead of the input."""
    linears = _linears(model)
    inputs: dict[str, torch.Tensor] = {}

    def record(_module, arguments, name):
        if arguments and isinstance(arguments[0], torch.Tensor):
            inputs.setdefault(name, arguments[0])

    handles = [
        module.register_forward_pre_hook(lambda m, a, name=name: record(m, a, name)) for name, module in linears.items()
    ]
    try:
        with no_side_effects(model), example_errors(), torch.enable_grad():
            with memory.saved_bytes(model) as saved:
                run_example(model, probe)
    finally:
        for handle in handles:
            handle.remove()
    shared = {}
    for name, x in inputs.items():
        savers = saved.savers(x)
        if not savers or savers - linears.keys():
            shared[id(linears[name])] = (name, linears[name])
    return shared


TECHNIQUE = Technique(
    name="linear",
    summary="linear layers that keep K-bit group codes of their input for the weight gradient",
    seam="module",
    options=LinearOptions,
    approximate=lambda options: "weight gradients of compressed linears",
    convert=_convert,
    in_convert=ConvertRole(
        "linear_report",
        default=False,
        compress=lambda options, bits: LinearOptions(bits, options.group_size, options.rounding),
    ),
)
