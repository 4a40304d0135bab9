"""What a plan was made for: per block of the chain, its class name and its parameters' names and shapes.

A plan (a checkpoint plan or a memory plan) stores the fingerprint of the chain it was profiled on, and applying
it checks the fingerprint of the blocks it is applied to, so a plan made for one model does not apply silently to
another whose blocks have the same names. Dtypes and devices are left out: a plan made in float32 on the CPU still
applies to the same model in bfloat16 on a GPU (its byte predictions then scale). Plans saved before fingerprints
existed have none and are applied without this check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FewBitError, check_integer, check_keys, check_string, show

__all__ = ["BlockFingerprint", "fingerprint", "check_fingerprint", "check_fingerprint_value", "fingerprint_from_json"]


@dataclass(frozen=True)
class BlockFingerprint:
    """A block's class name (``module``) and its parameters as ``(name, shape)`` pairs in registration order."""

    module: str
    parameters: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, block: torch.nn.Module) -> BlockFingerprint:
        parameters = tuple((name, tuple(int(s) for s in p.shape)) for name, p in block.named_parameters())
        return cls(type(block).__name__, parameters)

    def to_json(self) -> dict[str, Any]:
        return {"module": self.module, "parameters": [[name, list(shape)] for name, shape in self.parameters]}

    def difference(self, other: BlockFingerprint) -> str | None:
        """How ``other`` (the block found) differs from this one (the plan's), in words; None when it does not."""
        if self.module != other.module:
            return f"it is a {other.module}, the plan was made for a {self.module}"
        mine, theirs = dict(self.parameters), dict(other.parameters)
        for name, shape in self.parameters:
            if name not in theirs:
                return f"it has no parameter {name!r} (the plan's block has one of shape {_shape(shape)})"
            if theirs[name] != shape:
                return f"its parameter {name!r} has shape {_shape(theirs[name])}, in the plan {_shape(shape)}"
        for name, shape in other.parameters:
            if name not in mine:
                return f"it has a parameter {name!r} of shape {_shape(shape)} that the plan's block lacks"
        return None


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape) if shape else "()"


def fingerprint(blocks: Sequence[torch.nn.Module]) -> tuple[BlockFingerprint, ...]:
    """The fingerprint of a chain: one :class:`BlockFingerprint` per block."""
    return tuple(BlockFingerprint.of(block) for block in blocks)


def check_fingerprint(
    expected: Sequence[BlockFingerprint], blocks: Sequence[torch.nn.Module], names: Sequence[str], what: str
) -> None:
    """Raise one :class:`FewBitError` naming the first block of ``blocks`` that differs from the plan's
    ``expected`` fingerprint (nothing to check when the plan has none: plans saved before fingerprints)."""
    if not expected:
        return
    if len(expected) != len(blocks):
        raise FewBitError(f"{what} is for a chain of {len(expected)} blocks, but this one has {len(blocks)}")
    for index, (planned, block) in enumerate(zip(expected, blocks, strict=True)):
        difference = planned.difference(BlockFingerprint.of(block))
        if difference is not None:
            raise FewBitError(
                f"{what} was made for another model: block {index} ({names[index]!r}) differs: {difference}"
            )


def fingerprint_from_json(data: Any, where: str) -> tuple[BlockFingerprint, ...]:
    """The fingerprint of a plan file (a list of ``{"module": ..., "parameters": [[name, shape], ...]}``)."""
    if not isinstance(data, list | tuple):
        raise FewBitError(f"{where} must be a list, got {show(data)}")
    blocks = []
    for index, item in enumerate(data):
        here = f"{where}[{index}]"
        check_keys(here, item, ("module", "parameters"))
        parameters = item["parameters"]
        pair_types = list | tuple
        if not isinstance(parameters, pair_types) or not all(
            isinstance(pair, pair_types) and len(pair) == 2 for pair in parameters
        ):
            raise FewBitError(f"{here}.parameters must be a list of [name, shape] pairs, got {show(parameters)}")
        pairs = tuple((name, tuple(shape) if isinstance(shape, list) else shape) for name, shape in parameters)
        blocks.append(BlockFingerprint(item["module"], pairs))
    check_fingerprint_value(tuple(blocks), len(blocks), where)
    return tuple(blocks)


def check_fingerprint_value(value: Any, count: int, where: str) -> None:
    """A plan's fingerprint: empty (a plan saved before fingerprints), or one valid :class:`BlockFingerprint` per
    block."""
    if not isinstance(value, tuple):
        raise FewBitError(f"{where} must be a tuple of BlockFingerprint, got {show(value)}")
    if value and len(value) != count:
        raise FewBitError(f"{where} has {len(value)} blocks, but the plan has {count}")
    for index, item in enumerate(value):
        here = f"{where}[{index}]"
        if not isinstance(item, BlockFingerprint):
            raise FewBitError(f"{here} must be a BlockFingerprint, got {show(item)}")
        check_string(f"{here}.module", item.module)
        if not isinstance(item.parameters, tuple):
            raise FewBitError(f"{here}.parameters must be a tuple of (name, shape) pairs, got {show(item.parameters)}")
        for k, pair in enumerate(item.parameters):
            if not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[1], tuple):
                raise FewBitError(f"{here}.parameters[{k}] must be a (name, shape) pair, got {show(pair)}")
            check_string(f"{here}.parameters[{k}] name", pair[0])
            for size in pair[1]:
                check_integer(f"{here}.parameters[{k}] shape", size, low=0)
