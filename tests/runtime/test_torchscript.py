"""``torch.jit.script`` of a module of the runtime, or of a model holding one, is one FewBitError naming the module
(TorchScript cannot compile custom ops, autograd Functions or tables; torch.compile and torch.export run them)."""

from __future__ import annotations

import pytest
import torch

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime.attention.exact import ValueLinear
from fewbit_design.runtime.blpa.nn import BNReLULinear
from fewbit_design.runtime.fewbit import nn as fnn
from fewbit_design.runtime.reversible.couplings import AdditiveCoupling


class SwiGLU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
        self.down_proj, self.act_fn = torch.nn.Linear(16, 8), torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _converted() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), SwiGLU(), torch.nn.Linear(8, 8), torch.nn.GELU())
    return runtime.convert(model, example_inputs=torch.randn(4, 8))


MODULES = {
    "GELU": lambda: fnn.GELU(bits=3),
    "MemorySharingNorm": lambda: _converted()[0],
    "GatedMLP": lambda: _converted()[1],
    "CompressedLinear": lambda: runtime.convert(torch.nn.Sequential(torch.nn.Linear(8, 8)), compress=8)[0],
    "ValueLinear": lambda: ValueLinear(8, 8),
    "BNReLULinear": lambda: BNReLULinear(8, 8),
    "AdditiveCoupling": lambda: AdditiveCoupling(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_scripting_a_runtime_module_is_one_error_naming_it(name):
    module = MODULES[name]()
    assert type(module).__name__ == name
    message = f"torch.jit.script: {name} (fewbit_design.runtime) cannot be scripted with TorchScript"
    with pytest.raises(FewBitError, match=message.replace("(", r"\(").replace(")", r"\)")):
        torch.jit.script(module)
    with pytest.raises(FewBitError, match="cannot be scripted with TorchScript; use torch.compile or torch.export"):
        torch.jit.script(torch.nn.Sequential(torch.nn.Identity(), module))
