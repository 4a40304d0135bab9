"""The runtime lookup of tables: finding and loading them (the shipped set, table files) and checks against a module.

The shipped tables live in the package folder ``fewbit_design/tables/`` with an index ``index.json``
(format ``fewbit-index/1``) that lists, for every table file, its activation, params, bits, mode, symmetric flag
and weight ("uniform": w = 1 on [-10, 10]; "normal": the standard normal density on [-10, 10]).
The folder can be overridden with the ``FEWBIT_TABLES_DIR`` environment variable or the ``root=`` argument.
A shipped table is looked up by one :class:`TableKey` (activation, canonical params, bits, mode, weight); the index
is read once per version of the file, grouped by (activation, bits, mode, weight), and each group's params are bound
once.

>>> from fewbit_design import runtime
>>> table = runtime.load_table("gelu", bits=3)                        # doctest: +SKIP
>>> runtime.load_table("elu", params={"alpha": 0.5})                  # doctest: +SKIP
FewBitError: no shipped table for elu(alpha=0.5) at 3 bits (weight 'uniform', mode 'levelsets'): it is not in the
shipped set (.../index.json); design it with `fewbit-design elu --param alpha=0.5 --bits 3 --weight uniform --out
elu.json` and pass table='elu.json'
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...design import activations
from ...errors import FewBitError, check_bits, check_choice
from ...table import (
    MAX_NESTING,
    MAX_TABLE_BYTES,
    MODES,
    Table,
    check_index,
    check_numbers,
    loads,
    parse_json,
    read_table_text,
)

__all__ = [
    "INDEX_FORMAT",
    "TABLES_ENV",
    "WEIGHTS",
    "TableLike",
    "tables_root",
    "load_table",
    "load_table_file",
    "as_table",
    "resolve_table",
    "design_command",
    "MAX_TABLE_BYTES",
    "MAX_NESTING",
    "read_table_text",
    "check_kernel_table",
    "TableKey",
]

INDEX_FORMAT = "fewbit-index/1"
TABLES_ENV = "FEWBIT_TABLES_DIR"
WEIGHTS = ("uniform", "normal")
_PACKAGE_TABLES = Path(__file__).resolve().parents[2] / "tables"


def _load_path(path: str | os.PathLike) -> Table:
    return check_kernel_table(loads(read_table_text(path), str(path)))


def check_kernel_table(table: Table) -> Table:
    """``table`` itself, after checking that it survives the cast to the kernels' dtypes.

    Levels must be finite in float32 (the compute dtype of float32, float16 and bfloat16 inputs): a level of 1e300
    is finite in float64 but would give infinite gradients. Boundaries need no such check: one beyond the float32
    range rounds up to +inf or to the lowest float32 (:func:`~.backends.boundaries_float32`),
    and ``x >= boundary`` still holds for exactly the same float32 x (+inf: only x = +inf, as in float64), so the
    intervals stay exact.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        levels32 = np.asarray(table.levels, dtype=np.float64).astype(np.float32)
    bad = np.nonzero(~np.isfinite(levels32))[0]
    if bad.size:
        where = f"table {table.source!r}" if table.source else "table"
        index = int(bad[0])
        raise FewBitError(
            f"{where}: field 'levels' [{index}] = {float(table.levels[index])!r} is not finite in float32 "
            "(the dtype the kernels multiply in): levels must lie within +-3.4e38"
        )
    return table


TableLike = Table | Mapping[str, Any] | str | os.PathLike


TABLE_ARGUMENTS = {
    "bits": "bits per element kept for backward, 1..8 (default 3; a given ``table``'s bits win)",
    "weight": "the shipped table's weight, ``'uniform'`` (default) or ``'normal'``",
    "mode": "the shipped table's mode, ``'levelsets'`` (default) or ``'intervals'``",
    "table": "a :class:`~fewbit_design.table.Table`, a ``fewbit-table/1`` dict or a path, used instead of a shipped "
    "table (it must be for the same activation and parameters)",
}


def document_arguments(function: Any, torch_name: str) -> None:
    """Append an ``Args:`` section to the docstring of a few-bit drop-in for torch's ``torch_name``: every argument of
    ``function``'s signature, torch's described as torch's and the table arguments from :data:`TABLE_ARGUMENTS`.

    The few-bit modules and functions share one signature pattern (torch's arguments, then ``bits``, ``weight``,
    ``mode``, ``table``), so their argument documentation is written here once, not in 46 docstrings.

    Args:
        function: the few-bit function, or a module's ``__init__`` (the docstring changed is then the class's:
            pass the class itself).
        torch_name: torch's name for what it replaces, e.g. ``torch.nn.functional.gelu``.
    """
    target = function.__init__ if isinstance(function, type) else function
    lines = []
    for name in inspect.signature(target).parameters:
        if name == "self":
            continue
        if name in TABLE_ARGUMENTS:
            text = TABLE_ARGUMENTS[name]
        elif name == "input":
            text = "the input tensor (any shape, dtype float16/bfloat16/float32/float64)"
        elif name == "inplace":
            text = "accepted for compatibility with torch and ignored (the result is computed out of place)"
        else:
            text = f"as in ``{torch_name}``"
        lines.append(f"    {name}: {text}")
    function.__doc__ = (function.__doc__ or "").rstrip() + "\n\nArgs:\n" + "\n".join(lines) + "\n"


