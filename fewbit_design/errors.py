"""The project's one error class and the shared validators.

Every user-facing failure raises :class:`FewBitError` (a ``ValueError``) with one line that names the value, the
constraint and the context. Public entry points may add context once with :func:`with_context`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable

__all__ = [
    "FewBitError",
    "check_choice",
    "check_bits",
    "check_range",
    "check_positive",
    "check_finite",
    "close_matches",
    "parse_int_spec",
]


class FewBitError(ValueError):
    """A bad input, a bad table file or an unsupported request, described in one line."""


def close_matches(value: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Choices that look like ``value`` (for 'did you mean' hints)."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    hits = difflib.get_close_matches(str(value).lower(), list(lowered), n=n, cutoff=0.6)
    return [lowered[h] for h in hits]


def _quote_list(choices: list[str]) -> str:
    quoted = [repr(c) for c in choices]
    if len(quoted) <= 2:
        return " or ".join(quoted)
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``choices``; else raise naming all valid choices."""
    choices = list(choices)
    if isinstance(value, str) and value in choices:
        return value
    raise FewBitError(f"{name} must be {_quote_list(choices)}, got {value!r}")


def check_bits(bits: object, *, low: int = 1, high: int = 8, name: str = "bits") -> int:
    """Bits per element: an integer in [low, high]."""
    if isinstance(bits, bool) or not isinstance(bits, int | float) or int(bits) != bits:
        raise FewBitError(f"{name} must be an integer from {low} to {high}, got {bits!r}")
    bits = int(bits)
    if not low <= bits <= high:
        raise FewBitError(f"{name} must be an integer from {low} to {high}, got {bits}")
    return bits


def check_finite(name: str, value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise FewBitError(f"{name} must be a finite number, got {value!r}") from None
    if not math.isfinite(number):
        raise FewBitError(f"{name} must be a finite number, got {value!r}")
    return number


def check_positive(name: str, value: object) -> float:
    number = check_finite(name, value)
    if number <= 0:
        raise FewBitError(f"{name} must be > 0, got {value!r}")
    return number


def check_range(low: object, high: object, name: str = "range") -> tuple[float, float]:
    """A design range A < B, both finite."""
    a = check_finite(f"{name} start", low)
    b = check_finite(f"{name} end", high)
    if not a < b:
        raise FewBitError(f"{name} must satisfy A < B, got A={a:g}, B={b:g}")
    if not math.isfinite(b - a):
        raise FewBitError(f"{name} must have a finite width B - A (within +-1.8e308), got A={a:g}, B={b:g}")
    return a, b


def parse_int_spec(text: object, *, name: str = "bits", low: int = 1, high: int = 8) -> list[int]:
    """Parse a number, a range ``1-4`` or a list ``1,3,4`` (or a mix ``1-3,6``) into sorted distinct integers.

    >>> parse_int_spec("1-3,6")
    [1, 2, 3, 6]
    """
    values: set[int] = set()
    parts = [p.strip() for p in str(text).split(",")]
    for part in parts:
        start, sep, stop = part.partition("-")
        try:
            first = int(start)
            last = int(stop) if sep else first
        except ValueError:
            raise FewBitError(f"{name} must be a number, a range like 1-4 or a list like 1,3,4; got {text!r}") from None
        if first > last:
            raise FewBitError(f"{name} range must go up, got {part!r}")
        if first < low or last > high:
            raise FewBitError(f"{name} must be from {low} to {high}, got {text!r}")
        values.update(range(first, last + 1))
    return sorted(values)
