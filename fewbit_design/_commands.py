"""Imports every module that registers a ``fewbit-design`` subcommand on :data:`fewbit_design.cli.cli`."""

from . import cli_design  # noqa: F401
from . import cli_snr  # noqa: F401
from . import cli_tables  # noqa: F401
