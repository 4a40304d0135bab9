"""Find the gated MLPs of a model by structure and replace them with :class:`~.nn.GatedMLP`, saying what was done.

A module is a *candidate* when it has the linears of one of :data:`~.nn.LAYOUTS` as children (``gate_proj`` /
``up_proj`` / ``down_proj``: LLaMA, Mistral, Qwen2, Gemma; ``wi_0`` / ``wi_1`` / ``wo``: T5 v1.1; ``w1`` / ``w3`` /
``w2``: Mixtral's experts; ``gate_up_proj`` / ``down_proj``: Phi-3) and an activation child (``act_fn``, ``act``,
``activation_fn`` or ``activation``). It is replaced only when all of these hold, else it is left alone with the
reason in the report:

* the linears are plain ``torch.nn.Linear`` (not a quantized or adapter subclass) of matching shapes, on one dtype,
  not on the meta device, and neither they nor the module carry hooks (the op would bypass them); the module holds no
  parameter or buffer of its own, and its ``forward`` takes the input alone (the replacement takes nothing else);
* the activation is one the op computes exactly (SiLU, GELU, GELU tanh, ReLU; recognised as
  ``runtime.convert`` recognises activations, so ``transformers.activations`` classes count) and not few-bit already;
* no dropout with p > 0 sits among its children (the op has none), and no other child holds parameters (they
  would get no gradient);
* a numerical probe agrees: the original and the replacement run on the same small random input (with the module's
  weights, or random ones where the output is all zero) and give the same output within the dtype's rounding
  (:data:`PROBE_TOLERANCE`). So a module with this layout whose forward computes something else is left alone.

The replacement holds the original children under their own names, so parameters and ``state_dict`` keys do not
change. Applying :func:`convert` again changes nothing (a :class:`~.nn.GatedMLP` is no candidate).

>>> import torch
>>> class MLP(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.gate_proj, self.up_proj = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8)
...         self.down_proj, self.act_fn = torch.nn.Linear(8, 4), torch.nn.SiLU()
...     def forward(self, x):
...         return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
>>> model = convert(torch.nn.Sequential(MLP()))
>>> type(model[0]).__name__, str(model.gated_report).splitlines()[0]
('GatedMLP', 'gated MLP: replaced 1 module(s), left 0 alone')
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...errors import FewBitError, check_choice
from ..fewbit.convert import _recognise
from ..fewbit.nn import FewBitModule
from ..linear.quant import GROUP_SIZE, check_options
from ..modules import class_path as _class_path
from ..modules import decide, slots, swap, warn_nothing_replaced
from ..modules import has_hooks as _has_hooks
from ..probe import on_stand_in
from ..report import Report
from .nn import LAYOUTS, MODES, GatedMLP, Layout

__all__ = ["convert", "GatedReport", "PROBE_TOLERANCE", "ACTIVATION_ATTRIBUTES"]

#: the attribute names under which a gated MLP keeps its activation module
ACTIVATION_ATTRIBUTES = ("act_fn", "act", "activation_fn", "activation")

#: relative tolerance of the probe per dtype: the op runs the same torch kernels as the usual forward, so it agrees
#: bitwise with a module that calls torch's own activation; a module that writes the activation out (e.g.
#: transformers' NewGELUActivation, the tanh formula in Python) differs by a few roundings of its dtype. 16-bit: a few
#: units of bfloat16's 2^-8 relative rounding; 32/64-bit: 1e-4, far above rounding, far below a different function.
PROBE_TOLERANCE = {torch.float16: 3e-2, torch.bfloat16: 3e-2, torch.float32: 1e-4, torch.float64: 1e-4}

# (registry activation, approximate) as runtime.convert recognises it -> the op's activation
_OP_ACTIVATIONS = {
    ("silu", "none"): "silu",
    ("gelu", "none"): "gelu",
    ("gelu", "tanh"): "gelu_tanh",
    ("relu", "none"): "relu",
}
_SUPPORTED = "SiLU, GELU, GELU tanh, ReLU"
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class Replaced:
    """One gated MLP that was replaced (``names``: every name it has in the model)."""

    names: tuple[str, ...]
    original: str
    activation: str
    fused: bool


@dataclass(kw_only=True)
class GatedReport(Report):
    """What :func:`convert` did (``model.gated_report``): a :class:`~..report.Report` whose ``replaced`` are the gated
    MLPs replaced (:class:`Replaced`: names, class, layout), ``skipped`` the candidates left alone with the reason and
    ``already`` how many were converted already.

    Attributes:
        mode: the mode the replacements run (``"exact"``, ``"compressed"`` or ``"recompute"``)
        bits: the bits of the codes (unused in exact mode)
    """

    mode: str = "exact"
    bits: int = 8

    ALREADY: ClassVar[str] = "module(s) were GatedMLP already"

    def head(self) -> str:
        return f"gated MLP: {super().head()}"

    def replaced_lines(self) -> list[str]:
        lines = []
        kept = {
            "exact": "saves x, gate, up",
            "compressed": f"compressed: saves {self.bits}-bit codes of x, gate, up",
            "recompute": f"recompute: saves {self.bits}-bit codes of x, rebuilds gate and up",
        }[self.mode]
        for (original, activation, fused), count in Counter(
            (item.original, item.activation, item.fused) for item in self.replaced
        ).items():
            layout = ", fused gate_up" if fused else ""
            lines.append(f"  {count} x {original} -> GatedMLP ({activation}{layout}; {kept})")
        return lines


def _layout(module: torch.nn.Module) -> Layout | None:
    children = module._modules
    for layout in LAYOUTS:
        wanted = (layout.gate, layout.down) if layout.up is None else (layout.gate, layout.up, layout.down)
        if all(children.get(name) is not None for name in wanted):
            return layout
    return None


def _extra_forward_parameters(module: torch.nn.Module) -> list[str]:
    """The parameters of ``module.forward`` beyond its one input (the replacement takes only that)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the probe decides
        return []
    extra = parameters[1:] if parameters and parameters[0].kind in _POSITIONAL else parameters
    return [str(parameter) for parameter in extra]


