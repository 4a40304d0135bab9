"""``runtime.convert``: every exact module technique that pays off, few-bit activations for what is left, and
(opt-in) compressed linear inputs, applied to an existing model, with one report of what was done and measured.

Techniques, in registry order (:data:`fewbit_design.runtime.registry.REGISTRY`), each with a switch:

* ``norms`` (default on): LayerNorm / RMSNorm, the Hugging Face classes included, keep only their output and row
  statistics (:mod:`.norms.convert`; exact gradients);
* ``gated`` (default on): gated MLPs ``down(act(gate(x)) * up(x))`` keep x, gate and up (:mod:`.gated.convert`;
  exact gradients);
* ``attention`` (default on): Hugging Face SDPA attention cores keep the value projection's input (which q_proj and
  k_proj keep anyway) instead of v and rebuild v in backward (:mod:`.attention.exact`; exact gradients);
* ``activations`` (default on): the activation modules left keep b-bit codes of their derivative
  (:mod:`.fewbit.convert`, whose keywords ``bits``, ``weight``, ``mode``, ``filter``, ``tables``,
  ``only_if_smaller``, ``strict`` keep their meaning; approximate activation gradients);
* ``compress=K`` (default None, off): the norms keep K-bit group codes of their output instead of the output (shared
  with the compressed linears that read it: one set of codes for a norm and q, k, v in eager; approximate
  gradients), ``nn.Linear`` / ``Conv1D`` keep K-bit group codes of their input
  (:mod:`.linear.convert`; approximate weight gradients), and the gated MLPs run the gated op's compressed mode
  (K-bit codes of x, act(gate) and up, few-bit codes of act'(gate); approximate gradients), and the Hugging Face
  SDPA attention cores keep K-bit codes of q, k and v and recompute the attention in backward (:mod:`.attention`;
  exact forward, approximate gradients).

Never more memory: with a probe (``example_inputs``, or for a Hugging Face ``PreTrainedModel`` inputs built from its
config, caches off while probing) the bytes saved for backward by one training step are measured before and after
each technique, and a technique that does not reduce them is undone, with the reason in the report. Without a probe,
the rules each converter has (few-bit's ``only_if_smaller`` rule) apply.

The report, ``model.convert_report`` (:class:`ConvertReport`), holds per technique what was replaced and left (the
technique's own report, still set as ``model.norms_report``, ``model.gated_report``, ``model.fewbit_report``,
``model.linear_report``), the bytes measured and which gradients are approximate; and what convert could not see:
activation functions called functionally in a module's forward (``F.gelu`` in Whisper's convolutional stem), found by
running the probe under a ``TorchFunctionMode`` that attributes every call to the innermost running module. A model
converted again keeps one report: the last call's, holding the earlier calls' applied techniques
(:attr:`ConvertReport.earlier`), so that ``applied`` and ``approximate`` describe the model as it is.

>>> import torch
>>> from fewbit_design import runtime
>>> model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
>>> model = runtime.convert(model, example_inputs=torch.randn(4, 8))                # doctest: +SKIP
>>> print(model.convert_report)                                                      # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..design import activations as _activations
from ..errors import FewBitError, check_boolean, check_integer
from . import memory, registry
from .fewbit.convert import (
    Filter,
    _check_filter,
    _check_options,
    _check_table_names,
    _check_tables,
    _example_errors,
    _no_side_effects,
)
from .fewbit.lookup import TableLike
from .fewbit.matching import _recognise, _run_example, _slots

__all__ = ["convert", "ConvertReport", "TechniqueReport", "FunctionalCall"]

logger = logging.getLogger("fewbit_design.runtime.convert")

REPORT_MESSAGE = (
    "convert(report={report!r}): convert always returns the model; the report of the conversion is the attribute "
    "model.convert_report of the returned model (the activations' alone: model.fewbit_report) (drop report=)"
)

#: the switch of each technique convert applies, by registry name
SWITCHES = {"norms": "norms", "gated": "gated", "attention": "attention", "fewbit": "activations", "linear": "compress"}
#: which gradients each technique makes approximate (None: exact up to rounding); the attention cores' only under
#: compress=K
APPROXIMATE = {
    "fewbit": "activation gradients (few-bit tables)",
    "linear": "weight gradients of compressed linears",
}
#: the report attribute each technique's converter sets
REPORT_ATTRIBUTES = {
    "norms": "norms_report",
    "gated": "gated_report",
    "attention": "attention_report",
    "fewbit": "fewbit_report",
    "linear": "linear_report",
}
#: the probe built for a Hugging Face model: batch, tokens
PROBE_BATCH, PROBE_TOKENS = 2, 8
#: the functions looked for in forward code (every activation of the design registry, and the in-place forms)
FUNCTIONAL_NAMES = frozenset(_activations.names()) | {f"{name}_" for name in _activations.names()}


# ----------------------------------------------------------------------------------------------------------------------
# Report


@dataclass
class TechniqueReport:
    """One technique in one :func:`convert` call.

    ``status``: ``"applied"`` (kept), ``"undone"`` (applied, measured no smaller, restored), ``"nothing"`` (nothing
    to replace), ``"off"`` (switched off). ``report``: the technique's own report (what it replaced and left, and
    why). ``before`` / ``after``: bytes saved for backward by one training step on the probe, when measured.
    """

    name: str
    status: str
    replaced: int = 0
    reason: str = ""
    approximate: str | None = None
    before: int | None = None
    after: int | None = None
    report: Any = None

    def __str__(self) -> str:
        head = f"{self.name}: {self.status}"
        if self.replaced:
            head += f", {self.replaced} replacement(s)"
        if self.before is not None and self.after is not None:
            head += (
                f", saved for backward {self.before} -> {self.after} bytes ({self.after / max(self.before, 1):.2f}x)"
            )
        head += f"; gradients {'approximate: ' + self.approximate if self.approximate else 'exact'}"
        lines = [head]
        if self.reason:
            lines.append(f"  {self.reason}")
        if self.report is not None and self.status != "off":
            lines += ["  " + line for line in str(self.report).splitlines()]
        return "\n".join(lines)


@dataclass(frozen=True)
class FunctionalCall:
    """An activation function called in a module's forward code (not a module, so convert could not replace it)."""

    module: str
    module_class: str
    function: str
    calls: int


