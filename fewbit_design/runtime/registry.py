"""The technique registry: one contract per memory technique, which ``runtime.convert``, the planner, plan files, the
Trainer callback and the command line read, and nothing else.

Each technique folder has a ``technique.py`` whose ``TECHNIQUE`` is a :class:`Technique`: its name, how it reaches a
model (its *seam*), its options (a frozen dataclass whose fields are the options, with their defaults, checked when
made), which gradients each configuration changes (exactness is a property of the configured mode), ``convert`` (the
whole model), ``apply`` (one block, for the planner), its cost model, and how ``runtime.convert`` uses it
(:class:`ConvertRole`). Nothing outside the technique's folder and its registry line names it.

Adding a technique is one folder with a ``technique.py`` and one line in :data:`REGISTRY` (whose order is the order
in which the techniques of one option are applied: module replacements that take whole patterns first, then the
ones that take what is left, then the wrappers, then the regions). ``docs/development.md`` walks through one.

Options in plan files. A plan's ``settings`` hold each technique's options under flat keys: a field's key is
``<technique>_<field>`` unless its metadata names another (``field(metadata={"setting": "bits"})``) or none
(``{"setting": None}``: not a plan setting, such as a Python callable); a technique with ``nested`` set keeps them
in one object under that key instead (``settings["offload"]``).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import FewBitError
from .fake import deepcopy_module

__all__ = [
    "Technique",
    "ConvertRole",
    "REGISTRY",
    "techniques",
    "technique",
    "names",
    "setting_defaults",
    "iter_option",
    "registered",
    "SEAMS",
]

#: where the techniques are, in application order (module path of each ``technique.py``; its ``TECHNIQUE``)
REGISTRY: tuple[str, ...] = (
    "fewbit_design.runtime.norms.technique",
    "fewbit_design.runtime.gated.technique",
    "fewbit_design.runtime.attention.technique",
    "fewbit_design.runtime.attention.exact_technique",
    "fewbit_design.runtime.head.technique",
    "fewbit_design.runtime.blpa.technique",
    "fewbit_design.runtime.dropout.technique",
    "fewbit_design.runtime.fewbit.technique",
    "fewbit_design.runtime.linear.technique",
    "fewbit_design.runtime.offload.technique",
    "fewbit_design.runtime.checkpoint.technique",
)

#: how a technique reaches a model: it replaces modules inside a block, wraps a block's forward, or runs the
#: blocks under saved-tensor hooks (applied once for the whole model)
SEAMS = ("module", "wrapper", "region")


@dataclass(frozen=True)
class _NoOptions:
    """The options of a technique that has none."""


def _unchanged(cost: Any, facts: Mapping[str, int]) -> Any:
    return cost


def _exact(options: Any) -> str | None:
    return None


@dataclass(frozen=True)
class ConvertRole:
    """How :func:`fewbit_design.runtime.convert` uses a technique.

    Attributes:
        report_attribute: the attribute of the converted model that holds the technique's own report (its
            converter sets it: ``norms_report``).
        switch: the ``convert`` keyword that turns it off (``norms=False``; several techniques may share one: the
            exact and the compressed attention core), or None when only ``compress`` turns it on.
        default: whether it runs without ``compress``.
        keywords: ``convert`` keywords that are fields of the technique's options (few-bit's ``bits``, ``weight``).
        compress: ``compress(options, bits)``, the options under ``convert(compress=bits)``, or None to leave the
            technique out then; None (the attribute): the same options as without ``compress``.
        report_name: its entry's name in ``ConvertReport`` (default: the technique's name): the exact and the
            compressed attention core are one entry, ``attention``.
        check: ``check(model, options)``, what must hold before anything changes (raises :class:`FewBitError`).
        unseen: ``unseen(model, probe, options)``, what the technique cannot reach, as ``(module name, module
            class, what, count)`` rows for the report (few-bit: activation functions called in forward code).
    """

    report_attribute: str
    switch: str | None = None
    default: bool = True
    keywords: tuple[str, ...] = ()
    compress: Callable[[Any, int], Any] | None = None
    report_name: str | None = None
    check: Callable[[torch.nn.Module, Any], None] | None = None
    unseen: Callable[[torch.nn.Module, Any, Any], list[tuple[str, str, str, int]]] | None = None

    def options_for(self, options: Any, compress: int | None) -> Any:
        """The options the technique runs with in a ``convert`` call with ``compress``, or None (not in this call's
        set: off by default, or left out under ``compress``)."""
        if compress is None:
            return options if self.default else None
        return options if self.compress is None else self.compress(options, compress)


@dataclass(frozen=True)
class Technique:
    """One memory technique as the runtime sees it.

    Attributes:
        name: its identifier in option names (``"blpa+fewbit"``), plan files, ``allow=`` and the CLI.
        summary: one line for reports and ``--help``.
        seam: one of :data:`SEAMS`.
        options: a frozen dataclass of the technique's options with their defaults; making one checks it (raises
            :class:`FewBitError` naming the option). Plan settings hold them (module docstring).
        approximate: ``approximate(options)``, which gradients the technique changes under those options (one line
            for reports), or None where it keeps them exact up to rounding: exactness is a property of the configured
            mode (the gated op's ``"compressed"`` mode changes them, its ``"exact"`` mode does not). The planner uses
            an inexact configuration only where the budget needs it unless the user allows it (``approximate=``).
        convert: ``convert(model, options, probe)`` changes the whole model in place and returns it (the replacement
            when the model itself is replaced), with the technique's report on it; ``probe``: example inputs of one
            training step, or None. ``module`` seam only.
        apply: ``apply(block, options)`` changes one block for the planner (``module`` and ``wrapper`` seams; default
            for the ``module`` seam: ``convert`` on the block, its "nothing replaced" warnings silenced) and returns
            the block now at its place; for the ``region`` seam it is ``apply(model, blocks, options)``, once for all
            blocks that run under it, and returns a handle (``.remove()`` undoes it).
        region: ``region`` seam only: ``region(options)``, the context the profiler runs one block under; its value
            has ``.bytes``, what left memory, and may have ``.pool_bytes``, buffers it keeps for reuse after the
            block (shared by the blocks of a chain; the profiler passes it to ``cost`` as a fact).
        check: ``check(block, options)`` raises :class:`FewBitError` when ``apply`` would refuse ``block`` (run on
            every block before a plan changes any, so that applying a plan is all or nothing). Default: no check.
        changes: ``changes(block, options)``, whether ``apply`` would change ``block`` (the planner measures only
            such options). Default: a ``module``-seam technique changes a block when applying it to a copy changes
            the block's module types; the other seams change every block.
        cost: the cost model, ``cost(option_cost, facts)``: what the planner charges for a block under an option
            holding this technique, from what the profiler measured (``option_cost``, a
            :class:`~.planner.model.OptionCost`) and measured facts (``facts``: ``input_bytes``,
            ``output_bytes``, ``saved_bytes``, ``offloaded_bytes``, ``pool_bytes``); None drops the option (nothing
            to gain). Applied in registry order. Default: charge what was measured.
        excludes: techniques it is never combined with in one option.
        nested: the plan-settings key holding all its options in one object (module docstring), or None.
        aliases: ``plan_memory`` keywords that set one of its options (``{"blpa_bits": "bits"}``).
        in_convert: how ``runtime.convert`` uses it, or None (it does not).
        scope: ``"block"`` (the planner applies it per block of the chain) or ``"model"`` (it changes what is outside
            the chain, such as the LM head: the planner profiles the step with and without it, ``apply(model,
            options)`` applies it to the whole model and ``remove(model)`` undoes it).
        remove: ``remove(model)``, the undo of a ``"model"``-scope ``apply``.
    """

    name: str
    summary: str
    seam: str
    options: type = _NoOptions
    approximate: Callable[[Any], str | None] = _exact
    convert: Callable[[torch.nn.Module, Any, Any], torch.nn.Module] | None = None
    apply: Callable[..., Any] | None = None
    region: Callable[[Any], AbstractContextManager] | None = None
    check: Callable[[torch.nn.Module, Any], None] | None = None
    changes: Callable[[torch.nn.Module, Any], bool] | None = None
    cost: Callable[[Any, Mapping[str, int]], Any] = _unchanged
    excludes: frozenset[str] = field(default_factory=frozenset)
    nested: str | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)
    in_convert: ConvertRole | None = None
    scope: str = "block"
    remove: Callable[[torch.nn.Module], Any] | None = None

    def __post_init__(self) -> None:
        if self.seam not in SEAMS:
            raise ValueError(f"technique {self.name!r}: seam must be one of {SEAMS}, got {self.seam!r}")
        if (self.seam == "region") != (self.region is not None):
            raise ValueError(f"technique {self.name!r}: a region is given exactly for the 'region' seam")
        if not (dataclasses.is_dataclass(self.options) and self.options.__dataclass_params__.frozen):
            raise ValueError(f"technique {self.name!r}: options must be a frozen dataclass")
        if self.apply is None:
            if self.seam != "module" or self.convert is None:
                raise ValueError(f"technique {self.name!r}: apply is needed unless a module seam has convert")
            object.__setattr__(self, "apply", self._convert_block)
        if self.in_convert is not None and self.convert is None:
            raise ValueError(f"technique {self.name!r}: a convert role needs convert")
        if self.scope not in ("block", "model") or (self.scope == "model") != (self.remove is not None):
            raise ValueError(f"technique {self.name!r}: scope is 'block', or 'model' with a remove")

    # --- options and plan settings -------------------------------------------------------------------------------

    def setting_keys(self) -> dict[str, str]:
        """``{plan-settings key: option field}`` (within the ``nested`` object when there is one)."""
        keys = {}
        for item in dataclasses.fields(self.options):
            key = item.metadata.get("setting", f"{self.name}_{item.name}" if self.nested is None else item.name)
            if key is not None:
                keys[key] = item.name
        return keys

    @property
    def settings(self) -> dict[str, Any]:
        """The plan settings holding its options, with their defaults (``{nested: {...}}`` for a nested one)."""
        defaults = self.options()
        own = {key: getattr(defaults, name) for key, name in self.setting_keys().items()}
        return {self.nested: own} if self.nested is not None else own

    def config(self, settings: Mapping[str, Any]) -> Any:
        """The options held by a plan's ``settings`` (absent keys at their defaults; checked).

        Args:
            settings: a plan's settings, or ``plan_memory``'s ``technique_settings``
        """
        keys = self.setting_keys()
        source = settings
        if self.nested is not None:
            source = settings.get(self.nested, {})
            if not isinstance(source, Mapping):
                raise FewBitError(f"settings.{self.nested} must be an object, got {source!r}")
            unknown = sorted(set(source) - set(keys), key=str)
            if unknown:
                fields = ", ".join(keys)
                raise FewBitError(f"settings.{self.nested} has an unknown field {unknown[0]!r} (its fields: {fields})")
        return self.options(**{name: source[key] for key, name in keys.items() if key in source})

    def exact_under(self, options: Any) -> bool:
        """Whether gradients stay exact (up to rounding) under ``options``."""
        return self.approximate(options) is None

    @property
    def exact(self) -> bool:
        """Whether gradients stay exact under the default options."""
        return self.exact_under(self.options())

    def is_exact(self, settings: Mapping[str, Any]) -> bool:
        """Whether gradients stay exact under a plan's ``settings`` (the technique's configured mode).

        Args:
            settings: a plan's settings (the technique reads its own keys, with its defaults)
        """
        return self.exact_under(self.config(settings))

    # --- applying ------------------------------------------------------------------------------------------------

    def apply_block(self, block: torch.nn.Module, options: Any) -> torch.nn.Module:
        """``apply`` for one block of a chain (see ``apply``); returns the block now at its place."""
        return self.apply(block, options)

    def _convert_block(self, block: torch.nn.Module, options: Any) -> torch.nn.Module:
        """The default ``apply`` of a ``module`` seam: ``convert`` on the block, without a probe."""
        holder = torch.nn.Sequential(block)  # converts the block itself too when it is what the technique replaces
        with warnings.catch_warnings():  # "nothing replaced": the planner then does not offer the technique there
            warnings.simplefilter("ignore", UserWarning)
            return self.convert(holder, options, None)[0]

    def unwrap(self, block: torch.nn.Module) -> None:
        """Undo a ``wrapper``-seam ``apply`` on ``block``: the wrapper is the block's own ``forward`` attribute."""
        if self.seam == "wrapper":
            block.__dict__.pop("forward", None)

    def changes_block(self, block: torch.nn.Module, options: Any) -> bool:
        """Whether applying this technique changes ``block`` (see ``changes``); ``block`` itself is not changed."""
        if self.changes is not None:
            return bool(self.changes(block, options))
        if self.seam != "module":
            return True
        holder = torch.nn.ModuleDict({"block": deepcopy_module(block)})
        before = [type(m) for m in holder.modules()]
        holder["block"] = self.apply_block(holder["block"], options)
        return [type(m) for m in holder.modules()] != before


