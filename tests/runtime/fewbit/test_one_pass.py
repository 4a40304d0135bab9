"""The one-pass CUDA forward (fewbit_design/runtime/fewbit/one_pass.py): y and the codes from one kernel pass over x.

On the CPU the kernel runs in Triton's interpreter, which computes in numpy. What is compared, and why:

* codes: against the pure-torch reference (``quantize_reference``), bitwise. The lookup is exact arithmetic, the
  same under the interpreter as on a GPU.
* y: against :func:`one_pass.reference` (the formula in torch float32 operations), bitwise (NaN: any payload), with
  the interpreter's own exp / tanh / erf (``INTERPRETED_FUNCTIONS``). The interpreter cannot run libdevice, and torch's
  CPU exp differs from numpy's in the last bit, so comparing the kernel with torch's CPU op would test numpy against
  SLEEF. With the same elementary functions, the comparison checks everything the kernel adds: the formula, its
  constants, the order of its float32 roundings, the conversion to and from float16 / bfloat16, NaN and infinity
  handling, masks and offsets.
* the formula itself: :func:`one_pass.reference` with torch's functions against torch's own CPU op, to a few ulp
  (the CPU and the GPU compute the same formula with different exp / erf / tanh implementations).
* on a GPU (tests marked ``cuda``, skipped here): the compiled kernel's y against torch's CUDA op, bitwise: the
  promise itself, where libdevice is the math library both use.

Sizes 0, 1, 7, 2^10 and 2^10 +- 1; contiguous, a step-2 slice and a transposed 2-D view (not contiguous: the two-pass
path, whose y is torch's op itself); float32, float16 and bfloat16; every served activation.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from test_kinks import same_bits
from test_runtime_ops import edge_values

from fewbit_design.runtime import nn as fnn
from fewbit_design.runtime.fewbit import backends, one_pass

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    # the interpreter computes in numpy, which warns on the infinities and NaNs these inputs hold on purpose
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 1023, 1024, 1025]
LAYOUTS = ["contiguous", "step", "transposed"]
# (module class, constructor arguments, registry name, its parameters)
MODULES = {
    "relu": (fnn.ReLU, {}, "relu", {}),
    "relu6": (fnn.ReLU6, {}, "relu6", {}),
    "hardtanh": (fnn.Hardtanh, {}, "hardtanh", {}),
    "leaky_relu": (fnn.LeakyReLU, {}, "leaky_relu", {}),
    "gelu": (fnn.GELU, {}, "gelu", {}),
    "gelu_tanh": (fnn.GELU, {"approximate": "tanh"}, "gelu", {"approximate": "tanh"}),
    "silu": (fnn.SiLU, {}, "silu", {}),
    "sigmoid": (fnn.Sigmoid, {}, "sigmoid", {}),
    "tanh": (fnn.Tanh, {}, "tanh", {}),
}


def interpreted_functions():
    from fewbit_design.runtime.fewbit._triton_math import INTERPRETED_FUNCTIONS

    return {name: lambda t, f=f: torch.from_numpy(f(t.numpy())) for name, f in INTERPRETED_FUNCTIONS.items()}


def module_for(key, make_table, bits=3):
    cls, arguments, name, params = MODULES[key]
    return cls(**arguments, table=make_table(name, bits, params))


def inputs(table, dtype, numel, seed):
    """N(0, 9) samples with the table's boundaries and their neighbours, +-0, +-inf, NaN, subnormal and huge values."""
    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(numel, generator=generator) * 3).to(dtype)
    special = edge_values(table, dtype)[:numel]
    values[torch.randperm(numel, generator=generator)[: special.numel()]] = special
    return values


def laid_out(flat, layout):
    if layout == "contiguous" or flat.numel() < 2:
        return flat.clone()
    if layout == "step":
        buffer = torch.zeros(flat.numel(), 2, dtype=flat.dtype)
        buffer[:, 0] = flat
        return buffer[:, 0]
    rows = next(d for d in (8, 7, 5, 3, 1) if flat.numel() % d == 0)  # logical (rows, cols), stored column-major
    return flat.reshape(rows, -1).t().contiguous().t()


