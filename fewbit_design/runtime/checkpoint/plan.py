"""Checkpoint strategies: which segments of a profiled chain to checkpoint.

Strategies (Chen, Xu, Zhang, Guestrin 2016, "Training deep nets with sublinear memory cost"):

* ``"none"``: no checkpointing.
* ``"sqrt"`` (§4.3): round(sqrt(n)) segments as equal as possible, all checkpointed but the last (its backward
  follows its forward at once, so recomputing it would buy nothing), like
  ``torch.utils.checkpoint.checkpoint_sequential``.
* ``"greedy"`` (Alg. 3): walk the chain adding each block's bytes; close a checkpointed segment when the sum
  passes B; search B over the chain's prefix sums for the smallest predicted peak (or, under a budget, the least
  recomputation that fits).
* ``"recursive"`` (§4.4): split in halves, checkpoint the first half and recurse into both (nested checkpoints):
  O(log n) kept inputs, each block recomputed about log2(n) times.
* ``"optimal"``: a dynamic program over all flat schedules (each block plain or in a checkpointed segment) that
  minimises the recomputation time under the budget, with the peak model of :mod:`.cost`; without a budget it
  takes the smallest feasible peak.

Every plan's peak and extra time come from :func:`.cost.predict`, the same model for all strategies.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import (
    FewBitError,
    check_choice,
    check_integer,
    check_keys,
    check_number,
    check_string,
    parse_budget,
    resolve_budget,
    show,
)
from ..fingerprint import BlockFingerprint, check_fingerprint_value, fingerprint_from_json
from ..planfile import PlanFile
from .cost import Segment, check_segments, predict
from .profile import Profile

__all__ = ["Plan", "STRATEGIES", "FORMAT", "parse_budget", "plan", "format_bytes", "minimum_budget", "load_plan"]

STRATEGIES = ("none", "sqrt", "greedy", "recursive", "optimal")
FORMAT = "fewbit-checkpoint-plan/1"
#: a checkpoint plan file is a few KB per hundred blocks; a file this large is not one
MAX_PLAN_BYTES = 16 * 2**20


def format_bytes(nbytes: float) -> str:
    """``1.5 MiB`` style (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


@dataclass
class Plan(PlanFile):
    """A checkpoint schedule for a profiled chain.

    Attributes:
        segments: the top-level segments, covering blocks 0 .. n - 1 (see :class:`.cost.Segment`).
        strategy: the strategy that made it (any name for a plan built by hand).
        peak_bytes: predicted peak bytes of a training step (forward + backward) above its start.
        extra_seconds: predicted recomputation time per step.
        forward_seconds: the profiled forward time of the whole chain (for the overhead ratio).
        baseline_peak_bytes: predicted peak without checkpointing.
        budget_bytes: the budget it was made under, if any.
        names: the blocks' names (empty or one per block).
        fingerprint: per block, its class and parameter shapes (see :mod:`.fingerprint`); :func:`.apply.apply`
            refuses blocks that differ. Empty for plans saved before fingerprints existed (applied unchecked).

    A plan is checked completely (:meth:`validate`) when it is read (:meth:`from_dict`, :func:`load_plan`) and
    again when it is applied, so a plan built or changed by hand cannot run a schedule that computes something
    else than the model.
    """

    FORMAT = FORMAT
    KIND = "checkpoint plan"
    MAX_BYTES = MAX_PLAN_BYTES

    segments: tuple[Segment, ...]
    strategy: str
    peak_bytes: int
    extra_seconds: float
    forward_seconds: float
    baseline_peak_bytes: int
    budget_bytes: int | None = None
    names: tuple[str, ...] = field(default=())
    fingerprint: tuple[BlockFingerprint, ...] = field(default=())

    @property
    def checkpointed(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of the top-level checkpointed segments."""
        return [(s.start, s.stop) for s in self.segments if s.checkpoint]

    @property
    def block_count(self) -> int:
        """The number of blocks the plan is for."""
        return self.segments[-1].stop if self.segments else 0

    def validate(self, source: str | None = None) -> tuple[Segment, ...]:
        """Check every field (types, ranges, segments tiling the blocks); return the segments as checked (a
        tuple of frozen segments). Raises one :class:`FewBitError` naming the field and the constraint."""
        try:
            if not isinstance(self.names, tuple | list):
                raise FewBitError(f"names must be a tuple of strings, got {show(self.names)}")
            for index, name in enumerate(self.names):
                check_string(f"names[{index}]", name)
            if not isinstance(self.segments, tuple | list) or not self.segments:
                raise FewBitError(f"segments must be a non-empty list of Segment, got {show(self.segments)}")
            if self.names:
                count = len(self.names)
            elif isinstance(self.segments[-1], Segment):
                count = check_integer(f"segments[{len(self.segments) - 1}].stop", self.segments[-1].stop, low=1)
            else:
                raise FewBitError(
                    f"segments[{len(self.segments) - 1}] must be a Segment, got {show(self.segments[-1])}"
                )
            segments = check_segments(self.segments, 0, count)
            check_string("strategy", self.strategy)
            check_integer("peak_bytes", self.peak_bytes, low=0)
            check_number("extra_seconds", self.extra_seconds, low=0)
            check_number("forward_seconds", self.forward_seconds, low=0)
            check_integer("baseline_peak_bytes", self.baseline_peak_bytes, low=0)
            if self.budget_bytes is not None:
                check_integer("budget_bytes", self.budget_bytes, low=1)
            check_fingerprint_value(self.fingerprint, count, "fingerprint")
        except FewBitError as error:
            where = f"checkpoint plan {source!r}" if source else "checkpoint plan"
            raise FewBitError(f"{where}: {error}") from None
        return segments

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dictionary (see :meth:`from_dict`)."""
        return {
            "format": FORMAT,
            "strategy": self.strategy,
            "segments": [s.to_dict() for s in self.segments],
            "peak_bytes": self.peak_bytes,
            "extra_seconds": self.extra_seconds,
            "forward_seconds": self.forward_seconds,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "budget_bytes": self.budget_bytes,
            "names": list(self.names),
            "fingerprint": [block.to_json() for block in self.fingerprint],
        }

    @classmethod
    def _from_checked(cls, data: dict[str, Any]) -> Plan:
        """The plan of a dict whose format was checked (:meth:`~..planfile.PlanFile.from_dict`): JSON integers for
        counts and bytes, JSON booleans for ``checkpoint``, segments that tile the blocks; ``budget_bytes``,
        ``names`` and ``fingerprint`` may be absent (plans saved before fingerprints load, and apply without that
        check)."""
        required = ("format", "strategy", "segments", "peak_bytes", "extra_seconds", "forward_seconds")
        check_keys("the plan", data, required + ("baseline_peak_bytes",), ("budget_bytes", "names", "fingerprint"))
        if not isinstance(data["segments"], list):
            raise FewBitError(f"segments must be a list, got {show(data['segments'])}")
        names = data.get("names", [])
        if not isinstance(names, list):
            raise FewBitError(f"names must be a list of strings, got {show(names)}")
        return cls(
            segments=tuple(Segment.from_dict(s, where=f"segments[{k}]") for k, s in enumerate(data["segments"])),
            strategy=data["strategy"],
            peak_bytes=data["peak_bytes"],
            extra_seconds=data["extra_seconds"],
            forward_seconds=data["forward_seconds"],
            baseline_peak_bytes=data["baseline_peak_bytes"],
            budget_bytes=data.get("budget_bytes"),
            names=tuple(names),
            fingerprint=fingerprint_from_json(data.get("fingerprint", []), "fingerprint"),
        )

    def __str__(self) -> str:
        n = self.block_count
        overhead = self.extra_seconds / self.forward_seconds if self.forward_seconds > 0 else 0.0
        budget = f", budget {format_bytes(self.budget_bytes)}" if self.budget_bytes is not None else ""
        lines = [
            f"checkpoint plan {self.strategy!r} for {n} blocks: predicted peak {format_bytes(self.peak_bytes)} "
            f"(no checkpointing {format_bytes(self.baseline_peak_bytes)}{budget}), "
            f"recomputation {self.extra_seconds * 1e3:.2f} ms per step ({overhead:.0%} of the forward pass)",
            f"  {'blocks':<14}{'checkpointed':<14}{'nested':>8}",
        ]
        for segment in self.segments:
            first = self.names[segment.start] if self.names else str(segment.start)
            last = self.names[segment.stop - 1] if self.names else str(segment.stop - 1)
            span = first if segment.stop - segment.start == 1 else f"{first}..{last}"
            nested = str(len(segment.children)) if segment.children else "-"
            lines.append(f"  {span:<14}{'yes' if segment.checkpoint else 'no':<14}{nested:>8}")
        return "\n".join(lines)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a plan that :meth:`Plan.save` wrote; ``checkpoint.apply(blocks, load_plan(path))`` applies it. The file
    is read with the bounds of a table file (size, JSON nesting, UTF-8) and checked completely: every failure is
    one :class:`FewBitError` naming the file."""
    return Plan.load(path)


# --- strategies --------------------------------------------------------------------------------------------------


def _plain(start: int, stop: int) -> tuple[Segment, ...]:
    return (Segment(start, stop, False),) if stop > start else ()


def _merge_plain(segments: Sequence[Segment]) -> tuple[Segment, ...]:
    merged: list[Segment] = []
    for segment in segments:
        if merged and not segment.checkpoint and not merged[-1].checkpoint:
            merged[-1] = Segment(merged[-1].start, segment.stop, False)
        else:
            merged.append(segment)
    return tuple(merged)


def _sqrt(n: int) -> tuple[Segment, ...]:
    # k = round(sqrt(n)) segments as equal as possible, all checkpointed but the last. Equal lengths matter at the
    # tail: with segments of ceil-length the plain tail could be tiny (2 blocks of 32 with segments of 6), so
    # nearly every block was recomputed although the peak could hold a whole segment's activations anyway.
    count = max(1, round(math.sqrt(n)))
    bounds = [round(i * n / count) for i in range(count + 1)]
    segments = [Segment(bounds[i], bounds[i + 1], True) for i in range(count - 1)]
    return tuple(segments) + _plain(bounds[-2], n)


def _recursive(start: int, stop: int) -> tuple[Segment, ...]:
    if stop - start <= 1:
        return _plain(start, stop)
    middle = (start + stop) // 2
    first = Segment(start, middle, True, _recursive(start, middle) if middle - start > 1 else ())
    return _merge_plain((first,) + _recursive(middle, stop))


def _greedy_segments(sizes: Sequence[int], limit: float) -> tuple[Segment, ...]:
    """Chen's Alg. 3: a segment closes (its output is kept) when the bytes of its blocks pass ``limit``."""
    segments = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > limit and i + 1 < len(sizes):
            segments.append(Segment(start, i + 1, True))
            start, total = i + 1, 0
    return tuple(segments) + _plain(start, len(sizes))


def _greedy(profile: Profile, budget: int | None) -> tuple[Segment, ...]:
    sizes = [b.retained_bytes + b.output_bytes for b in profile.blocks]
    limits = sorted(set(np.cumsum(sizes).tolist()) | {0})
    best: tuple[tuple[float, float], tuple[Segment, ...]] | None = None
    for limit in limits:
        segments = _greedy_segments(sizes, limit)
        prediction = predict(profile, segments)
        if budget is not None and prediction.peak_bytes > budget:
            continue
        key = (
            (prediction.extra_seconds, prediction.peak_bytes)
            if budget is not None
            else (
                prediction.peak_bytes,
                prediction.extra_seconds,
            )
        )
        if best is None or key < best[0]:
            best = (key, segments)
    if best is None:
        raise _infeasible(profile, budget, "greedy")
    return best[1]


# --- the dynamic program -----------------------------------------------------------------------------------------


@dataclass
class _Terms:
    """Per-segment terms of the peak model for flat schedules (see the derivation in :func:`_terms`)."""

    plain_need: list[list[int]]  # [p][a]: peak above F(a) of block a run plainly, p = x_a held by block a - 1
    plain_kept: list[list[int]]
    checkpoint_need: np.ndarray  # [a, b]: peak above F(a) of checkpointed segment [a, b) (inf where b <= a)
    times: np.ndarray  # prefix sums of forward seconds


def _terms(profile: Profile, max_length: int | None) -> _Terms:
    """The peak of a flat schedule is max over its segments S = [a, b) of F(a) + need(S), where F(a) is what the
    segments before a keep (x_a excluded) and need(S) depends on S alone (and, for a plain block, on whether the
    block before saves its output). These are the same numbers :func:`.cost.predict` replays, in closed form."""
    blocks = profile.blocks
    n = len(blocks)
    out = [0] + [b.output_bytes for b in blocks]  # out[i] = bytes of x_i (x_0: alive before the step)
    so = [b.saves_output for b in blocks]
    si = [b.saves_input for b in blocks]
    grad_in = [b.input_grad_bytes for b in blocks] + [0]  # incoming gradient of block i = grad_in[i + 1]
    gradient_bytes = [b.gradient_bytes for b in blocks]
    suffix_grads = np.concatenate([np.cumsum(gradient_bytes[::-1])[::-1], [0]]).astype(np.int64)  # PG(b)
    plain_need: list[list[int]] = [[0] * n, [0] * n]
    plain_kept: list[list[int]] = [[0] * n, [0] * n]
    for p in (0, 1):
        for a, block in enumerate(blocks):
            held = a > 0 and (p or si[a])
            kept = (out[a] if held else 0) + block.retained_bytes
            forward = out[a] + block.forward_peak_bytes
            backward = (
                kept + (out[a + 1] if so[a] else 0) + grad_in[a + 1] + suffix_grads[a + 1] + block.backward_peak_bytes
            )
            plain_need[p][a] = int(max(forward, backward))
            plain_kept[p][a] = int(kept)
    # checkpointed segments, vectorised over the end b for each start a
    pf = np.array([b.forward_peak_bytes for b in blocks], dtype=np.int64)
    cf = np.array([b.checkpoint_forward_peak_bytes for b in blocks], dtype=np.int64)
    pb = np.array([b.backward_peak_bytes for b in blocks], dtype=np.int64)
    retained = np.array([b.retained_bytes for b in blocks], dtype=np.int64)
    delta = np.array([b.backward_delta_bytes for b in blocks], dtype=np.int64)
    outs = np.array(out, dtype=np.int64)
    # recompute increments: block j adds what it keeps and its output, then x_j is freed unless held (j > a)
    freed_input = np.array([out[j] if j > 0 and not (si[j] or so[j - 1]) else 0 for j in range(n)], dtype=np.int64)
    increment = retained + outs[1:] - freed_input
    # backward step of block i: its delta, minus the incoming gradient and the hidden states it releases
    released = np.array(
        [(out[i + 1] if so[i] else 0) + (out[i] if i > 0 and si[i] and not so[i - 1] else 0) for i in range(n)],
        dtype=np.int64,
    )
    step = delta - np.array(grad_in[1:], dtype=np.int64) - released
    step_prefix = np.concatenate([[0], np.cumsum(step)])  # P[k] = sum of step_j for j < k
    incoming = np.array(grad_in, dtype=np.int64)  # g_b = grad_in[b] (0 for b = n)
    not_saved_out = np.array([0] + [out[b] if not so[b - 1] else 0 for b in range(1, n + 1)], dtype=np.int64)
    need = np.full((n + 1, n + 1), np.iinfo(np.int64).max // 4, dtype=np.int64)
    for a in range(n):
        stop = n if max_length is None else min(n, a + max_length)
        idx = np.arange(a, stop)
        inc = increment[a:stop].copy()
        inc[0] += freed_input[a]  # x_a is held by the checkpoint
        recompute_before = np.concatenate([[0], np.cumsum(inc)])  # R_i for i = a .. stop
        recompute_max = np.maximum.accumulate(recompute_before[:-1] + pf[a:stop])
        backward_max = np.maximum.accumulate(pb[a:stop] - step_prefix[idx + 1])
        forward_events = cf[a:stop] + np.where(idx > a, outs[idx], 0)
        forward_max = np.maximum.accumulate(forward_events) + out[a]
        b = idx + 1
        base = out[a] + incoming[b] + suffix_grads[b]
        start = base + recompute_before[1:] - not_saved_out[b]
        backward_need = np.maximum(base + recompute_max, start + step_prefix[b] + backward_max)
        need[a, b] = np.maximum(forward_max, backward_need)
    times = np.concatenate([[0.0], np.cumsum([b.forward_seconds for b in blocks])])
    return _Terms(plain_need, plain_kept, need, times)


def _dynamic_program(profile: Profile, budget: int, max_length: int | None, terms: _Terms | None = None):
    """Least recomputation time under ``budget``: a Pareto front of (kept bytes F, time) per position and flag."""
    n = len(profile.blocks)
    terms = terms or _terms(profile, max_length)
    out = [0] + [b.output_bytes for b in profile.blocks]
    so = [b.saves_output for b in profile.blocks]
    # fronts[(a, p)] = (F, T, parent index arrays); candidates gathered per target node
    candidates: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    fronts: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    parents: list[tuple[int, int, int, int, bool]] = []  # (a, p, index in front(a, p), b, checkpointed)

    def push(node, kept, times, ids):
        candidates.setdefault(node, []).append((kept, times, ids))

    fronts[(0, 0)] = (np.zeros(1, dtype=np.int64), np.zeros(1))
    front_ids: dict[tuple[int, int], np.ndarray] = {(0, 0): np.array([-1])}
    for a in range(n):
        for p in (0, 1):
            node = (a, p)
            if node not in fronts and node in candidates:
                fronts[node], front_ids[node] = _pareto(candidates.pop(node))
            if node not in fronts:
                continue
            kept, times = fronts[node]
            # plain block a
            limit = budget - terms.plain_need[p][a]
            count = int(np.searchsorted(kept, limit, side="right"))
            if count:
                first = len(parents)
                parents.extend((a, p, k, a + 1, False) for k in range(count))
                push(
                    (a + 1, int(so[a])),
                    kept[:count] + terms.plain_kept[p][a],
                    times[:count],
                    np.arange(first, first + count),
                )
            # checkpointed segments [a, b)
            for b in range(a + 1, n + 1):
                need = int(terms.checkpoint_need[a, b])
                count = int(np.searchsorted(kept, budget - need, side="right"))
                if not count:
                    continue
                first = len(parents)
                parents.extend((a, p, k, b, True) for k in range(count))
                extra = terms.times[b] - terms.times[a]
                push((b, 0), kept[:count] + out[a], times[:count] + extra, np.arange(first, first + count))
    for p in (0, 1):
        if (n, p) in candidates:
            fronts[(n, p)], front_ids[(n, p)] = _pareto(candidates.pop((n, p)))
    return _fastest_path(n, fronts, front_ids, parents)


def _fastest_path(n, fronts, front_ids, parents) -> tuple[Segment, ...] | None:
    """The fastest schedule ending at block ``n`` of :func:`_dynamic_program`'s fronts, followed back through
    ``parents``; None when no path reaches the end within the budget."""
    ends = []
    for p in (0, 1):
        if (n, p) in fronts:
            kept, times = fronts[(n, p)]
            k = int(np.argmin(times))
            ends.append((times[k], kept[k], int(front_ids[(n, p)][k])))
    if not ends:
        return None
    _, _, parent = min(ends)
    cuts = []
    while parent >= 0:
        a, p, k, b, checkpointed = parents[parent]
        cuts.append(Segment(a, b, checkpointed))
        parent = int(front_ids[(a, p)][k])
    return _merge_plain(cuts[::-1])


def _pareto(parts):
    kept = np.concatenate([part[0] for part in parts])
    times = np.concatenate([part[1] for part in parts])
    ids = np.concatenate([part[2] for part in parts])
    order = np.lexsort((times, kept))
    kept, times, ids = kept[order], times[order], ids[order]
    best_before = np.concatenate([[np.inf], np.minimum.accumulate(times)[:-1]])
    keep = times < best_before - 1e-15
    return (kept[keep], times[keep]), ids[keep]


def minimum_budget(profile: Profile, *, per_block: bool | None = None) -> int:
    """The smallest peak any flat plan reaches (the smallest feasible budget for ``"optimal"``).

    Args:
        profile: the profile
        per_block: segments of one block only (a ModuleList); None: the profile's own setting
    """
    per_block = profile.per_block if per_block is None else per_block
    terms = _terms(profile, 1 if per_block else None)
    high = predict(profile, _plain(0, len(profile.blocks))).peak_bytes
    low = 0
    while low < high:  # the smallest budget with a feasible schedule (feasibility is monotone in the budget)
        middle = (low + high) // 2
        if _feasible(profile, middle, terms):
            high = middle
        else:
            low = middle + 1
    return high


def _feasible(profile: Profile, budget: int, terms: _Terms) -> bool:
    """Whether some flat schedule fits ``budget``: the least kept bytes per position and flag suffice."""
    n = len(profile.blocks)
    out = [0] + [b.output_bytes for b in profile.blocks]
    so = [b.saves_output for b in profile.blocks]
    best = np.full((n + 1, 2), np.inf)
    best[0, 0] = 0
    for a in range(n):
        for p in (0, 1):
            kept = best[a, p]
            if not np.isfinite(kept):
                continue
            if kept + terms.plain_need[p][a] <= budget:
                target = (a + 1, int(so[a]))
                best[target] = min(best[target], kept + terms.plain_kept[p][a])
            reachable = kept + terms.checkpoint_need[a, a + 1 :] <= budget
            best[a + 1 :, 0] = np.where(reachable, np.minimum(best[a + 1 :, 0], kept + out[a]), best[a + 1 :, 0])
    return bool(np.isfinite(best[n]).any())


def _infeasible(profile: Profile, budget: int | None, strategy: str, peak: int | None = None) -> FewBitError:
    smallest = minimum_budget(profile)
    reached = f" (the {strategy!r} plan needs {format_bytes(peak)})" if peak is not None else ""
    return FewBitError(
        f"budget {format_bytes(budget or 0)} is below what checkpointing can reach{reached}: the smallest feasible "
        f"budget is {smallest} bytes ({format_bytes(smallest)}, strategy 'optimal')"
    )


def plan(profile: Profile, *, budget: int | float | str | None = None, strategy: str = "optimal") -> Plan:
    """Choose which segments to checkpoint.

    Args:
        profile: what :func:`.profile.profile` measured.
        budget: peak bytes allowed for a training step above its start, in the syntax of
            :func:`fewbit_design.errors.parse_budget` (shared with ``plan_memory`` and the CLI): an int or a string
            like ``"2GiB"``, ``"512MiB"``, ``"1.5GB"``; a fraction in (0, 1] of the peak without checkpointing
            (``0.5`` or ``"0.5"``); or ``"min"``, the smallest feasible budget (:func:`minimum_budget`).
            ``"optimal"`` and ``"greedy"`` minimise recomputation under it; the fixed strategies only check it.
            Without a budget, ``"optimal"`` and ``"greedy"`` take their smallest peak.
        strategy: ``"none"``, ``"sqrt"``, ``"greedy"``, ``"recursive"`` or ``"optimal"`` (see the module docstring).

    Raises FewBitError when no plan fits the budget, naming the smallest feasible budget.
    """
    check_choice("strategy", strategy, STRATEGIES)
    if not isinstance(profile, Profile):
        raise FewBitError(f"plan needs the Profile that profile() returned, got {type(profile).__name__}")
    n = len(profile.blocks)
    baseline = predict(profile, _plain(0, n)).peak_bytes
    budget_bytes = (
        None
        if budget is None
        else resolve_budget(budget, unconverted=baseline, minimum=lambda: minimum_budget(profile))
    )
    if profile.per_block and strategy in ("sqrt", "greedy", "recursive"):
        raise FewBitError(
            f"strategy {strategy!r} needs segments of several blocks, but an nn.ModuleList is checkpointed block by "
            "block; use 'optimal' or 'none' (or pass an nn.Sequential)"
        )
    if strategy == "none":
        segments = _plain(0, n)
    elif strategy == "sqrt":
        segments = _sqrt(n)
    elif strategy == "recursive":
        segments = _recursive(0, n)
    elif strategy == "greedy":
        segments = _greedy(profile, budget_bytes)
    else:
        max_length = 1 if profile.per_block else None
        terms = _terms(profile, max_length)
        target = budget_bytes if budget_bytes is not None else minimum_budget(profile)
        found = _dynamic_program(profile, target, max_length, terms)
        if found is None:
            raise _infeasible(profile, budget_bytes, strategy)
        segments = found
    prediction = predict(profile, segments)
    if budget_bytes is not None and prediction.peak_bytes > budget_bytes:
        raise _infeasible(profile, budget_bytes, strategy, prediction.peak_bytes)
    return Plan(
        segments=tuple(segments),
        strategy=strategy,
        peak_bytes=prediction.peak_bytes,
        extra_seconds=prediction.extra_seconds,
        forward_seconds=profile.forward_seconds,
        baseline_peak_bytes=baseline,
        budget_bytes=budget_bytes,
        names=tuple(b.name for b in profile.blocks),
        fingerprint=profile.fingerprint,
    )
