"""The ``fewbit-design`` command: :func:`main` is the console entry point (in :mod:`.main`), :data:`cli` the click
group (in :mod:`._options`); one module per command family registers its commands on it.

Importing this package loads the standard library only: :func:`main` imports click, numpy and the commands once
its Ctrl-C handler is in place, and :data:`cli` loads them on first use.
"""

from .._lazy import lazy_getattr as _lazy_getattr
from .main import for_shell, main

__all__ = ["cli", "main", "for_shell"]

__getattr__ = _lazy_getattr(__name__, {"cli": ("fewbit_design.cli.main", "cli")})
