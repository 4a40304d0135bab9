"""The runtime lookup of tables (finding and loading them: the shipped set or files), at its documented path.

Re-exports the public names of :mod:`fewbit_design.runtime.fewbit.lookup`, where the code lives (the objects are the
same: ``runtime.tables.load_table is runtime.fewbit.lookup.load_table``). The other modules named after tables are the
file format (:mod:`fewbit_design.table`), the shipped set (:mod:`fewbit_design.tables`) and the CLI command
(:mod:`fewbit_design.cli.tables`).
"""

from .fewbit.lookup import *  # noqa: F403
from .fewbit.lookup import __all__  # noqa: F401