_loaded: dict[str, Technique] = {}
_extra: list[str] = []  # module paths added by :func:`registered` (tests of the contract)


def _paths() -> tuple[str, ...]:
    return REGISTRY + tuple(_extra)


def techniques() -> tuple[Technique, ...]:
    """The registered techniques, in application order (each ``technique.py`` is imported on first use)."""
    paths = _paths()
    for path in paths:
        if path not in _loaded:
            found = importlib.import_module(path).TECHNIQUE
            if not isinstance(found, Technique):
                raise TypeError(f"{path}.TECHNIQUE must be a Technique, got {type(found).__name__}")
            _loaded[path] = found
    return tuple(_loaded[path] for path in paths)


@contextmanager
def registered(path: str) -> Iterator[Technique]:
    """Register the technique of module ``path`` (its ``TECHNIQUE``) after the others while the block runs: what a
    registry line does, for tests of the contract (``tests/runtime/test_registry_contract.py``).

    Args:
        path: the module path of a ``technique.py``
    """
    _extra.append(path)
    try:
        yield techniques()[-1]
    finally:
        _extra.remove(path)
        _loaded.pop(path, None)


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
    """The registered techniques' plan settings (:attr:`Technique.settings`) with their defaults."""
    found: dict[str, Any] = {}
    for t in techniques():
        found.update(t.settings)
    return found


def iter_option(option: str) -> Iterator[Technique]:
    """The techniques of an option name, in application order."""
    wanted = set(() if option == "plain" else option.split("+"))
    return (t for t in techniques() if t.name in wanted)
