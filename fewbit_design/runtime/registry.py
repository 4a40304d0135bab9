"""The technique registry: one contract per memory technique, which the planner reads and nothing else.

Each technique folder has a ``technique.py`` whose ``TECHNIQUE`` is a :class:`Technique`: its name, whether its
gradients are exact, how it reaches a model (its *seam*), its config (read from a plan's settings), ``apply`` (one
block), and its cost model (how the planner charges what the profiler measured with the technique in place). The
planner knows no technique by name: it builds options from :func:`techniques` and applies them through the contract.

Adding a technique is one folder with a ``technique.py`` and one line in :data:`REGISTRY` (whose order is the order
in which the techniques of one option are applied: module replacements that take whole patterns first, then the
ones that take what is left, then the wrappers, then the regions).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import FewBitError

__all__ = ["Technique", "REGISTRY", "techniques", "technique", "names", "setting_defaults", "iter_option", "SEAMS"]

#: where the techniques are, in application order (module path of each ``technique.py``; its ``TECHNIQUE``)
REGISTRY = (
    "fewbit_design.runtime.norms.technique",
    "fewbit_design.runtime.gated.technique",
    "fewbit_design.runtime.attention.technique",
    "fewbit_design.runtime.head.technique",
    "fewbit_design.runtime.blpa.technique",
    "fewbit_design.runtime.fewbit.technique",
    "fewbit_design.runtime.linear.technique",
    "fewbit_design.runtime.offload.technique",
    "fewbit_design.runtime.checkpoint.technique",
)

#: how a technique reaches a model: it replaces modules inside a block, wraps a block's forward, or runs the
#: blocks under saved-tensor hooks (applied once for the whole model)
SEAMS = ("module", "wrapper", "region")


def _unchanged(cost: Any, facts: Mapping[str, int]) -> Any:
    return cost


@dataclass(frozen=True)
class Technique:
    """One memory technique as the planner sees it.

    Attributes:
        name: its identifier in option names (``"blpa+fewbit"``), plan files, ``allow=`` and the CLI.
        summary: one line for reports and ``--help``.
        seam: one of :data:`SEAMS`.
        exact: whether gradients are unchanged (up to rounding) in the technique's default settings. The planner
            uses an inexact technique only where the budget needs it unless the user allows it (``approximate=``);
            it reads :meth:`is_exact`, which asks ``exact_in`` for a technique whose settings choose a mode.
        exact_in: ``exact_in(config)``, whether gradients are exact under ``config`` (gated's ``"compressed"`` mode
            is approximate, its ``"exact"`` mode exact). Default: ``exact`` whatever the config.
        config: the technique's config from a plan's settings (it reads its own keys, with its defaults).
        apply: ``apply(block, config)`` changes one block for the ``module`` and ``wrapper`` seams (in place where it
            can) and returns the block now at its place; for the ``region`` seam it is ``apply(model, blocks,
            config)``, once for all blocks that run under it, and returns a handle (``.remove()`` undoes it).
        region: ``region`` seam only: ``region(config)``, the context the profiler runs one block under; its
            value has ``.bytes``, what left memory, and may have ``.pool_bytes``, buffers it keeps for reuse
            after the block (shared by the blocks of a chain; the profiler passes it to ``cost`` as a fact).
        check: ``check(block, config)`` raises :class:`FewBitError` when ``apply`` would refuse ``block`` (run on
            every block before a plan changes any, so that applying a plan is all or nothing). Default: no check.
        changes: ``changes(block, config)``, whether ``apply`` would change ``block`` (the planner measures only
            such options). Default: a ``module``-seam technique changes a block when applying it to a copy changes
            the block's module types; the other seams change every block.
        cost: the cost model, ``cost(option_cost, facts)``: what the planner charges for a block under an option
            holding this technique, from what the profiler measured (``option_cost``, a
            :class:`~.planner.model.OptionCost`) and measured facts (``facts``: ``input_bytes``,
            ``output_bytes``, ``saved_bytes``, ``offloaded_bytes``, ``pool_bytes``); None drops the option (nothing
            to gain). Applied in registry order. Default: charge what was measured.
        excludes: techniques it is never combined with in one option.
        settings: the plan-settings keys this technique reads beyond the planner's own (``bits``, ``blpa_bits``,
            ``offload``), with their defaults: ``plan_memory(technique_settings=...)`` sets them, plan files record
            them, and ``config`` checks them (raising :class:`FewBitError` for a bad value).
    """

    name: str
    summary: str
    seam: str
    exact: bool
    config: Callable[[Mapping[str, Any]], Any]
    apply: Callable[..., Any]
    region: Callable[[Any], AbstractContextManager] | None = None
    check: Callable[[torch.nn.Module, Any], None] | None = None
    changes: Callable[[torch.nn.Module, Any], bool] | None = None
    cost: Callable[[Any, Mapping[str, int]], Any] = _unchanged
    exact_in: Callable[[Any], bool] | None = None
    excludes: frozenset[str] = field(default_factory=frozenset)
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.seam not in SEAMS:
            raise ValueError(f"technique {self.name!r}: seam must be one of {SEAMS}, got {self.seam!r}")
        if (self.seam == "region") != (self.region is not None):
            raise ValueError(f"technique {self.name!r}: a region is given exactly for the 'region' seam")

    def is_exact(self, settings: Mapping[str, Any]) -> bool:
        """Whether this technique keeps gradients exact under a plan's ``settings`` (its configured mode).

        Args:
            settings: a plan's settings (the technique reads its own keys, with its defaults)
        """
        return self.exact if self.exact_in is None else bool(self.exact_in(self.config(settings)))

    def changes_block(self, block: torch.nn.Module, config: Any) -> bool:
        """Whether applying this technique changes ``block`` (see ``changes``); ``block`` itself is not changed."""
        if self.changes is not None:
            return bool(self.changes(block, config))
        if self.seam != "module":
            return True
        holder = torch.nn.ModuleDict({"block": copy.deepcopy(block)})
        before = [type(m) for m in holder.modules()]
        holder["block"] = self.apply(holder["block"], config)
        return [type(m) for m in holder.modules()] != before


_loaded: dict[str, Technique] = {}


def techniques() -> tuple[Technique, ...]:
    """The registered techniques, in application order (each ``technique.py`` is imported on first use)."""
    if len(_loaded) != len(REGISTRY):
        for path in REGISTRY:
            found = importlib.import_module(path).TECHNIQUE
            if not isinstance(found, Technique):
                raise TypeError(f"{path}.TECHNIQUE must be a Technique, got {type(found).__name__}")
            _loaded.setdefault(path, found)
    return tuple(_loaded[path] for path in REGISTRY)


def names() -> tuple[str, ...]:
    """The registered techniques' names, in application order."""
    return tuple(t.name for t in techniques())


def technique(name: str) -> Technique:
    """The technique called ``name``; :class:`FewBitError` naming the registered ones otherwise."""
    for found in techniques():
        if found.name == name:
            return found
    raise FewBitError(f"no technique {name!r}: the registered techniques are {', '.join(names())}")


def setting_defaults() -> dict[str, Any]:
    """The registered techniques' own plan settings (``Technique.settings``) with their defaults."""
    found: dict[str, Any] = {}
    for t in techniques():
        found.update(t.settings)
    return found


def iter_option(option: str) -> Iterator[Technique]:
    """The techniques of an option name, in application order."""
    wanted = set(() if option == "plain" else option.split("+"))
    return (t for t in techniques() if t.name in wanted)
