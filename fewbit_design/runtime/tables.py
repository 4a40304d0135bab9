"""Finding and loading design tables for the runtime (the shipped set or files): the documented path.

Re-exports the public names of :mod:`fewbit_design.runtime.fewbit.tables`, where the code lives (the objects are the
same: ``runtime.tables.load_table is runtime.fewbit.tables.load_table``).
"""

from .fewbit.tables import *  # noqa: F403
from .fewbit.tables import __all__  # noqa: F401
