"""The table file format: one few-bit derivative table as ``fewbit-table/1`` JSON, validation, atomic writes.

A table is a quantizer of x: sorted finite ``boundaries`` t_1 < ... < t_{M-1} cut the real line into M
intervals (the first and last unbounded); interval m = number of boundaries <= x (a point on a boundary
belongs to the interval on its right); interval m has ``codes[m]`` in [0, 2**bits); code c has ``levels[c]``.
The approximation of f'(x) is q(x) = levels[codes[interval(x)]].

This module needs only numpy and the standard library: the runtime loads tables through it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import FewBitError
from .output_files import check_outputs, check_writable, write_bytes_atomic, write_files_atomic, write_text_atomic

__all__ = [
    "FORMAT",
    "MODES",
    "Table",
    "load",
    "loads",
    "format_float",
    "read_table_text",
    "read_json_text",
    "load_json",
    "check_numbers",
    "MAX_TABLE_BYTES",
    "MAX_NESTING",
    "parse_json",
    "check_index",
    "INDEX_FORMAT",
    "check_writable",
    "check_outputs",
    "write_bytes_atomic",
    "write_files_atomic",
    "write_text_atomic",
]

FORMAT = "fewbit-table/1"
MODES = ("levelsets", "intervals")
_SIGNIFICANT_DIGITS = 12


def format_float(value: float) -> float:
    """Round to the fixed precision tables are written with (12 significant digits).

    Written files are then the same bytes on every machine even when the last bits of a computation differ.

    Args:
        value: the number to round
    """
    value = float(value)
    if value == 0.0 or not math.isfinite(value):
        return 0.0 if value == 0.0 else value
    return float(f"{value:.{_SIGNIFICANT_DIGITS}g}")


def _format_values(values: np.ndarray, exact: Any) -> list[float]:
    """Values rounded by :func:`format_float`, except those at the ``exact`` indices, written in full.

    Exact values are kinks and their float neighbours (a boundary at nextafter(-1, +inf) must not round to -1) and
    constant derivatives (1/6), so that the runtime reproduces torch's derivative bitwise there.
    """
    exact = exact if isinstance(exact, list | tuple) else ()
    keep = {int(i) for i in exact if isinstance(i, int) and not isinstance(i, bool)}
    return [float(v) if i in keep else format_float(v) for i, v in enumerate(values)]


def _fail(source: str | None, name: str, message: str) -> FewBitError:
    where = f"table {source!r}" if source else "table"
    return FewBitError(f"{where}: field {name!r} {message}")


@dataclass(frozen=True, eq=False)
class Table:
    """A validated few-bit table. Build it with :func:`fewbit_design.design` or load it with :func:`load`.

    >>> t = Table(activation="relu", params={}, bits=1, mode="levelsets", symmetric=False,
    ...           weight={"kind": "uniform", "low": -10.0, "high": 10.0},
    ...           boundaries=[0.0], codes=[0, 1], levels=[0.0, 1.0], error=0.0, snr_db=None)
    >>> t.q([-1.0, 0.0, 2.0]).tolist()
    [0.0, 1.0, 1.0]

    Attributes:
        source: where the table came from (a file name), named in error messages; None for a table built in memory
    """

    activation: str
    params: dict[str, Any]
    bits: int
    mode: str
    symmetric: bool
    weight: dict[str, Any]
    boundaries: np.ndarray
    codes: np.ndarray
    levels: np.ndarray
    error: float
    snr_db: float | None
    design: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "boundaries", np.asarray(self.boundaries, dtype=np.float64))
        codes = np.asarray(self.codes)
        if codes.dtype.kind == "f" and np.all(codes == np.round(codes)):
            codes = codes.astype(np.int64)
        set_(self, "codes", codes)
        set_(self, "levels", np.asarray(self.levels, dtype=np.float64))
        _validate(self, self.source)
        set_(self, "codes", self.codes.astype(np.int64))
        for array in (self.boundaries, self.codes, self.levels):
            array.setflags(write=False)

    # ------------------------------------------------------------------ evaluation
    @property
    def intervals(self) -> int:
        """Number of intervals M = len(boundaries) + 1."""
        return len(self.codes)

    def interval(self, x: Any) -> np.ndarray:
        """Interval index of each x (a point on a boundary belongs to the interval on its right)."""
        return np.searchsorted(self.boundaries, np.asarray(x, dtype=np.float64), side="right")

    def code(self, x: Any) -> np.ndarray:
        """The code stored for each x."""
        return self.codes[self.interval(x)]

    def q(self, x: Any) -> np.ndarray:
        """The piecewise-constant approximation q(x) = levels[codes[interval(x)]]."""
        return self.levels[self.code(x)]

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """The ``fewbit-table/1`` object: 12 significant digits, except the values ``design.exact`` marks exact."""
        exact = self.design.get("exact") if isinstance(self.design.get("exact"), dict) else {}
        return {
            "format": FORMAT,
            "activation": self.activation,
            "params": dict(self.params),
            "bits": int(self.bits),
            "mode": self.mode,
            "symmetric": bool(self.symmetric),
            "weight": dict(self.weight),
            "boundaries": _format_values(self.boundaries, exact.get("boundaries", ())),
            "codes": [int(c) for c in self.codes],
            "levels": _format_values(self.levels, exact.get("levels", ())),
            "error": None if math.isnan(self.error) else format_float(self.error),
            "snr_db": None if self.snr_db is None else format_float(self.snr_db),
            "design": dict(self.design),
        }

    def to_json(self) -> str:
        """The table as ``fewbit-table/1`` JSON text (deterministic: fixed key order and float precision)."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> Table:
        """Validate a parsed JSON object and build a table; errors name ``source`` and the field."""
        if not isinstance(data, dict):
            raise FewBitError(f"table {source!r}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise _fail(source, "format", f"must be {FORMAT!r}, got {data.get('format')!r}")
        required = ("activation", "bits", "mode", "boundaries", "codes", "levels")
        for name in required:
            if name not in data:
                raise _fail(source, name, "is missing")
        kwargs = {
            "activation": data["activation"],
            "params": data.get("params", {}),
            "bits": data["bits"],
            "mode": data["mode"],
            "symmetric": data.get("symmetric", False),
            "weight": data.get("weight", {}),
            "error": float("nan") if data.get("error") is None else data["error"],
            "snr_db": data.get("snr_db"),
            "design": data.get("design", {}),
            "source": source,
        }
        for name in ("boundaries", "codes", "levels"):
            value = data[name]
            if not isinstance(value, list) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in value
            ):
                raise _fail(source, name, "must be a list of numbers")
            kwargs[name] = value
        return cls(**kwargs)

    def save(self, path: str | os.PathLike, *, force: bool = False) -> Path:
        """Write the table atomically (temporary file, then rename). Refuses to overwrite unless ``force``."""
        return write_text_atomic(path, self.to_json(), force=force)

    def __repr__(self) -> str:
        return (
            f"Table({self.activation!r}, bits={self.bits}, mode={self.mode!r}, intervals={self.intervals}, "
            f"weight={self.weight.get('kind')!r}, error={self.error:.4g})"
        )


