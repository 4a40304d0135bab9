"""Few-bit activation modules (drop-in ``torch.nn`` classes and :class:`FewBit`): the documented path.

Re-exports the public names of :mod:`fewbit_design.runtime.fewbit.nn`, where the code lives (the objects are the
same: ``runtime.nn.GELU is runtime.fewbit.nn.GELU``).
"""

from .fewbit.nn import *  # noqa: F403
from .fewbit.nn import __all__  # noqa: F401