def tables_root(root: str | os.PathLike | None = None) -> Path:
    """The folder of shipped tables: ``root`` if given, else ``$FEWBIT_TABLES_DIR``, else the package folder."""
    if root is not None:
        return Path(root)
    env = os.environ.get(TABLES_ENV)
    return Path(env) if env else _PACKAGE_TABLES


def _format_params(params: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{key}={value!r}" if isinstance(value, str) else f"{key}={value:g}" for key, value in params.items()
    )


def _non_default(bound: activations.BoundActivation) -> dict[str, Any]:
    defaults = bound.activation.defaults
    return {key: value for key, value in bound.params.items() if not _same_value(value, defaults.get(key))}


def design_command(
    activation: str,
    params: Mapping[str, Any] | None = None,
    *,
    bits: int = 3,
    weight: str = "uniform",
    mode: str = "levelsets",
) -> str:
    """The ``fewbit-design`` command line that designs this table.

    >>> design_command("elu", {"alpha": 0.5}, bits=3)
    'fewbit-design elu --param alpha=0.5 --bits 3 --weight uniform --out elu.json'

    Args:
        activation: the registry name
        params: its parameters (defaults left out of the command)
        bits: bits per element
        weight: the weight
        mode: the mode
    """
    bound = activations.bind(activation, dict(params or {}))
    parts = ["fewbit-design", bound.name]
    for key, value in _non_default(bound).items():
        parts.append(f"--param {key}={value:g}" if isinstance(value, float) else f"--param {key}={value}")
    parts += [f"--bits {bits}", f"--weight {weight}"]
    if mode != "levelsets":
        parts.append(f"--mode {mode}")
    parts.append(f"--out {bound.name}.json")
    return " ".join(parts)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str) or isinstance(a, bool) or isinstance(b, bool):
        return a == b
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return a == b


