"""Run the attention cores of a Hugging Face model through the compressed attention op, and say what was done.

Hugging Face attention modules (LLaMA, Mistral, Qwen2, Phi-3, Gemma, GPT-2, ...) compute q, k and v, then call
``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, ...)``: the attention core is looked up by
name in transformers' ``AttentionInterface``. This module registers one more name there, :data:`IMPLEMENTATION`,
whose function (:func:`hf_attention_forward`) does what transformers' ``sdpa`` function does (the same GQA choice,
causal flag and output layout) with the SDPA call replaced by :func:`~.ops.compressed_attention`.

Recognition is by structure: a module whose ``forward`` reads ``ALL_ATTENTION_FUNCTIONS`` and which has a
``config`` whose attention implementation is ``"sdpa"``. Each such module is replaced at its places by a shallow copy
(same class, same ``Parameter`` objects, hooks and attributes) whose ``config`` is a copy naming
:data:`IMPLEMENTATION`, and whose ``fewbit_attention`` attribute holds the options. The model's own config is not
changed, so removing the replacement (``runtime.convert`` restores the original modules when a technique does not pay
off, or on error) restores the model exactly. Attention modules with another implementation (``"eager"``: its
softmax is not SDPA's, so the forward would not be bitwise the model's) are left alone with the reason in the report.

Attention dropout (training): the compressed mode, and the exact mode where native SDPA would run its math path
(always on the CPU; :func:`~.ops.native_keeps_probabilities`), run :mod:`.dropout`'s core (native SDPA's math path with
a keep mask drawn from a seed the core keeps, drawn again in backward): nothing of size S x S is kept, where native's
math path keeps the probabilities and the mask. Where native runs a fused kernel with dropout (CUDA: flash or
memory-efficient attention, which keep nothing of size S x S either), the exact mode leaves the call to it. In the
exact mode a module without a value projection (GPT-2's ``Conv1D``) keeps v; the core still keeps the caller's mask
where native SDPA keeps a float copy per layer.

When the module's output projection (:data:`OUTPUT_PROJECTIONS`) is a compressed linear and the core's codes have
:data:`SHARED_OUTPUT_BITS` bits, the core makes the projection's codes of its output and shares them, and keeps the
forward's log-sum-exp: its backward runs no forward (:mod:`.ops`, "Shared output").

Calls the cores do not cover go to transformers' own ``sdpa`` function unchanged: ``position_bias``, ``softcap``,
attention outputs, and key/value lengths other than the query's (caches). k and v reach the cores at their key/value
heads (grouped-query attention): they are kept so, with or without a mask, where transformers' ``sdpa`` function
repeats them whenever a mask is passed.

>>> import transformers                                                              # doctest: +SKIP
>>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=1))  # doctest: +SKIP
>>> model = convert(model, bits=8)                                                    # doctest: +SKIP
>>> print(model.attention_report)                                                     # doctest: +SKIP
compressed 1 attention core(s) (8-bit q, k, v; groups of 64), left 0 alone
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ...errors import FewBitError, check_choice
from ..linear.nn import CompressedConv1D, CompressedLinear, share_state
from ..linear.quant import GROUP_SIZE, check_options
from ..modules import slots, swap
from ..report import Report
from .exact import ValueLinear, dropout_attention, take_recipe, value_recompute_attention
from .ops import compressed_attention, native_keeps_probabilities

__all__ = ["convert", "AttentionReport", "hf_attention_forward", "IMPLEMENTATION"]

#: the name registered in transformers' AttentionInterface
IMPLEMENTATION = "fewbit_compressed"
#: the attribute holding the options on a converted attention module: (bits, group_size) in the compressed mode,
#: ("exact", name of the value projection or None) in the exact mode
OPTIONS = "fewbit_attention"
#: the modes of :func:`convert`
MODES = ("compressed", "exact")
#: the names of the linear layer whose output v is a view of (``v_proj``, Phi-3's fused ``qkv_proj``, BERT's ``value``)
VALUE_PROJECTIONS = ("v_proj", "qkv_proj", "value")
#: the names of the linear layer that reads the attention output (LLaMA-style ``o_proj``, GPT-2's ``c_proj``, ...)
OUTPUT_PROJECTIONS = ("o_proj", "c_proj", "out_proj", "dense")
#: the fewest bits of q, k, v codes at which the core shares its output's codes with the output projection and keeps
#: the forward's log-sum-exp instead of recomputing the forward in backward: that backward's rows of P do not sum to
#: 1 exactly, which raises the q, k, v gradient error by about 1.4x (8 bits: 0.014 against 0.010 relative; 4 bits:
#: 0.23 against 0.16, measured at B, H, S, D = 2, 4, 64, 64), so 4-bit cores keep the recomputing backward
SHARED_OUTPUT_BITS = 8


@dataclass(kw_only=True)
class AttentionReport(Report):
    """What :func:`convert` did: a :class:`~..report.Report` whose ``replaced`` are the attention modules converted
    (qualified name, class), ``skipped`` those left alone (name, class, reason) and ``already`` how many were
    converted already.

    Attributes:
        bits: the bits of the q, k, v codes (None in the exact mode)
        group_size: values per group
        mode: "compressed" or "exact"
        keeps_v: names and class of the converted modules that keep v (exact mode, no value projection: the core
            still keeps the caller's mask, not a float copy, and runs attention dropout)
    """

    bits: int | None
    group_size: int
    mode: str = "compressed"
    keeps_v: list[tuple[str, str]] = field(default_factory=list)

    ALREADY: ClassVar[str] = "were converted already"

    def head(self) -> str:
        if self.mode == "exact":
            head = f"{self.count - len(self.keeps_v)} attention core(s) rebuild v in backward (exact)"
            if self.keeps_v:
                head += f", {len(self.keeps_v)} keep v (no value projection: {' / '.join(VALUE_PROJECTIONS)})"
        else:
            head = f"compressed {self.count} attention core(s) ({self.bits}-bit q, k, v; groups of {self.group_size})"
        return f"{head}, left {len(self.skipped)} alone"

    def replaced_lines(self) -> list[str]:
        counts = Counter(original for _, original in self.replaced)
        return [f"  {count} x {original}" for original, count in counts.items()]


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward`` with the compressed op (module docstring); the calls the op does not
    cover, and modules without options, go to transformers' function itself.

    Args:
        module: the attention module (its ``fewbit_attention`` options, ``num_key_value_groups``, ``is_causal``)
        query: (B, H, S, D)
        key: (B, H_kv, S_kv, D)
        value: (B, H_kv, S_kv, D)
        attention_mask: the model's mask for SDPA, or None
        dropout: the attention dropout probability
        scaling: the score scale
        is_causal: the caller's causal flag (None: the module's)
        kwargs: the other keywords transformers passes
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    options = getattr(module, OPTIONS, None)
    exact = options is not None and options[0] == "exact"
    projection = getattr(module, options[1], None) if exact and options[1] is not None else None
    recipe = take_recipe(projection)  # taken whatever runs next: no tensor kept past this call
    q_length, kv_length = query.shape[2], key.shape[2]
    uncovered = (
        options is None
        or not 0.0 <= dropout < 1.0
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
        or q_length != kv_length
    )
    caller = is_causal  # the caller's causal flag, as given

    def native() -> tuple[torch.Tensor, None]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=caller, **kwargs
        )

    if uncovered:
        return native()
    kv_repeat, enable_gqa = _grouping(module, attention_mask, key, value)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    call = dict(scale=scaling, is_causal=is_causal)
    if exact and dropout > 0.0:  # k and v at their key/value heads, whatever transformers would repeat
        grouped = key.shape[1] != query.shape[1]
        if not native_keeps_probabilities(query, key, value, attention_mask, dropout, scaling, is_causal, grouped):
            return native()  # a fused kernel (CUDA) keeps nothing of size S x S either, and runs faster
        rebuild = dict(recipe=recipe, projection=projection)
        output = dropout_attention(query, key, value, attention_mask, p=dropout, **call, **rebuild)
    elif exact:
        grouping = dict(kv_repeat=kv_repeat, enable_gqa=enable_gqa)
        output = value_recompute_attention(query, key, value, attention_mask, recipe, projection, **call, **grouping)
        if output is None:  # not a case the op covers (its docstring): native SDPA, which keeps v
            return native()
    else:
        bits, group_size = options
        codes = dict(bits=bits, group_size=group_size, output_codes=_output_codes(module, bits), dropout=dropout)
        output = compressed_attention(
            query, key, value, attention_mask, kv_repeat=kv_repeat, enable_gqa=enable_gqa, **call, **codes
        )
    output = output.reshape(output.shape[0], -1, q_length, value.shape[-1])
    return output.transpose(1, 2).contiguous(), None


def _grouping(module: torch.nn.Module, mask: Any, key: torch.Tensor, value: torch.Tensor) -> tuple[int, bool]:
    """``(kv_repeat, enable_gqa)``: how transformers' ``sdpa`` function would repeat k and v for the module's query
    heads per key/value head (SDPA's ``enable_gqa`` where it can, else ``repeat_kv``)."""
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    groups = getattr(module, "num_key_value_groups", 1)
    if groups <= 1:
        return 1, False
    if use_gqa_in_sdpa(mask, key, value):
        return 1, True
    return groups, False


def _output_codes(module: torch.nn.Module, bits: int) -> tuple[int, int, str] | None:
    """``(bits, group_size, rounding)`` of the module's output projection (:data:`OUTPUT_PROJECTIONS`) when it is a
    compressed linear that keeps codes of its input (it runs now, with a weight gradient to compute) and the core's
    codes have at least :data:`SHARED_OUTPUT_BITS` bits: the attention core then makes those codes itself and
    shares them (:func:`~.ops.compressed_attention`'s ``output_codes``), and its backward runs no forward."""
    if bits < SHARED_OUTPUT_BITS:
        return None
    for name in OUTPUT_PROJECTIONS:
        projection = module._modules.get(name)
        if isinstance(projection, CompressedLinear | CompressedConv1D):
            if not (torch.is_grad_enabled() and projection.weight.requires_grad):
                return None
            return projection.bits, projection.group_size, projection.rounding
    return None


def _register() -> None:
    """Register :data:`IMPLEMENTATION` in transformers' AttentionInterface (idempotent)."""
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        transformers.AttentionInterface.register(IMPLEMENTATION, hf_attention_forward)


def _attention_core(module: torch.nn.Module) -> str | None:
    """The attention implementation a Hugging Face attention module looks up, or None for any other module."""
    # unwrap decorators (transformers wraps forward in deprecate_kwarg)
    forward = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    config = getattr(module, "config", None)
    if forward is None or "ALL_ATTENTION_FUNCTIONS" not in forward.co_names or config is None:
        return None
    return getattr(config, "_attn_implementation", None) or "none"


def _value_projection(module: torch.nn.Module) -> str | None:
    """The name of the child linear that makes v (:data:`VALUE_PROJECTIONS`, a plain ``nn.Linear``), or None."""
    for name in VALUE_PROJECTIONS:
        if type(module._modules.get(name)) is torch.nn.Linear:
            return name
    return None


def convert(
    model: torch.nn.Module,
    *,
    bits: int = 8,
    mode: str = "compressed",
    group_size: int = GROUP_SIZE,
    filter: Callable[[str, torch.nn.Module], bool] | None = None,
) -> torch.nn.Module:
    """Run the SDPA attention cores of ``model`` through the compressed op, or the exact op that rebuilds v (in
    place: each attention module is replaced at its places by a converted copy); returns the model with the report
    as ``model.attention_report``.

    Args:
        bits: bits of the q, k, v codes, 2 to 8 (compressed mode; not read in the exact mode).
        mode: "compressed" (K-bit codes of q, k, v; approximate gradients) or "exact" (native SDPA that keeps the
            value projection's input, shared with q_proj and k_proj, instead of v: :mod:`.exact`; exact gradients;
            attention modules without a value projection (:data:`VALUE_PROJECTIONS`, an ``nn.Linear``) keep v).
            Both modes run attention dropout through :mod:`.dropout`'s core.
        group_size: values per (low, step) pair along the head dimension.
        filter: ``filter(name, module) -> bool``; only attention modules it accepts are converted.
    """
    mode = check_choice("mode", mode, MODES)
    bits, group_size, _ = check_options(bits, group_size, "nearest")
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"convert takes a torch.nn.Module, got {type(model).__name__}")
    if filter is not None and not callable(filter):
        raise FewBitError(f"filter must be None or a callable(name, module) -> bool, got {filter!r}")
    report = AttentionReport(bits=bits if mode == "compressed" else None, group_size=group_size, mode=mode)
    found = slots(model, root=False)
    replacements: dict[int, torch.nn.Module] = {}
    for slot in found:
        name, module = slot.names[0], slot.module
        implementation = _attention_core(module)
        if implementation == IMPLEMENTATION:
            report.already += 1
            continue
        if implementation is None or (implementation == "sdpa" and filter is not None and not filter(name, module)):
            continue
        reason = _left_alone(module, implementation)
        if reason is not None:
            report.skipped.append((name, type(module).__name__, reason))
            continue
        replacements[id(module)] = _converted_copy(module, mode, bits, group_size)
        report.replaced.append((name, type(module).__name__))
        if mode == "exact" and _value_projection(module) is None:
            report.keeps_v.append((name, type(module).__name__))
    swap(model, found, replacements)
    model.attention_report = report
    return model


def _left_alone(module: torch.nn.Module, implementation: str) -> str | None:
    """Why an attention module with this implementation is left alone (in both modes), or None: it is converted."""
    if implementation != "sdpa":
        return (
            f"attention implementation {implementation!r}: the cores stand in for 'sdpa' only (its softmax and "
            "dropout are not SDPA's; load the model with attn_implementation='sdpa')"
        )
    if "position_bias" in inspect.signature(inspect.unwrap(type(module).forward)).parameters:
        return (
            "position bias (T5's relative attention bias): an additive bias with a gradient, which the cores do not "
            "take; every call would run native SDPA"
        )
    return None


def _converted_copy(module: torch.nn.Module, mode: str, bits: int, group_size: int) -> torch.nn.Module:
    """A shallow copy of the attention module (its parameters, hooks and attributes) whose config names
    :data:`IMPLEMENTATION` and which holds the options (the model's own config is not changed)."""
    _register()
    replacement = share_state(module, type(module))
    replacement.config = copy.copy(module.config)
    # the copy's own name only: its sub-configs are the original's objects, left as they are
    replacement.config._attn_implementation_internal = IMPLEMENTATION
    if mode == "exact":
        projection = _value_projection(module)
        if projection is not None:
            replacement._modules[projection] = share_state(module._modules[projection], ValueLinear)
        setattr(replacement, OPTIONS, ("exact", projection))
    else:
        setattr(replacement, OPTIONS, (bits, group_size))
    return replacement
