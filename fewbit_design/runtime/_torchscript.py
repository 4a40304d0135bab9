"""TorchScript: the runtime's modules cannot be scripted, and say so in one line.

They run ``torch.library`` custom ops, autograd Functions and table objects that ``torch.jit.script`` cannot
compile, and TorchScript is deprecated in favour of ``torch.compile`` and ``torch.export``, which run them (custom
ops with fake kernels). ``torch.jit.script`` calls ``__prepare_scriptable__`` on a module and each submodule before
compiling anything, so a model holding one of these modules gets the error below instead of TorchScript's own from
deep inside its compiler.
"""

from __future__ import annotations

from typing import NoReturn

from ..errors import FewBitError

__all__ = ["NotScriptable"]


class NotScriptable:
    """Mixin of the runtime's modules: ``torch.jit.script`` of the module, or of a model holding it, raises one
    :class:`FewBitError` naming the module."""

    def __prepare_scriptable__(self) -> NoReturn:
        raise FewBitError(
            f"torch.jit.script: {type(self).__name__} (fewbit_design.runtime) cannot be scripted with TorchScript; "
            "use torch.compile or torch.export, which run it"
        )
