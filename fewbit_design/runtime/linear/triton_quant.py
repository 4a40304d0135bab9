"""The Triton launchers of the group quantizer (CUDA; CPU tensors under ``TRITON_INTERPRET=1``), and the list of
every launch they make.

:func:`quantize_groups_triton` and :func:`dequantize_groups_triton` are the kernels (:mod:`._triton_quant`) of
:func:`.quant.quantize_groups_reference` and :func:`.quant.dequantize_groups_reference`, bitwise equal to them:
one pass each (x read once, the codes and scales written; the codes and scales read once, the values written).
They serve rows whose features and group size are multiples of 8 (every group then starts a packing group of 8
codes) with a group size of at most :data:`MAX_GROUP_SIZE` (:func:`kernel_serves`); :mod:`.quant` runs the
reference for other shapes. :func:`triton_launches` lists the launches for the test that compiles each one for real
GPU targets and checks its PTX against :mod:`..fewbit.traffic` (tests/runtime/fewbit/test_triton_compile.py).
Triton itself is imported only when a kernel runs.
"""

from __future__ import annotations

import contextlib

import torch

from ...errors import FewBitError
from .._packing import packed_nbytes
from ..fewbit.triton_launch import TritonLaunch, _cdiv, _interpreted, _kernel_values, _packed_words

__all__ = [
    "MAX_GROUP_SIZE",
    "TRITON_BLOCK_ELEMENTS",
    "kernel_serves",
    "quantize_groups_triton",
    "dequantize_groups_triton",
    "triton_launches",
]

#: elements of a program's block: groups of a power-of-2 size up to this share a program (8 per thread of 4 warps)
TRITON_BLOCK_ELEMENTS = 1024
#: the largest group size the kernels take (one group's values are in registers)
MAX_GROUP_SIZE = 4096
#: compile options: the quantizer's arithmetic rounds after every operation, as torch does (no FMA contraction);
#: the decoder's one FMA is written out
_COMPILE_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False, "enable_reflect_ftz": False}


def kernel_serves(features: int, group_size: int) -> bool:
    """Whether the Triton kernels take rows of ``features`` values in groups of ``group_size``: both multiples of 8
    (each group's codes are whole packing words) and ``group_size <= MAX_GROUP_SIZE``.

    Args:
        features: values per row
        group_size: values per group
    """
    return features > 0 and features % 8 == 0 and 0 < group_size <= MAX_GROUP_SIZE and group_size % 8 == 0


def _check_served(features: int, group_size: int) -> None:
    if not kernel_serves(features, group_size):
        raise FewBitError(
            f"the group quantizer's Triton kernels take a positive feature count and a group size that are "
            f"multiples of 8, the group size at most {MAX_GROUP_SIZE}, got {features} features in groups of "
            f"{group_size} (quant.quantize_groups runs the reference for these)"
        )