@dataclass
class ConvertReport:
    """What :func:`convert` did: ``techniques`` in the order applied, the ``probe`` (what was run to measure, or
    why nothing was), ``before`` / ``after`` (bytes saved for backward by one training step, when measured) and
    ``unseen`` (activation functions called functionally, which no module replacement can reach).

    A model converted more than once keeps one report: that of the last call, which also holds ``earlier`` (the
    entries of the techniques applied by the earlier calls, oldest first, still in the model) and ``calls`` (how
    many convert calls the model had). ``techniques``, ``probe``, ``before``, ``after`` and ``unseen`` are the last
    call's; :attr:`applied` and :attr:`approximate` are of the model as it is now (every call's)."""

    techniques: list[TechniqueReport] = field(default_factory=list)
    probe: str = "none"
    before: int | None = None
    after: int | None = None
    unseen: list[FunctionalCall] = field(default_factory=list)
    earlier: list[TechniqueReport] = field(default_factory=list)
    calls: int = 1

    def technique(self, name: str) -> TechniqueReport:
        """The last call's entry of technique ``name`` (``norms``, ``gated``, ``attention``, ``fewbit``,
        ``linear``)."""
        for item in self.techniques:
            if item.name == name:
                return item
        raise FewBitError(f"no technique {name!r} in this report: it has {', '.join(t.name for t in self.techniques)}")

    @property
    def applied(self) -> tuple[str, ...]:
        """The techniques kept in the model (by any convert call on it)."""
        return tuple(dict.fromkeys(item.name for item in self._held()))

    @property
    def approximate(self) -> dict[str, str]:
        """Technique -> which gradients it makes approximate, for the techniques kept (by any call)."""
        texts: dict[str, list[str]] = {}
        for item in self._held():
            if item.approximate and item.approximate not in texts.setdefault(item.name, []):
                texts[item.name].append(item.approximate)
        return {name: "; ".join(found) for name, found in texts.items() if found}

    def _held(self) -> list[TechniqueReport]:
        return self.earlier + [item for item in self.techniques if item.status == "applied"]

    def merge_earlier(self, previous: ConvertReport) -> ConvertReport:
        """Make this report (a new call's) the one report of the model: the techniques ``previous`` holds as applied
        become :attr:`earlier` (before any already there) and its calls are counted in :attr:`calls`. Returns self.

        Args:
            previous: the model's report before this call.
        """
        held = previous.earlier + [item for item in previous.techniques if item.status == "applied"]
        self.earlier = held + self.earlier
        self.calls += previous.calls
        return self

    def __str__(self) -> str:
        this_call = [item.name for item in self.techniques if item.status == "applied"]
        head = f"convert: applied {', '.join(this_call) or 'nothing'}"
        if self.calls > 1:
            head += f" (call {self.calls} on this model; it holds {', '.join(self.applied) or 'nothing'})"
        lines = [f"{head}; probe: {self.probe}"]
        if self.before is not None and self.after is not None:
            ratio = self.after / max(self.before, 1)
            by = " by this call" if self.calls > 1 else ""
            lines.append(
                f"saved for backward by one training step{by}: {self.before} -> {self.after} bytes ({ratio:.2f}x)"
            )
        lines += [str(item) for item in self.techniques]
        if self.unseen:
            lines.append("could not see (activation functions called in forward code, not modules; left exact):")
            for call in self.unseen:
                lines.append(f"  {call.module or '(model)'} ({call.module_class}): {call.function} x {call.calls}")
        if self.earlier:
            lines.append(f"applied by the {self.calls - 1} earlier call(s) (still in the model):")
            lines += ["  " + line for item in self.earlier for line in str(item).splitlines()]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------------
