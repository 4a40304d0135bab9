"""Running a model once to measure it, without leaving a trace: what ``runtime.convert``, the techniques' converters
and the planner share.

Terms. A *probe* is example inputs of one training step: a tensor, a tuple of positional arguments or a dict of
keyword arguments (:func:`run_example`), or, for a Hugging Face model given none, inputs built from its config
(:func:`huggingface_probe`). Measuring runs the model with gradients on whatever the caller's mode
(:func:`training_grad_mode`), with its caches off (:func:`caches_disabled`), and puts back what a run changes: the
buffers (BatchNorm statistics), the random state (:func:`no_side_effects`) and the parameters' gradients
(:func:`step_bytes`). A model that fails on the probe gives one :class:`FewBitError` (:func:`example_errors`).

Fake tensors. A model built under ``torch._subclasses.fake_tensor.FakeTensorMode`` (shapes, dtypes and storages,
no data) is measured as any other: the probe is fake too, and the bytes are those real tensors would have. A check
that needs values (a norm converter comparing formulas on random weights) runs on :func:`real_stand_in`, a real
copy of the module of the same shapes and dtypes, outside fake mode.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from ..errors import FewBitError
from . import memory

__all__ = [
    "run_example",
    "no_side_effects",
    "example_errors",
    "training_grad_mode",
    "outside_inference",
    "caches_disabled",
    "cache_configs",
    "step_bytes",
    "forward_bytes",
    "step_loss",
    "huggingface_probe",
    "real_stand_in",
    "stand_in_values",
    "on_stand_in",
    "PROBE_BATCH",
    "PROBE_TOKENS",
]

#: the probe built for a Hugging Face model: batch, tokens
PROBE_BATCH, PROBE_TOKENS = 2, 8


def run_example(model: torch.nn.Module, example_inputs: Any) -> Any:
    """``model`` called on a probe: keyword arguments for a dict, positional ones for a tuple or list, else one."""
    if isinstance(example_inputs, Mapping):
        return model(**example_inputs)
    if isinstance(example_inputs, tuple | list):
        return model(*example_inputs)
    return model(example_inputs)


@contextlib.contextmanager
def no_side_effects(model: torch.nn.Module) -> Iterator[None]:
    """Measuring runs the model: restore its buffers (BatchNorm running statistics) and the CPU random state."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)


@contextlib.contextmanager
def example_errors() -> Iterator[None]:
    """A model that fails on the probe (with autograd on) gives one clear error, not its traceback."""
    try:
        yield
    except FewBitError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise FewBitError(
            f"convert(example_inputs=...): measuring runs the model once on the example with autograd on, and it "
            f"failed: {type(exc).__name__}: {first}"
        ) from None


@contextlib.contextmanager
def training_grad_mode() -> Iterator[None]:
    """Gradients on (and inference mode off) for the duration of the block: a training step is measured whatever mode
    the caller is in (``torch.no_grad()``, ``torch.inference_mode()``)."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def outside_inference(value: Any) -> Any:
    """``value`` with every inference tensor (made under ``torch.inference_mode()``, which autograd cannot save for
    backward) replaced by a normal copy; other values as they are. Call it under :func:`training_grad_mode`."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, tuple | list):
        return type(value)(outside_inference(v) for v in value)
    if isinstance(value, dict):
        return {k: outside_inference(v) for k, v in value.items()}
    return value