def _block_shape(group_size: int) -> dict[str, int]:
    """The constexprs of a group size: the group as WORDS words of 8 (a power of 2), BLOCK_GROUPS groups a
    program."""
    block = 8
    while block < group_size:
        block *= 2
    return {"GROUP_SIZE": group_size, "WORDS": block // 8, "BLOCK_GROUPS": max(1, TRITON_BLOCK_ELEMENTS // block)}


def _kernels(device: torch.device):
    """The Triton kernels module, for tensors on ``device``: CUDA, or any device under Triton's interpreter."""
    from . import _triton_quant

    if device.type != "cuda" and not _interpreted(_triton_quant._group_quantize_forward_kernel):
        raise FewBitError(
            f"the group quantizer's Triton kernels run on CUDA tensors, got {device.type} tensors (Triton's "
            "interpreter runs them on the CPU only when TRITON_INTERPRET=1 is set before they are imported)"
        )
    return _triton_quant


def _run(launch: TritonLaunch, device: torch.device) -> None:
    kernel = getattr(_kernels(device), launch.kernel)
    # Triton launches on the current CUDA device: make it the tensors' own
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[launch.grid](*launch.args, **launch.options)


def _seed_words(seed: int) -> tuple[int, int]:
    """The seed's low and high 32 bits as int32 bit patterns (one int32 kernel argument each, whatever the seed)."""
    low, high = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return tuple(word - (1 << 32) if word >= 1 << 31 else word for word in (low, high))


def _quantize_launch(
    rows2d: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group_size: int,
    stochastic: bool,
    seed: int,
) -> TritonLaunch:
    """The quantizer over ``rows2d`` (rows x features, unit column stride, float32 / float16 / bfloat16)."""
    rows, features = rows2d.shape
    groups_per_row = _cdiv(features, group_size)
    x_arg, bf16 = _kernel_values(rows2d)
    seed_low, seed_high = _seed_words(int(seed))
    num_groups = rows * groups_per_row
    args = (
        x_arg,
        _packed_words(packed, bits),
        scales,
        num_groups,
        groups_per_row,
        features,
        rows2d.stride(0),
        int(bool(stochastic)),
        seed_low,
        seed_high,
        bf16,
    )
    options = {"BITS": bits, **_block_shape(group_size), **_COMPILE_OPTIONS}
    tensors = {"x_ptr": "x", "packed_ptr": "codes", "scales_ptr": "scales"}
    grid = (_cdiv(num_groups, options["BLOCK_GROUPS"]),)
    return TritonLaunch("_group_quantize_forward_kernel", grid, args, options, tensors)


def _dequantize_launch(
    packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int, group_size: int
) -> TritonLaunch:
    """The decoder into the contiguous ``out`` (rows x features, float32 / float16 / bfloat16)."""
    rows, features = out.shape
    groups_per_row = _cdiv(features, group_size)
    out_arg, bf16 = _kernel_values(out)
    num_groups = rows * groups_per_row
    args = (_packed_words(packed, bits), scales, out_arg, num_groups, groups_per_row, features, bf16)
    options = {"BITS": bits, **_block_shape(group_size), **_COMPILE_OPTIONS}
    tensors = {"packed_ptr": "codes", "scales_ptr": "scales", "out_ptr": "y"}
    grid = (_cdiv(num_groups, options["BLOCK_GROUPS"]),)
    return TritonLaunch("_group_dequantize_forward_kernel", grid, args, options, tensors)


def _kernel_rows(x: torch.Tensor, features: int) -> torch.Tensor:
    """x as the quantizer reads it: (rows, features) with unit column stride (a view where one exists), float32
    unless float16 or bfloat16 (float64 is quantized in float32, as the reference does)."""
    rows2d = x.detach().reshape(-1, features)
    if rows2d.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        rows2d = rows2d.to(torch.float32)
    return rows2d if rows2d.stride(1) == 1 or rows2d.shape[1] == 1 else rows2d.contiguous()


def quantize_groups_triton(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.quant.quantize_groups` with the Triton kernel, bitwise :func:`.quant.quantize_groups_reference`, for
    a shape that :func:`kernel_serves`.

    Args:
        x: the values, features last (CUDA, or any device under Triton's interpreter)
        bits: bits per code, 2 to 8
        group_size: values per group along the features
        stochastic: stochastic rounding (unbiased) instead of nearest
        seed: the seed of the stochastic rounding, 0 to 2**63 - 1
    """
    features = x.shape[-1] if x.dim() else 1
    _check_served(features, group_size)
    rows2d = _kernel_rows(x, features)
    rows = rows2d.shape[0]
    packed = torch.empty(packed_nbytes(rows * features, bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, _cdiv(features, group_size), 2, dtype=torch.float32, device=x.device)
    if rows:
        _run(_quantize_launch(rows2d, packed, scales, bits, group_size, stochastic, seed), x.device)
    return packed, scales


def dequantize_groups_triton(
    packed: torch.Tensor, scales: torch.Tensor, features: int, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`.quant.dequantize_groups` with the Triton kernel, bitwise :func:`.quant.dequantize_groups_reference`,
    for a shape that :func:`kernel_serves`.

    Args:
        packed: the packed codes from :func:`quantize_groups_triton`
        scales: its (low, step) per group
        features: the feature count (the last dimension)
        bits: bits per code, 2 to 8
        group_size: values per group
        dtype: the dtype of the result
    """
    _check_served(features, group_size)
    rows = scales.shape[0]
    if packed.numel() != packed_nbytes(rows * features, bits) or scales.shape[1] != _cdiv(features, group_size):
        raise FewBitError(
            f"codes of {rows} rows of {features} features at {bits} bits in groups of {group_size} are "
            f"{packed_nbytes(rows * features, bits)} bytes and ({rows}, {_cdiv(features, group_size)}, 2) scales, "
            f"got {packed.numel()} bytes and scales of shape {tuple(scales.shape)}"
        )
    kernel_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32
    out = torch.empty(rows, features, dtype=kernel_dtype, device=scales.device)
    codes = packed.detach().reshape(-1).contiguous()
    group_scales = scales.detach().to(torch.float32).contiguous()
    if rows:
        _run(_dequantize_launch(codes, group_scales, out, bits, group_size), scales.device)
    return out if out.dtype == dtype else out.to(dtype)


def triton_launches(group_size: int, rows: int = 256, features: int = 512) -> list[tuple[str, str, int, TritonLaunch]]:
    """Every compiled variant the launchers make for ``group_size``, on example CPU tensors: a list of (traffic kernel
    of :func:`..fewbit.traffic.kernel_traffic`, dtype, bits, launch) for float32, float16 and bfloat16 and 2 to 8
    bits. float16 and bfloat16 share their variants; the rounding and the seed are run-time arguments.

    Args:
        group_size: values per group (the runtime's default: :data:`.quant.GROUP_SIZE`)
        rows: rows of the example tensors
        features: features of the example tensors (a multiple of 16 and of the group size: the 16-byte
            specialisation of a training tensor)
    """
    launches = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.zeros(rows, features, dtype=dtype)
        scales = torch.zeros(rows, _cdiv(features, group_size), 2)
        name = str(dtype).removeprefix("torch.")
        for bits in range(2, 9):
            packed = torch.zeros(packed_nbytes(x.numel(), bits), dtype=torch.uint8)
            launch = _quantize_launch(x, packed, scales, bits, group_size, True, 0)
            launches.append(("group_quantize", name, bits, launch))
            launch = _dequantize_launch(packed, scales, torch.empty_like(x), bits, group_size)
            launches.append(("group_dequantize", name, bits, launch))
    return launches
