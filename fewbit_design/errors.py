"""The project's one error class and the shared validators.

Every user-facing failure raises :class:`FewBitError` (a ``ValueError``) with one line that names the value, the
constraint and the context. Public entry points may add context once with :func:`with_context`.
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "FewBitError",
    "check_choice",
    "check_bits",
    "check_range",
    "check_positive",
    "check_finite",
    "check_integer",
    "check_number",
    "check_boolean",
    "check_string",
    "check_keys",
    "close_matches",
    "parse_int_spec",
    "parse_budget",
    "resolve_budget",
    "show",
]


class FewBitError(ValueError):
    """A bad input, a bad table file or an unsupported request, described in one line."""


def close_matches(value: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Choices that look like ``value`` (for 'did you mean' hints).

    Args:
        value: the unknown value
        choices: the valid values
        n: at most this many matches
    """
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
    """Return ``value`` if it is one of ``choices``; else raise naming all valid choices.

    Args:
        name: what the value is, for the error message
        value: the value to check
        choices: the valid values
    """
    choices = list(choices)
    if isinstance(value, str) and value in choices:
        return value
    raise FewBitError(f"{name} must be {_quote_list(choices)}, got {value!r}")


def check_bits(bits: object, *, low: int = 1, high: int = 8, name: str = "bits") -> int:
    """Bits per element: an integer in [low, high].

    Args:
        bits: the value to check
        low: the smallest valid value
        high: the largest valid value
        name: what the value is, for the error message
    """
    if isinstance(bits, bool) or not isinstance(bits, int | float) or int(bits) != bits:
        raise FewBitError(f"{name} must be an integer from {low} to {high}, got {bits!r}")
    bits = int(bits)
    if not low <= bits <= high:
        raise FewBitError(f"{name} must be an integer from {low} to {high}, got {bits}")
    return bits


def check_finite(name: str, value: object) -> float:
    """A finite number (anything ``float()`` takes), as a float.

    Args:
        name: what the value is, for the error message
        value: the value to check
    """
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise FewBitError(f"{name} must be a finite number, got {value!r}") from None
    if not math.isfinite(number):
        raise FewBitError(f"{name} must be a finite number, got {value!r}")
    return number


def check_positive(name: str, value: object) -> float:
    """A finite number > 0, as a float.

    Args:
        name: what the value is, for the error message
        value: the value to check
    """
    number = check_finite(name, value)
    if number <= 0:
        raise FewBitError(f"{name} must be > 0, got {value!r}")
    return number


def check_range(low: object, high: object, name: str = "range") -> tuple[float, float]:
    """A design range A < B, both finite.

    Args:
        low: A, the range's lower end
        high: B, the range's upper end
        name: what the range is, for the error message
    """
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

    Args:
        text: the specification (an int, or a string such as ``"1-3,6"``)
        name: what the value is, for the error message
        low: the smallest valid integer
        high: the largest valid integer
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


# --- strict types (values read from JSON files: a count is a JSON integer, a flag a JSON boolean) ----------------


