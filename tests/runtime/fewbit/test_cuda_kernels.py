"""The few-bit op on a GPU: the compiled Triton kernels against the pure-torch reference kernels, codes
and gradients bitwise; the autograd function on CUDA; CUDA graph capture of a forward and backward.

Every test here is marked ``cuda``: skipped without a GPU, run by ``TRITON_INTERPRET=0 pytest -m cuda`` (as
scripts/gpu_suite.sh does). The CPU twins are in test_runtime_ops.py, where the reference, numba and interpreted
Triton kernels are checked against independent oracles; so here the reference kernel on the same CUDA tensors is the
oracle, and the reference on CPU shows that it does not depend on the device.

Matrix: every registry activation (its shipped level-set table, and gelu with approximate='tanh'), 1-8 bits,
float32 / float16 / bfloat16 (float64 for two activations), sizes 0, 1, 7, 2^k and 2^k +- 1 (k = 10, 16, 20), each
contiguous, as a step-2 slice and as a transposed 2-D view. Inputs mix the table's boundaries and their neighbours in
the dtype, signed zeros, +-inf, NaN, subnormal and huge values with N(0, 9) samples; gradients mix +-inf, NaN, -0
and subnormals with N(0, 1) samples. ``FEWBIT_CUDA_LARGE=1`` adds 2^28 elements and more than 2^31 elements (64-bit
offsets; about 14 GiB of GPU memory, a few seconds).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from test_kinks import same_bits, torch_module
from test_runtime_ops import edge_values

from fewbit_design.design import activations
from fewbit_design.runtime import nn as fnn
from fewbit_design.runtime._packing import packed_nbytes
from fewbit_design.runtime.fewbit import backends
from fewbit_design.runtime.fewbit import ops as op
from fewbit_design.runtime.tables import load_table

pytestmark = pytest.mark.cuda

LARGE = os.environ.get("FEWBIT_CUDA_LARGE") == "1"
SPECS = [(name, {}) for name in activations.names()] + [("gelu", {"approximate": "tanh"})]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, 1023, 1024, 1025, 65535, 65537, (1 << 20) + 1]
CPU_CHECK_MAX = 65537  # sizes up to this are also compared with the reference run on CPU
LAYOUTS = ["contiguous", "step", "transposed"]
GRAD_SPECIALS = [math.inf, -math.inf, math.nan, -0.0, 0.0, 1e-40, -1e-39]  # float32 / bfloat16 subnormals too


def spec_id(spec):
    name, params = spec
    return name + "".join(f"-{key}={value}" for key, value in params.items())


def mixed(first: torch.Tensor, numel: int, dtype: torch.dtype, generator: torch.Generator, scale: float):
    """``numel`` values in ``dtype`` on CUDA: N(0, scale^2) samples with the values of ``first`` (as many as fit) at
    random positions."""
    values = torch.randn(numel, generator=generator, device="cuda") * scale
    count = min(first.numel(), numel)
    positions = torch.randperm(numel, generator=generator, device="cuda")[:count]
    values = values.to(torch.float64)
    values[positions] = first[:count].to(torch.float64).cuda()
    return values.to(dtype)


def laid_out(flat: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor whose elements, flattened in logical order, are ``flat``, stored as ``layout`` says."""
    numel = flat.numel()
    if layout == "contiguous" or numel == 0:
        return flat.clone()
    if layout == "step":  # every other element of a buffer twice as long
        buffer = torch.zeros(numel, 2, dtype=flat.dtype, device=flat.device)
        buffer[:, 0] = flat
        return buffer[:, 0]
    rows = max(d for d in range(1, math.isqrt(numel) + 1) if numel % d == 0)
    if rows == 1:  # a prime size: a column of a wider buffer
        buffer = torch.zeros(numel, 3, dtype=flat.dtype, device=flat.device)
        buffer[:, 1] = flat
        return buffer[:, 1]
    return flat.reshape(rows, numel // rows).t().contiguous().t()  # logical (rows, cols), stored column-major


def run(backend, function, *args):
    with backends.use_backend(backend):
        return getattr(op, function)(*args)


def test_triton_kernels_are_compiled_not_interpreted():
    from triton.runtime.jit import JITFunction

    from fewbit_design.runtime.fewbit import _triton_kernels as kernels

    assert isinstance(kernels._fewbit_forward_kernel, JITFunction), (
        "the Triton kernels run in the interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets by default): "
        "run the CUDA tests with TRITON_INTERPRET=0"
    )
    assert backends.backend_for(torch.device("cuda")) == "triton"


def check_against_reference(table, dtype, numel, layout, generator):
    bits = int(table.bits)
    cuda = backends.table_tensors(table, "cuda")
    boundaries, levels = cuda.for_input(dtype)
    x = laid_out(mixed(edge_values(table, dtype), numel, dtype, generator, 3.0), layout)
    grad = laid_out(mixed(torch.tensor(GRAD_SPECIALS), numel, dtype, generator, 1.0), layout)
    where = f"{table.activation} {bits} bits {dtype} numel {numel} {layout}"

    packed = run("triton", "quantize", x, boundaries, cuda.interval_codes, bits)
    expected = run("reference", "quantize", x, boundaries, cuda.interval_codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(numel, bits), where
    assert torch.equal(packed, expected), where
    result = run("triton", "scale", grad, packed, levels, bits)
    assert result.shape == grad.shape and result.is_contiguous(), where
    assert same_bits(result, run("reference", "scale", grad, expected, levels, bits)), where

    if numel <= CPU_CHECK_MAX:  # the reference does not depend on the device
        cpu = backends.table_tensors(table)
        cpu_boundaries, cpu_levels = cpu.for_input(dtype)
        on_cpu = backends.quantize_reference(x.cpu(), cpu_boundaries, cpu.interval_codes, bits)
        assert torch.equal(packed.cpu(), on_cpu), where
        assert same_bits(result.cpu(), backends.scale_reference(grad.cpu(), on_cpu, cpu_levels, bits)), where


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_triton_codes_and_gradients_equal_the_reference(spec, bits, dtype):
    name, params = spec
    table = load_table(name, params=params, bits=bits)
    generator = torch.Generator("cuda").manual_seed(bits * 1000 + DTYPES.index(dtype))
    for numel in SIZES:
        for layout in LAYOUTS if numel <= CPU_CHECK_MAX else LAYOUTS[:2]:
            check_against_reference(table, dtype, numel, layout, generator)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("name", ["gelu", "silu"])
def test_triton_float64_equals_the_reference(name, bits):
    table = load_table(name, bits=bits)
    generator = torch.Generator("cuda").manual_seed(bits)
    for numel in (1, 7, 1025, 65537):
        for layout in LAYOUTS:
            check_against_reference(table, torch.float64, numel, layout, generator)


@pytest.mark.skipif(not LARGE, reason="2^28 elements: set FEWBIT_CUDA_LARGE=1 (scripts/gpu_suite.sh does)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_to_the_28_elements(dtype):
    table = load_table("gelu", bits=3)
    check_against_reference(table, dtype, (1 << 28) + 3, "contiguous", torch.Generator("cuda").manual_seed(28))
    torch.cuda.empty_cache()


@pytest.mark.skipif(not LARGE, reason="2^31 elements and more: set FEWBIT_CUDA_LARGE=1 (scripts/gpu_suite.sh does)")
def test_more_than_two_to_the_31_elements_use_64_bit_offsets():
    # bfloat16 keeps it at 4 GiB per tensor; the reference runs on the last 2^20 + 13 elements only (a multiple of 8
    # elements from the start, so its packed groups are the last groups of the whole tensor)
    bits, numel, tail = 3, (1 << 31) + 13, (1 << 20) + 13
    table = load_table("silu", bits=bits)
    cuda = backends.table_tensors(table, "cuda")
    generator = torch.Generator("cuda").manual_seed(31)
    x = torch.randn(numel, device="cuda", dtype=torch.bfloat16, generator=generator)
    packed = run("triton", "quantize", x, cuda.boundaries32, cuda.interval_codes, bits)
    assert packed.numel() == packed_nbytes(numel, bits)
    start = numel - tail
    expected_tail = run("reference", "quantize", x[start:], cuda.boundaries32, cuda.interval_codes, bits)
    assert torch.equal(packed[start // 8 * bits :], expected_tail)
    del x
    grad = torch.randn(numel, device="cuda", dtype=torch.bfloat16, generator=generator)
    result = run("triton", "scale", grad, packed, cuda.levels32, bits)
    expected = run("reference", "scale", grad[start:], packed[start // 8 * bits :], cuda.levels32, bits)
    assert same_bits(result[start:], expected)
    del grad, result, packed
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_autograd_function_on_cuda_is_native_forward_and_reference_backward(spec, dtype):
    name, params = spec
    table = load_table(name, params=params, bits=3)
    native = torch_module(name) if not params else torch.nn.GELU(**params)
    generator = torch.Generator("cuda").manual_seed(3)
    x = laid_out(mixed(edge_values(table, dtype), 4096 * 3, dtype, generator, 3.0), "transposed")
    grad = laid_out(mixed(torch.tensor(GRAD_SPECIALS), 4096 * 3, dtype, generator, 1.0), "transposed")
    gradients = {}
    for backend in ("triton", "reference"):
        leaf = x.detach().clone().requires_grad_()
        with backends.use_backend(backend):
            y = op.fewbit_activation(leaf, native, backends.table_tensors(table, "cuda"))
            assert same_bits(y, native(x)), (name, dtype, backend)
            y.backward(grad)
        gradients[backend] = leaf.grad
    assert same_bits(gradients["triton"], gradients["reference"]), (name, dtype)


def test_cuda_graph_captures_forward_and_backward():
    # the captured forward must not synchronise with the host: it saves the non-finite flag instead of the sparse
    # record (ops._capturing; its CPU twin is test_nonfinite.py::test_cuda_graph_capture_saves_the_flag_...)
    module = fnn.GELU(bits=3).cuda()
    static_x = torch.randn(512, 96, device="cuda", requires_grad=True)
    static_grad = torch.randn(512, 96, device="cuda")
    side = torch.cuda.Stream()  # warm-up on a side stream (compiles the kernels, caches the table tensors)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            static_x.grad = None
            module(static_x).backward(static_grad)
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = module(static_x)
        static_y.backward(static_grad)
    static_x_grad = static_x.grad  # allocated in the capture; every replay writes it again
    for seed in range(3):
        generator = torch.Generator("cuda").manual_seed(seed)
        with torch.no_grad():
            static_x.copy_(torch.randn(static_x.shape, device="cuda", generator=generator) * 3)
            static_x[seed, 7] = (math.inf, -math.inf, 0.0)[seed]
        static_grad.copy_(torch.randn(static_grad.shape, device="cuda", generator=generator))
        graph.replay()
        leaf = static_x.detach().clone().requires_grad_()
        y = module(leaf)  # eager, same module and table
        y.backward(static_grad)
        assert same_bits(static_y, y.detach()), seed
        if seed == 2:  # all finite: the replayed gradient is the eager one, bitwise
            assert same_bits(static_x_grad, leaf.grad), seed
        else:  # an infinity: the flag saved in the capture makes the whole gradient NaN (eager: torch's at the inf)
            assert torch.isnan(static_x_grad).all(), seed