def _validate(table: Table, source: str | None) -> None:
    if not isinstance(table.activation, str) or not table.activation:
        raise _fail(source, "activation", f"must be a non-empty string, got {table.activation!r}")
    if not isinstance(table.params, dict):
        raise _fail(source, "params", f"must be an object, got {table.params!r}")
    for key, value in table.params.items():
        if not (value is None or isinstance(value, str | bool | int | float | np.integer | np.floating)) or (
            isinstance(value, float | np.floating) and not math.isfinite(value)
        ):
            raise _fail(source, "params", f"must map names to numbers, strings or booleans, got {key}={value!r}")
    bits = table.bits
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer) or not 1 <= bits <= 8:
        raise _fail(source, "bits", f"must be an integer from 1 to 8, got {bits!r}")
    if table.mode not in MODES:
        raise _fail(source, "mode", f"must be 'levelsets' or 'intervals', got {table.mode!r}")
    if not isinstance(table.symmetric, bool):
        raise _fail(source, "symmetric", f"must be true or false, got {table.symmetric!r}")
    if not isinstance(table.weight, dict):
        raise _fail(source, "weight", f"must be an object, got {table.weight!r}")
    b, c, y = table.boundaries, table.codes, table.levels
    if b.ndim != 1 or not np.all(np.isfinite(b)):
        raise _fail(source, "boundaries", "must be a list of finite numbers")
    if b.size > 1 and not np.all(np.diff(b) > 0):
        i = int(np.argmin(np.diff(b) > 0))
        raise _fail(source, "boundaries", f"must be strictly increasing (index {i + 1}: {b[i + 1]!r} <= {b[i]!r})")
    if c.ndim != 1 or c.dtype.kind not in "iu":
        raise _fail(source, "codes", "must be a list of integers")
    if c.size != b.size + 1:
        raise _fail(source, "codes", f"must have len(boundaries) + 1 = {b.size + 1} entries, got {c.size}")
    if y.ndim != 1 or y.size < 1 or y.size > 2**bits or not np.all(np.isfinite(y)):
        raise _fail(source, "levels", f"must be 1 to {2**bits} finite numbers (one per code), got {y.size}")
    if c.size and (c.min() < 0 or c.max() >= y.size):
        bad = int(c[(c < 0) | (c >= y.size)][0])
        raise _fail(source, "codes", f"must be in [0, {y.size}) (one level per code), got {bad}")
    error = table.error
    if (
        isinstance(error, bool)
        or not isinstance(error, int | float | np.floating)
        or not (math.isnan(error) or 0 <= error < math.inf)
    ):
        raise _fail(source, "error", f"must be a finite number >= 0 or null, got {error!r}")
    snr = table.snr_db
    if snr is not None and (
        isinstance(snr, bool) or not isinstance(snr, int | float | np.floating) or not math.isfinite(snr)
    ):
        raise _fail(source, "snr_db", f"must be a finite number or null, got {snr!r}")
    if not isinstance(table.design, dict):
        raise _fail(source, "design", f"must be an object, got {table.design!r}")