def _same_params(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return set(a) == set(b) and all(_same_value(a[key], b[key]) for key in a)


@dataclass(frozen=True)
class TableKey:
    """What identifies a shipped table: the activation's canonical name, its canonical params (name/value pairs
    sorted by name, torch's defaults filled in by :func:`~fewbit_design.design.activations.bind`), bits, mode and
    weight. Lookups are cached on it."""

    activation: str
    params: tuple[tuple[str, Any], ...]
    bits: int
    mode: str
    weight: str

    @classmethod
    def of(cls, bound: activations.BoundActivation, *, bits: int, mode: str, weight: str) -> TableKey:
        return cls(bound.name, tuple(sorted(bound.params.items())), bits, mode, weight)


@functools.lru_cache(maxsize=16)
def _read_index(path: str, mtime_ns: int) -> dict[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """The index's entries by (activation, bits, mode, weight), read once per version of the file: the same size and
    nesting bounds and strict JSON as a table file, and the index schema shared with the design side."""
    where = f"table index {path!r}"
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for entry in check_index(parse_json(read_table_text(path), where), where):
        groups.setdefault((entry["activation"], entry["bits"], entry["mode"], entry["weight"]), []).append(entry)
    return {group: tuple(members) for group, members in groups.items()}


@functools.lru_cache(maxsize=64)
def _bound_entries(path: str, mtime_ns: int, group: tuple[Any, ...]) -> tuple[tuple[dict[str, Any], dict], ...]:
    """The entries of one (activation, bits, mode, weight) with their params bound (torch's defaults filled in),
    once per version of the index; an entry whose params do not bind matches nothing."""
    name = group[0]
    bound = []
    for entry in _read_index(path, mtime_ns).get(group, ()):
        try:
            bound.append((activations.bind(name, dict(entry.get("params") or {})).params, entry))
        except FewBitError:
            continue
    return tuple(bound)


def _not_shipped(bound: activations.BoundActivation, bits: int, weight: str, mode: str, reason: str) -> FewBitError:
    command = design_command(bound.name, bound.params, bits=bits, weight=weight, mode=mode)
    what = f"{bound.name}({_format_params(bound.params)})"
    return FewBitError(
        f"no shipped table for {what} at {bits} bits (weight {weight!r}, mode {mode!r}): {reason}; "
        f"design it with `{command}` and pass table='{bound.name}.json'"
    )


def load_table(
    activation: str,
    *,
    params: Mapping[str, Any] | None = None,
    bits: int = 3,
    weight: str = "uniform",
    mode: str = "levelsets",
    root: str | os.PathLike | None = None,
) -> Table:
    """The shipped table for an activation (torch.nn.functional name or torch class name), cached.

    ``params`` are compared with the shipped tables' after filling in torch's defaults. A combination that is not
    shipped raises a :class:`FewBitError` showing the ``fewbit-design`` command that designs it.

    >>> load_table("gelu", bits=3).bits          # doctest: +SKIP
    3

    Args:
        activation: torch.nn.functional name or torch class name
        params: the activation's parameters (torch's defaults fill in the rest)
        bits: bits per element
        weight: ``'uniform'`` or ``'normal'``
        mode: ``'levelsets'`` or ``'intervals'``
        root: the tables folder (default: the shipped one, or ``FEWBIT_TABLES_DIR``)
    """
    bound = activations.bind(activation, dict(params or {}))
    bits = check_bits(bits)
    check_choice("weight", weight, WEIGHTS)
    check_choice("mode", mode, MODES)
    folder = tables_root(root).resolve()
    index = folder / "index.json"
    try:
        mtime = index.stat().st_mtime_ns
    except OSError:
        raise _not_shipped(bound, bits, weight, mode, f"the table index {str(index)!r} does not exist") from None
    return _load_shipped(TableKey.of(bound, bits=bits, mode=mode, weight=weight), str(folder), mtime)


@functools.lru_cache(maxsize=256)
def _load_shipped(key: TableKey, folder: str, mtime: int) -> Table:
    name, params = key.activation, dict(key.params)
    index = Path(folder) / "index.json"
    matches = [
        entry
        for entry_params, entry in _bound_entries(str(index), mtime, (name, key.bits, key.mode, key.weight))
        if _same_params(entry_params, params)
    ]
    if not matches:
        bound = activations.bind(name, params)
        raise _not_shipped(bound, key.bits, key.weight, key.mode, f"it is not in the shipped set ({index})")
    entry = sorted(matches, key=lambda e: bool(e.get("symmetric", False)))[0]  # prefer the non-symmetric table
    path = (Path(folder) / str(entry["file"])).resolve()
    if Path(folder) not in path.parents:
        raise FewBitError(f"table index {str(index)!r}: file {entry['file']!r} lies outside the tables folder")
    table = _load_path(path)
    found = (table.activation, table.bits, table.mode)
    if found != (name, key.bits, key.mode) or not _same_params(activations.bind(name, table.params).params, params):
        raise FewBitError(
            f"table file {str(path)!r} does not match its index entry: it is {table.activation} "
            f"({_format_params(table.params)}) at {table.bits} bits, mode {table.mode!r}"
        )
    return table


@functools.lru_cache(maxsize=64)
def _load_file_cached(path: str, mtime_ns: int, size: int) -> Table:
    return _load_path(path)


def load_table_file(path: str | os.PathLike) -> Table:
    """Load and validate a table file, cached until the file changes.

    Args:
        path: the table file
    """
    resolved = Path(path).expanduser()
    try:
        stat = resolved.stat()
    except OSError:
        raise FewBitError(f"table file {str(path)!r} does not exist") from None
    if resolved.is_dir():
        raise FewBitError(f"table file {str(path)!r} is a directory")
    return _load_file_cached(str(resolved.resolve()), stat.st_mtime_ns, stat.st_size)


def as_table(table: TableLike) -> Table:
    """A :class:`Table` from a Table, a ``fewbit-table/1`` dict, or a path to a table file."""
    if isinstance(table, Table):
        return check_kernel_table(table)
    if isinstance(table, Mapping):
        check_numbers(dict(table), "<dict>")
        return check_kernel_table(Table.from_dict(dict(table), source="<dict>"))
    if isinstance(table, str | os.PathLike):
        return load_table_file(table)
    raise FewBitError(f"table must be a Table, a dict or a path to a table file, got {type(table).__name__}")


def _describe(table: Table) -> str:
    return f"table {table.source!r}" if table.source else "the table"


def resolve_table(
    table: TableLike | None,
    *,
    activation: str,
    params: Mapping[str, Any],
    bits: int = 3,
    weight: str = "uniform",
    mode: str = "levelsets",
) -> Table:
    """The table a module or function of ``activation`` with ``params`` uses.

    ``table=None`` loads the shipped table for (bits, weight, mode); otherwise ``table`` (Table, dict or path) must be
    for the same activation and params (its own bits, weight and mode win).
    """
    bound = activations.bind(activation, dict(params))
    if table is None:
        return load_table(bound.name, params=bound.params, bits=bits, weight=weight, mode=mode)
    check_bits(bits)
    check_choice("weight", weight, WEIGHTS)
    check_choice("mode", mode, MODES)
    resolved = as_table(table)
    try:
        table_activation = activations.get(resolved.activation).name
    except FewBitError:
        table_activation = resolved.activation
    if table_activation != bound.name:
        raise FewBitError(
            f"{_describe(resolved)} is for activation {resolved.activation!r}, but it was given to "
            f"{bound.activation.torch_name} ({bound.name}); use a table designed for {bound.name}"
        )
    try:
        table_params = activations.bind(bound.name, dict(resolved.params)).params
    except FewBitError as exc:
        raise FewBitError(f"{_describe(resolved)} has bad params for {bound.name}: {exc}") from None
    if not _same_params(table_params, bound.params):
        raise FewBitError(
            f"{_describe(resolved)} is for {bound.name}({_format_params(table_params)}), but the module has "
            f"{bound.name}({_format_params(bound.params)}); design a table with "
            f"`{design_command(bound.name, bound.params, bits=resolved.bits, weight='uniform', mode=resolved.mode)}`"
        )
    return resolved
