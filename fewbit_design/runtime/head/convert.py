"""Hugging Face causal LMs whose loss goes through :func:`~.ops.lm_loss`: no logits exist when ``labels`` are given.

:func:`convert` replaces the model's ``forward`` by an instance attribute (the class and transformers are not
edited; :func:`remove` deletes it). Called with ``labels``, the new forward runs the model's own forward without
them, while the output embedding (``lm_head``) only hands over its input (it returns an empty ``(..., 0)`` tensor,
so whatever the model does to its logits afterwards costs nothing), then computes Hugging Face's causal-LM loss
with :func:`~.ops.lm_loss`: labels shifted by one (``labels[..., 1:]`` against positions ``[..., :-1]``, or
``shift_labels`` when given), ``ignore_index`` -100, the mean over counted tokens, or the sum over
``num_items_in_batch`` when the trainer passes it. It returns the model's output with ``loss`` set and ``logits=None``
(a tuple output keeps ``None`` in the logits' place). Without labels the model runs exactly as before.

Tied embeddings (GPT-2) keep working: the loss reads ``lm_head.weight``, the same parameter as the input embedding,
and both uses add to its gradient. Logit transforms that the model applies after its head are read from the config
(Cohere ``logit_scale``, Granite ``logits_scaling``, Gemma 2 ``final_logit_softcapping``); a model that changes its
logits in any other way is refused by :func:`convert` with one line, rather than given a wrong loss.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...errors import FewBitError, check_integer
from ..report import Report
from .ops import lm_loss

__all__ = ["HeadReport", "convert", "remove", "is_causal_lm"]


@dataclass(kw_only=True)
class HeadReport(Report):
    """What :func:`convert` did to one model (``model.head_report``): a :class:`~..report.Report` whose ``replaced``
    is the model's head (its class name: the forward computes the loss a chunk of rows at a time); ``skipped`` and
    ``already`` stay empty (a model converted again keeps its first report).

    Attributes:
        model: the model's class name.
        vocab_size, hidden_size: the head's (V, H).
        chunk_rows: rows per chunk (None: :func:`~.ops.default_chunk_rows` of each call's shape).
        tied: whether the head's weight is the input embedding's (GPT-2, small LLaMAs).
        logit_scale, softcap: the logit transform taken from the config (1.0 and None: none).
        note: what changes for the caller.
    """

    model: str
    vocab_size: int
    hidden_size: int
    chunk_rows: int | None
    tied: bool
    logit_scale: float = 1.0
    softcap: float | None = None
    note: str = "with labels, the loss is computed a chunk of rows at a time and the output's logits are None"

    def head(self) -> str:
        rows = self.chunk_rows if self.chunk_rows is not None else "default"
        tied = ", tied to the input embedding" if self.tied else ""
        shape = f"vocabulary {self.vocab_size}, hidden {self.hidden_size}{tied}"
        return f"LM head of {self.model} ({shape}): chunk rows {rows}"

    def replaced_lines(self) -> list[str]:
        return [f"  {self.note}"]


def _head(model: torch.nn.Module) -> torch.nn.Linear | None:
    getter = getattr(model, "get_output_embeddings", None)
    if not callable(getter):
        return None
    try:
        head = getter()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return head if isinstance(head, torch.nn.Linear) else None


def is_causal_lm(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face decoder-only LM with a linear output embedding and the causal-LM loss:
    its loss type is ``ForCausalLM`` (LLaMA, Mistral, Qwen2, ...) or its class is a ``...LMHeadModel`` (GPT-2, whose
    loss type is unset and defaults to it), and no custom loss function was set on it."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) or "_loss_function" in vars(model):
        return False
    causal = getattr(model, "loss_type", None) == "ForCausalLM" or type(model).__name__.endswith("LMHeadModel")
    return causal and _head(model) is not None


def _logit_transform(model: torch.nn.Module) -> tuple[float, float | None]:
    config = getattr(model, "config", None)
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale = float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        scale = 1.0 / float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2: softcap * tanh(logits / softcap)
    return scale, (float(softcap) if softcap else None)


class _Capture:
    """The head's forward while the loss is computed: records its input, returns an empty (..., 0) tensor."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.inputs.append(hidden)
        empty = hidden.new_empty((*hidden.shape[:-1], 0))
        self.outputs.append(empty)
        return empty


def _swap_in(head: torch.nn.Module, capture: _Capture) -> tuple[bool, Any]:
    """Make ``head``'s forward ``capture``; returns what :func:`_swap_out` needs to undo it."""
    had_forward = "forward" in head.__dict__
    previous = head.__dict__.get("forward")
    capture.inputs.clear()
    capture.outputs.clear()
    head.forward = capture
    return had_forward, previous


def _swap_out(head: torch.nn.Module, state: tuple[bool, Any]) -> None:
    had_forward, previous = state
    if had_forward:
        head.forward = previous
    else:
        head.__dict__.pop("forward", None)


_UNTRACED: dict[str, Callable] = {}


def _untraced_swaps() -> dict[str, Callable]:
    """:func:`_swap_in` and :func:`_swap_out` as functions ``torch.compile`` never traces (made once, eagerly: at
    convert time). Setting and deleting a module's attribute inside a traced frame is replayed wrongly by dynamo
    ('Linear' object has no attribute 'forward'); untraced, they are two graph breaks and the model's own forward
    between them compiles as usual."""
    if not _UNTRACED:
        _UNTRACED.update({"in": torch.compiler.disable(_swap_in), "out": torch.compiler.disable(_swap_out)})
    return _UNTRACED


class _HeadForward:
    """The converted model's forward (a picklable, deep-copyable object: its model is an attribute)."""

    def __init__(self, model: torch.nn.Module, chunk_rows: int | None, previous: Callable | None) -> None:
        self.model = model
        self.chunk_rows = chunk_rows
        self.previous = previous  # an instance forward that was there before (None: the class's)
        # one capture for every call (empty between calls): a compiled forward guards on the head's forward object
        self.capture = _Capture()

    def _original(self) -> Callable:
        return self.previous if self.previous is not None else type(self.model).forward.__get__(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = self._original()
        bound = inspect.signature(type(self.model).forward).bind_partial(self.model, *args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None:
            return original(*args, **kwargs)
        bound.arguments["labels"] = None
        extra = bound.arguments.get("kwargs", {})
        head = _head(self.model)
        capture = self.capture
        swaps = _UNTRACED or _untraced_swaps()
        state = swaps["in"](head, capture)
        try:
            output = original(*bound.args[1:], **bound.kwargs)
        finally:
            swaps["out"](head, state)
        count = len(capture.inputs)
        hidden = capture.inputs[0] if count == 1 else None
        capture.inputs.clear()
        capture.outputs.clear()
        if hidden is None:
            raise FewBitError(
                f"head.convert: {type(self.model).__name__}'s forward called its output embedding "
                f"{count} times (expected once): use the unconverted model (head.remove)"
            )
        ignore_index = extra.get("ignore_index", -100)
        shifted = extra.get("shift_labels")
        if shifted is None:
            shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        scale, softcap = _logit_transform(self.model)
        items = extra.get("num_items_in_batch")
        loss = lm_loss(
            hidden,
            head.weight,
            shifted.to(hidden.device),
            bias=head.bias,
            chunk_rows=self.chunk_rows,
            ignore_index=ignore_index,
            reduction="mean" if items is None else "sum",
            logit_scale=scale,
            softcap=softcap,
        )
        if items is not None:
            loss = loss / (items.to(loss.device) if torch.is_tensor(items) else items)
        if isinstance(output, tuple):
            return (loss, None, *output[1:])
        fields = {key: value for key, value in output.items() if key not in ("loss", "logits")}
        return type(output)(loss=loss, logits=None, **fields)


def _check_transform(model: torch.nn.Module) -> None:
    """Refuse a model that changes its logits after the head in a way :func:`_logit_transform` does not know: run its
    forward on one token with the capturing head and see whether the logits come back untouched."""
    scale, softcap = _logit_transform(model)
    if scale != 1.0 or softcap is not None:
        return
    head = _head(model)
    capture = _Capture()
    head.forward = capture
    try:
        parameter = next(model.parameters())
        with torch.no_grad():
            output = type(model).forward(
                model, input_ids=torch.zeros(1, 1, dtype=torch.long, device=parameter.device), use_cache=False
            )
    except Exception:  # noqa: BLE001 (a model that cannot run on one token here is checked by its first call)
        return
    finally:
        del head.forward
    logits = output[0] if isinstance(output, tuple) else output.get("logits")
    if capture.outputs and logits is not capture.outputs[-1]:
        raise FewBitError(
            f"head.convert: {type(model).__name__} changes its logits after the output embedding in a way the "
            "chunked head does not know (it knows Cohere logit_scale, Granite logits_scaling, Gemma 2 "
            "final_logit_softcapping): leave this model unconverted"
        )


def _convert_one(model: torch.nn.Module, chunk_rows: int | None) -> None:
    if isinstance(model.__dict__.get("forward"), _HeadForward):
        return  # already converted: nothing changes
    _check_transform(model)
    head = _head(model)
    inputs = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    scale, softcap = _logit_transform(model)
    _untraced_swaps()
    model.forward = _HeadForward(model, chunk_rows, model.__dict__.get("forward"))
    model.head_report = HeadReport(
        replaced=[type(model).__name__],
        model=type(model).__name__,
        vocab_size=head.out_features,
        hidden_size=head.in_features,
        chunk_rows=chunk_rows,
        tied=inputs is not None and getattr(inputs, "weight", None) is head.weight,
        logit_scale=scale,
        softcap=softcap,
    )


def _causal_lms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost causal LMs in ``model`` (itself included)."""
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if is_causal_lm(module):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def apply(model: torch.nn.Module, chunk_rows: int | None = None) -> torch.nn.Module:
    """Convert every causal LM in ``model`` (itself included) and return ``model``; anything else is left as it is."""
    for found in _causal_lms(model):
        _convert_one(found, chunk_rows)
    return model


def convert(model: torch.nn.Module, *, chunk_rows: int | None = None) -> torch.nn.Module:
    """Make the Hugging Face causal LMs in ``model`` compute their loss with :func:`~.ops.lm_loss` (see the module
    docstring); returns ``model``, each converted LM with ``head_report`` (:class:`HeadReport`).

    Converting twice changes nothing. Raises :class:`FewBitError` when ``model`` holds no causal LM (a Hugging Face
    model with a linear output embedding and the ``ForCausalLM`` loss), or one whose logit transform is unknown.

    Args:
        chunk_rows: rows per chunk (default: :func:`~.ops.default_chunk_rows` of each call's shape).
    """
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"head.convert takes a torch.nn.Module, got {type(model).__name__}")
    if chunk_rows is not None:
        chunk_rows = check_integer("head.convert chunk_rows", chunk_rows, low=1)
    if not _causal_lms(model):
        raise FewBitError(
            f"head.convert: {type(model).__name__} holds no Hugging Face causal LM (a model with a linear output "
            "embedding and the ForCausalLM loss, such as LlamaForCausalLM or GPT2LMHeadModel)"
        )
    return apply(model, chunk_rows)


def remove(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`convert` on every causal LM in ``model`` (their forward and ``head_report``); returns ``model``."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, _HeadForward):
            if forward.previous is not None:
                module.forward = forward.previous
            else:
                del module.forward
            module.__dict__.pop("head_report", None)
    return model
