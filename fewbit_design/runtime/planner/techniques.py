"""Options (combinations of registered techniques) and applying one to a block of the chain, through the technique
contract of :mod:`fewbit_design.runtime.registry`; the planner knows no technique by name.

An option is a ``+``-joined set of technique names in registry order (``"blpa+fewbit+checkpoint"``), or
``"plain"``. Applying an option runs its techniques in registry order: the ``module`` seams replace modules inside
the block, the ``wrapper`` seams wrap the block's forward, and the ``region`` seams are applied once for all the
blocks that run under them (:func:`apply_regions`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from ...errors import FewBitError, show
from .. import registry

__all__ = [
    "TECHNIQUES",
    "parse_option",
    "option_name",
    "is_exact",
    "apply_option",
    "apply_regions",
    "check_choices",
    "check_technique_settings",
    "technique_plan_settings",
    "plan_keywords",
    "remove_wrappers",
    "model_options",
    "apply_model_options",
    "remove_model_options",
    "option_region",
    "charge",
    "candidate_options",
]

#: the registered techniques' names, in application order, when this module was imported (the registry's
#: :func:`~..registry.names` is the current list)
TECHNIQUES = registry.names()


def parse_option(option: str) -> tuple[str, ...]:
    """The techniques of an option name (``"plain"``: none)."""
    return () if option == "plain" else tuple(option.split("+"))


def option_name(techniques: Iterable[str]) -> str:
    """The canonical name of a set of techniques (registry order)."""
    chosen = set(techniques)
    ordered = [t for t in registry.names() if t in chosen]
    return "+".join(ordered) if ordered else "plain"


def is_exact(option: str, settings: Mapping[str, Any]) -> bool:
    """Whether every technique of ``option`` keeps gradients exact under ``settings`` (each technique's configured
    mode: gated's ``"compressed"`` mode is approximate)."""
    return all(registry.technique(t).is_exact(settings) for t in parse_option(option))


def check_technique_settings(settings: Mapping[str, Any], where: str = "settings") -> None:
    """Check every registered technique's own settings (``Technique.settings``) present in ``settings``, one key at
    a time (the technique's other keys at their defaults), so that one :class:`FewBitError` names the key: its
    ``config``, then, for a ``module`` seam, its ``apply`` on an empty module, which checks what only the technique's
    converter checks (a norms threshold that is NaN or negative) and changes nothing.

    Args:
        settings: a plan's settings, or ``plan_memory``'s ``technique_settings``
        where: how the error names the mapping (``"settings"``: ``settings.norms_threshold``)
    """
    for technique in registry.techniques():
        for key in technique.settings:
            if key not in settings:
                continue
            trial = {**settings, **technique.settings, key: settings[key]}
            try:
                config = technique.config(trial)
                if technique.seam == "module":
                    technique.apply_block(torch.nn.Sequential(), config)
            except Exception as error:  # FewBitError, or a raw ValueError/TypeError of a config such as float("x")
                if str(error).startswith(f"{key} "):  # the option's check named the key itself
                    raise FewBitError(f"{where}.{error}") from None
                raise FewBitError(
                    f"{where}.{key} is {show(settings[key])}, which the {technique.name} technique refuses: {error}"
                ) from None


def plan_keywords() -> list[str]:
    """``plan_memory``'s technique keywords (each technique's ``aliases``: few-bit's ``bits``, ...)."""
    return [alias for t in registry.techniques() for alias in t.aliases]


def technique_plan_settings(technique_settings: Mapping[str, Any] | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """Every registered technique's plan settings: the defaults, then ``technique_settings`` (by plan-settings key),
    then ``options`` (``plan_memory``'s technique keywords, each technique's ``aliases``), each checked naming its
    key or keyword.

    Args:
        technique_settings: ``plan_memory``'s ``technique_settings``, or None
        options: ``plan_memory``'s other keywords
    """
    own = registry.setting_defaults()
    extra = dict(technique_settings or {})
    for key in extra:
        if key not in own:
            raise FewBitError(
                f"technique_settings: no registered technique reads {key!r} (known: {', '.join(sorted(own))})"
            )
    check_technique_settings(extra, "technique_settings")  # a bad value fails before the model is profiled
    keywords = {alias: t for t in registry.techniques() for alias in t.aliases}
    for keyword, value in options.items():
        technique = keywords.get(keyword)
        if technique is None:
            raise FewBitError(
                f"plan_memory got an unexpected keyword {keyword!r}; the techniques' keywords are "
                f"{', '.join(sorted(keywords))} (other options: technique_settings={{key: value}})"
            )
        key = {name: key for key, name in technique.setting_keys().items()}[technique.aliases[keyword]]
        if technique.nested is None:
            trial, extra[key] = {**extra, key: value}, value
        else:
            nested = {**own[technique.nested], **extra.get(technique.nested, {}), key: value}
            trial, extra[technique.nested] = {**extra, technique.nested: nested}, nested
        try:
            technique.config(trial)
        except FewBitError as error:
            raise FewBitError(f"plan_memory({keyword}={show(value)}): {error}") from None
    return {**own, **extra}


def _configs(settings: Mapping[str, Any], option: str) -> list[tuple[registry.Technique, Any]]:
    return [(t, t.config(settings)) for t in registry.iter_option(option)]


def apply_option(container: torch.nn.Module, key: str, option: str, settings: Mapping[str, Any]) -> torch.nn.Module:
    """Apply ``option``'s per-block techniques (the ``module`` and ``wrapper`` seams; not the regions) to
    ``container``'s child ``key`` in place; return the block now at that place."""
    block = container._modules[key]
    for technique, config in _configs(settings, option):
        if technique.seam == "region":
            continue
        try:
            block = technique.apply_block(block, config)
        except FewBitError as error:
            raise FewBitError(f"block {key!r}: {error}") from None
    container._modules[key] = block
    return block


def model_options(model: torch.nn.Module, allow: Sequence[str], settings: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The sets of ``"model"``-scope techniques worth profiling the step with: none, and each allowed one that would
    change ``model`` (the LM head of a causal LM)."""
    found: list[tuple[str, ...]] = [()]
    for technique in registry.techniques():
        if technique.scope == "model" and technique.name in allow:
            if technique.changes_block(model, technique.config(settings)):
                found.append((technique.name,))
    return found


def apply_model_options(model: torch.nn.Module, names: Sequence[str], settings: Mapping[str, Any]) -> None:
    """Apply the ``"model"``-scope techniques ``names`` to the whole model."""
    for technique in registry.iter_option("+".join(names) or "plain"):
        technique.apply(model, technique.config(settings))


def remove_model_options(model: torch.nn.Module, names: Sequence[str]) -> None:
    """Undo :func:`apply_model_options`."""
    for technique in registry.iter_option("+".join(names) or "plain"):
        technique.remove(model)


def remove_wrappers(block: torch.nn.Module) -> None:
    """Undo every ``wrapper``-seam technique on ``block`` (:meth:`~..registry.Technique.unwrap`)."""
    for technique in registry.techniques():
        if technique.seam == "wrapper":
            technique.unwrap(block)


def apply_regions(
    model: torch.nn.Module, blocks: Sequence[torch.nn.Module], choices: Sequence[str], settings: Mapping[str, Any]
) -> dict[str, Any]:
    """Apply each ``region`` seam once, around the blocks whose choice holds it; return ``{name: handle}``."""
    handles = {}
    for technique in registry.techniques():
        if technique.seam != "region":
            continue
        chosen = [b for b, c in zip(blocks, choices, strict=True) if technique.name in parse_option(c)]
        if chosen:
            handles[technique.name] = technique.apply(model, chosen, technique.config(settings))
    return handles


def check_choices(
    keys: Sequence[str], blocks: Sequence[torch.nn.Module], choices: Sequence[str], settings: Mapping[str, Any]
) -> None:
    """Everything applying ``choices`` could refuse, checked before anything changes: each technique's ``check`` on
    each block it is chosen for, and each region technique's config (building the region checks it and probes its
    resources, such as offload's folder)."""
    for key, block, choice in zip(keys, blocks, choices, strict=True):
        for technique, config in _configs(settings, choice):
            if technique.check is not None:
                try:
                    technique.check(block, config)
                except FewBitError as error:
                    raise FewBitError(f"block {key!r}: {error}") from None
    used = {t for c in choices for t in parse_option(c)}
    for technique in registry.techniques():
        if technique.seam == "region" and technique.name in used:
            technique.region(technique.config(settings))


class option_region(ExitStack):  # noqa: N801  (a context manager used like a function)
    """The region seams of ``option`` entered around one block's run; ``bytes`` is what left memory, ``pool_bytes``
    what the regions keep for reuse after it (buffers a chain's blocks share: offload's staging pool)."""

    def __init__(self, option: str, settings: Mapping[str, Any]) -> None:
        super().__init__()
        self._regions = [(t, c) for t, c in _configs(settings, option) if t.seam == "region"]
        self._stats: list[Any] = []

    def __enter__(self) -> option_region:
        super().__enter__()
        self._stats = [self.enter_context(t.region(c)) for t, c in self._regions]
        return self

    @property
    def bytes(self) -> int:
        return sum(int(getattr(s, "bytes", 0)) for s in self._stats)

    @property
    def pool_bytes(self) -> int:
        return sum(int(getattr(s, "pool_bytes", 0)) for s in self._stats)

    @property
    def facts(self) -> dict[str, int]:
        """Other numbers the regions measured for their technique's cost model (offload's ``peak_allowance``)."""
        found: dict[str, int] = {}
        for stats in self._stats:
            for key, value in getattr(stats, "facts", {}).items():
                found[key] = found.get(key, 0) + int(value)
        return found


def charge(cost: Any, option: str, facts: Mapping[str, int]) -> Any:
    """What the planner charges for a block under ``option``: each technique's cost model in registry order applied
    to what was measured; None when one drops the option."""
    for technique in registry.iter_option(option):
        cost = technique.cost(cost, facts)
        if cost is None:
            return None
    return cost


def _combinable(names: Sequence[str]) -> bool:
    chosen = set(names)
    return not any(registry.technique(n).excludes & chosen for n in names)


def candidate_options(block: torch.nn.Module, allow: Sequence[str], settings: Mapping[str, Any]) -> list[str]:
    """The options worth measuring for ``block``: ``plain`` and every combinable set of the allowed techniques that
    change it (a ``module`` seam only where applying it to a copy changes the block), in a stable order."""
    useful = [
        t.name
        for t in registry.techniques()
        if t.scope == "block" and t.name in allow and t.changes_block(block, t.config(settings))
    ]
    options = []
    for size in range(len(useful) + 1):
        for subset in itertools.combinations(useful, size):
            if _combinable(subset):
                options.append(option_name(subset))
    return options
