"""The peak-memory and time model of a checkpoint schedule, as torch executes it.

Terms: block i maps the hidden state x_i to x_{i+1}; x_0 is the chain's input (alive before the step, so not
counted). A *segment* [a, b) of consecutive blocks is either plain (its blocks keep what they save for backward)
or checkpointed: ``torch.utils.checkpoint(..., use_reentrant=False)`` keeps only its input x_a in the forward
pass and, in the backward pass, first recomputes the whole segment (keeping what its blocks save), then runs its
backward. A checkpointed segment may have *children*: a plan of its own range that its recomputation runs (nested
checkpoints, Chen's recursion).

The model replays the step block by block with per-block measurements (:class:`BlockProfile`) and tracks the
bytes alive: a block's forward adds its ``retained_bytes`` and its output, and peaks ``forward_peak_bytes``
above where it started; its backward peaks ``backward_peak_bytes`` above where it started, then adds
``backward_delta_bytes`` (gradients made minus saved tensors freed) and frees the incoming gradient. A hidden
state x_i stays alive while something holds it: block i saving its input, block i - 1 saving its output, or a
checkpoint whose input it is; it is freed after the backward of the last of those. The loss is taken as
``output.sum()``, whose gradient is an expanded scalar (no bytes). Parameters' gradients are assumed absent at
the start of the step (``zero_grad(set_to_none=True)``, torch's default).

This module is pure Python on numbers: it never runs a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import FewBitError, check_boolean, check_integer, check_keys, show
from .profile import BlockProfile, Profile

__all__ = ["Segment", "Prediction", "predict", "check_segments", "MAX_SEGMENT_DEPTH"]

#: nested checkpoints a plan may have (the recursive strategy nests log2(n) deep; a plan nesting deeper is not one)
MAX_SEGMENT_DEPTH = 32


@dataclass(frozen=True)
class Segment:
    """Blocks ``start`` to ``stop - 1``, checkpointed or not; ``children`` (checkpointed only) is the plan its
    recomputation runs, covering the same blocks (empty: its blocks run plainly)."""

    start: int
    stop: int
    checkpoint: bool
    children: tuple[Segment, ...] = ()

    def to_dict(self) -> dict:
        data: dict = {"start": self.start, "stop": self.stop, "checkpoint": self.checkpoint}
        if self.children:
            data["children"] = [child.to_dict() for child in self.children]
        return data

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "segment", depth: int = 0) -> Segment:
        """The segment that :meth:`to_dict` wrote, with strict types (``start``/``stop`` JSON integers,
        ``checkpoint`` a JSON boolean); whether segments tile their blocks is :func:`check_segments`' part."""
        check_keys(where, data, ("start", "stop", "checkpoint"), ("children",))
        children = data.get("children", [])
        if not isinstance(children, list):
            raise FewBitError(f"{where}.children must be a list of segments, got {show(children)}")
        if children and depth >= MAX_SEGMENT_DEPTH:
            raise FewBitError(f"{where}: segments nest more than {MAX_SEGMENT_DEPTH} deep")
        return cls(
            check_integer(f"{where}.start", data["start"], low=0),
            check_integer(f"{where}.stop", data["stop"], low=0),
            check_boolean(f"{where}.checkpoint", data["checkpoint"]),
            tuple(
                cls.from_dict(child, where=f"{where}.children[{k}]", depth=depth + 1)
                for k, child in enumerate(children)
            ),
        )


@dataclass
class Prediction:
    """Predicted peak bytes (above the step's start) and extra time (recomputation) of a schedule.

    Attributes:
        peak_bytes: the predicted peak above the step's start
        extra_seconds: the predicted recomputation time
        forward_peak_bytes: the peak during the forward pass
        backward_peak_bytes: the peak during the backward pass
        timeline: (event, live bytes) at each block's forward and backward peak, when asked for
    """

    peak_bytes: int
    extra_seconds: float
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    timeline: list[tuple[str, int]] = field(default_factory=list)