def _activation_of(module: torch.nn.Module) -> tuple[str, str] | str:
    """(attribute, op activation) or the reason why the module's activation cannot be taken."""
    found = [name for name in ACTIVATION_ATTRIBUTES if module._modules.get(name) is not None]
    if not found:
        return f"no activation module under {', '.join(ACTIVATION_ATTRIBUTES)} (a functional activation is not seen)"
    attribute = found[0]
    act = module._modules[attribute]
    if isinstance(act, FewBitModule):
        return f"its activation {attribute!r} is few-bit already (apply the gated op before few-bit activations)"
    recognised = _recognise(act)
    if recognised is None or isinstance(recognised, str):
        return f"its activation {attribute!r} ({_class_path(type(act))}) is not one the op computes " + (
            f"({_SUPPORTED})" if recognised is None else f"({recognised})"
        )
    key = (recognised.activation, recognised.params.get("approximate", "none"))
    if key not in _OP_ACTIVATIONS:
        return f"its activation {attribute!r} ({_class_path(type(act))}) is not one the op computes ({_SUPPORTED})"
    return attribute, _OP_ACTIVATIONS[key]


def _check_structure(module: torch.nn.Module, layout: Layout, attribute: str) -> str | None:
    """The reason why the module's structure rules the op out, or None."""
    if _has_hooks(module):
        return "it has hooks, which the replacement would not run"
    own = [name for name, tensor in [*module._parameters.items(), *module._buffers.items()] if tensor is not None]
    if own:
        return f"it holds parameters or buffers of its own ({', '.join(own)}), outside the pattern"
    extra = _extra_forward_parameters(module)
    if extra:
        return f"its forward takes more than the input ({', '.join(extra)}), which the replacement would not take"
    roles = [name for name in (layout.gate, layout.up, layout.down) if name is not None]
    linears = [module._modules[name] for name in roles]
    for name, linear in zip(roles, linears, strict=True):
        if type(linear) is not torch.nn.Linear:
            return f"{name!r} is {_class_path(type(linear))}, not torch.nn.Linear"
        if _has_hooks(linear):
            return f"{name!r} has hooks, which the replacement would not run"
    gate, down = module._modules[layout.gate], module._modules[layout.down]
    width = gate.out_features // 2 if layout.up is None else gate.out_features
    if layout.up is None and gate.out_features % 2:
        return f"{layout.gate!r} has an odd number of outputs ({gate.out_features}): no gate and up halves"
    if layout.up is not None:
        up = module._modules[layout.up]
        if (up.in_features, up.out_features) != (gate.in_features, gate.out_features):
            return (
                f"{layout.up!r} ({up.in_features} -> {up.out_features}) does not match {layout.gate!r} "
                f"({gate.in_features} -> {gate.out_features})"
            )
    if down.in_features != width:
        return f"{layout.down!r} takes {down.in_features} features but the product has {width}"
    parameters = [p for linear in linears for p in linear.parameters()]
    if any(p.is_meta for p in parameters):
        return "its parameters are on the meta device (nothing to probe)"
    if len({p.dtype for p in parameters}) > 1 or len({p.device for p in parameters}) > 1:
        kinds = sorted({f"{p.dtype} on {p.device}" for p in parameters})
        return f"its linears mix dtypes or devices ({', '.join(kinds)}); the op takes one"
    for name, child in module._modules.items():
        if child is None or name in roles or name == attribute:
            continue
        if isinstance(child, torch.nn.modules.dropout._DropoutNd):
            if child.p > 0:
                return f"dropout {name!r} (p={child.p}) between the product and {layout.down!r}: the op has no dropout"
        elif any(True for _ in child.parameters()):
            return f"child {name!r} ({_class_path(type(child))}) holds parameters outside the pattern"
    return None


