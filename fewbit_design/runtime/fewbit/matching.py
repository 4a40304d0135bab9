"""Finding the activation modules of a model for :func:`~.convert.convert` and :func:`~.calibrate.calibrate`: walking
the model (every module object once, with all the places it sits at), recognising activation classes (``torch.nn``,
``transformers``, timm: :data:`ECOSYSTEM`) and the rule for activations whose replacement would free nothing.

A library is looked at only when it is already imported (``sys.modules``), never imported here. What is recognised,
and why some activations are left alone, is described in :mod:`.convert`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from ...design import activations
from ...errors import FewBitError
from .. import memory
from ..modules import Slot, slots
from .nn import FewBitModule, _entry_for

__all__ = ["ECOSYSTEM", "canonical_name"]

_GELU_TANH = ("gelu", {"approximate": "tanh"})

# (library module, class name) -> (registry activation, params) or a reason why it is left alone. A class whose
# registry entry does not exist yet (quick_gelu, relu_squared are being added on the design side) is left alone with
# that reason until the entry lands; nothing else changes then.
ECOSYSTEM: dict[tuple[str, str], tuple[str, dict[str, Any]] | str] = {
    ("transformers.activations", "GELUActivation"): ("gelu", {"approximate": "none"}),
    ("transformers.activations", "NewGELUActivation"): _GELU_TANH,
    ("transformers.activations", "GELUTanh"): _GELU_TANH,
    ("transformers.activations", "PytorchGELUTanh"): _GELU_TANH,
    ("transformers.activations", "FastGELUActivation"): _GELU_TANH,  # 0.7978845608 = sqrt(2 / pi) to 1e-10
    ("transformers.activations", "AccurateGELUActivation"): _GELU_TANH,
    ("transformers.activations", "SiLUActivation"): ("silu", {}),
    ("transformers.activations", "MishActivation"): ("mish", {}),
    ("transformers.activations", "QuickGELUActivation"): ("quick_gelu", {}),
    ("transformers.activations", "ReLUSquaredActivation"): ("relu_squared", {}),
    ("transformers.activations", "ClippedGELUActivation"): "no table for GELU clipped to [min, max]: its derivative "
    "is 0 where the clip binds",
    ("transformers.activations", "LaplaceActivation"): "no registry entry for the Laplace activation",
    ("transformers.activations", "SqrtSoftplusActivation"): "no registry entry for sqrt(softplus(x))",
    ("transformers.activations", "XIELUActivation"): "XIELU has trainable parameters (they would get no gradient)",
    ("transformers.activations", "LinearActivation"): None,  # the identity: saves nothing, nothing to convert
    ("timm.layers.activations", "GELU"): ("gelu", {"approximate": "none"}),
    ("timm.layers.activations", "GELUTanh"): _GELU_TANH,
    ("timm.layers.activations", "QuickGELU"): ("quick_gelu", {}),
    ("timm.layers.activations", "Swish"): ("silu", {}),
    ("timm.layers.activations", "SiLU"): ("silu", {}),
    ("timm.layers.activations", "Mish"): ("mish", {}),
    ("timm.layers.activations", "Sigmoid"): ("sigmoid", {}),
    ("timm.layers.activations", "Tanh"): ("tanh", {}),
    ("timm.layers.activations", "HardSwish"): ("hardswish", {}),
    ("timm.layers.activations", "HardSigmoid"): ("hardsigmoid", {}),
    ("timm.layers.activations", "HardMish"): "no registry entry for hard mish",
    ("timm.layers.activations", "PReLU"): "PReLU has a trainable slope (it would get no gradient)",
    ("timm.layers.activations", "GELUTanhFast"): _GELU_TANH,
}

_TORCH_UNSUPPORTED = {
    "PReLU": "PReLU has a trainable slope (it would get no gradient)",
    "RReLU": "RReLU has a random slope in training: no fixed derivative to tabulate",
}


def _ecosystem_entry(module: torch.nn.Module):
    """ECOSYSTEM's entry for the module's exact class, ``KeyError`` when it is not an ecosystem class."""
    cls = type(module)
    for (library, name), entry in ECOSYSTEM.items():
        imported = sys.modules.get(library)
        if imported is not None and getattr(imported, name, None) is cls:
            return entry
    raise KeyError(cls)


def _has_registry_entry(name: str) -> bool:
    try:
        activations.get(name)
    except FewBitError:
        return False
    return True


@dataclass
class _Candidate:
    """A recognised activation module: how to build its replacement."""

    activation: str  # registry name
    params: dict[str, Any]
    torch_class: bool  # a torch.nn class (few-bit nn module) or a library class (FewBit wrapper)


def _recognise(module: torch.nn.Module) -> _Candidate | str | None:
    """A candidate, a reason why this activation is left alone, or None when it is not an activation module."""
    entry = _entry_for(type(module))
    if entry is not None:
        params = {name: getattr(module, name) for name in entry.defaults if hasattr(module, name)}
        return _Candidate(entry.name, params, torch_class=True)
    if getattr(torch.nn, type(module).__name__, None) is type(module) and type(module).__name__ in _TORCH_UNSUPPORTED:
        return _TORCH_UNSUPPORTED[type(module).__name__]
    try:
        found = _ecosystem_entry(module)
    except KeyError:
        return None
    if found is None or isinstance(found, str):
        return found
    name, params = found
    if not _has_registry_entry(name):
        return f"no registry entry {name!r} for it yet (so no table)"
    return _Candidate(name, dict(params), torch_class=False)


# which activations save only their output, probed once per (class, hyper-parameters)
_OUTPUT_ONLY: dict[tuple[type, str], bool] = {}


def _saves_only_output(module: torch.nn.Module) -> bool:
    key = (type(module), repr(module))
    if key not in _OUTPUT_ONLY:
        saved: list[torch.Tensor] = []
        try:
            # in normal grad mode whatever the caller's (under no_grad or inference_mode nothing would be saved)
            with torch.inference_mode(False), torch.enable_grad():
                x = torch.linspace(-3.0, 3.0, 16).requires_grad_().clone()
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                    y = module(x)
            output = memory.storage_key(y)
            _OUTPUT_ONLY[key] = bool(saved) and all(memory.storage_key(t) == output for t in saved)
        except Exception:  # a module that cannot run on a small float32 vector: no claim, convert it
            _OUTPUT_ONLY[key] = False
    return _OUTPUT_ONLY[key]


# layers whose backward saves their input: an output-saving activation right before one frees nothing when replaced
_SAVE_INPUT = (
    torch.nn.Linear,
    torch.nn.modules.conv._ConvNd,
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.pooling._MaxPoolNd,
)
_CONVOLUTIONAL = (torch.nn.modules.conv._ConvNd, torch.nn.modules.batchnorm._NormBase)


def _output_saved_by_neighbour(slot: Slot) -> bool:
    """The common cases where an activation's output is saved by the next layer: the activation sits in a
    convolutional block (its parent holds convolutions or batch norms at any depth: ResNet blocks, torchvision and
    Hugging Face alike, where the next convolution, norm or pooling takes the output), or the next module of its
    Sequential saves its input."""
    for parent, attribute, _ in slot.places:
        children = [(name, child) for name, child in parent._modules.items() if child is not None]
        if any(isinstance(module, _CONVOLUTIONAL) for module in parent.modules()):
            return True
        if isinstance(parent, torch.nn.Sequential):
            names = [name for name, _ in children]
            position = names.index(attribute)
            if position + 1 < len(children) and isinstance(children[position + 1][1], _SAVE_INPUT):
                return True
    return False


def canonical_name(name: str) -> str:
    """A module's qualified name without the ``_orig_mod`` parts that ``torch.compile`` wraps a model in: the name
    the same module has in the model that was compiled (``'_orig_mod.1'`` -> ``'1'``)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def owns_activation(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes its activation itself (class attribute ``owns_activation``, as the gated-MLP op's
    module has): an activation module among its children is not called, and few-bit conversion leaves it alone."""
    return bool(getattr(type(module), "owns_activation", False))


def _slots(model: torch.nn.Module, *, root: bool = False) -> list[Slot]:
    """Every submodule object once (in ``named_modules`` order) with all the places it occupies (:func:`..modules.
    slots`); not below few-bit modules nor below modules that :func:`owns_activation`: such a module's activation
    child is never called, so replacing it would change nothing and the report would claim it. With ``root``, a model
    that has no children (an activation module given alone) is its own slot."""
    return slots(model, descend=_descend, root=root and not model._modules)


def _descend(module: torch.nn.Module) -> bool:
    return not isinstance(module, FewBitModule) and not owns_activation(module)
