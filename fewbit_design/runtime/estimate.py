"""Whole-step memory and predicted time of training a Hugging Face model on a device one may not have.

Terms. A *variant* is one way of training the same model: ``eager`` (native PyTorch), ``checkpointing`` (every
layer checkpointed, as ``gradient_checkpointing_enable()`` does), ``checkpoint-offload`` (checkpointed layers whose
inputs wait in host memory), ``convert``, ``convert(compress=8)``, ``convert(compress=4)`` and ``plan`` (the
planner's exact choice, per layer, of the converted layer plain or checkpointed: the fastest that fits).

How the bytes are found (measured, exact). The model is built from its config with two layers at full width under
:func:`.fake.fake_mode` (nothing is allocated) and profiled by the planner for one training step at the given batch
and sequence (:func:`.planner.plan_memory`: the layers' costs with and without checkpointing, and what runs before
and after them: embeddings, the head's logits, the loss). Its chain of layers is then lengthened to the config's
depth (the layers of one model are alike) and replayed (:func:`.planner.model.replay`), which gives the step's peak
of activations and gradients above its start. To it are added the parts that do not depend on the step:

* parameters in their dtype; AdamW's two float32 states per parameter (8 bytes); float32 master weights for
  16-bit parameters when ``master_weights`` (4 bytes); gradients in the parameters' dtype appear during the step (in
  the replayed peak);
* with FSDP over ``gpus`` ranks (``fsdp``): parameters, gradients, master weights and optimizer states divided by
  ``gpus``, plus what is unsharded while in flight: two layers' parameters (the one running and the one prefetched),
  one layer's gradients before their reduce-scatter, and the root module's parameters (embeddings, final norm, head),
  which FSDP2 keeps gathered between forward and backward. Each rank trains ``batch`` sequences.

``checkpoint-offload`` is modelled from ``checkpointing``: each layer's input goes to host memory after its forward
and comes back for its backward (one in flight).

Times (predicted). A roofline (:mod:`.roofline`) prices every operator of one step of the model with one layer and
with two under the device's peak FLOP/s and bandwidth: the difference is one layer's forward and backward, the rest
the embeddings, head and loss. A checkpointed layer runs its forward twice; offload moves each layer's input over
the host link both ways, overlapped with compute. The optimizer step and communication are not in it.

>>> from fewbit_design.runtime.estimate import estimate, load_config   # doctest: +SKIP
>>> result = estimate(load_config("llama-3-8b"), batch=1, sequence=8192, device="h100-80gb")  # doctest: +SKIP
>>> print(result.report())                                                   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import FewBitError, check_integer
from .devices import Device
from .devices import device as find_device
from .fake import fake_mode

__all__ = [
    "VARIANTS",
    "StepMemory",
    "VariantEstimate",
    "Estimate",
    "estimate",
    "load_config",
    "config_names",
    "sequence_limit",
    "parameter_bytes",
]

#: the variants of :func:`estimate`, in the order reported
VARIANTS = (
    "eager",
    "checkpointing",
    "checkpoint-offload",
    "convert",
    "convert(compress=8)",
    "convert(compress=4)",
    "plan",
)
#: what each converted variant passes to ``runtime.convert`` (None: the model as built)
_CONVERSIONS: dict[str, dict[str, Any] | None] = {
    "eager": None,
    "convert": {},
    "convert(compress=8)": {"compress": 8},
    "convert(compress=4)": {"compress": 4},
}
#: the model each variant runs (the others are choices of checkpointing over its layers)
_BASES = {
    "eager": "eager", "checkpointing": "eager", "checkpoint-offload": "eager", "convert": "convert",
    "convert(compress=8)": "convert(compress=8)", "convert(compress=4)": "convert(compress=4)", "plan": "convert",
}  # fmt: skip
#: the longest sequence that fits is reported in multiples of this many tokens
SEQUENCE_STEP = 128
#: AdamW's state per parameter: two float32 moments
OPTIMIZER_BYTES = 8
MASTER_BYTES = 4
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


# ----------------------------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one training step on one device (one rank with FSDP), at the step's peak.

    Attributes:
        weights: parameters held, in their dtype (a rank's shard with FSDP)
        master_weights: float32 copies of 16-bit parameters (0 without)
        optimizer_states: AdamW's two float32 moments per parameter held
        in_flight: FSDP only: unsharded parameters and gradients of the layers running, and the root's parameters
        inputs: the batch's tensors (token ids and labels, or pixels)
        step: the peak of activations and gradients above the step's start (measured under fake mode, replayed
            over the config's depth)
    """

    weights: int
    master_weights: int
    optimizer_states: int
    in_flight: int
    inputs: int
    step: int

    @property
    def total(self) -> int:
        """Every part together: the step's peak."""
        return self.weights + self.master_weights + self.optimizer_states + self.in_flight + self.inputs + self.step


