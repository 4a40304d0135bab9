"""Lazy attributes of a package (PEP 562): names that import their module on first access, so importing a package
stays cheap and loads nothing heavy (no numba, scipy or matplotlib) until a user reaches for it; and a ``__dir__``
that lists the package's public names (before they load), so ``dir()`` and tab completion show the API."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_getattr", "public_dir"]


def lazy_getattr(package: str, attributes: Mapping[str, tuple[str, str | None]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name -> (module, attribute or None for the module)``, the module
    absolute or relative to ``package`` (``".nn"``).

    The value is imported on first access and stored in the package, so later accesses cost nothing.
    """

    def __getattr__(name: str) -> Any:
        try:
            module, attribute = attributes[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = importlib.import_module(module, package)
        if attribute is not None:
            value = getattr(value, attribute)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def public_dir(*names: Iterable[str]) -> Callable[[], list[str]]:
    """A module ``__dir__`` that lists ``names`` (the package's ``__all__``, its lazy names), sorted, and nothing else:
    no helper the package imported for itself, and no need to load a lazy name to see it."""
    listed = sorted(set().union(*names))

    def __dir__() -> list[str]:
        return list(listed)

    return __dir__
