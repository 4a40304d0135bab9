"""Replace a model's ``torch.nn.Dropout`` modules by :class:`~.nn.CompactDropout`, and say what was done.

A module is replaced when its class is exactly ``torch.nn.Dropout`` (Hugging Face models use it for their residual,
MLP, embedding and classifier dropout), its ``p`` is above 0 and it carries no hooks (the replacement would drop
them). The replacement takes the module's ``p``, ``inplace`` and training mode and nothing else (a dropout module
holds nothing else), and draws as it does, so the model computes what it computed. Left alone, with the reason in
the report: dropout with ``p = 0`` (nothing drawn, nothing kept), the channel-wise and alpha forms
(``Dropout1d/2d/3d``, ``AlphaDropout``, ``FeatureAlphaDropout``: another mask), subclasses of ``torch.nn.Dropout``
(their forward may differ) and other modules named like a dropout (transformers' ``StableDropout`` of SEW-D,
``EsmFoldDropout``: other formulas). Converting again changes nothing (a :class:`~.nn.CompactDropout` is no
candidate).

Dropout called as a function in forward code (``torch.nn.functional.dropout``, as the eager attention of GPT-2 and
BERT does on its probabilities) is no module to replace: :func:`functional_calls` finds such calls on a probe for
``runtime.convert``'s report.

>>> import torch
>>> model = convert(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)))
>>> type(model[1]).__name__, str(model.dropout_report).splitlines()[0]
('CompactDropout', 'dropout: replaced 1 module(s), left 0 alone; the mask kept as 1 bit per element')
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...errors import FewBitError, check_choice
from ..modules import decide, slots, swap, warn_nothing_replaced
from ..modules import has_hooks as _has_hooks
from ..report import Report
from .nn import CompactDropout
from .ops import MODES

__all__ = ["convert", "DropoutReport", "functional_calls", "FUNCTIONAL_NAMES"]

#: the dropout functions looked for in forward code (``torch.nn.functional.dropout``, ``torch.dropout`` and the
#: in-place forms): element-wise masks that a replaced module would have kept in bits
FUNCTIONAL_NAMES = frozenset({"dropout", "dropout_"})
_KEPT = {"bits": "the mask kept as 1 bit per element", "seed": "the random state kept to draw the mask again"}
_OTHER_FORMS = {
    torch.nn.Dropout1d: "drops whole channels (another mask)",
    torch.nn.Dropout2d: "drops whole channels (another mask)",
    torch.nn.Dropout3d: "drops whole channels (another mask)",
    torch.nn.AlphaDropout: "alpha dropout (another formula)",
    torch.nn.FeatureAlphaDropout: "alpha dropout of whole channels (another formula)",
}


@dataclass(frozen=True)
class Replaced:
    """One dropout module replaced (``names``: every name it has in the model)."""

    names: tuple[str, ...]
    p: float


@dataclass(kw_only=True)
class DropoutReport(Report):
    """What :func:`convert` did (``model.dropout_report``): a :class:`~..report.Report` whose ``replaced`` are the
    dropout modules replaced (:class:`Replaced`: names, p), ``skipped`` the dropout-like modules left alone with the
    reason and ``already`` how many were :class:`~.nn.CompactDropout` already.

    Attributes:
        mode: what the replacements keep (:data:`.ops.MODES`)
    """

    mode: str = "bits"

    ALREADY: ClassVar[str] = "module(s) were CompactDropout already"

    def head(self) -> str:
        return f"dropout: replaced {self.count} module(s), left {len(self.skipped)} alone; {_KEPT[self.mode]}"

    def replaced_lines(self) -> list[str]:
        return [
            f"  {count} x torch.nn.Dropout(p={p:g}) -> CompactDropout"
            for p, count in sorted(Counter(item.p for item in self.replaced).items())
        ]


def _candidate(module: torch.nn.Module, mode: str) -> CompactDropout | str | None:
    """The replacement, the reason to leave a dropout-like module alone, or None for any other module."""
    if type(module) is torch.nn.Dropout:
        if module.p == 0:
            return "p = 0 (it draws and keeps nothing)"
        if _has_hooks(module):
            return "it carries hooks (the replacement would drop them)"
        try:
            replacement = CompactDropout(module.p, bool(module.inplace), mode=mode)
        except FewBitError as error:  # a p set after construction, which torch's dropout would refuse in forward
            return str(error)
        return replacement.train(module.training)
    if type(module) in _OTHER_FORMS:
        return _OTHER_FORMS[type(module)]
    if isinstance(module, torch.nn.Dropout):
        return "a subclass of torch.nn.Dropout (its forward may differ)"
    if "dropout" in type(module).__name__.lower() and not module._modules:
        return "not torch.nn.Dropout (another formula)"
    return None


def convert(model: torch.nn.Module, *, mode: str = "bits") -> torch.nn.Module:
    """Replace, in place, every ``torch.nn.Dropout`` of ``model`` with ``p > 0`` (see the module docstring) by a
    :class:`~.nn.CompactDropout`; return the model, with ``model.dropout_report`` (a :class:`DropoutReport`). A
    model that is itself a dropout module is returned replaced (use the return value). A model in which nothing was
    replaced gives a warning.

    Args:
        model: the model
        mode: what the replacements keep for backward: ``"bits"`` (the mask, 1 bit per element) or ``"seed"`` (the
            random state, drawing the mask again in backward)
    """
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"dropout.convert takes a torch.nn.Module, got {type(model).__name__}")
    mode = check_choice("dropout mode", mode, MODES)
    found = slots(model)
    decisions = decide(found, lambda module: _candidate(module, mode), CompactDropout)
    replaced = [Replaced(slot.names, replacement.p) for slot, replacement in decisions.replaced]
    report = DropoutReport(replaced=replaced, skipped=decisions.skipped, already=decisions.already, mode=mode)
    converted = swap(model, found, decisions.replacements)
    converted.dropout_report = report
    if not report.replaced and not report.already:
        warn_nothing_replaced("dropout.convert", model, report.skipped, "it has no torch.nn.Dropout")
    return converted


# ----------------------------------------------------------------------------------------------------------------------
# What convert cannot reach


def _dropout_call(name: str, args: tuple, kwargs: dict) -> bool:
    """A call of a dropout function with ``p > 0`` (torch.dropout takes p second, F.dropout's default is 0.5)."""
    if name not in FUNCTIONAL_NAMES:
        return False
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    return isinstance(p, int | float) and p > 0


def _sees_itself(module: torch.nn.Module) -> bool:
    """Calls inside a dropout module (convert saw it: replaced or left with its reason) or a module of this runtime
    are not unseen."""
    return isinstance(module, torch.nn.modules.dropout._DropoutNd) or type(module).__module__.startswith(
        "fewbit_design."
    )


def functional_calls(model: torch.nn.Module, probe: Any, options: Any = None) -> list[tuple[str, str, str, int]]:
    """``(module name, module class, function, calls)`` of every dropout function called with ``p > 0`` in forward
    code on one run of ``probe`` (no gradients; no side effects): dropout that keeps its native mask.

    Args:
        model: the model
        probe: example inputs of one step
        options: the technique's options (unused)
    """
    from ..fewbit.unseen import functional_calls as calls_in_forward

    return calls_in_forward(model, probe, wanted=_dropout_call, sees_itself=_sees_itself)
