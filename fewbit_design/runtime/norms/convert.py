"""Replace the LayerNorm / RMSNorm modules of a model by memory-sharing norms, and say what was done.

Recognition is by structure, never by class name alone, and every replacement is proven on a probe first:

* candidates: ``torch.nn.LayerNorm`` (kind ``layer_norm``) and ``torch.nn.RMSNorm`` (``rms_norm``), and any other
  module without submodules whose parameters are a 1-D ``weight`` (and optionally a ``bias`` of the same shape) and
  which has a numeric ``variance_epsilon`` or ``eps`` attribute (the Hugging Face classes: LlamaRMSNorm and its
  Mistral / Qwen2 / Phi-3 copies, T5LayerNorm, Gemma's RMSNorm, ...), tried as each formula of :mod:`.ops`;
* the probe: a copy of the module with random weights (and bias) runs beside the candidate replacement on a small
  random input, in the module's dtype and in float32 / bfloat16 weight-and-input combinations (which tell LLaMA's
  cast-then-scale from T5's and Gemma's forms); the candidate is used only where the outputs agree to rounding
  (2 float32 units in the last place: 16-bit outputs equal) in every combination, dtypes included, and the float32
  gradients (input and parameters) agree to 1e-4 of their largest value. The probe draws from its own generator:
  the caller's random stream is untouched.

A module that looks like a norm (its class name holds "Norm") and is not replaced is listed with the reason in the
report (``BatchNorm`` and ``GroupNorm`` normalise over other axes than a row; a module with extra arguments or
another formula fails the probe). Memory-sharing norms already in the model are left as they are, so converting
twice changes nothing the second time.

Caveat (the price of sharing): the converted norm saves its output, so an in-place change of that output before
backward (which the native norm would have allowed) raises torch's "modified by an inplace operation" error.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
>>> model = convert(model)
>>> type(model[0]).__name__, model.norms_report.replaced
('MemorySharingNorm', {'0': 'LayerNorm as layer_norm'})
"""

from __future__ import annotations

import copy
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...errors import FewBitError, check_bits, check_positive
from ..modules import Skipped, class_path, slots, swap
from ..probe import on_stand_in
from ..report import Report
from .nn import MemorySharingNorm
from .ops import DEFAULT_THRESHOLD

__all__ = ["convert", "NormsReport"]

#: the other forms tried, in order, for a module with a 1-D weight and no bias (a bias: only ``layer_norm``)
WEIGHT_ONLY_KINDS = ("llama", "t5", "gemma", "rms_norm", "layer_norm")
PROBE_ROWS = 3
#: forward agreement on the probe, in float32 units in the last place (of the largest value): a float32 output may
#: differ by rounding, a 16-bit one must be equal (one 16-bit ulp is 2^8-2^13 float32 ulps: a 16-bit difference is
#: a different formula, e.g. another eps)
PROBE_ULPS = 2
#: gradient agreement on the float32 probe, relative to the largest gradient: the backward reconstructs xhat and
#: sums in another order, a few float32 roundings (1e-7) times the width; 1e-4 leaves room and still tells forms apart
PROBE_GRADIENT_TOLERANCE = 1e-4


@dataclass(kw_only=True)
class NormsReport(Report):
    """What :func:`convert` did: a :class:`~..report.Report` whose ``replaced`` maps a qualified name to ``"<class> as
    <kind>"`` and ``skipped`` lists the norm-like modules left alone (:class:`~..modules.Skipped`: names, class,
    reason); :attr:`left` maps each of their qualified names to the reason. Memory-sharing norms already in the model
    are left as they are, uncounted."""

    replaced: dict[str, str] = field(default_factory=dict)

    @property
    def left(self) -> dict[str, str]:
        """The qualified name of each norm-like module left alone -> the reason."""
        return {name: item.reason for item in self.skipped for name in item.names}

    def head(self) -> str:
        return f"memory-sharing norms: replaced {self.count} module(s), left {len(self.left)} alone"

    def replaced_lines(self) -> list[str]:
        return [f"  {name or '(model)'}: {what}" for name, what in self.replaced.items()]

    def left_lines(self) -> list[str]:
        return [f"  left {name or '(model)'}: {reason}" for name, reason in self.left.items()]


Builder = Callable[[torch.nn.Module], MemorySharingNorm]


