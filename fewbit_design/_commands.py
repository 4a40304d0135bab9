"""Imports every module that registers a ``fewbit-design`` subcommand on :data:`fewbit_design.cli.cli`."""

from . import (
    cli_design,  # noqa: F401
    cli_snr,  # noqa: F401
    cli_tables,  # noqa: F401
)
