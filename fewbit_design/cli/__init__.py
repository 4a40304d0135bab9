"""The ``fewbit-design`` command: :func:`main` is the console entry point (in :mod:`.main`), :data:`cli` the click
group (in :mod:`._options`); one module per command family registers its commands on it."""

from .main import cli, for_shell, main

__all__ = ["cli", "main", "for_shell"]
