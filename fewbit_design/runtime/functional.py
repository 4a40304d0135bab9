"""The documented path of :mod:`fewbit_design.runtime.fewbit.functional` (the same module object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("fewbit_design.runtime.fewbit.functional")