def _candidates(module: torch.nn.Module, threshold: float) -> list[tuple[str, Builder]] | str:
    """``[(kind, build)]`` for the forms ``module`` may compute (``build(m)`` makes the replacement from module ``m``
    of the same structure, sharing its parameters), or the reason it is no candidate."""
    if isinstance(module, MemorySharingNorm):
        return "already a memory-sharing norm"
    if any(True for _ in module.children()):
        return "has submodules (a norm is one module with a weight and an eps)"
    if isinstance(module, torch.nn.LayerNorm | torch.nn.RMSNorm):
        kind = "layer_norm" if isinstance(module, torch.nn.LayerNorm) else "rms_norm"

        def build_torch(m: torch.nn.Module, kind: str = kind) -> MemorySharingNorm:
            return MemorySharingNorm(
                m.normalized_shape, kind=kind, eps=m.eps, weight=m.weight, bias=getattr(m, "bias", None),
                threshold=threshold,
            )  # fmt: skip

        return [(kind, build_torch)]
    parameters = dict(module.named_parameters(recurse=False))
    weight = parameters.get("weight")
    if weight is None or weight.dim() != 1:
        return "no 1-D weight parameter (not a per-row LayerNorm / RMSNorm)"
    if set(parameters) - {"weight", "bias"}:
        return f"parameters {sorted(parameters)} beyond weight and bias"
    bias = parameters.get("bias")
    if bias is not None and bias.shape != weight.shape:
        return f"bias of shape {tuple(bias.shape)} beside a weight of shape {tuple(weight.shape)}"
    attribute = next((name for name in ("variance_epsilon", "eps") if hasattr(module, name)), None)
    eps = getattr(module, attribute) if attribute else None
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        return "no numeric eps attribute (variance_epsilon or eps)"

    def builder(kind: str) -> Builder:
        def build(m: torch.nn.Module) -> MemorySharingNorm:
            return MemorySharingNorm(
                tuple(m.weight.shape), kind=kind, eps=float(getattr(m, attribute)), weight=m.weight,
                bias=getattr(m, "bias", None) if bias is not None else None, threshold=threshold,
            )  # fmt: skip

        return build

    kinds = ("layer_norm",) if bias is not None else WEIGHT_ONLY_KINDS
    return [(kind, builder(kind)) for kind in kinds]


def _settings(dtype: torch.dtype) -> list[tuple[torch.dtype, torch.dtype]]:
    """(parameter dtype, input dtype) pairs of the probe."""
    pairs = [(dtype, dtype), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)]
    pairs.append((torch.bfloat16, torch.bfloat16))
    return list(dict.fromkeys(pairs))


def _agree(native: torch.Tensor, ours: torch.Tensor) -> bool:
    if native.dtype != ours.dtype or native.shape != ours.shape:
        return False
    if not native.is_floating_point():
        return torch.equal(native, ours)
    scale = float(native.detach().abs().max()) if native.numel() else 0.0
    ulp = torch.finfo(torch.float32).eps * PROBE_ULPS  # of float32 whatever the dtype: 16-bit outputs must be equal
    return torch.allclose(native, ours, rtol=ulp, atol=ulp * scale)


def _probe(module: torch.nn.Module, build: Builder, kind: str) -> str | None:
    """None when the replacement of ``kind`` built by ``build`` agrees with ``module`` on the probe; else what
    differed. A module of fake tensors is probed as a real copy of the same shapes and dtypes on CPU
    (:func:`..probe.on_stand_in`): the probe draws its own weights and input, so it decides as on the real module."""

    def probe(module: torch.nn.Module) -> str | None:
        generator = torch.Generator().manual_seed(0)
        device = next(module.parameters(), torch.empty(0)).device
        dtype = next(module.parameters(), torch.empty(0)).dtype
        for parameter_dtype, input_dtype in _settings(dtype):
            with warnings.catch_warnings():  # torch warns about the mixed-dtype combinations it then runs unfused
                warnings.simplefilter("ignore", UserWarning)
                failure = _probe_one(module, build, parameter_dtype, input_dtype, generator, device)
            if failure is not None:
                return failure
        return None

    return on_stand_in(probe, module, key=(kind,))