@dataclass(frozen=True)
class VariantEstimate:
    """One variant of :func:`estimate`.

    Attributes:
        name: the variant (:data:`VARIANTS`)
        bytes_per_token_per_layer: bytes one layer keeps for backward per token of the batch (measured; a
            checkpointed layer keeps its input)
        memory: the step's bytes by part (:class:`StepMemory`; ``memory.total`` is the peak)
        fits: whether the peak is at most the device's memory
        max_seq: the longest sequence (a multiple of :data:`SEQUENCE_STEP`, at most the config's limit) whose step
            fits at this batch; 0 when none does
        max_batch: the largest batch whose step fits at this sequence; 0 when none does
        predicted_step_s: the roofline time of one step (predicted)
        host_bytes: host memory the variant needs (offload)
        checkpointed_layers: layers checkpointed (all for ``checkpointing``; the plan's choice)
        seq_capped: whether ``max_seq`` is the config's limit rather than memory's
    """

    name: str
    bytes_per_token_per_layer: float
    memory: StepMemory
    fits: bool
    max_seq: int
    max_batch: int
    predicted_step_s: float
    host_bytes: int = 0
    checkpointed_layers: int = 0
    seq_capped: bool = False

    @property
    def peak_bytes(self) -> int:
        """The step's peak (``memory.total``)."""
        return self.memory.total

    def row(self) -> dict[str, Any]:
        """The variant as one JSON object (what ``--json`` writes)."""
        return {
            "name": self.name,
            "bytes_per_token_per_layer": self.bytes_per_token_per_layer,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "max_seq": self.max_seq,
            "max_seq_capped_by_config": self.seq_capped,
            "max_batch": self.max_batch,
            "predicted_step_s": self.predicted_step_s,
            "host_bytes": self.host_bytes,
            "checkpointed_layers": self.checkpointed_layers,
            "memory": dataclasses.asdict(self.memory),
            "measured": ["bytes_per_token_per_layer", "peak_bytes", "fits", "max_seq", "max_batch"],
            "predicted": ["predicted_step_s"],
        }


