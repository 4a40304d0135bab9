"""The Triton launchers of the few-bit op (CUDA; CPU tensors under ``TRITON_INTERPRET=1``): the forward in one pass,
the codes pass alone, the backward, and the list of every launch they make.

:func:`forward_triton` reads x once and writes y (torch's formula, :mod:`.one_pass`), the packed codes and the
non-finite flag where it can, else the codes and the flag, then torch's op; :func:`quantize_triton` and
:func:`scale_triton` are the Triton kernels of the reference's ``quantize`` and ``scale`` (bitwise equal).
:func:`triton_launches` lists every launch, as the launchers make it, for the test that compiles each one for real
GPU targets and checks its PTX against :mod:`.traffic` (tests/runtime/fewbit/test_triton_compile.py). Triton itself
is imported only when a kernel runs (:mod:`._triton_kernels`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ...errors import FewBitError
from .._packing import packed_nbytes
from . import one_pass
from ._inputs import BACKEND_ENV, SUPPORTED_DTYPES, check_input, check_packed, flat_contiguous, nonfinite_positions

__all__ = [
    "TRITON_BLOCK_GROUPS",
    "TRITON_CACHED_ARGUMENTS",
    "TritonLaunch",
    "forward_triton",
    "quantize_triton",
    "scale_triton",
    "triton_launches",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _triton_kernels(device: torch.device):
    """The Triton kernels module, for tensors on ``device``: CUDA, or any device when the kernels run in Triton's
    interpreter (``TRITON_INTERPRET=1`` when they were imported, as in the tests); else one FewBitError, not
    Triton's own driver error."""
    from . import _triton_kernels

    if device.type != "cuda" and not _interpreted(_triton_kernels._fewbit_forward_kernel):
        raise FewBitError(
            f"backend 'triton' ({BACKEND_ENV} or use_backend) runs on CUDA tensors, got {device.type} tensors: use "
            "'auto', 'numba' or 'reference' on the CPU (Triton's interpreter runs it on the CPU only when "
            "TRITON_INTERPRET=1 is set before the kernels are imported)"
        )
    return _triton_kernels


