"""Import hygiene, checked in fresh interpreters: the design package loads no torch, the runtime loads no scipy,
matplotlib, numba or triton until a CPU (numba) or CUDA (Triton) kernel actually runs."""

import json
import subprocess
import sys

HEAVY = ("scipy", "matplotlib", "numba", "triton")


def loaded_after(code: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it must assign ``result``, which is returned (JSON)."""
    script = f"import json, sys\n{code}\nprint(json.dumps(result))\n"
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_design_package_does_not_import_torch():
    result = loaded_after("import fewbit_design\nresult = sorted(m for m in ('torch',) if m in sys.modules)")
    assert result == []


def test_runtime_loads_no_scipy_matplotlib_numba_or_triton_until_a_cpu_kernel_runs():
    code = """
import fewbit_design.runtime
heavy = ('scipy', 'matplotlib', 'numba', 'triton')
after_import = [m for m in heavy if m in sys.modules]
import torch
from fewbit_design import runtime
from fewbit_design.runtime import nn, functional, convert, tables, memory
from fewbit_design.runtime import _packing as packing
from fewbit_design.runtime.fewbit import backends
from fewbit_design.runtime.fewbit import ops as fewbit
from fewbit_design.table import Table
table = Table(activation='gelu', params={'approximate': 'none'}, bits=2, mode='levelsets', symmetric=False,
              weight={'kind': 'uniform', 'low': -10.0, 'high': 10.0}, boundaries=[-1.0, 0.0, 1.0],
              codes=[0, 1, 2, 3], levels=[0.0, 0.3, 0.7, 1.0], error=0.0, snr_db=None)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), nn.GELU(table=table))
runtime.convert(model, filter={torch.nn.SiLU: table})
after_modules = [m for m in heavy if m in sys.modules]
with backends.use_backend('reference'):
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    functional.gelu(x, table=table).sum().backward()
after_reference = [m for m in heavy if m in sys.modules]
model(x).sum().backward()  # the default CPU path: the numba kernel, loaded now
result = {'import': after_import, 'modules': after_modules, 'reference': after_reference,
          'cpu kernel': 'numba' in sys.modules}
"""
    result = loaded_after(code)
    assert result == {"import": [], "modules": [], "reference": [], "cpu kernel": True}


def test_documented_runtime_paths_are_plain_modules_and_convert_is_the_function_whatever_was_imported_first():
    # The documented paths re-export the technique's public names (the same objects); ``runtime.convert`` is the
    # function even after the module that defines it was imported by its own path, and no module stands in for
    # another in sys.modules.
    code = """
import types
import fewbit_design.runtime.fewbit.convert
import fewbit_design.runtime.nn
from fewbit_design import runtime
from fewbit_design.runtime import fewbit, functional, nn, tables
from fewbit_design.runtime.nn import GELU
result = {
    'convert is the function': isinstance(runtime.convert, types.FunctionType),
    'same objects': GELU is fewbit.nn.GELU and functional.gelu is fewbit.functional.gelu
        and tables.load_table is fewbit.lookup.load_table is runtime.load_table and runtime.FewBit is fewbit.nn.FewBit,
    'same names': [sorted(m.__all__) == sorted(getattr(fewbit, n).__all__)
                   for n, m in (('nn', nn), ('functional', functional), ('lookup', tables))],
    'own modules': [sys.modules[f'fewbit_design.runtime.{n}'].__name__ for n in ('nn', 'functional', 'tables')],
}
"""
    assert loaded_after(code) == {
        "convert is the function": True,
        "same objects": True,
        "same names": [True, True, True],
        "own modules": [f"fewbit_design.runtime.{name}" for name in ("nn", "functional", "tables")],
    }


def test_dir_of_the_lazy_packages_lists_their_api_and_no_helper_without_loading_anything():
    code = """
import fewbit_design
import fewbit_design.design as design_package
from fewbit_design import runtime
before = set(sys.modules)
listed = {'fewbit_design': dir(fewbit_design), 'design': dir(design_package), 'runtime': dir(runtime)}
loaded_by_dir = sorted(m for m in set(sys.modules) - before)
public = {'fewbit_design': sorted(set(fewbit_design.__all__) | {'activations', 'weights', 'integrals', 'dp', 'refine',
                                                                'snr'}),
          'design': sorted(design_package.__all__), 'runtime': sorted(runtime.__all__)}
packages = {'fewbit_design': fewbit_design, 'design': design_package, 'runtime': runtime}
result = {'listed is public': [listed[name] == public[name] for name in listed], 'loaded by dir': loaded_by_dir,
          'resolvable': [name for name in listed if not all(hasattr(packages[name], a) for a in listed[name])] == [],
          'callable design package': callable(design_package)}
"""
    assert loaded_after(code) == {
        "listed is public": [True, True, True],
        "loaded by dir": [],
        "resolvable": True,
        "callable design package": False,
    }


def test_dir_of_the_technique_packages_lists_their_api_and_no_helper():
    code = """
import importlib
helpers = {'annotations', 'torch', 'Any', 'lazy_getattr', 'sys', 'types', 'importlib'}
result = {}
for name in ('blpa', 'reversible', 'checkpoint', 'offload', 'planner'):
    package = importlib.import_module(f'fewbit_design.runtime.{name}')
    listed = set(dir(package))
    result[name] = {'missing': sorted(set(package.__all__) - listed), 'helpers': sorted(helpers & listed)}
"""
    assert loaded_after(code) == {
        name: {"missing": [], "helpers": []} for name in ("blpa", "reversible", "checkpoint", "offload", "planner")
    }