class _Replay:
    """Replays a schedule over the profiled blocks, tracking live bytes and their peak.

    ``alive[j]`` is the block after whose backward x_j is freed (the smallest index among its holders, since the
    backward pass runs from the last block down)."""

    def __init__(self, blocks: Sequence[BlockProfile], record: bool = False) -> None:
        self.blocks = blocks
        self.n = len(blocks)
        self.live = 0
        self.peak = 0
        self.alive: dict[int, int] = {}
        self.timeline: list[tuple[str, int]] | None = [] if record else None

    def event(self, label: str, extra: int) -> None:
        if self.live + extra > self.peak:
            self.peak = self.live + extra
        if self.timeline is not None:
            self.timeline.append((label, self.live + extra))

    def _hold_or_free(self, j: int, holders: list[int]) -> None:
        """x_j was consumed (or is a level's output): keep it until the backward of min(holders), or free it."""
        if j == 0:
            return
        if holders:
            self.alive[j] = min(holders + [self.alive.get(j, self.n)])
        elif j not in self.alive:
            self.live -= self.blocks[j - 1].output_bytes

    def forward(self, segments: Sequence[Segment], keep_saved: bool) -> None:
        """Run ``segments`` forward. ``keep_saved`` False: inside an enclosing checkpoint's forward, where nothing is
        saved (nested checkpoints keep nothing either: they save their inputs through the enclosing one's hooks)."""
        plain_blocks = {i for s in segments if keep_saved and not s.checkpoint for i in range(s.start, s.stop)}
        starts = {s.start for s in segments if keep_saved and s.checkpoint}
        for segment in segments:
            for i in range(segment.start, segment.stop):
                block = self.blocks[i]
                if i in plain_blocks:
                    self.event(f"forward {block.name}", block.forward_peak_bytes)
                    self.live += block.retained_bytes + block.output_bytes
                else:
                    self.event(f"forward {block.name} (checkpointed)", block.checkpoint_forward_peak_bytes)
                    self.live += block.output_bytes
                holders = []
                if i in plain_blocks and block.saves_input:
                    holders.append(i)
                if i - 1 in plain_blocks and self.blocks[i - 1].saves_output:
                    holders.append(i - 1)
                if i in starts:
                    holders.append(i)
                self._hold_or_free(i, holders)
        last = segments[-1].stop - 1
        self._hold_or_free(last + 1, [last] if last in plain_blocks and self.blocks[last].saves_output else [])

    def backward(self, segments: Sequence[Segment]) -> None:
        """Run the backward pass of ``segments`` (their forward already run), last block first."""
        for segment in reversed(segments):
            if segment.checkpoint:
                # recomputation: the children (or the plain blocks) forward with saving on; x_start is alive
                children = segment.children or (Segment(segment.start, segment.stop, False),)
                self.forward(children, keep_saved=True)
                self.backward(children)
                continue
            for i in range(segment.stop - 1, segment.start - 1, -1):
                block = self.blocks[i]
                self.event(f"backward {block.name}", block.backward_peak_bytes)
                incoming = self.blocks[i + 1].input_grad_bytes if i + 1 < self.n else 0  # the sum's: a scalar
                self.live += block.backward_delta_bytes - incoming
                for j in [j for j, release in self.alive.items() if release == i]:
                    del self.alive[j]
                    self.live -= self.blocks[j - 1].output_bytes


def _extra_seconds(blocks: Sequence[BlockProfile], segments: Sequence[Segment]) -> float:
    total = 0.0
    for segment in segments:
        if segment.checkpoint:
            total += sum(b.forward_seconds for b in blocks[segment.start : segment.stop])
            total += _extra_seconds(blocks, segment.children)
    return total


def predict(profile: Profile | Sequence[BlockProfile], segments: Sequence[Segment], *, timeline: bool = False):
    """Predict the peak bytes (above the step's start) and the extra time of running ``segments``.

    ``segments`` must cover blocks 0 .. n - 1 in order. Returns a :class:`Prediction` (with ``timeline``: the live
    bytes at each block's forward and backward peak, for plots and debugging).

    Args:
        profile: a :class:`Profile` or its blocks
        segments: the schedule
        timeline: also return the timeline
    """
    blocks = profile.blocks if isinstance(profile, Profile) else tuple(profile)
    segments = check_segments(segments, 0, len(blocks))
    replay = _Replay(blocks, record=timeline)
    replay.forward(segments, keep_saved=True)
    forward_peak = replay.peak
    replay.peak = 0
    replay.backward(segments)
    return Prediction(
        peak_bytes=max(forward_peak, replay.peak),
        extra_seconds=_extra_seconds(blocks, segments),
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=replay.peak,
        timeline=replay.timeline or [],
    )


def check_segments(
    segments: Any, start: int, stop: int, *, where: str = "segments", depth: int = 0
) -> tuple[Segment, ...]:
    """Check that ``segments`` tile blocks ``start`` .. ``stop - 1`` in order (no gap, no overlap, none empty),
    with strict types, children only under checkpointed segments (tiling their parent's blocks) and at most
    :data:`MAX_SEGMENT_DEPTH` levels; return them as a tuple of frozen segments (children tuples too), so a later
    change to the lists they came in changes nothing."""
    if not isinstance(segments, tuple | list):
        raise FewBitError(f"{where} must be a list of Segment, got {show(segments)}")
    span = f"blocks {start}..{stop - 1} in order, without gaps or overlaps"
    if not segments:
        raise FewBitError(f"{where} is empty: segments must cover {span}")
    if depth > MAX_SEGMENT_DEPTH:
        raise FewBitError(f"{where}: segments nest more than {MAX_SEGMENT_DEPTH} deep")
    checked = []
    position = start
    for index, segment in enumerate(segments):
        here = f"{where}[{index}]"
        if not isinstance(segment, Segment):
            raise FewBitError(f"{here} must be a Segment, got {show(segment)}")
        first = check_integer(f"{here}.start", segment.start, low=0)
        last = check_integer(f"{here}.stop", segment.stop, low=0)
        checkpointed = check_boolean(f"{here}.checkpoint", segment.checkpoint)
        if first != position:
            before = f"{where}[{index - 1}] ends at {position}" if index else f"the first must start at {start}"
            raise FewBitError(f"{here} starts at {first} but {before}: segments must cover {span}")
        if last <= first:
            raise FewBitError(f"{here} is empty (start {first}, stop {last}): segments must cover {span}")
        if last > stop:
            raise FewBitError(f"{here} ends at {last}, beyond block {stop - 1}: segments must cover {span}")
        children: tuple[Segment, ...] = ()
        if not isinstance(segment.children, tuple | list):
            raise FewBitError(f"{here}.children must be a list of Segment, got {show(segment.children)}")
        if segment.children:
            if not checkpointed:
                raise FewBitError(f"{here} has children but is not checkpointed: only a checkpointed segment may")
            children = check_segments(segment.children, first, last, where=f"{here}.children", depth=depth + 1)
        checked.append(Segment(first, last, checkpointed, children))
        position = last
    if position != stop:
        raise FewBitError(f"{where} end at block {position - 1}: segments must cover {span}")
    return tuple(checked)