def _interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` (a ``triton.jit`` function) runs in Triton's interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


#: groups of 8 elements per program of the Triton kernels (1024 elements: 8 per thread of 4 warps)
TRITON_BLOCK_GROUPS = 128
#: as nvcc compiles ATen by default: FMA contraction on (--fmad=true), no flush-to-zero in libdevice (-ftz=false)
_COMPILE_OPTIONS = {"num_warps": 4, "enable_fp_fusion": True, "enable_reflect_ftz": False}

#: the dtype of the packed buffer as the Triton kernels address it: one word per group where ``bits`` is a power of 2
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _packed_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The packed buffer (uint8) as the kernels address it: ``bits``-byte words for 1, 2, 4 or 8 bits, else bytes."""
    dtype = _WORD_DTYPES.get(bits)
    if dtype is None or dtype == torch.uint8:
        return packed
    if packed.storage_offset() % dtype.itemsize:  # (codes read from a view at an odd offset: words need an aligned
        packed = packed.clone()  # start; the forward writes into a buffer of its own, at offset 0)
    return packed.view(dtype)


def _kernel_values(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(tensor as the kernels take it, bf16 flag): float16 and bfloat16 travel as their int16 bit patterns."""
    if flat.dtype in (torch.float16, torch.bfloat16):
        return flat.view(torch.int16), int(flat.dtype == torch.bfloat16)
    return flat, 0


class TritonLaunch(NamedTuple):
    """One launch of a Triton kernel, as the launchers below make it (:func:`triton_launches` lists them all)."""

    kernel: str  # the kernel's name in :mod:`._triton_kernels`
    grid: tuple[int]
    args: tuple
    options: dict[str, Any]  # constexprs and compile options, passed as keywords
    tensors: dict[str, str]  # pointer argument -> the tensor of :func:`.traffic.kernel_traffic` it addresses


#: the pointer arguments that address the table and the flag: constant size, read through the cache
TRITON_CACHED_ARGUMENTS = ("boundaries_ptr", "interval_codes_ptr", "levels_ptr", "nonfinite_ptr")


def _forward_launch(
    flat: torch.Tensor,
    y: torch.Tensor | None,
    boundaries: torch.Tensor,
    interval_codes: torch.Tensor,
    bits: int,
    formula: one_pass.Formula | None,
    packed: torch.Tensor,
    flag: torch.Tensor,
) -> TritonLaunch:
    """The forward kernel over the contiguous flat ``flat``: codes into ``packed``, the non-finite flag into ``flag``
    and, for a ``formula`` of :mod:`.one_pass`, y = f(x) into ``y``."""
    numel = flat.numel()
    x_arg, bf16 = _kernel_values(flat)
    y_arg = x_arg if y is None else _kernel_values(y)[0]  # (not written for CODES_ONLY)
    groups = _cdiv(numel, 8)
    activation, low, high = (formula.kernel_id, formula.low, formula.high) if formula else (one_pass.CODES_ONLY, 0, 0)
    args = (
        x_arg,
        y_arg,
        boundaries.contiguous(),
        interval_codes.to(torch.int32).contiguous(),
        _packed_words(packed, bits),
        flag,
        numel,
        groups,
        boundaries.numel(),
        activation,
        float(low),
        float(high),
        bf16,
    )
    options = {"BITS": bits, "BLOCK_GROUPS": TRITON_BLOCK_GROUPS, **_COMPILE_OPTIONS}
    tensors = {"x_ptr": "x", "y_ptr": "y", "packed_ptr": "codes"}
    return TritonLaunch("_fewbit_forward_kernel", (_cdiv(groups, TRITON_BLOCK_GROUPS),), args, options, tensors)


def _backward_launch(
    flat_grad: torch.Tensor, packed: torch.Tensor, levels: torch.Tensor, flat_out: torch.Tensor, bits: int
) -> TritonLaunch:
    """The backward kernel: ``flat_out = flat_grad * levels[code]`` (contiguous flat tensors)."""
    numel = flat_grad.numel()
    grad_arg, bf16 = _kernel_values(flat_grad)
    groups = _cdiv(numel, 8)
    args = (
        grad_arg,
        _packed_words(packed, bits),
        levels.contiguous(),
        _kernel_values(flat_out)[0],
        numel,
        groups,
        bf16,
    )
    options = {"BITS": bits, "BLOCK_GROUPS": TRITON_BLOCK_GROUPS, **_COMPILE_OPTIONS}
    tensors = {"grad_ptr": "grad", "packed_ptr": "codes", "out_ptr": "grad_x"}
    return TritonLaunch("_fewbit_backward_kernel", (_cdiv(groups, TRITON_BLOCK_GROUPS),), args, options, tensors)


def _run(launch: TritonLaunch, device: torch.device) -> None:
    kernel = getattr(_triton_kernels(device), launch.kernel)
    kernel[launch.grid](*launch.args, **launch.options)


def _codes_pass(
    flat: torch.Tensor,
    y: torch.Tensor | None,
    boundaries: torch.Tensor,
    interval_codes: torch.Tensor,
    bits: int,
    formula: one_pass.Formula | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel over the contiguous flat ``flat``: (packed codes, non-finite flag); y written if given."""
    packed = torch.empty(packed_nbytes(flat.numel(), bits), dtype=torch.uint8, device=flat.device)
    flag = torch.zeros(1, dtype=torch.int32, device=flat.device)
    if flat.numel():
        _run(_forward_launch(flat, y, boundaries, interval_codes, bits, formula, packed, flag), flat.device)
    return packed, flag


def triton_launches(numel: int = 1 << 17) -> list[tuple[str, str, int, TritonLaunch]]:
    """Every Triton launch the launchers make, on example CPU tensors of ``numel`` elements: a list of (traffic
    kernel of :func:`.traffic.kernel_traffic`, dtype, bits, launch) for each dtype the op takes and 1 to 8 bits.

    The forward kernel's float32 / float16 / bfloat16 variants hold the one-pass formulas ('forward'; a codes-only
    launch skips the y store at run time); its float64 variant computes codes only ('codes'). Binding the arguments
    as Triton does gives the compiled variants (float16 and bfloat16 share theirs).

    Args:
        numel: elements of the example tensors (a multiple of 128: the 16-byte specialisation of a training tensor)
    """
    launches = []
    table = torch.zeros(1)
    for dtype in SUPPORTED_DTYPES:
        flat = torch.zeros(numel, dtype=dtype)
        boundaries = table.to(torch.float64 if dtype == torch.float64 else torch.float32)
        codes = torch.zeros(2, dtype=torch.uint8)
        name = str(dtype).removeprefix("torch.")
        for bits in range(1, 9):
            packed = torch.zeros(packed_nbytes(numel, bits), dtype=torch.uint8)
            flag = torch.zeros(1, dtype=torch.int32)
            formula = None if dtype == torch.float64 else one_pass.Formula("gelu", one_pass.GELU)
            y = None if formula is None else torch.empty_like(flat)
            forward = _forward_launch(flat, y, boundaries, codes, bits, formula, packed, flag)
            launches.append(("codes" if formula is None else "forward", name, bits, forward))
            backward = _backward_launch(flat, packed, boundaries, torch.empty_like(flat), bits)
            launches.append(("backward", name, bits, backward))
    return launches


def quantize_triton(x: torch.Tensor, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Triton kernel of :func:`.backends.quantize_reference` (bitwise equal): the forward kernel, codes only."""
    check_input(x, boundaries, interval_codes, bits)
    packed, _ = _codes_pass(flat_contiguous(x), None, boundaries, interval_codes, bits, None)
    return packed


def forward_triton(
    x: torch.Tensor,
    native: Callable[[torch.Tensor], torch.Tensor],
    boundaries: torch.Tensor,
    interval_codes: torch.Tensor,
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``(native(x), packed codes of x, record of x's non-finite elements or None)`` on CUDA.

    One pass over x where :func:`.one_pass.formula_for` knows ``native`` and x is a contiguous float32, float16 or
    bfloat16 tensor: the kernel reads x once and writes y (torch's formula) and the codes. Else two passes: the
    codes (with the non-finite flag), then ``native(x)`` itself, whose output keeps torch's strides.

    Args:
        x: the input (CUDA, or any device under Triton's interpreter)
        native: the torch function whose value y is
        boundaries: the table's boundaries in x's compute dtype
        interval_codes: the code of each interval
        bits: bits per code, 1 to 8
    """
    check_input(x, boundaries, interval_codes, bits)
    formula = None
    if x.dtype in one_pass.SERVED_DTYPES and x.is_contiguous():
        formula = one_pass.formula_for(native)
    flat = flat_contiguous(x)
    y = torch.empty_like(flat) if formula is not None else None
    packed, flag = _codes_pass(flat, y, boundaries, interval_codes, bits, formula)
    y = y.view(x.shape) if y is not None else native(x)
    record = nonfinite_positions(flat, 0) if bool(flag) else None
    return y, packed, record


def scale_triton(grad: torch.Tensor, packed: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Triton kernel of :func:`.backends.scale_reference` (bitwise equal)."""
    numel = grad.numel()
    check_packed(packed, bits, numel)
    out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    if numel:
        _run(_backward_launch(flat_contiguous(grad), packed, levels, out.view(-1), bits), grad.device)
    return out