def forward(module, x):
    tensors = module._table_tensors(x.device)
    boundaries, _ = tensors.for_input(x.dtype)
    with backends.use_backend("triton"):
        return backends.forward_triton(x, module._native, boundaries, tensors.interval_codes, tensors.bits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("key", list(MODULES))
def test_y_and_codes_are_the_reference_paths_bitwise(key, dtype, make_table):
    module = module_for(key, make_table)
    formula = one_pass.formula_for(module._native)
    assert formula is not None and formula.name == key.replace("relu6", "hardtanh")
    tensors = module._table_tensors(torch.device("cpu"))
    boundaries, _ = tensors.for_input(dtype)
    functions = interpreted_functions()
    for numel in SIZES:
        flat = inputs(module.table, dtype, numel, seed=numel)
        for layout in LAYOUTS:
            x = laid_out(flat, layout)
            y, packed, record = forward(module, x)
            expected_codes = backends.quantize_reference(x, boundaries, tensors.interval_codes, tensors.bits)
            assert torch.equal(packed, expected_codes), (key, dtype, numel, layout)
            # contiguous x: the kernel's y; else torch's op (the two-pass path keeps torch's strides)
            expected_y = one_pass.reference(formula, x, functions) if x.is_contiguous() else module._native(x)
            assert y.shape == x.shape and same_bits(y, expected_y), (key, dtype, numel, layout)
            nonfinite = ~torch.isfinite(x.reshape(-1))
            if nonfinite.any():
                assert torch.equal(record[0], torch.nonzero(nonfinite).reshape(-1)), (key, dtype, numel, layout)
                assert same_bits(record[1], x.reshape(-1)[nonfinite])
            else:
                assert record is None


@pytest.mark.parametrize("bits", [1, 2, 4, 5, 8])
def test_every_code_width_packs_as_the_reference(bits, make_table):
    # 1, 2, 4 and 8 bits store a group as one word, the others byte by byte
    module = module_for("gelu", make_table, bits)
    tensors = module._table_tensors(torch.device("cpu"))
    for dtype in DTYPES:
        x = inputs(module.table, dtype, 8 * 131 + 5, seed=bits)
        y, packed, _ = forward(module, x)
        boundaries, _ = tensors.for_input(dtype)
        assert torch.equal(packed, backends.quantize_reference(x, boundaries, tensors.interval_codes, bits))
        assert same_bits(y, one_pass.reference(one_pass.formula_for(module._native), x, interpreted_functions()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("key", list(MODULES))
def test_the_formulas_are_torchs_ops(key, dtype, make_table):
    # The formula with torch's own exp / erf / tanh against torch's CPU op. Tolerance: 8 float32 ulp (2^-20
    # relative; CPU and GPU use different exp / erf / tanh, each within a few ulp), 1e-6 absolute near 0 (where
    # x * 0.5 * (1 + erf) loses relative accuracy in every implementation); one rounding of the dtype beyond that
    # for float16 / bfloat16 (the float32 results may round to neighbouring values). Finite x and NaN only: at
    # +-inf torch's CPU kernels do not follow the CUDA formula (CPU gelu(+inf) is NaN, the CUDA formula's inf).
    module = module_for(key, make_table)
    formula = one_pass.formula_for(module._native)
    x = torch.cat([torch.linspace(-12, 12, 4801), torch.tensor([0.0, -0.0, 1e-30, -1e-30, math.nan])]).to(dtype)
    rtol = 2.0**-20 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(one_pass.reference(formula, x), module._native(x), rtol=rtol, atol=1e-6, equal_nan=True)


def test_the_one_pass_path_does_not_call_the_native_op(monkeypatch, make_table):
    module = module_for("silu", make_table)
    tensors = module._table_tensors(torch.device("cpu"))

    def native(x):
        raise AssertionError("the one-pass forward called the native op")

    monkeypatch.setattr(one_pass, "formula_for", lambda function: one_pass.Formula("silu", one_pass.SILU))
    x = torch.randn(100)
    with backends.use_backend("triton"):
        y, _, _ = backends.forward_triton(x, native, tensors.boundaries32, tensors.interval_codes, tensors.bits)
    assert same_bits(y, one_pass.reference(one_pass.Formula("silu", one_pass.SILU), x, interpreted_functions()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_on_the_triton_backend_gives_the_reference_backends_gradient(dtype, make_table):
    module = module_for("gelu_tanh", make_table)
    x = inputs(module.table, dtype, 1025, seed=3)
    x = x[torch.isfinite(x)]
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    results = {}
    for backend in ("triton", "reference"):
        leaf = x.clone().requires_grad_()
        with backends.use_backend(backend):
            y = module(leaf)
            y.backward(grad)
        results[backend] = (y.detach(), leaf.grad)
    assert same_bits(results["triton"][1], results["reference"][1])
    formula = one_pass.formula_for(module._native)
    assert same_bits(results["triton"][0], one_pass.reference(formula, x, interpreted_functions()))


def test_which_natives_take_one_pass(make_table):
    assert one_pass.formula_for(F.relu).name == "relu"
    assert one_pass.formula_for(torch.sigmoid).name == "sigmoid"
    assert one_pass.formula_for(F.relu6) == one_pass.Formula("hardtanh", one_pass.HARDTANH, 0.0, 6.0)
    leaky = fnn.LeakyReLU(table=make_table("leaky_relu", 3))
    slope = one_pass.formula_for(leaky._native).low
    assert slope == float(torch.tensor(0.01, dtype=torch.float32)) and slope != 0.01  # rounded as ATen does
    # not served: a lambda (the functional forms with arguments), FewBit, a subclass with its own forward, GELU
    # with an unknown approximation
    assert one_pass.formula_for(lambda x: F.gelu(x, approximate="tanh")) is None
    wrapped = fnn.FewBit(torch.tanh, make_table("tanh", 3))
    assert one_pass.formula_for(wrapped._native) is None

    class Shifted(fnn.SiLU):
        def _native(self, input):
            return F.silu(input) + 1

    assert one_pass.formula_for(Shifted(table=make_table("silu", 3))._native) is None

    class Unhashable:
        __hash__ = None

        def __call__(self, x):
            return torch.tanh(x)

    assert one_pass.formula_for(Unhashable()) is None
    gelu = fnn.GELU(table=make_table("gelu", 3))
    gelu.__dict__["approximate"] = "erfc"  # (bypasses the table check: only the formula lookup is tested)
    assert one_pass.formula_for(gelu._native) is None


def test_float64_and_non_contiguous_inputs_take_two_passes(make_table):
    module = module_for("silu", make_table)
    for x in (torch.randn(64, dtype=torch.float64), torch.randn(8, 8).t()):
        y, _, _ = forward(module, x)
        assert same_bits(y, module._native(x)) and y.stride() == module._native(x).stride()


def test_reference_rejects_a_dtype_it_does_not_serve():
    from fewbit_design.errors import FewBitError

    with pytest.raises(FewBitError, match="float64"):
        one_pass.reference(one_pass.Formula("silu", one_pass.SILU), torch.zeros(3, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------------------
# on a GPU: the promise itself


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("key", list(MODULES))
def test_cuda_one_pass_y_is_torchs_cuda_op_bitwise(key, dtype, make_table):
    module = module_for(key, make_table).cuda()
    tensors = module._table_tensors(torch.device("cuda"))
    boundaries, _ = tensors.for_input(dtype)
    for numel in [1, 7, 1023, 1024, 1025, (1 << 20) + 1]:
        x = inputs(module.table, dtype, numel, seed=numel).cuda()
        with backends.use_backend("triton"):
            y, packed, _ = backends.forward_triton(x, module._native, boundaries, tensors.interval_codes, 3)
        assert same_bits(y, module._native(x)), (key, dtype, numel)
        assert torch.equal(packed, backends.quantize_reference(x, boundaries, tensors.interval_codes, 3))