def _agrees(original: torch.nn.Module, replacement: GatedMLP, layout: Layout) -> str | None:
    """Run both on a small random input; None when they agree, else the reason."""
    gate = original._modules[layout.gate]
    dtype, device = gate.weight.dtype, gate.weight.device
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, gate.in_features, generator=generator, device=device, dtype=torch.float32).to(dtype)
    tolerance = PROBE_TOLERANCE.get(dtype, 1e-4)
    try:
        with torch.no_grad():
            native, ours = original(x), replacement(x)
            if isinstance(native, torch.Tensor) and native.shape == ours.shape and not bool(native.any()):
                # all zero (a zero-initialised projection): probe the function with random weights instead
                weights = {
                    name: torch.randn(p.shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
                    for name, p in replacement.named_parameters()
                }
                native = torch.func.functional_call(original, weights, (x,))
                ours = torch.func.functional_call(replacement, weights, (x,))
    except Exception as exc:  # a forward that cannot take a (3, H) tensor is not the pattern
        return f"the probe failed to run it on a (3, {gate.in_features}) input ({type(exc).__name__}: {exc})"
    if not isinstance(native, torch.Tensor) or native.shape != ours.shape:
        return "its forward does not return one tensor of the pattern's shape on the probe"
    scale = float(native.abs().max()) if native.numel() else 0.0
    error = float((native.float() - ours.float()).abs().max()) if native.numel() else 0.0
    if not error <= tolerance * max(scale, 1e-30):  # NaN error counts as disagreement
        return (
            f"its forward is not down(act(gate(x)) * up(x)) on a probe: max difference {error:.3g} against "
            f"{tolerance:g} x {scale:.3g}"
        )
    return None


def _candidate(module: torch.nn.Module, options: dict) -> GatedMLP | str | None:
    """The replacement, the reason to leave the module alone, or None when it is not gated-MLP shaped."""
    layout = _layout(module)
    if layout is None:
        return None
    activation = _activation_of(module)
    if isinstance(activation, str):
        return activation
    attribute, op_activation = activation
    reason = _check_structure(module, layout, attribute)
    if reason is not None:
        return reason
    children = {name: child for name, child in module._modules.items() if child is not None}
    replacement = GatedMLP(children, layout, op_activation, original=_class_path(type(module)), **options)
    replacement.train(module.training)
    # fake weights: the probe runs on real copies (random weights), once per structure
    return on_stand_in(lambda *probed: _agrees(*probed, layout), module, replacement, key=(layout,)) or replacement


def convert(
    model: torch.nn.Module, *, mode: str = "exact", bits: int = 8, rounding: str = "stochastic"
) -> torch.nn.Module:
    """Replace the gated MLPs of ``model`` (in place) by :class:`~.nn.GatedMLP`; returns the model.

    ``mode``: ``"exact"`` (keep x, gate and up; exact gradients), ``"compressed"`` (``bits``-bit group codes of x,
    gate and up, 2 to 8 bits, act(gate) and act'(gate) recomputed from gate's: exact forward, approximate gradients; see
    :mod:`.compressed`) or ``"recompute"`` (``bits``-bit group codes of x alone, gate and up recomputed from them in
    backward: two matmuls more; :mod:`.recompute`); ``rounding``: the codes', ``"stochastic"`` (unbiased, the
    default) or ``"nearest"``. A module that is a :class:`~.nn.GatedMLP` already keeps its mode.

    The report (:class:`GatedReport`: what was replaced, what was left alone and why) is ``model.gated_report``. A
    model that is itself a gated MLP cannot be changed in place: its replacement is returned (use the return value).
    A model in which nothing was replaced gives a warning. See the module docstring for what is recognised.
    """
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"gated.convert takes a torch.nn.Module, got {type(model).__name__}")
    bits, _, rounding = check_options(bits, GROUP_SIZE, rounding)
    options = {"mode": check_choice("gated MLP mode", mode, MODES), "bits": bits, "rounding": rounding}
    found = slots(model, descend=lambda module: not isinstance(module, GatedMLP))
    with torch.inference_mode(False):
        decisions = decide(found, lambda module: _candidate(module, options), GatedMLP)
    replaced = [
        Replaced(slot.names, replacement.original, replacement.activation, replacement.layout.up is None)
        for slot, replacement in decisions.replaced
    ]
    report = GatedReport(
        replaced=replaced,
        skipped=decisions.skipped,
        already=decisions.already,
        mode=options["mode"],
        bits=options["bits"],
    )
    converted = swap(model, found, decisions.replacements)
    converted.gated_report = report
    if not report.replaced and not report.already:
        warn_nothing_replaced("gated.convert", model, report.skipped, "it has no gated MLP the op recognises")
    return converted
