"""Walking a model's modules and swapping some for replacements: the one walk every module-replacing technique uses.

Terms. A *slot* is one module object of the model with every place it sits at: each (parent, attribute) that holds
it and the qualified name it has there (a module used twice, or inside a module that is itself shared, has several
places; the model itself is a slot with no place). :func:`slots` lists every module object once, in
``named_modules`` order; :func:`swap` puts replacements at every place of the slots they replace, all or nothing.

A *snapshot* is every module's children as they are (:func:`snapshot`, :func:`restore`): the converters change a
model only by replacing children, so a snapshot taken before undoes them. :func:`remember` keeps the first one on the
model itself, for ``runtime.unconvert``.

The converters' reports name a module by :func:`class_path` and list what they left alone as :class:`Skipped`
records, counted per class and reason (with the modules converted already) by :func:`left_alone_lines`. A converter
that decides module by module (a replacement, a reason to leave it, or nothing to say) walks the slots with
:func:`decide`, and one that replaced nothing says why with :func:`warn_nothing_replaced`.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "Slot",
    "slots",
    "swap",
    "snapshot",
    "restore",
    "remember",
    "ORIGINAL",
    "class_path",
    "has_hooks",
    "Skipped",
    "left_alone_lines",
    "Decisions",
    "decide",
    "warn_nothing_replaced",
]

#: the attribute of a converted model holding (its original root, the snapshot taken before its first conversion)
ORIGINAL = "_fewbit_original"


@dataclass
class Slot:
    """One module object of the model with every (parent, attribute, qualified name) it sits at (the model itself:
    no place, ``root`` True, name '')."""

    module: torch.nn.Module
    places: list[tuple[torch.nn.Module, str, str]] = field(default_factory=list)
    root: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        """Every qualified name of the module (``("",)`` for the model itself)."""
        if self.root:
            return ("",)
        return tuple(dict.fromkeys(name for _, _, name in self.places))

    def unique_places(self) -> list[tuple[torch.nn.Module, str]]:
        """The (parent, attribute) pairs that hold the module, each once (a shared parent is reached twice)."""
        seen: dict[tuple[int, str], tuple[torch.nn.Module, str]] = {}
        for parent, attribute, _ in self.places:
            seen.setdefault((id(parent), attribute), (parent, attribute))
        return list(seen.values())


def slots(
    model: torch.nn.Module, *, descend: Callable[[torch.nn.Module], bool] | None = None, root: bool = True
) -> list[Slot]:
    """Every module object of ``model`` once, with all its places, in ``named_modules`` order (the model first when
    ``root``).

    Args:
        model: the model
        descend: ``descend(module)``, whether to walk into a module's children (default: every module's)
        root: list the model itself as the first slot
    """
    found: dict[int, Slot] = {}
    if root:
        found[id(model)] = Slot(model, root=True)
    ancestors: set[int] = set()

    def walk(parent: torch.nn.Module, prefix: str) -> None:
        ancestors.add(id(parent))
        for attribute, child in parent._modules.items():  # not named_children(): it de-duplicates
            if child is None:
                continue
            name = f"{prefix}.{attribute}" if prefix else attribute
            slot = found.setdefault(id(child), Slot(child))
            slot.places.append((parent, attribute, name))
            if id(child) not in ancestors and (descend is None or descend(child)):
                walk(child, name)
        ancestors.discard(id(parent))

    walk(model, "")
    return list(found.values())


def swap(model: torch.nn.Module, found: list[Slot], replacements: Mapping[int, torch.nn.Module]) -> torch.nn.Module:
    """Put ``replacements[id(slot.module)]`` at every place of each slot of ``found`` that has one, in the training
    mode of the module it replaces; return the model, or the replacement of the model itself (its root slot). All or
    nothing: an error puts back what was swapped.

    Args:
        model: the model the slots were listed from
        found: its slots (:func:`slots`)
        replacements: ``id(module) -> replacement``
    """
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    result = model
    try:
        for slot in found:
            replacement = replacements.get(id(slot.module))
            if replacement is None:
                continue
            replacement.train(slot.module.training)  # a replacement runs in the mode of the module it replaces
            if slot.root:
                result = replacement
            for parent, attribute in slot.unique_places():
                swapped.append((parent, attribute, slot.module))
                parent._modules[attribute] = replacement
    except BaseException:
        for parent, attribute, original in reversed(swapped):
            parent._modules[attribute] = original
        raise
    return result


Snapshot = list[tuple[torch.nn.Module, dict[str, torch.nn.Module | None]]]


def snapshot(model: torch.nn.Module) -> Snapshot:
    """Every module's children as they are now.

    Args:
        model: the model
    """
    return [(module, dict(module._modules)) for module in model.modules()]


def restore(taken: Snapshot) -> None:
    """Put every module's children back as :func:`snapshot` found them.

    Args:
        taken: the snapshot
    """
    for module, children in taken:
        module._modules.clear()
        module._modules.update(children)


def remember(model: torch.nn.Module) -> None:
    """Keep on ``model`` (attribute :data:`ORIGINAL`, not a submodule) the snapshot of its modules before its first
    conversion, and the model itself as its original root; later conversions keep the first.

    Args:
        model: the model about to be converted
    """
    if ORIGINAL not in model.__dict__:
        model.__dict__[ORIGINAL] = (model, snapshot(model))


def class_path(cls: type) -> str:
    """``module.QualifiedName`` of a class, as reports name what they replaced or left.

    Args:
        cls: the class
    """
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class Skipped:
    """One module a converter left alone (``names``: every name it has in the model), its class path and why."""

    names: tuple[str, ...]
    original: str
    reason: str


def left_alone_lines(skipped: Iterable[tuple[str, str]], already: int = 0, converted: str = "") -> list[str]:
    """A report's lines for what it did not replace: one per (class, reason) pair of ``skipped``, with how many, then
    how many modules it found converted ``already`` (no line for none).

    Args:
        skipped: the (class path, reason) of each module left alone
        already: how many modules were converted already
        converted: what the line says of them (``"module(s) were X already"``)
    """
    lines = [f"  left alone: {count} x {original}: {reason}" for (original, reason), count in Counter(skipped).items()]
    if already:
        lines.append(f"  {already} {converted}")
    return lines


@dataclass
class Decisions:
    """What :func:`decide` found: the ``replacements`` for :func:`swap`, each ``(slot, replacement)`` in walk order,
    the modules ``skipped`` and how many were converted ``already``."""

    replacements: dict[int, torch.nn.Module] = field(default_factory=dict)
    replaced: list[tuple[Slot, torch.nn.Module]] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    already: int = 0


def decide(
    found: list[Slot], candidate: Callable[[torch.nn.Module], torch.nn.Module | str | None], converted: type
) -> Decisions:
    """Each slot of ``found`` decided: an instance of ``converted`` counts as converted already, else
    ``candidate(module)`` gives its replacement, the reason it is left alone, or None (not a candidate).

    Args:
        found: the slots, from :func:`slots`
        candidate: the converter's decision for one module
        converted: the class of the replacements (a module of it is not converted again)
    """
    decisions = Decisions()
    for slot in found:
        if isinstance(slot.module, converted):
            decisions.already += 1
            continue
        choice = candidate(slot.module)
        if isinstance(choice, torch.nn.Module):
            decisions.replacements[id(slot.module)] = choice
            decisions.replaced.append((slot, choice))
        elif isinstance(choice, str):
            decisions.skipped.append(Skipped(slot.names, class_path(type(slot.module)), choice))
    return decisions


def warn_nothing_replaced(context: str, model: torch.nn.Module, skipped: list[Skipped], absent: str) -> None:
    """The warning of a converter that replaced nothing in ``model``: the reasons of what it ``skipped``, or
    ``absent`` (what the model lacks) when it skipped nothing. Raised at the converter's caller.

    Args:
        context: the converter, as the warning names it
        model: the model given to it
        skipped: what it left alone
        absent: why there was nothing to replace (``"it has no ..."``)
    """
    why = "; ".join(sorted({f"{item.original}: {item.reason}" for item in skipped})) or absent
    warnings.warn(f"{context}: nothing replaced in {type(model).__name__}: {why}", stacklevel=3)


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has hooks of its own (a replacement would drop them, so converters leave such modules).

    Args:
        module: the module
    """
    return bool(
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
    )