def _no_constant(name: str) -> Any:
    raise FewBitError(f"{name} is not a JSON number (tables hold finite numbers only)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise FewBitError(f"the number {text[:20]}{'...' if len(text) > 20 else ''} is beyond the float64 range")
    return value


def parse_json(text: str, where: str) -> Any:
    """Parse JSON text strictly, every failure one :class:`FewBitError` starting with ``where`` (``table 'a.json'``).

    Strict: ``NaN`` and ``Infinity`` (which Python's json accepts) and numbers beyond float64 are errors, and an
    integer literal beyond Python's 4300-digit limit is an error instead of a ValueError from the decoder.
    """
    depth = _nesting_depth(text)
    if depth > MAX_NESTING:
        raise FewBitError(f"{where}: JSON nesting depth {depth} exceeds the limit of {MAX_NESTING}: not a table file")
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except FewBitError as exc:
        raise FewBitError(f"{where}: not valid: {exc}") from None
    except json.JSONDecodeError as exc:
        raise FewBitError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except (ValueError, RecursionError) as exc:  # an integer literal of more than 4300 digits, and the like
        message = str(exc).split(";")[0]
        raise FewBitError(f"{where}: not valid JSON ({message})") from None


INDEX_FORMAT = "fewbit-index/1"
_INDEX_TYPES = {
    "file": (str,),
    "activation": (str,),
    "weight": (str,),
    "mode": (str,),
    "bits": (int,),
    "params": (dict, type(None)),
    "symmetric": (bool,),
    "error": (int, float, type(None)),
}


def check_index(document: Any, where: str) -> list[dict[str, Any]]:
    """The entries of a ``fewbit-index/1`` document (the index of a tables folder), each checked: an object with a
    non-empty ``file``, the ``activation``, ``bits``, ``mode`` and ``weight`` it holds, and optional ``params`` (an
    object of numbers, strings and booleans), ``symmetric`` and ``error``. Every failure is one :class:`FewBitError`
    starting with ``where`` and naming the entry and field."""
    if not isinstance(document, dict) or document.get("format") != INDEX_FORMAT:
        raise FewBitError(f"{where}: field 'format' must be {INDEX_FORMAT!r}")
    entries = document.get("tables")
    if not isinstance(entries, list):
        raise FewBitError(f"{where}: field 'tables' must be a list of objects")
    for number, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise FewBitError(f"{where}: entry {number} must be an object, got {type(entry).__name__}")
        for key, types in _INDEX_TYPES.items():
            if key not in entry:
                if key in ("file", "activation", "bits", "mode", "weight"):
                    raise FewBitError(f"{where}: entry {number} has no field {key!r}")
                continue
            value = entry[key]
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types) or value == "":
                raise FewBitError(f"{where}: entry {number} field {key!r} has the wrong type: {value!r}")
        params = entry.get("params") or {}
        for key, value in params.items():
            if not (value is None or isinstance(value, str | bool | int | float)):
                raise FewBitError(f"{where}: entry {number} field 'params' must map names to numbers, strings or "
                                  f"booleans, got {key}={value!r}")  # fmt: skip
    return entries


def loads(text: str, source: str | None = None) -> Table:
    """Parse ``fewbit-table/1`` JSON text (data only: no pickle, no eval) with :func:`parse_json`.

    Args:
        text: the JSON text
        source: where the text came from, named in error messages
    """
    data = parse_json(text, f"table {source!r}")
    check_numbers(data, source)
    return Table.from_dict(data, source=source)