def cache_configs(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """(qualified name of the first module holding it, config) for every distinct config of ``model``'s modules that
    has a ``use_cache`` setting (Hugging Face models and their sub-models: where transformers is imported, only its
    ``PreTrainedModel`` modules, whose forward reads it; a layer's own copy of the config is not read), in module
    order."""
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    found: dict[int, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        if pretrained is not None and not isinstance(module, pretrained):
            continue
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", None) is not None:
            found.setdefault(id(config), (name, config))
    return list(found.values())


@contextlib.contextmanager
def caches_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Set ``config.use_cache = False`` on every module with a config that has one (Hugging Face models; their
    default is True) for the duration of the block, and put the previous values back afterwards, also on error.

    With the cache on, each training step returns its keys and values (``past_key_values``) and each block receives
    the cache object: a block run again on its recorded inputs would append to a cache that still holds the first
    step's graph ("Trying to backward through the graph a second time"), and a probe would count the cache's copies.
    A training step does not use the cache."""
    configs = [(config, config.use_cache) for _, config in cache_configs(model)]
    try:
        for config, _ in configs:
            config.use_cache = False
        yield
    finally:
        for config, previous in configs:
            config.use_cache = previous


def step_loss(output: Any) -> torch.Tensor | None:
    """A scalar to run backward from: the output's ``loss`` when it has one, else the sum of its float tensors that
    require grad; None when there is none."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    # a loop, not a recursive closure: a closure that calls itself is a reference cycle, which would keep the sums
    # alive until Python's garbage collector runs (at a moment that differs from run to run, and moves the peak)
    found: list[torch.Tensor] = []
    pending = [output]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            if value.requires_grad and value.is_floating_point():
                found.append(value.float().sum())
        elif isinstance(value, Mapping):
            pending.extend(reversed(list(value.values())))
        elif isinstance(value, tuple | list):
            pending.extend(reversed(value))
    return torch.stack(found).sum() if found else None


#: a stand-in parameter repeats this many standard normal draws (a prime: no row of a weight repeats another)
STAND_IN_PERIOD = 4099


def stand_in_values(shape: torch.Size, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Values for a stand-in parameter of ``shape`` and ``dtype``: standard normal draws from ``generator``, the
    first :data:`STAND_IN_PERIOD` of them repeated over a larger tensor (a copy, not a draw per element: a 70B
    model's MLP weight is drawn in a tenth of the time).

    Args:
        shape: the parameter's shape
        dtype: its dtype
        generator: the generator to draw from
    """
    numel = math.prod(shape)
    pattern = torch.randn(min(numel, STAND_IN_PERIOD), generator=generator).to(dtype)
    if numel <= STAND_IN_PERIOD:
        return pattern.reshape(shape)
    return pattern.repeat(-(-numel // STAND_IN_PERIOD))[:numel].reshape(shape)


@contextlib.contextmanager
def real_stand_in(*modules: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, ...]]:
    """``modules`` themselves when none of their parameters and buffers is a fake tensor; otherwise, for the duration
    of the block and with fake mode suspended, copies of them (sharing what they share) whose parameters and buffers
    are real CPU tensors of the same shapes and dtypes: parameters :func:`stand_in_values` (the same every time),
    buffers zero.

    Args:
        modules: the modules a check runs on with real values (random weights, a random input)
    """
    tensors = [tensor for module in modules for tensor in (*module.parameters(), *module.buffers())]
    if not any(is_fake(tensor) for tensor in tensors):
        yield modules
        return
    with unset_fake_temporarily():
        generator = torch.Generator().manual_seed(0)
        memo: dict[int, Any] = {}
        for module in modules:
            for parameter in module.parameters():
                if id(parameter) not in memo:
                    values = stand_in_values(parameter.shape, parameter.dtype, generator)
                    memo[id(parameter)] = torch.nn.Parameter(values, requires_grad=parameter.requires_grad)
            for buffer in module.buffers():
                memo.setdefault(id(buffer), torch.zeros(buffer.shape, dtype=buffer.dtype))
        yield tuple(copy.deepcopy(module, memo) for module in modules)


#: results of checks on stand-ins of fake modules, by the modules' structure (see :func:`on_stand_in`)
_STAND_IN_RESULTS: dict[tuple, Any] = {}
_STAND_IN_LIMIT = 256


def _structure(module: torch.nn.Module) -> tuple:
    """What determines a check on a stand-in of ``module``: each submodule's class, parameter and buffer shapes and
    dtypes, and its plain attributes (numbers, strings: an eps), which are all a stand-in keeps of it."""
    parts = []
    for name, sub in module.named_modules():
        tensors = [(key, tuple(t.shape), t.dtype) for key, t in [*sub._parameters.items(), *sub._buffers.items()]
                   if t is not None]  # fmt: skip
        plain = sorted(
            (key, value) for key, value in vars(sub).items()
            if isinstance(value, bool | int | float | str | type(None)) and key != "training"
        )  # fmt: skip
        parts.append((name, type(sub), tuple(tensors), tuple(plain), sub.training))
    return tuple(parts)


def on_stand_in(check: Callable[..., Any], *modules: torch.nn.Module, key: tuple = ()) -> Any:
    """``check(*copies)`` on :func:`real_stand_in` copies of ``modules``. For fake modules the result is remembered:
    stand-ins of the same structure (classes, shapes, dtypes, plain attributes) and the same ``key`` (what else the
    check depends on) hold the same values, so the check gives the same result, and a model's identical layers (and
    the same model converted again) are checked once.

    Args:
        check: the check, run on the copies (or on ``modules`` themselves when none is fake)
        modules: the modules it reads
        key: whatever else determines its result (a formula's name, options)
    """
    fake = any(is_fake(t) for m in modules for t in (*m.parameters(), *m.buffers()))
    if not fake:
        return check(*modules)
    found = (tuple(_structure(m) for m in modules), key)
    if found not in _STAND_IN_RESULTS:
        if len(_STAND_IN_RESULTS) >= _STAND_IN_LIMIT:
            _STAND_IN_RESULTS.clear()
        with real_stand_in(*modules) as copies:
            _STAND_IN_RESULTS[found] = check(*copies)
    return _STAND_IN_RESULTS[found]


def forward_bytes(model: torch.nn.Module, example_inputs: Any) -> int:
    """Bytes saved for backward by one forward on the probe (gradients on; no side effects undone: the caller's
    :func:`no_side_effects` does that)."""
    with torch.enable_grad(), memory.saved_bytes(model) as measured:
        run_example(model, example_inputs)
    return measured.total


def step_bytes(model: torch.nn.Module, example_inputs: Any) -> int:
    """Bytes saved for backward by one training step (forward, then backward) on the probe; the model's gradients,
    buffers and the random state are as they were."""
    parameters = list(model.parameters())
    grads = [p.grad for p in parameters]
    try:
        for p in parameters:
            p.grad = None
        with no_side_effects(model), torch.enable_grad():
            with memory.saved_bytes(model) as saved:
                output = run_example(model, example_inputs)
            loss = step_loss(output)
            if loss is not None:
                loss.backward()
    finally:
        for p, grad in zip(parameters, grads, strict=True):
            p.grad = grad
    return saved.total


def _forward_parameters(module: torch.nn.Module) -> set[str]:
    """The names of ``module.forward``'s parameters (empty when it has no signature)."""
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def huggingface_probe(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor] | None, str]:
    """(inputs for one forward, description) for a transformers PreTrainedModel, or a PEFT model around one
    (``peft.PeftModel``: its ``get_base_model()``), built from its config; (None, why not) otherwise."""
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    peft_model = getattr(sys.modules.get("peft"), "PeftModel", None)
    base = model.get_base_model() if peft_model is not None and isinstance(model, peft_model) else model
    if pretrained is None or not isinstance(base, pretrained):
        return None, "none (no example_inputs, and not a Hugging Face PreTrainedModel): nothing measured"
    config = base.config
    text = getattr(config, "text_config", None) or config
    vision = getattr(config, "vision_config", None) or config
    # a PEFT model passes its inputs on to the base model (PeftModel.forward takes *args, **kwargs)
    accepted = _forward_parameters(model) | _forward_parameters(base)
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