@dataclass(frozen=True)
class Estimate:
    """What :func:`estimate` found for one model, run and device."""

    model: str
    device: Device
    batch: int
    sequence: int
    dtype: str
    gpus: int
    fsdp: bool
    master_weights: bool
    layers: int
    parameters: int
    variants: tuple[VariantEstimate, ...]
    notes: tuple[str, ...] = field(default=())

    def variant(self, name: str) -> VariantEstimate:
        """The variant called ``name``."""
        for item in self.variants:
            if item.name == name:
                return item
        raise FewBitError(f"no variant {name!r} in this estimate: it has {', '.join(v.name for v in self.variants)}")

    def to_json(self) -> str:
        """The estimate as JSON: the run and one row per variant (:meth:`VariantEstimate.row`)."""
        data = {
            "format": "fewbit-estimate/1",
            "model": self.model,
            "device": dataclasses.asdict(self.device),
            "batch": self.batch,
            "sequence": self.sequence,
            "dtype": self.dtype,
            "gpus": self.gpus,
            "fsdp": self.fsdp,
            "master_weights": self.master_weights,
            "layers": self.layers,
            "parameters": self.parameters,
            "rows": [item.row() for item in self.variants],
            "notes": list(self.notes),
        }
        return json.dumps(data, indent=2) + "\n"

    def report(self) -> str:
        """A table of the variants; bytes are measured (fake mode, exact), times predicted (roofline)."""
        ranks = f", FSDP over {self.gpus} GPUs" if self.fsdp else ""
        head = (
            f"{self.model}: {self.parameters / 1e9:.2f}B parameters, {self.layers} layers; batch {self.batch} x "
            f"{self.sequence} tokens, {self.dtype}{', float32 master weights' if self.master_weights else ''}"
            f", AdamW; {self.device.name} ({self.device.memory_bytes / 1e9:.0f} GB){ranks}"
        )
        columns = ("variant", "KiB/token/layer", "peak GB", "fits", "max seq", "max batch", "step s (predicted)")
        lines = [head, "", "  ".join(f"{c:>{_width(c)}}" for c in columns)]
        for item in self.variants:
            seq = f"{item.max_seq}{'*' if item.seq_capped else ''}"
            cells = (
                item.name, f"{item.bytes_per_token_per_layer / 1024:.1f}", f"{item.peak_bytes / 1e9:.1f}",
                "yes" if item.fits else "no", seq, str(item.max_batch), f"{item.predicted_step_s:.3g}",
            )  # fmt: skip
            lines.append("  ".join(f"{cell:>{_width(c)}}" for cell, c in zip(cells, columns, strict=True)))
        lines.append("")
        kernels = "a GPU's" if self.device.kernels == "cuda" else "this CPU's"
        lines.append(f"bytes: measured under fake mode with {kernels} kernel choices (exact for the tensors; no")
        lines.append("allocator rounding, fragmentation or kernel workspace); times: predicted by a roofline at the")
        lines.append("device's peaks (a lower bound).")
        if any(item.seq_capped for item in self.variants):
            lines.append("* the config's longest sequence")
        lines += list(self.notes)
        return "\n".join(lines)


def _width(column: str) -> int:
    return max(len(column), 20 if column == "variant" else 6)


# ----------------------------------------------------------------------------------------------------------------------
# Configs


def config_names() -> tuple[str, ...]:
    """The shipped configs (``fewbit_design/configs/*.json``), by name."""
    return tuple(sorted(name[:-5] for name in os.listdir(_CONFIGS) if name.endswith(".json")))


