"""Applying one option (a combination of techniques) to one block of the chain, in place.

An option is a ``+``-joined subset of :data:`TECHNIQUES` in that order (``"blpa+fewbit+checkpoint"``), or
``"plain"``. BLPA fuses first (it takes ReLUs into its units), then few-bit converts the remaining activations, then
checkpointing wraps the block's forward (an instance attribute, so state-dict keys and the model's own loop stay),
and offloading is applied to all offloaded blocks at once (one ``offload.apply``, one file per step).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ...errors import FewBitError
from ..checkpoint.apply import CheckpointedForward

__all__ = ["TECHNIQUES", "parse_option", "option_name", "apply_option", "CheckpointedForward"]

TECHNIQUES = ("blpa", "fewbit", "offload", "checkpoint")


def parse_option(option: str) -> tuple[str, ...]:
    """The techniques of an option name (``"plain"``: none)."""
    return () if option == "plain" else tuple(option.split("+"))


def option_name(techniques: Sequence[str]) -> str:
    """The canonical name of a set of techniques."""
    ordered = [t for t in TECHNIQUES if t in techniques]
    return "+".join(ordered) if ordered else "plain"


def apply_option(container: torch.nn.Module, key: str, option: str, *, bits: int, blpa_bits: int) -> torch.nn.Module:
    """Apply ``option``'s module changes (BLPA, few-bit, checkpoint; not offload) to ``container``'s child ``key``
    in place; return the block now at that place."""
    techniques = parse_option(option)
    block = container._modules[key]
    if "blpa" in techniques:
        from .. import blpa

        with warnings.catch_warnings():  # "nothing fused": the planner then does not offer BLPA there
            warnings.simplefilter("ignore", UserWarning)
            block = blpa.convert(block, bits=blpa_bits)
    if "fewbit" in techniques:
        from ..fewbit.convert import convert

        holder = torch.nn.Sequential(block)  # converts the block itself too when it is an activation
        with warnings.catch_warnings():  # "nothing replaced": the planner then does not offer few-bit there
            warnings.simplefilter("ignore", UserWarning)
            block = convert(holder, bits=bits)[0]
    if "checkpoint" in techniques:
        if isinstance(block.__dict__.get("forward"), CheckpointedForward):
            raise FewBitError(f"block {key!r} is checkpointed already; it cannot be checkpointed twice")
        block.forward = CheckpointedForward(block, selective=False)  # checkpoint.apply's per-block wrapper
    container._modules[key] = block
    return block


def changed_by(technique: str, block: torch.nn.Module, *, bits: int, blpa_bits: int) -> bool:
    """Whether ``technique`` (``blpa`` or ``fewbit``) changes anything in a copy of ``block``."""
    import copy

    holder = torch.nn.Sequential(copy.deepcopy(block))
    before = [type(m) for m in holder.modules()]
    apply_option(holder, "0", technique, bits=bits, blpa_bits=blpa_bits)
    return [type(m) for m in holder.modules()] != before