def load(path: str | os.PathLike) -> Table:
    """Load and validate a table file; a bad file raises one :class:`FewBitError` naming the file and field.

    The file's size and JSON nesting are bounded before it is parsed (:func:`read_table_text`).

    Args:
        path: the table file
    """
    return loads(read_table_text(path), source=str(Path(path)))


# Bounds checked before a table file is parsed (by the design side and the runtime alike). The largest shipped table
# (8 bits, 510 boundaries) is 18 KB and nests 3 deep (object -> params / weight / design -> values); a table file
# 200x larger or 10x deeper is not a table, and Python's JSON decoder recurses once per level (10**5 brackets raise
# RecursionError).
MAX_TABLE_BYTES = 4 * 1024 * 1024
MAX_NESTING = 32
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a JSON string literal (its brackets are not nesting)


def _nesting_depth(text: str) -> int:
    """The deepest nesting of JSON arrays / objects in ``text`` (brackets inside strings do not count)."""
    brackets = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8", "replace"), dtype=np.uint8)
    steps = (np.isin(brackets, (ord("["), ord("{"))).astype(np.int64)) - np.isin(brackets, (ord("]"), ord("}")))
    return int(np.cumsum(steps).max(initial=0))


def read_table_text(path: str | os.PathLike) -> str:
    """The text of a table file, checked against :data:`MAX_TABLE_BYTES` and :data:`MAX_NESTING` before parsing.

    Args:
        path: the table file
    """
    return read_json_text(
        path,
        what="table file",
        max_bytes=MAX_TABLE_BYTES,
        size_note=" (the largest shipped table is under 20 KB): not a table file",
        nesting_note=" (a table nests 3 deep): not a table file",
    )


def read_json_text(
    path: str | os.PathLike,
    *,
    what: str,
    max_bytes: int,
    max_nesting: int = MAX_NESTING,
    size_note: str = "",
    nesting_note: str = "",
) -> str:
    """The text of a JSON data file (a table, a plan: ``what`` names it in errors), as UTF-8, checked against
    ``max_bytes`` and ``max_nesting`` before it is parsed: every failure is one :class:`FewBitError`.

    Args:
        path: the file
        what: what the file is (``"table"``, ``"memory plan"``), for error messages
        max_bytes: the largest file size accepted
        max_nesting: the deepest JSON nesting accepted
        size_note: appended to the size error (why the limit)
        nesting_note: appended to the nesting error
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise FewBitError(
                f"{what} {str(path)!r}: file size {size} bytes exceeds the limit of {max_bytes} bytes{size_note}"
            )
        with path.open("rb") as handle:
            data = handle.read(max_bytes + 1)
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise FewBitError(f"{what} {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FewBitError(f"{what} {str(path)!r} cannot be read: {exc}") from None
    if len(data) > max_bytes:
        raise FewBitError(f"{what} {str(path)!r}: file size exceeds the limit of {max_bytes} bytes")
    depth = _nesting_depth(text)
    if depth > max_nesting:
        raise FewBitError(
            f"{what} {str(path)!r}: JSON nesting depth {depth} exceeds the limit of {max_nesting}{nesting_note}"
        )
    return text


def load_json(path: str | os.PathLike, *, what: str, max_bytes: int, max_nesting: int = MAX_NESTING) -> Any:
    """Parse a JSON data file read by :func:`read_json_text` (data only: no pickle, no eval). Integers beyond
    Python's digit limit (4300) and malformed JSON are one :class:`FewBitError` naming the file.

    Args:
        path: the file
        what: what the file is, for error messages
        max_bytes: the largest file size accepted
        max_nesting: the deepest JSON nesting accepted
    """
    text = read_json_text(path, what=what, max_bytes=max_bytes, max_nesting=max_nesting)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FewBitError(f"{what} {str(path)!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
    except ValueError as exc:  # an integer literal over the digit limit
        raise FewBitError(f"{what} {str(path)!r} cannot be parsed: {exc}") from None


def check_numbers(data: Any, source: str) -> None:
    """Every number of the numeric fields converts to a float (JSON integers like 10**400 do not: OverflowError).

    Args:
        data: the parsed table (a dict)
        source: where it came from, for error messages
    """
    if not isinstance(data, dict):
        return
    for name in ("boundaries", "codes", "levels", "error", "snr_db"):
        value = data.get(name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool):
                try:
                    float(item)
                except OverflowError:
                    raise FewBitError(
                        f"table {source!r}: field {name!r} holds the integer {str(item)[:20]}... "
                        f"({len(str(item))} digits), beyond the float range"
                    ) from None