# The probe: example inputs, or inputs built from a Hugging Face config


def _huggingface_probe(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor] | None, str]:
    """(inputs for one forward, description) for a transformers PreTrainedModel; (None, why not) otherwise."""
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    if pretrained is None or not isinstance(model, pretrained):
        return None, "none (no example_inputs, and not a Hugging Face PreTrainedModel): nothing measured"
    config = model.config
    text = getattr(config, "text_config", None) or config
    vision = getattr(config, "vision_config", None) or config
    try:
        accepted = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        accepted = {}
    parameter = next(iter(model.parameters()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    generator = torch.Generator().manual_seed(0)

    def tokens(vocab: int, limit: Any) -> torch.Tensor:
        length = min(PROBE_TOKENS, int(limit)) if isinstance(limit, int) and limit > 0 else PROBE_TOKENS
        return torch.randint(0, int(vocab), (PROBE_BATCH, length), generator=generator).to(device)

    def floats(*shape: int) -> torch.Tensor:
        return torch.randn((PROBE_BATCH, *shape), generator=generator).to(device, dtype)

    inputs: dict[str, torch.Tensor] = {}
    positions = next(
        (getattr(text, key) for key in ("max_position_embeddings", "n_positions") if hasattr(text, key)), None
    )
    if "input_ids" in accepted and getattr(text, "vocab_size", None):
        inputs["input_ids"] = tokens(text.vocab_size, positions)
    if "pixel_values" in accepted and hasattr(vision, "image_size"):
        size = vision.image_size if isinstance(vision.image_size, int) else tuple(vision.image_size)[0]
        inputs["pixel_values"] = floats(getattr(vision, "num_channels", 3), size, size)
    if "input_features" in accepted and hasattr(config, "num_mel_bins"):
        inputs["input_features"] = floats(config.num_mel_bins, 2 * config.max_source_positions)
    if "decoder_input_ids" in accepted and getattr(config, "is_encoder_decoder", False):
        limit = getattr(config, "max_target_positions", positions)
        inputs["decoder_input_ids"] = tokens(getattr(text, "vocab_size", 2) or 2, limit)
    if not inputs:
        return None, f"none (no probe could be built from the {type(config).__name__}): nothing measured"
    shapes = ", ".join(f"{key} {tuple(value.shape)}" for key, value in inputs.items())
    return inputs, f"built from {type(config).__name__} ({shapes}), caches off"


@contextlib.contextmanager
def _caches_off(model: torch.nn.Module) -> Iterator[None]:
    """``use_cache = False`` on a Hugging Face model's config (and its sub-configs) while probing; restored."""
    config = getattr(model, "config", None)
    configs = [c for c in (config, getattr(config, "text_config", None)) if c is not None and hasattr(c, "use_cache")]
    saved = [(c, c.use_cache) for c in configs]
    for c in configs:
        c.use_cache = False
    try:
        yield
    finally:
        for c, value in saved:
            c.use_cache = value


def _loss(output: Any) -> torch.Tensor | None:
    """A scalar to run backward from: the output's ``loss`` when it has one, else the sum of its float tensors that
    require grad."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    found: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.requires_grad and value.is_floating_point():
                found.append(value.float().sum())
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, tuple | list):
            for item in value:
                walk(item)

    walk(output)
    return torch.stack(found).sum() if found else None


def _step_bytes(model: torch.nn.Module, inputs: Any) -> int:
    """Bytes saved for backward by one training step (forward, then backward) on ``inputs``; the model's gradients,
    buffers and the random state are as they were."""
    parameters = list(model.parameters())
    grads = [p.grad for p in parameters]
    try:
        for p in parameters:
            p.grad = None
        with _no_side_effects(model), torch.enable_grad():
            with memory.saved_bytes(model) as saved:
                output = _run_example(model, inputs)
            loss = _loss(output)
            if loss is not None:
                loss.backward()
    finally:
        for p, grad in zip(parameters, grads, strict=True):
            p.grad = grad
    return saved.total


# ----------------------------------------------------------------------------------------------------------------------
# What convert could not see: activation functions called in forward code


class _FunctionalActivations(TorchFunctionMode):
    """Counts calls of activation functions per innermost running module (a stack kept by forward hooks)."""

    def __init__(self, stack: list[tuple[str, torch.nn.Module]]) -> None:
        super().__init__()
        self.stack = stack
        self.calls: Counter[tuple[str, str, str]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in FUNCTIONAL_NAMES and not any(_sees_itself(module) for _, module in self.stack):
            where, module = self.stack[-1] if self.stack else ("", None)
            owner = type(module).__qualname__ if module is not None else "?"
            self.calls[where, owner, _function_name(func, name)] += 1
        return func(*args, **(kwargs or {}))


def _function_name(func: Any, name: str) -> str:
    """``torch.nn.functional.gelu`` for the builtin ``torch._C._nn.gelu``, ``torch.Tensor.relu`` for the method."""
    owner = getattr(func, "__module__", None) or ""
    if owner in ("torch._C._nn", "torch.nn.functional", ""):
        owner = "torch.nn.functional" if owner else "torch.Tensor"
    elif owner.startswith("torch._C"):
        owner = "torch"
    return f"{owner}.{name}"


def _sees_itself(module: torch.nn.Module) -> bool:
    """Calls inside this module are its own business: an activation module (replaced or not, convert saw it) or a
    module of this runtime (few-bit, gated, norms, linear)."""
    return type(module).__module__.startswith("fewbit_design.") or _recognise(module) is not None


def _functional_calls(model: torch.nn.Module, inputs: Any) -> list[FunctionalCall]:
    stack: list[tuple[str, torch.nn.Module]] = []
    handles = []
    for name, module in model.named_modules():

        def push(module, _inputs, _name=name):
            stack.append((_name, module))

        def pop(module, _inputs, _outputs, _name=name):
            if stack and stack[-1][0] == _name:
                stack.pop()

        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop, always_call=True))
    mode = _FunctionalActivations(stack)
    try:
        with _no_side_effects(model), torch.no_grad(), mode:
            _run_example(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return [FunctionalCall(where, owner, function, count) for (where, owner, function), count in mode.calls.items()]


# ----------------------------------------------------------------------------------------------------------------------
# Applying one technique, undoing it


def _snapshot(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, torch.nn.Module | None]]]:
    """Every module's children as they are: the converters change a model only by replacing children."""
    return [(module, dict(module._modules)) for module in model.modules()]


def _restore(snapshot: list[tuple[torch.nn.Module, dict[str, torch.nn.Module | None]]]) -> None:
    for module, children in snapshot:
        module._modules.clear()
        module._modules.update(children)


def _count(report: Any) -> int:
    """Replacements a technique's report lists (a dict or a list of them)."""
    return len(report.replaced)


SHARED_INPUT_REASON = (
    "measured on the probe: its input is saved for backward by another module too (a memory-sharing norm keeps its "
    "output): its codes would add bytes and free none"
)


def _shared_inputs(model: torch.nn.Module, probe: Any) -> dict[int, tuple[str, torch.nn.Module]]:
    """The linear layers (by id: (name, module)) whose saved input a module other than the linear layers saves too
    (one forward on the probe, :meth:`memory.SavedBytes.savers`): compressing them frees nothing. Linear layers that
    share an input among themselves alone (q, k and v after a norm in compressed mode) are not listed: converted,
    they keep one set of codes (:func:`.linear.ops.share_codes`) instead of the input."""
    linears = {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    transformers_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(transformers_utils, "Conv1D", None)
    if conv1d is not None:
        linears.update({name: module for name, module in model.named_modules() if type(module) is conv1d})
    inputs: dict[str, torch.Tensor] = {}

    def record(_module, arguments, name):
        if arguments and isinstance(arguments[0], torch.Tensor):
            inputs.setdefault(name, arguments[0])

    handles = [
        module.register_forward_pre_hook(lambda m, a, name=name: record(m, a, name)) for name, module in linears.items()
    ]
    try:
        with _no_side_effects(model), _example_errors(), torch.enable_grad():
            with memory.saved_bytes(model) as saved:
                _run_example(model, probe)
    finally:
        for handle in handles:
            handle.remove()
    shared = {}
    for name, x in inputs.items():
        savers = saved.savers(x)
        if not savers or savers - linears.keys():
            shared[id(linears[name])] = (name, linears[name])
    return shared


def _apply(name: str, model: torch.nn.Module, options: Mapping[str, Any]) -> torch.nn.Module:
    """Apply technique ``name`` with this call's options; returns the model (or the replacement of the root)."""
    if name == "norms":
        from .norms.convert import convert as norms_convert

        return norms_convert(model, bits=options["compress"])
    if name == "gated":
        from .gated.convert import convert as gated_convert

        if options["compress"] is None:
            return gated_convert(model)
        return gated_convert(model, mode="compressed", bits=options["compress"])
    if name == "attention":
        from .attention.convert import convert as attention_convert

        if options["compress"] is None:
            return attention_convert(model, mode="exact")
        return attention_convert(model, bits=options["compress"])
    if name == "fewbit":
        from .fewbit.convert import convert as fewbit_convert

        return fewbit_convert(model, **options["fewbit"])
    if name == "linear":
        from .gated.nn import GatedMLP
        from .linear.convert import convert as linear_convert

        # the linears of a gated MLP are run by the gated op, which reads their weights: compressing them would
        # change nothing (their compressed mode belongs to the gated op)
        inside_gated = {
            id(child) for module in model.modules() if isinstance(module, GatedMLP) for child in module.children()
        }
        shared = _shared_inputs(model, options["probe"]) if options["probe"] is not None else {}
        converted = linear_convert(
            model,
            bits=options["compress"],
            filter=lambda _, module: id(module) not in inside_gated and id(module) not in shared,
        )
        converted.linear_report.skipped.extend(
            (name, type(module).__name__, SHARED_INPUT_REASON) for name, module in shared.values()
        )
        return converted
    raise AssertionError(name)


# ----------------------------------------------------------------------------------------------------------------------
# convert


def convert(
    model: torch.nn.Module,
    *,
    bits: int = 3,
    weight: str = "uniform",
    mode: str = "levelsets",
    filter: Filter = None,
    tables: Mapping[str, TableLike] | None = None,
    only_if_smaller: bool = True,
    example_inputs: Any = None,
    strict: bool = False,
    report: bool = False,
    compress: int | None = None,
    norms: bool = True,
    gated: bool = True,
    attention: bool = True,
    activations: bool = True,
) -> torch.nn.Module:
    """Convert ``model`` in place with the memory techniques that pay off (see the module docstring); return it.

    Args:
        bits, weight, mode, filter, tables, only_if_smaller, strict: the few-bit activations' options, as
            :func:`fewbit_design.runtime.fewbit.convert.convert` takes them.
        example_inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments for ``model``: the
            probe on which each technique is measured (one training step) and undone when it does not reduce the
            bytes saved for backward. A Hugging Face model gets a probe built from its config when this is None.
        report: must stay False; read ``model.convert_report`` instead.
        compress: None (default) or 2..8: linear layers keep that many bits of their input (approximate weight
            gradients), norms keep codes of their output, gated MLPs run the gated op's compressed mode and Hugging
            Face SDPA attention cores keep q, k and v, all at that many bits.
        norms, gated, attention, activations: switch the default techniques off one by one (``norms=False``);
            ``attention`` covers both of its modes (exact by default, compressed under ``compress``).

    Every argument is checked first; the conversion is all or nothing (an error leaves the model as it was). The
    report is ``model.convert_report`` (:class:`ConvertReport`; a second call merges the first's into it: its
    ``earlier`` entries keep the earlier calls' technique reports); the techniques' own reports stay where they were
    (``model.fewbit_report``, ..., each the technique's last run). ``bits`` is an int (not a float, not a bool),
    ``only_if_smaller`` and ``strict`` are True or False. A model in which nothing was replaced gives a warning. A
    model that is itself one replaced module (``convert(torch.nn.GELU())``) is returned replaced: use the return
    value.
    """
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"convert takes a torch.nn.Module, got {type(model).__name__}")
    if report is not False:
        raise FewBitError(REPORT_MESSAGE.format(report=report))
    switches = {
        "norms": check_boolean("norms", norms),
        "gated": check_boolean("gated", gated),
        "fewbit": check_boolean("activations", activations),
        "attention": check_boolean("attention", attention),
        "linear": compress is not None,
    }
    if compress is not None:
        compress = check_integer("compress (bits of compressed linear inputs, or None)", compress, low=2, high=8)
    fewbit_options = _check_options(bits=bits, weight=weight, mode=mode, only_if_smaller=only_if_smaller, strict=strict)
    options = {"fewbit": {**fewbit_options, "filter": filter, "tables": tables}, "compress": compress, "probe": None}
    _check_filter(filter)
    if switches["fewbit"]:
        _check_table_names(model, _check_tables(tables), _slots(model, root=True))
    with torch.inference_mode(False), _caches_off(model):
        converted, result, fewbit_warnings = _convert(model, switches, options, example_inputs)
    logger.info("convert %s: %s", type(model).__name__, result)
    if not any(item.status == "applied" for item in result.techniques) and not _already_converted(converted):
        why = "; ".join(fewbit_warnings) or f"convert: nothing replaced in {type(model).__name__}"
        warnings.warn(why, stacklevel=2)
    previous = model.__dict__.get("convert_report")
    converted.convert_report = result.merge_earlier(previous) if isinstance(previous, ConvertReport) else result
    return converted


def _already_converted(model: torch.nn.Module) -> bool:
    return any(type(m).__module__.startswith("fewbit_design.runtime.") for m in model.modules())


def _convert(
    model: torch.nn.Module, switches: Mapping[str, bool], options: Mapping[str, Any], example_inputs: Any
) -> tuple[torch.nn.Module, ConvertReport, list[str]]:
    result = ConvertReport()
    probe, given = example_inputs, example_inputs is not None
    if given:
        result.probe = "example_inputs"
    else:
        probe, result.probe = _huggingface_probe(model)
    before = None
    if probe is not None:
        try:
            with _example_errors():
                before = _step_bytes(model, probe)
        except FewBitError as error:
            if given:
                raise
            probe, result.probe = None, f"none (the probe built from the config failed to run: {error}): not measured"
    result.before = before
    if probe is not None:
        options = {**options, "probe": probe}
        if switches["fewbit"] and options["fewbit"]["only_if_smaller"]:
            options["fewbit"] = {**options["fewbit"], "example_inputs": probe}

    original = _snapshot(model)
    current = model
    fewbit_warnings: list[str] = []
    try:
        for name in registry.names():
            if name not in SWITCHES:
                continue
            approximate = APPROXIMATE.get(name)
            if name == "gated" and options["compress"] is not None:
                approximate = f"gradients of gated MLPs (compressed mode, {options['compress']}-bit values)"
            if name == "attention" and options["compress"] is not None:
                approximate = f"gradients through compressed attention cores ({options['compress']}-bit q, k, v)"
            if name == "norms" and options["compress"] is not None:
                approximate = f"gradients of norms (compressed mode, {options['compress']}-bit output codes)"
            entry = TechniqueReport(name, "off", approximate=approximate)
            result.techniques.append(entry)
            if not switches[name]:
                off = "None" if SWITCHES[name] == "compress" else "False"
                entry.reason = f"switched off ({SWITCHES[name]}={off})"
                continue
            attribute = REPORT_ATTRIBUTES[name]
            snapshot = _snapshot(current)
            previous = current.__dict__.get(attribute)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                changed = _apply(name, current, options)
            if name == "fewbit":
                fewbit_warnings = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
            entry.report = getattr(changed, attribute)
            entry.replaced = _count(entry.report)
            if not entry.replaced:
                entry.status = "nothing"
                continue
            entry.status = "applied"
            if before is None:
                current = changed
                continue
            with _example_errors():
                after = _step_bytes(changed, probe)
            entry.before, entry.after = before, after
            if after >= before:
                entry.status = "undone"
                entry.reason = (
                    f"measured on the probe: one training step saves {after} bytes for backward with it, {before} "
                    "without: it does not reduce memory"
                )
                _restore(snapshot)
                if previous is None:
                    current.__dict__.pop(attribute, None)
                else:
                    current.__dict__[attribute] = previous
                continue
            current, before = changed, after
        result.after = before if result.before is not None else None
        if probe is not None:
            with _example_errors():
                result.unseen = _functional_calls(current, probe)
    except BaseException:
        _restore(original)
        raise
    return current, result, fewbit_warnings