def load_config(path: str | os.PathLike) -> Any:
    """A transformers config from a JSON file (a model's ``config.json``), or a shipped one by name
    (:func:`config_names`). A file that is not JSON, or JSON without a known ``model_type``, raises
    :class:`FewBitError` naming it.

    Args:
        path: the file, or a shipped config's name (``llama-3-8b``)
    """
    text = str(path)
    if not os.path.exists(text) and text in config_names():
        text = os.path.join(_CONFIGS, f"{text}.json")
    try:
        with open(text, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as error:
        raise FewBitError(f"cannot read the config {text!r}: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FewBitError(f"the config {text!r} is not JSON: {error}") from None
    import transformers

    model_type = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(model_type, str):
        raise FewBitError(f"the config {text!r} is not a model config: it has no \"model_type\" (a Hugging Face "
                          "config.json names one, such as \"llama\")")  # fmt: skip
    try:
        config_class = transformers.AutoConfig.for_model(model_type).__class__
        config = config_class.from_dict({k: v for k, v in data.items() if k != "model_type"})
    except (ValueError, KeyError, TypeError) as error:
        first = str(error).strip().splitlines()[0][:200]
        raise FewBitError(f"the config {text!r} is not a model config transformers knows: {first}") from None
    if not _architecture(config):
        raise FewBitError(f'the config {text!r} names no model class transformers has ("architectures")')
    config.name_or_path = os.path.basename(text)[:-5] if text.endswith(".json") else text
    return config


def _architecture(config: Any) -> Any:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        found = getattr(transformers, name, None)
        if found is not None:
            return found
    return None


def sequence_limit(config: Any) -> int | None:
    """The longest sequence the config allows: its positions (``max_position_embeddings``, ``n_positions``), or for
    a vision transformer its patches plus the class token; None when it sets none (rotary positions)."""
    if getattr(config, "model_type", "") == "vit":
        return (config.image_size // config.patch_size) ** 2 + 1
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# ----------------------------------------------------------------------------------------------------------------------
# Parameters and the step's fixed parts


def parameter_bytes(parameters: int, *, dtype_size: int, master_weights: bool, shards: int) -> dict[str, int]:
    """Bytes of the parts of a step held whatever the batch: weights, float32 master weights (16-bit parameters,
    when ``master_weights``) and AdamW's states, each divided over ``shards`` ranks (FSDP; 1 without).

    Args:
        parameters: every parameter of the model
        dtype_size: bytes per parameter in the training dtype
        master_weights: float32 copies of 16-bit parameters
        shards: ranks the state is sharded over

    >>> parameter_bytes(1000, dtype_size=2, master_weights=True, shards=1)
    {'weights': 2000, 'master_weights': 4000, 'optimizer_states': 8000}
    """
    master = MASTER_BYTES if master_weights and dtype_size < 4 else 0
    return {
        "weights": -(-parameters * dtype_size // shards),
        "master_weights": -(-parameters * master // shards),
        "optimizer_states": -(-parameters * OPTIMIZER_BYTES // shards),
    }


def _in_flight(parameters: int, layers: int, layer_parameters: int, dtype_size: int, gpus: int) -> int:
    """FSDP: two layers' parameters gathered (running and prefetched), one layer's gradients before their
    reduce-scatter, and the root's parameters gathered beyond the rank's shard."""
    root = parameters - layers * layer_parameters
    return (3 * layer_parameters + root - -(-root // gpus)) * dtype_size


# ----------------------------------------------------------------------------------------------------------------------
# Measuring under fake mode


@dataclass
class _Profile:
    """One variant's model profiled at one (batch, sequence): the planner's chain (two layers), the inputs' bytes,
    and (at the requested size only) the roofline seconds of a layer's forward and backward and of the rest."""

    chain: Any
    saved_per_layer: int
    input_bytes: int
    layer_forward_s: float = 0.0
    layer_backward_s: float = 0.0
    rest_s: float = 0.0


class _Model:
    """The config's model with two layers, built under fake mode, converted for one variant."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        conversion: dict[str, Any] | None,
        transform: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    ) -> None:
        from . import conversion as conversion_module
        from .planner.profile import find_chain

        small = config.__class__.from_dict(config.to_dict())
        small.num_hidden_layers = 2
        small.use_cache = False
        model_class = _architecture(config)
        model = model_class._from_config(small, dtype=dtype)
        model.train()
        if conversion is not None:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = conversion_module.convert(model, **conversion)
        if transform is not None:
            model = transform(model) or model
        self.model, self.config = model, small
        self.chain_name = find_chain(model)
        self.layer_parameters = sum(p.numel() for p in model.get_submodule(self.chain_name)[1].parameters())

    def inputs(self, batch: int, sequence: int) -> dict[str, torch.Tensor]:
        config = self.config
        if getattr(config, "model_type", "") == "vit":
            size = config.image_size
            pixels = torch.empty(batch, config.num_channels, size, size, dtype=next(self.model.parameters()).dtype)
            return {"pixel_values": pixels, "labels": torch.zeros(batch, dtype=torch.int64)}
        ids = torch.zeros(batch, sequence, dtype=torch.int64)
        return {"input_ids": ids, "labels": ids.clone()}

    @contextlib.contextmanager
    def layers(self, count: int) -> Iterator[None]:
        """The model with only its first ``count`` layers for the duration of the block."""
        container = self.model.get_submodule(self.chain_name)
        kept = dict(container._modules)
        previous = self.config.num_hidden_layers
        try:
            for key in list(kept)[count:]:
                del container._modules[key]
            self.config.num_hidden_layers = count
            yield
        finally:
            container._modules.clear()
            container._modules.update(kept)
            self.config.num_hidden_layers = previous

    def profile(self, batch: int, sequence: int, timing: Device | None) -> _Profile:
        from .planner import plan_memory

        inputs = self.inputs(batch, sequence)
        plan = plan_memory(self.model, example_kwargs=inputs, allow=("checkpoint",), repeats=1)
        chain = plan.costs
        saved = plan.facts["saved_bytes"][chain.blocks[-1].name]
        input_bytes = sum(t.numel() * t.element_size() for t in inputs.values())
        result = _Profile(chain, saved, input_bytes)
        if timing is not None:
            (f1, b1), (f2, b2) = (self._roofline(count, inputs, timing) for count in (1, 2))
            result.layer_forward_s, result.layer_backward_s = f2 - f1, b2 - b1
            result.rest_s = f1 + b1 - (f2 - f1) - (b2 - b1)
        return result

    def _roofline(self, count: int, inputs: dict[str, torch.Tensor], timing: Device) -> tuple[float, float]:
        from .probe import step_loss
        from .roofline import roofline

        with self.layers(count):
            for parameter in self.model.parameters():
                parameter.grad = None
            with roofline(timing) as forward:
                loss = step_loss(self.model(**inputs))
            with roofline(timing) as backward:
                loss.backward()
            for parameter in self.model.parameters():
                parameter.grad = None
        return forward.seconds, backward.seconds


# ----------------------------------------------------------------------------------------------------------------------
# The chain over the config's depth


def _lengthened(chain: Any, layers: int, gradient_scale: float) -> Any:
    """``chain`` (profiled with two alike layers) with ``layers`` layers, the layers' gradients scaled by
    ``gradient_scale`` (1 / ranks with FSDP, which reduce-scatters each layer's gradients)."""
    from .planner.model import ChainCosts

    first, other = chain.blocks[0], chain.blocks[-1]
    scaled = [dataclasses.replace(b, gradient_bytes=int(b.gradient_bytes * gradient_scale)) for b in (first, other)]
    blocks = [scaled[0]] + [dataclasses.replace(scaled[1], name=f"layer {i}") for i in range(1, layers)]
    gradients = sum(b.gradient_bytes for b in chain.blocks)
    pre_backward = chain.pre_backward_peak - gradients + sum(b.gradient_bytes for b in blocks)
    return ChainCosts(
        blocks=tuple(blocks), entry_bytes=chain.entry_bytes, pre_forward_peak=chain.pre_forward_peak,
        post_forward_peak=chain.post_forward_peak, post_bytes=chain.post_bytes,
        pre_backward_peak=pre_backward, argument_bytes=chain.argument_bytes,
    )  # fmt: skip


def _offloaded(block: Any) -> Any:
    """The checkpoint option of ``block`` with its input in host memory: not held in forward, fetched back (alive
    again) for its backward."""
    option = block.option("checkpoint")
    return dataclasses.replace(
        option, option="checkpoint-offload", saves_input=False, backward_peak=option.backward_peak + block.input_bytes
    )


def _choice(chain: Any, name: str) -> list[Any]:
    if name == "checkpoint-offload":
        return [_offloaded(block) for block in chain.blocks]
    return [block.option(name) for block in chain.blocks]


def _peak(chain: Any, choice: list[Any]) -> int:
    from .planner.model import replay

    return replay(chain, choice).peak


# ----------------------------------------------------------------------------------------------------------------------
# estimate


@dataclass
class _Run:
    """The run's settings and what does not depend on the variant."""

    config: Any
    device: Device
    batch: int
    sequence: int
    dtype: torch.dtype
    gpus: int
    fsdp: bool
    master_weights: bool
    layers: int = 0
    parameters: int = 0
    layer_parameters: int = 0

    def fixed(self) -> dict[str, int]:
        size = torch.empty((), dtype=self.dtype).element_size()
        shards = self.gpus if self.fsdp else 1
        parts = parameter_bytes(self.parameters, dtype_size=size, master_weights=self.master_weights, shards=shards)
        in_flight = _in_flight(self.parameters, self.layers, self.layer_parameters, size, self.gpus) if self.fsdp else 0
        return {**parts, "in_flight": in_flight}

    def memory(self, profile: _Profile, choice_name: str) -> StepMemory:
        return StepMemory(**self.fixed(), inputs=profile.input_bytes, step=max(self._replay(profile, choice_name)))

    def events(self, profile: _Profile, choice_name: str) -> list[int]:
        """The whole step's bytes at each event of the replayed step (the peak is their largest)."""
        fixed = sum(self.fixed().values()) + profile.input_bytes
        return [fixed + value for value in self._replay(profile, choice_name)]

    def _replay(self, profile: _Profile, choice_name: str) -> list[int]:
        from .planner.model import replay

        chain = _lengthened(profile.chain, self.layers, 1 / self.gpus if self.fsdp else 1.0)
        return [value for _, value in replay(chain, _choice(chain, choice_name)).timeline]


def _check(config: Any, batch: int, sequence: int, dtype: str, gpus: int) -> None:
    check_integer("batch", batch, low=1)
    check_integer("sequence", sequence, low=1)
    check_integer("gpus", gpus, low=1)
    if dtype not in _DTYPES:
        raise FewBitError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    limit = sequence_limit(config)
    if limit is not None and sequence > limit:
        raise FewBitError(
            f"sequence {sequence} is longer than the config allows ({limit} tokens"
            f"{': its image patches and class token' if config.model_type == 'vit' else ''})"
        )


def estimate(
    config: Any,
    *,
    batch: int,
    sequence: int,
    device: str | Device = "h100-80gb",
    dtype: str = "bfloat16",
    gpus: int = 1,
    fsdp: bool = False,
    master_weights: bool = True,
    variants: tuple[str, ...] = VARIANTS,
    search: bool = True,
    transforms: Mapping[str, Callable[[torch.nn.Module], torch.nn.Module]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Estimate:
    """Estimate each variant's whole-step memory, whether it fits, the longest sequence and largest batch that fit,
    and its predicted step time (module docstring), without allocating the model.

    Args:
        config: a transformers config (:func:`load_config`) naming its model class in ``architectures``
        batch: sequences per step (per rank with FSDP)
        sequence: tokens per sequence (a vision transformer: its patches and class token, at most)
        device: a :class:`~.devices.Device` or its name (:func:`.devices.device`)
        dtype: the parameters' and activations' dtype: ``bfloat16``, ``float16`` or ``float32``
        gpus: ranks; with ``fsdp`` the model's state is sharded over them
        fsdp: FSDP2 sharding (parameters, gradients, optimizer states) over ``gpus``
        master_weights: float32 master weights for 16-bit parameters
        variants: which of :data:`VARIANTS` to estimate
        search: find ``max_seq`` and ``max_batch`` (four more profiles per variant); False leaves them 0
        transforms: more variants, reported after those of ``variants``: name -> a function that changes the model
            (built under fake mode, two layers) in place or returns its replacement, whose layers then run plain
            (reference points: another library's modules, say)
        progress: called with a line before each model is built and measured (the command line shows them)
    """
    _check(config, batch, sequence, dtype, gpus)
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        raise FewBitError(f"unknown variant {unknown[0]!r} (variants: {', '.join(VARIANTS)})")
    target = device if isinstance(device, Device) else find_device(device)
    run = _Run(config, target, batch, sequence, _DTYPES[dtype], gpus, fsdp, master_weights)
    run.layers = config.num_hidden_layers
    extra = dict(transforms or {})
    clash = [name for name in extra if name in VARIANTS]
    if clash:
        raise FewBitError(f"transform {clash[0]!r} has the name of a variant: name it otherwise")
    wanted = [name for name in VARIANTS if name in variants] + list(extra)
    bases = {**_BASES, **{name: name for name in extra}}
    results: dict[str, VariantEstimate] = {}
    with fake_mode(kernels=target.kernels):  # a GPU's kernel choices for a GPU (native dropout, SDPA with dropout)
        for base in dict.fromkeys(bases[name] for name in wanted):
            if progress is not None:
                progress(f"measuring {', '.join(name for name in wanted if bases[name] == base)} under fake mode")
            built = _Model(config, run.dtype, _CONVERSIONS.get(base), extra.get(base))
            if not run.parameters:
                run.layer_parameters = built.layer_parameters
                two = sum(p.numel() for p in built.model.parameters())
                run.parameters = two + (run.layers - 2) * built.layer_parameters
            profiles = _profiles(built, run, search)
            for name in wanted:
                if bases[name] == base:
                    results[name] = _variant(name, run, profiles)
    return Estimate(
        model=getattr(config, "name_or_path", "") or config.model_type, device=target, batch=batch,
        sequence=sequence, dtype=dtype, gpus=gpus, fsdp=fsdp, master_weights=master_weights, layers=run.layers,
        parameters=run.parameters, variants=tuple(results[name] for name in wanted),
    )  # fmt: skip


def _profiles(built: _Model, run: _Run, search: bool) -> dict[tuple[int, int], _Profile]:
    """Profiles at the requested size (with times), and for the searches at a quarter and half of the sequence
    (where the config allows different sequences) and at twice the batch."""
    found = {(run.batch, run.sequence): built.profile(run.batch, run.sequence, run.device)}
    if search:
        for batch, sequence in _search_points(run):
            found[(batch, sequence)] = built.profile(batch, sequence, None)
    return found


def _search_points(run: _Run) -> list[tuple[int, int]]:
    points = [(2 * run.batch, run.sequence)]
    if run.config.model_type != "vit":
        points += [(run.batch, s) for s in sorted({max(run.sequence // 4, 1), max(run.sequence // 2, 1)})]
    return [point for point in points if point != (run.batch, run.sequence)]


def _variant(name: str, run: _Run, profiles: dict[tuple[int, int], _Profile]) -> VariantEstimate:
    here = profiles[(run.batch, run.sequence)]
    layer = here.chain.blocks[-1]
    option = {"checkpointing": "checkpoint", "checkpoint-offload": "checkpoint-offload"}.get(name, "plain")
    checkpointed = run.layers if option != "plain" else (_plan(run, here) if name == "plan" else 0)
    memory = _plan_memory(run, here) if name == "plan" else run.memory(here, option)
    # kept for backward per layer and token: what a plain layer saves, a checkpointed one's input, nothing on the
    # device for an offloaded one (the plan: the average over its layers)
    tokens = run.batch * (sequence_limit(run.config) if run.config.model_type == "vit" else run.sequence)
    kept = {"plain": here.saved_per_layer, "checkpoint": layer.input_bytes, "checkpoint-offload": 0}
    if name == "plan":
        per_layer = ((run.layers - checkpointed) * kept["plain"] + checkpointed * kept["checkpoint"]) / run.layers
    else:
        per_layer = kept[option]
    seconds = here.rest_s + run.layers * (here.layer_forward_s + here.layer_backward_s)
    seconds += checkpointed * here.layer_forward_s  # a checkpointed layer runs its forward again
    host = run.layers * layer.input_bytes if option == "checkpoint-offload" else 0
    if host:  # each input out in forward and back in backward over the host link, overlapped with compute
        seconds = max(seconds, 2 * host / run.device.host_bandwidth)
    # the least memory a plan reaches is every layer checkpointed: its searches are that choice's
    searched = "checkpoint" if name == "plan" else option
    max_seq, capped, max_batch = _searches(run, profiles, lambda profile: run.events(profile, searched))
    return VariantEstimate(
        name=name, bytes_per_token_per_layer=per_layer / tokens, memory=memory,
        fits=memory.total <= run.device.memory_bytes, max_seq=max_seq, max_batch=max_batch, predicted_step_s=seconds,
        host_bytes=host, checkpointed_layers=checkpointed, seq_capped=capped,
    )  # fmt: skip


def _timed(chain: Any, profile: _Profile) -> Any:
    """``chain`` with its options' seconds from the roofline: a layer's forward and backward, and its forward once
    more when checkpointed."""
    plain = profile.layer_forward_s + profile.layer_backward_s
    seconds = {"plain": plain, "checkpoint": plain + profile.layer_forward_s}
    blocks = tuple(
        dataclasses.replace(b, options=tuple(dataclasses.replace(o, seconds=seconds[o.option]) for o in b.options))
        for b in chain.blocks
    )
    return dataclasses.replace(chain, blocks=blocks)


def _optimised(run: _Run, chain: Any, profile: _Profile) -> list[str]:
    """The planner's exact choice (:func:`.planner.model.optimise`) of plain or checkpointed per layer: the fastest
    whose whole step fits the device; every layer checkpointed when none does."""
    from .planner.model import optimise

    budget = run.device.memory_bytes - sum(run.fixed().values()) - profile.input_bytes
    choice = optimise(chain, budget) if budget > 0 else None
    return choice if choice is not None else ["checkpoint"] * len(chain.blocks)


def _plan(run: _Run, profile: _Profile) -> int:
    """How many layers the plan checkpoints (:func:`_optimised` on the converted model)."""
    chain = _timed(_lengthened(profile.chain, run.layers, 1 / run.gpus if run.fsdp else 1.0), profile)
    return sum(name == "checkpoint" for name in _optimised(run, chain, profile))


def _plan_memory(run: _Run, profile: _Profile) -> StepMemory:
    """The step's memory under the plan :func:`_plan` chooses."""
    chain = _timed(_lengthened(profile.chain, run.layers, 1 / run.gpus if run.fsdp else 1.0), profile)
    choice = _optimised(run, chain, profile)
    options = [block.option(name) for block, name in zip(chain.blocks, choice, strict=True)]
    return StepMemory(**run.fixed(), inputs=profile.input_bytes, step=_peak(chain, options))


def _searches(
    run: _Run, profiles: dict[tuple[int, int], _Profile], events: Callable[[_Profile], list[int]]
) -> tuple[int, bool, int]:
    """(max_seq, whether the config's limit capped it, max_batch) from the profiles. The step's bytes at each event
    of the replayed step (``events``) are affine in the batch, and at one batch a quadratic in the sequence through
    the three sequences profiled (attention's S x S terms); the step fits while every event does, so the edge is the
    nearest of the events' edges (the peak itself moves from event to event: the gradients' at the end of the
    backward pass do not grow with the batch, the activations' do)."""
    memory = run.device.memory_bytes
    here = events(profiles[(run.batch, run.sequence)])
    twice = profiles.get((2 * run.batch, run.sequence))
    max_batch = 0
    if twice is not None:
        edges = [_affine_edge(run.batch, low, high, memory) for low, high in zip(here, events(twice), strict=True)]
        edge = min(edges)
        max_batch = int(edge) if math.isfinite(edge) else 2**31 - 1
    limit = sequence_limit(run.config)
    fits = max(here) <= memory
    if run.config.model_type == "vit":
        return (limit if fits else 0), fits, max_batch
    points = sorted((s, events(p)) for (b, s), p in profiles.items() if b == run.batch)[-3:]
    if len(points) < 3:
        return 0, False, max_batch
    longest = min(_largest_root([(s, values[k]) for s, values in points], memory) for k in range(len(points[0][1])))
    if limit is not None and longest >= limit:
        return limit, True, max_batch
    return (int(min(longest, 2**31 - 1)) // SEQUENCE_STEP) * SEQUENCE_STEP, False, max_batch


def _affine_edge(batch: int, low: int, high: int, memory: int) -> float:
    """The largest batch at which a value that is ``low`` at ``batch`` and ``high`` at twice it stays within
    ``memory`` (infinity when it does not grow; 0 when it exceeds it whatever the batch)."""
    slope = (high - low) / batch
    if slope <= 0:
        return math.inf if low <= memory else 0.0
    return max(math.floor(batch + (memory - low) / slope), 0)


def _largest_root(points: list[tuple[int, int]], memory: int) -> float:
    """The largest x with q(x) <= memory for the quadratic q through ``points`` (0 when q(0+) exceeds it; infinity
    when q never reaches it)."""
    (x0, y0), (x1, y1), (x2, y2) = points
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    a = (d12 - d01) / (x2 - x0)
    b = d01 - a * (x0 + x1)
    c = y0 - a * x0 * x0 - b * x0
    if abs(a) < 1e-9:
        return math.inf if b <= 0 else max((memory - c) / b, 0.0)
    disc = b * b - 4 * a * (c - memory)
    if disc < 0:
        return math.inf if a < 0 else 0.0
    root = (-b + math.sqrt(disc)) / (2 * a) if a > 0 else (-b - math.sqrt(disc)) / (2 * a)
    return max(root, 0.0)
