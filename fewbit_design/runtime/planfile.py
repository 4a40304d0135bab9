"""Plan files: what a checkpoint plan (:class:`.checkpoint.plan.Plan`) and a memory plan
(:class:`.planner.plan.MemoryPlan`) share. A plan is written as one JSON object with a ``format`` field, atomically
(never a partial file), and read back with the bounds of a table file (size, JSON nesting, UTF-8) and checked
completely: every failure is one :class:`FewBitError` naming the file."""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar, TypeVar

from ..errors import FewBitError, show

__all__ = ["PlanFile"]

P = TypeVar("P", bound="PlanFile")


class PlanFile:
    """The JSON side of a plan. A subclass sets :attr:`FORMAT`, :attr:`KIND` and :attr:`MAX_BYTES` and has
    ``to_dict()``, ``_from_checked(data)`` (a classmethod building the plan from a dict whose format was checked)
    and ``validate(source)``."""

    FORMAT: ClassVar[str]
    KIND: ClassVar[str]  # "memory plan": how messages and file reads name it
    MAX_BYTES: ClassVar[int]  # the largest file read

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def validate(self, source: str | None = None) -> None:
        raise NotImplementedError

    @classmethod
    def _from_checked(cls: type[P], data: dict[str, Any]) -> P:
        raise NotImplementedError

    def to_json(self) -> str:
        """The plan as JSON text (:meth:`load` reads it back into an equal plan)."""
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike, *, force: bool = True) -> None:
        """Write :meth:`to_json` to ``path`` atomically (never a partial file); ``force=False`` refuses to replace
        an existing file.

        Args:
            path: the file
            force: replace an existing file
        """
        from ..output_files import write_text_atomic

        write_text_atomic(path, self.to_json(), force=force)

    @classmethod
    def from_dict(cls: type[P], data: Any, *, source: str | None = None) -> P:
        """The plan that :meth:`to_dict` wrote, checked completely (its ``validate``); one :class:`FewBitError`
        naming the plan (and ``source``) otherwise.

        Args:
            data: the dict
            source: the file it came from, for messages
        """
        where = f"{cls.KIND} {source!r}" if source else cls.KIND
        try:
            if isinstance(data, dict) and data.get("format") != cls.FORMAT:
                raise FewBitError(f"format must be {cls.FORMAT!r}, got {show(data.get('format'))}")
            plan = cls._from_checked(data)
        except FewBitError as error:
            raise FewBitError(f"{where}: {error}") from None
        plan.validate(source)
        return plan

    @classmethod
    def load(cls: type[P], path: str | os.PathLike) -> P:
        """Read a plan that :meth:`save` wrote.

        Args:
            path: the file
        """
        from ..table import load_json

        data = load_json(path, what=cls.KIND, max_bytes=cls.MAX_BYTES)
        return cls.from_dict(data, source=os.fspath(path))
