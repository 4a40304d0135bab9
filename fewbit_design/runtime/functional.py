"""Few-bit activation functions (the ``torch.nn.functional`` forms): the documented path.

Re-exports the public names of :mod:`fewbit_design.runtime.fewbit.functional`, where the code lives (the objects are
the same: ``runtime.functional.gelu is runtime.fewbit.functional.gelu``).
"""

from .fewbit.functional import *  # noqa: F403
from .fewbit.functional import __all__  # noqa: F401