def show(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about values of any size."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond str()'s digit limit
        text = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _integer_bounds(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f" from {low} to {high}"
    if low is not None:
        return f" >= {low}"
    return f" <= {high}" if high is not None else ""


def check_integer(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """An integer in [low, high]: not a bool, not a float such as ``3.0`` and not a string (a JSON integer).

    >>> check_integer("start", 3, low=0)
    3

    Args:
        name: what the value is, for the error message
        value: the value to check
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FewBitError(f"{name} must be an integer{_integer_bounds(low, high)}, got {show(value)}")
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high):
        raise FewBitError(f"{name} must be an integer{_integer_bounds(low, high)}, got {show(number)}")
    return number


def check_number(name: str, value: object, *, low: float | None = None, allow_nan: bool = False) -> float:
    """A finite real number (an int or a float, not a bool or a string) >= ``low``; NaN too when ``allow_nan``.

    Args:
        name: what the value is, for the error message
        value: the value to check
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FewBitError(f"{name} must be a number{'' if low is None else f' >= {low:g}'}, got {show(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise FewBitError(f"{name} must be a finite number, got {show(value)}") from None
    if math.isnan(number) and allow_nan:
        return number
    if not math.isfinite(number):
        raise FewBitError(f"{name} must be a finite number, got {show(value)}")
    if low is not None and number < low:
        raise FewBitError(f"{name} must be a number >= {low:g}, got {show(value)}")
    return number


def check_boolean(name: str, value: object) -> bool:
    """``True`` or ``False`` itself (a JSON boolean): not ``"no"``, not ``0``.

    Args:
        name: what the value is, for the error message
        value: the value to check
    """
    if not isinstance(value, bool):
        raise FewBitError(f"{name} must be true or false, got {show(value)}")
    return value


def check_string(name: str, value: object) -> str:
    """A string itself (a JSON string): not a number, not None.

    Args:
        name: what the value is, for the error message
        value: the value to check
    """
    if not isinstance(value, str):
        raise FewBitError(f"{name} must be a string, got {show(value)}")
    return value


def check_keys(name: str, data: object, required: Iterable[str], optional: Iterable[str] = ()) -> dict[str, Any]:
    """``data`` is a dict (a JSON object) with every key of ``required`` and none beyond ``required`` and
    ``optional``; returns it.

    Args:
        name: what the object is, for the error message
        data: the value to check
        required: the keys it must have
        optional: the keys it may have besides
    """
    if not isinstance(data, dict):
        raise FewBitError(f"{name} must be an object (a dict), got {show(data)}")
    required, optional = list(required), list(optional)
    missing = [key for key in required if key not in data]
    if missing:
        listed = ", ".join(repr(key) for key in missing[:-1]) + " and " if len(missing) > 1 else ""
        raise FewBitError(f"{name} lacks {listed}{missing[-1]!r}")
    unknown = [key for key in data if key not in required and key not in optional]
    if unknown:
        allowed = ", ".join(repr(key) for key in required + optional)
        raise FewBitError(f"{name} has an unknown field {show(unknown[0])} (allowed: {allowed})")
    return data


# --- memory budgets ----------------------------------------------------------------------------------------------

BYTE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_BUDGET = re.compile(r"(\d{1,20}(?:\.\d{1,20})?)\s*([A-Za-z]+)?")
_BUDGET_FORMS = "bytes (an integer, or a string like '2GiB', '512MiB', '1.5GB'), a fraction in (0, 1] or 'min'"


def parse_budget(budget: object, *, name: str = "budget") -> int | float | str:
    """The one syntax of memory budgets (``checkpoint.plan``, ``plan_memory``, ``fewbit-design memory --budget``).

    * bytes: a positive integer, or a string holding a whole number (``"1000"``) or a number with a unit, decimal
      (``KB MB GB TB``) or binary (``KiB MiB GiB TiB``), like ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``; units are
      written exactly so (``"2gib"`` is refused with a hint: ``b`` means bits elsewhere);
    * a fraction of the unconverted peak: a float in (0, 1], or a string with a decimal point (``"0.5"``);
    * ``"min"`` (in any case): the smallest feasible peak.

    Returns bytes as an int, a fraction as a float, or ``"min"``; :func:`resolve_budget` turns it into bytes.

    >>> parse_budget("1.5GB"), parse_budget("512MiB"), parse_budget(4096), parse_budget("0.5"), parse_budget("Min")
    (1500000000, 536870912, 4096, 0.5, 'min')

    Args:
        budget: the budget in any of the forms above
        name: what the value is, for the error message
    """
    if isinstance(budget, bool) or budget is None:
        raise FewBitError(f"{name} must be {_BUDGET_FORMS}; got {show(budget)}")
    if isinstance(budget, numbers.Integral):
        if budget <= 0:
            raise FewBitError(f"{name} must be > 0 bytes, got {show(budget)}")
        return int(budget)
    if isinstance(budget, numbers.Real):
        fraction = float(budget)
        if not 0 < fraction <= 1:  # NaN fails too
            raise FewBitError(
                f"{name} given as a float is a fraction of the unconverted peak and must be in (0, 1], got "
                f"{show(budget)} (give bytes as an integer or a string like '2GiB')"
            )
        return fraction
    if not isinstance(budget, str):
        raise FewBitError(f"{name} must be {_BUDGET_FORMS}; got a {type(budget).__name__}")
    text = budget.strip()
    if text.lower() == "min":
        return "min"
    match = _BUDGET.fullmatch(text)
    if match is None:
        raise FewBitError(f"{name} must be {_BUDGET_FORMS}; got {show(budget)}")
    number, unit = match.groups()
    if unit is None and "." in number:
        fraction = float(number)
        if not 0 < fraction <= 1:
            raise FewBitError(
                f"{name} {show(budget)} has a decimal point, so it is a fraction of the unconverted peak, which must "
                "be in (0, 1] (bytes are a whole number, or a number with a unit like '1.5GB')"
            )
        return fraction
    if unit is not None and unit not in BYTE_UNITS:
        hint = [u for u in BYTE_UNITS if u.lower() == unit.lower()]
        suggestion = f"; did you mean '{number}{hint[0]}'?" if hint else ""
        raise FewBitError(
            f"{name} has an unknown unit {unit!r} in {show(budget)}: units are {', '.join(BYTE_UNITS)}{suggestion}"
        )
    scale = BYTE_UNITS[unit or "B"]
    if "." in number and scale == 1:
        raise FewBitError(f"{name} in bytes must be a whole number, got {show(budget)}")
    value = int(float(number) * scale) if "." in number else int(number) * scale
    if value <= 0:
        raise FewBitError(f"{name} must be > 0 bytes, got {show(budget)}")
    return value


def resolve_budget(budget: object, *, unconverted: int, minimum: Callable[[], int], name: str = "budget") -> int:
    """Bytes from any form :func:`parse_budget` reads: a fraction is of ``unconverted`` (the peak without the
    technique), ``"min"`` is ``minimum()`` (computed only then).

    Args:
        budget: the budget in any form :func:`parse_budget` reads
        unconverted: the peak bytes without the technique
        minimum: computes the smallest feasible peak (called only for ``"min"``)
        name: what the value is, for the error message
    """
    value = parse_budget(budget, name=name)
    if value == "min":
        return int(minimum())
    if isinstance(value, float):
        return max(int(value * unconverted), 1)
    return int(value)
