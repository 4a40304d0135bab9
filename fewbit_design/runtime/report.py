"""The one report type of the techniques: what a technique's ``convert`` did to a model.

Every technique's converter sets a :class:`Report` on the model it converted (``model.norms_report``,
``model.gated_report``, ...; the registry's :class:`~.registry.ConvertRole` names the attribute), and
``runtime.convert`` reads each one the same way: :attr:`Report.replaced` (one entry per replacement),
:attr:`Report.skipped` (what was left alone, each with its reason) and :attr:`Report.already` (modules found
converted before). A technique's report adds its settings as fields (bits, mode, ...) and the words of its lines;
its entries keep the technique's own shape (a :class:`~.modules.Skipped` record, or a ``(name, class, reason)``
tuple).

>>> from fewbit_design.runtime.modules import Skipped
>>> report = Report(replaced=["0"], skipped=[Skipped(("2",), "torch.nn.modules.linear.Linear", "no activation")])
>>> print(report)
replaced 1 module(s), left 1 alone
  left alone: 1 x torch.nn.modules.linear.Linear: no activation
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .modules import Skipped, left_alone_lines

__all__ = ["Report"]


@dataclass(kw_only=True)
class Report:
    """What one technique's ``convert`` did to a model.

    Attributes:
        replaced: one entry per replacement (the technique's record of it: a qualified name, a ``(name, class)``
            pair or a record with ``names``).
        skipped: one entry per module left alone: a :class:`~.modules.Skipped` record or a tuple ending in
            ``(class, reason)``.
        already: how many modules were converted already (converting twice changes nothing the second time).
    """

    replaced: Any = field(default_factory=list)
    skipped: list[Any] = field(default_factory=list)
    already: int = 0

    #: what the report's line for modules found converted already says of them
    ALREADY: ClassVar[str] = "module(s) were converted already"

    @property
    def count(self) -> int:
        """How many replacements were made."""
        return len(self.replaced)

    def left_alone(self) -> list[tuple[str, str]]:
        """The (class path, reason) of each module left alone."""
        return [
            (item.original, item.reason) if isinstance(item, Skipped) else tuple(item[-2:]) for item in self.skipped
        ]

    def head(self) -> str:
        """The report's first line."""
        return f"replaced {self.count} module(s), left {len(self.skipped)} alone"

    def replaced_lines(self) -> Iterable[str]:
        """The lines on what was replaced (none by default)."""
        return ()

    def left_lines(self) -> Iterable[str]:
        """The lines on what was left alone: one per (class, reason), then the modules converted already."""
        return left_alone_lines(self.left_alone(), self.already, self.ALREADY)

    def __str__(self) -> str:
        return "\n".join([self.head(), *self.replaced_lines(), *self.left_lines()])