def _probe_one(
    module: torch.nn.Module,
    build: Builder,
    parameter_dtype: torch.dtype,
    input_dtype: torch.dtype,
    generator: torch.Generator,
    device: torch.device,
) -> str | None:
    """One (parameter dtype, input dtype) combination of :func:`_probe`."""
    shape = getattr(module, "normalized_shape", None) or tuple(module.weight.shape)
    # every parameter of the copy requires grad, frozen or not in the model: the probe checks the formula's
    # gradients (a frozen norm may be unfrozen later, and the replacement shares the model's parameters as they are)
    original = copy.deepcopy(module).to(parameter_dtype).requires_grad_(True)
    with torch.no_grad():
        for parameter in original.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5 + 0.25)
    replacement = build(original)
    # 3-D (batch, rows, *shape), rows unlike the first normalised size: a norm over other axes (GroupNorm,
    # InstanceNorm, BatchNorm) then raises or differs instead of passing for a LayerNorm
    rows = PROBE_ROWS if shape[0] != PROBE_ROWS else PROBE_ROWS + 1
    x = (torch.randn((2, rows, *shape), generator=generator) + 0.5).to(device, input_dtype)
    results = []
    for candidate in (original, replacement):
        leaf = x.clone().requires_grad_()
        try:
            y = candidate(leaf)
        except Exception as error:  # noqa: BLE001  (the original may take other arguments: no agreement)
            results.append(type(error).__name__)
            continue
        if not isinstance(y, torch.Tensor):
            results.append(f"a {type(y).__name__}")
            continue
        grads = ()
        if parameter_dtype == input_dtype == torch.float32:
            upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device, y.dtype)
            grads = torch.autograd.grad(y, [leaf, *original.parameters()], upstream, allow_unused=True)
        results.append((y.detach(), grads))
    native, ours = results
    if isinstance(native, str) and isinstance(ours, str):
        return None  # neither runs with these dtypes (a mixed-dtype LayerNorm, for one)
    if isinstance(native, str) or isinstance(ours, str):
        who, what = ("the module", native) if isinstance(native, str) else ("the replacement", ours)
        return f"with {parameter_dtype} parameters and {input_dtype} input {who} alone raised {what}"
    if not _agree(native[0], ours[0]):
        return f"its output differs with {parameter_dtype} parameters and {input_dtype} input"
    for reference, grad in zip(native[1], ours[1], strict=True):
        if (reference is None) != (grad is None):
            return "its gradients reach other tensors"
        if reference is None:
            continue
        scale = float(reference.abs().max()) or 1.0
        if float((reference - grad).abs().max()) > PROBE_GRADIENT_TOLERANCE * scale:
            return "its float32 gradients differ"
    return None


def _replacement(module: torch.nn.Module, threshold: float) -> tuple[MemorySharingNorm | None, str]:
    """(replacement, "<class> as <kind>") or (None, reason)."""
    candidates = _candidates(module, threshold)
    if isinstance(candidates, str):
        return None, candidates
    failures = []
    for kind, build in candidates:
        failure = _probe(module, build, kind)
        if failure is None:
            return build(module), f"{type(module).__name__} as {kind}"
        failures.append(f"{kind}: {failure}")
    return None, "no known norm form agrees on the probe (" + "; ".join(failures) + ")"


def _norm_like(module: torch.nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not isinstance(module, MemorySharingNorm)


def convert(
    model: torch.nn.Module, *, threshold: float = DEFAULT_THRESHOLD, bits: int | None = None
) -> torch.nn.Module:
    """Replace, in place, every LayerNorm / RMSNorm of ``model`` proven equal on the probe (see the module
    docstring) by a :class:`~.nn.MemorySharingNorm` sharing its parameters; return the model, with
    ``model.norms_report`` (a :class:`NormsReport`). A model that is itself a norm is returned replaced (use the
    return value). ``threshold``: see :mod:`.ops` (channels with ``|w| < threshold * (|b| + tiny / eps)`` keep
    their normalised input). ``bits``: None (exact), or 2..8 for the compressed mode (the output kept as group
    codes shared with the compressed linears reading it; approximate gradients; the probe is exact mode's)."""
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"norms.convert takes a torch.nn.Module, got {type(model).__name__}")
    threshold = check_positive("norms threshold", threshold)
    if bits is not None:
        bits = check_bits(bits, low=2, high=8)
    report = NormsReport()
    found = slots(model)
    replacements: dict[int, torch.nn.Module] = {}
    for slot in found:
        module = slot.module
        replacement, what = (None, "") if isinstance(module, MemorySharingNorm) else _replacement(module, threshold)
        if replacement is not None:
            if bits is not None:
                replacement.bits = bits
                what = f"{what}, {bits}-bit output codes"
            replacements[id(module)] = replacement
        if replacement is not None:
            report.replaced.update(dict.fromkeys(slot.names, what))
        elif what and _norm_like(module):
            report.skipped.append(Skipped(slot.names, class_path(type(module)), what))
    result = swap(model, found, replacements)
    result.norms_report = report
    return result
