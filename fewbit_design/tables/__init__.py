"""The shipped set of tables (package data: ``<activation>/*.json`` and ``index.json``) and the code that builds and
verifies it: :mod:`.shipped` (the set, build, verify, the index), :mod:`.same` (when a rebuilt table is the same
table) and :mod:`.perturb` (the spread of the objective under perturbations)."""

from .shipped import (
    INDEX_FORMAT,
    SHIPPED_WEIGHTS,
    TABLES_DIR,
    VARIANTS,
    TableSpec,
    build,
    build_table,
    check,
    read_index,
    sample_specs,
    table_specs,
    verify,
)

__all__ = [
    "INDEX_FORMAT",
    "TABLES_DIR",
    "SHIPPED_WEIGHTS",
    "VARIANTS",
    "TableSpec",
    "table_specs",
    "build_table",
    "build",
    "check",
    "verify",
    "read_index",
    "sample_specs",
]
