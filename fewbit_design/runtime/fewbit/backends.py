"""The backends of the few-bit op: the table as tensors, the pure-torch reference, the numba launchers, and the
dispatch that picks one by device (the Triton launchers are in :mod:`.triton_launch`, the shared checks in
:mod:`._inputs`).

Terms (see :mod:`fewbit_design`): sorted ``boundaries`` cut the real line into intervals, interval m (the number of
boundaries <= x) has code ``interval_codes[m]`` in [0, 2**bits), and code c has level ``levels[c]``; the
derivative is approximated by q(x) = levels[code(x)]. ``quantize`` packs the codes of x (``ceil(n / 8) * bits``
bytes, layout in :mod:`.._packing`); ``scale`` returns ``grad * levels[code]`` computed in float32 (float64 for
float64 gradients), in grad's dtype. The code of x is found by comparing x with the boundaries in the compute dtype
(float64 for float64 x, else float32: float16 and bfloat16 upcast exactly); boundaries are rounded *up* to float32,
so ``x >= float32(b)`` holds exactly when ``x >= b`` does.

Layers: ``quantize_reference`` / ``scale_reference`` (pure torch, any device: the oracle), numba CPU kernels
(:mod:`._numba_kernels`), Triton kernels (:mod:`._triton_kernels`, launched by :mod:`.triton_launch`); the
launchers ``quantize`` / ``scale`` pick one by device (CUDA -> Triton, CPU -> numba, else reference;
``FEWBIT_BACKEND`` or :func:`use_backend` force one). The custom ops and the autograd entry point that use them are
in :mod:`.ops`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from ...errors import FewBitError, check_choice
from ...table import Table
from .._packing import pack_reference, packed_nbytes, unpack_reference
from ..memory import count_storage
from ._cpu_tables import BRANCHLESS_SPLITS, MULTI, build_lut16, build_lut32, codes_plan, direct_lut32
from ._inputs import BACKEND_ENV, SUPPORTED_DTYPES, check_input, check_packed, flat_contiguous, nonfinite_positions
from .lookup import check_kernel_table
from .triton_launch import forward_triton, quantize_triton, scale_triton

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "SUPPORTED_DTYPES",
    "TableTensors",
    "table_tensors",
    "encode_table",
    "decode_table",
    "boundaries_float32",
    "build_lut32",
    "direct_lut32",
    "MULTI",
    "BRANCHLESS_SPLITS",
    "build_lut16",
    "quantize_reference",
    "scale_reference",
    "quantize_numba",
    "forward_numba",
    "scale_numba",
    "quantize_triton",
    "forward_triton",
    "scale_triton",
    "quantize",
    "scale",
    "use_backend",
    "backend_for",
]

BACKENDS = ("auto", "reference", "numba", "triton")


# ----------------------------------------------------------------------------------------------------------------------
# Table tensors


class TableTensors(NamedTuple):
    """A table as tensors on one device, in both compute dtypes (all constant size)."""

    bits: int
    boundaries32: torch.Tensor  # float32, each boundary rounded up to the next float32
    boundaries64: torch.Tensor  # float64, exact
    interval_codes: torch.Tensor  # uint8, one code per interval
    levels32: torch.Tensor  # float32 (round to nearest)
    levels64: torch.Tensor  # float64, exact

    def for_input(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(boundaries, levels) in the compute dtype of an input of ``dtype``."""
        if dtype == torch.float64:
            return self.boundaries64, self.levels64
        return self.boundaries32, self.levels32


def boundaries_float32(boundaries: np.ndarray) -> np.ndarray:
    """Each boundary rounded up to the smallest float32 >= it: ``x >= result`` iff ``x >= boundary`` for float32 x.

    >>> boundaries_float32(np.array([0.1, 0.5])).tolist() == [np.float32(0.1).item(), 0.5]
    True
    """
    exact = np.asarray(boundaries, dtype=np.float64)
    with np.errstate(over="ignore"):  # beyond the float32 range: inf, then the comparison below keeps it right
        rounded = exact.astype(np.float32)
    below = rounded.astype(np.float64) < exact
    rounded[below] = np.nextafter(rounded[below], np.float32(np.inf))
    return rounded


def _check_table(table: Any) -> Table:
    if not isinstance(table, Table):
        raise FewBitError(f"expected a fewbit_design.table.Table, got {type(table).__name__}")
    return check_kernel_table(table)


def encode_table(table: Table) -> dict[str, torch.Tensor]:
    """The table as CPU *integer* tensors (float bit patterns), to be registered as module buffers.

    Integer buffers are left alone by ``module.half()`` / ``module.to(torch.bfloat16)``, which would otherwise round
    boundaries and levels; :func:`decode_table` views them back as floats.
    """
    _check_table(table)
    return {
        "boundaries32": torch.from_numpy(boundaries_float32(table.boundaries).view(np.int32).copy()),
        "boundaries64": torch.from_numpy(table.boundaries.astype(np.float64).view(np.int64).copy()),
        "interval_codes": torch.from_numpy(table.codes.astype(np.uint8)),
        "levels32": torch.from_numpy(table.levels.astype(np.float32).view(np.int32).copy()),
        "levels64": torch.from_numpy(table.levels.astype(np.float64).view(np.int64).copy()),
    }


def decode_table(bits: int, encoded: dict[str, torch.Tensor]) -> TableTensors:
    """Float views of :func:`encode_table`'s tensors (no copy; traceable by ``torch.compile``)."""
    return TableTensors(
        bits,
        encoded["boundaries32"].view(torch.float32),
        encoded["boundaries64"].view(torch.float64),
        encoded["interval_codes"],
        encoded["levels32"].view(torch.float32),
        encoded["levels64"].view(torch.float64),
    )


_TENSOR_CACHE: weakref.WeakKeyDictionary[Table, dict[str, TableTensors]] = weakref.WeakKeyDictionary()
_TENSOR_CACHE_LOCK = threading.Lock()


def table_tensors(table: Table, device: torch.device | str | None = None) -> TableTensors:
    """The table's tensors on ``device`` (default CPU), converted once per (table, device) and cached."""
    _check_table(table)
    device = torch.device(device if device is not None else "cpu")
    key = str(device)
    with _TENSOR_CACHE_LOCK:
        per_device = _TENSOR_CACHE.setdefault(table, {})
        if key not in per_device:
            # normal tensors even under torch.inference_mode: the cache outlives the block, and inference tensors
            # cannot be saved for backward in training later
            with torch.inference_mode(False):
                encoded = {name: tensor.to(device) for name, tensor in encode_table(table).items()}
                per_device[key] = decode_table(int(table.bits), encoded)
        return per_device[key]


# ----------------------------------------------------------------------------------------------------------------------
# Pure-torch reference (the oracle; any device)


def quantize_reference(
    x: torch.Tensor, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int
) -> torch.Tensor:
    """Packed codes of x (flattened in contiguous order): uint8, ``ceil(numel / 8) * bits`` bytes."""
    check_input(x, boundaries, interval_codes, bits)
    flat = x.detach().reshape(-1).to(boundaries.dtype).contiguous()
    # interval = number of boundaries <= x (searchsorted right); NaN goes to the last interval
    interval = torch.searchsorted(boundaries, flat, right=True)
    interval = torch.where(torch.isnan(flat), boundaries.numel(), interval)
    codes = interval_codes.to(torch.int64)[interval]
    return pack_reference(codes, bits)


def scale_reference(grad: torch.Tensor, packed: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    """grad * levels[code] computed in the dtype of ``levels``, returned in grad's dtype and shape (contiguous).

    A zero level gives +0 whatever grad is (torch's backward *selects* 0 there: relu, hardtanh, hardshrink, ...),
    not grad * 0, which is -0 for a negative grad and NaN for a non-finite one.
    """
    codes = unpack_reference(packed, bits, grad.numel())
    selected = levels[codes]
    product = grad.detach().reshape(-1).to(levels.dtype) * selected
    product = torch.where(selected == 0, torch.zeros((), dtype=levels.dtype, device=product.device), product)
    return product.to(grad.dtype).reshape(grad.shape)


# ----------------------------------------------------------------------------------------------------------------------
# numba CPU kernels


@functools.cache
def _numba_kernels():
    # cached: a function-level import statement costs microseconds a call (the fixed cost of a small forward)
    from . import _numba_kernels

    return _numba_kernels


# Outputs of at least this many bytes are allocated by numpy and shared with torch (torch.from_numpy): numpy asks the
# kernel for transparent huge pages on large arrays (madvise), so first touching a 64 MiB gradient costs ~512x fewer
# page faults. Measured on the 2-core dev machine, 2^24 float32: allocate + fill 28.6 ms with torch.empty, 13.8 ms
# with np.empty (benchmarks/runtime_speed.py shows it as the backward time).
_NUMPY_ALLOCATION_BYTES = 1 << 22


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.uint8)


def _empty_cpu(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor; large ones live in numpy memory (huge pages, see above)."""
    if numel * dtype.itemsize >= _NUMPY_ALLOCATION_BYTES and dtype in _NUMPY_DTYPES:
        return _counted(torch.from_numpy(np.empty(numel, dtype=torch.empty((), dtype=dtype).numpy().dtype)))
    return torch.empty(numel, dtype=dtype)


def _counted(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, made over numpy memory (no operator returned it), counted by the open ``memory.peak`` blocks."""
    count_storage(tensor)
    return tensor


def _codes_kernel(
    flat: torch.Tensor, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int, out_np: np.ndarray
) -> tuple[Callable[..., int], tuple]:
    """The numba quantize kernel for ``flat`` (a flat contiguous CPU tensor) and its arguments before (start, stop):
    ``kernel(*args, start, stop)`` packs the codes of ``flat[start:stop]`` into ``out_np`` (start a multiple of 8) and
    returns the number of non-finite elements there."""
    plan = codes_plan(flat.dtype, boundaries, interval_codes, bits)
    return plan.kernel, plan.arguments(flat, out_np)


def _zero_padding(out_np: np.ndarray, numel: int, bits: int) -> None:
    if bits == 8:  # the 8-bit kernels write codes in place, one per byte: zero the last group's padding bytes
        out_np[numel:] = 0


def _codes_numba(
    x: torch.Tensor, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int
) -> tuple[torch.Tensor, int]:
    """(packed codes of x, number of non-finite elements of x), the codes split over the kernel threads."""
    check_input(x, boundaries, interval_codes, bits)
    if x.device.type != "cpu":
        raise FewBitError(f"the numba backend runs on CPU tensors, got a tensor on {x.device}")
    numel = x.numel()
    out = _empty_cpu(packed_nbytes(numel, bits), torch.uint8)
    if numel == 0:
        return out, 0
    out_np = out.numpy()
    kernel, args = _codes_kernel(flat_contiguous(x), boundaries, interval_codes, bits, out_np)
    nonfinite = _numba_kernels().run(kernel, numel, *args)
    _zero_padding(out_np, numel, bits)
    return out, int(nonfinite)


def quantize_numba(x: torch.Tensor, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int) -> torch.Tensor:
    """numba CPU kernel of :func:`quantize_reference` (bitwise equal)."""
    return _codes_numba(x, boundaries, interval_codes, bits)[0]


#: Elements per block of the blocked CPU forward (:func:`forward_numba`): a multiple of CHUNK and of every SIMD width
#: torch uses, large enough that the per-block Python cost (two kernel calls, a copy) stays a few percent of the
#: native op, small enough that the block is still in L2 (x and y: 2 MiB in float32) when the native op reads it.
FORWARD_BLOCK = 1 << 18
#: Inputs of fewer bytes run the codes over all of x, then the native op: x is still in the last-level cache when the
#: second pass reads it, and a block costs a temporary output and its copy into y. Measured on the 2-core dev machine
#: (32 MiB L3, loaded, one thread, GELU 3 bits, median of 9 interleaved rounds): at 2^22 float32 the blocks took 3.7x
#: native against 1.9x for the two passes, at 2^24 float32 1.00x against 1.37x.
FORWARD_BLOCKED_BYTES = 32 << 20
# torch runs a one-element tensor through its scalar loop (stride 0), while the same element at the end of a longer
# tensor takes the vector loop's tail, and the two differ in the last bit for gelu, silu, ...: a remainder shorter
# than two vectors of the widest SIMD (64 elements) is processed with the block before it.
_VECTOR_TAIL = 64


def forward_numba(
    x: torch.Tensor,
    native: Callable[[torch.Tensor], torch.Tensor],
    boundaries: torch.Tensor,
    interval_codes: torch.Tensor,
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(native(x), packed codes of x, the non-finite record of x) on CPU, x read from memory once.

    The record is None when every element is finite (the kernels count non-finite elements from the loads they make
    anyway), else (positions, values) as :func:`~.ops.nonfinite_record` gives them; like the codes, it is taken before
    ``native`` sees the elements (a user fn might work in place).

    With one torch thread and a contiguous x of at least :data:`FORWARD_BLOCKED_BYTES`, x is processed in blocks of
    :data:`FORWARD_BLOCK` elements: the codes of the block (which loads it into cache), then ``native`` on the block,
    written into y. Blocks start at multiples of every vector width, as torch's own serial loop does, so every
    element takes the same (vector or scalar) path as in ``native(x)``: y is bitwise ``native(x)`` (torch's scalar
    and vector paths differ in the last bit for gelu, silu, sigmoid, ...). With several torch threads, torch cuts
    ``native(x)`` at op-specific places (gelu's grain differs from sigmoid's), which blocks cannot follow exactly:
    there, as for smaller and non-contiguous inputs (y keeps native's strides), the codes run first over all of x
    (split over the kernel threads), then ``native(x)`` once.
    """
    numel = x.numel()
    fused = _forward_relu(x, native, boundaries, interval_codes, bits)
    if fused is not None:
        return fused
    small = numel * x.element_size() < FORWARD_BLOCKED_BYTES
    if small or torch.get_num_threads() > 1 or not x.is_contiguous() or numel <= FORWARD_BLOCK:
        return _forward_two_passes(x, native, boundaries, interval_codes, bits)
    check_input(x, boundaries, interval_codes, bits)
    packed = _empty_cpu(packed_nbytes(numel, bits), torch.uint8)
    out_np = packed.numpy()
    kernel, args = _codes_kernel(x.detach().reshape(-1), boundaries, interval_codes, bits, out_np)
    x_flat = x.view(-1)
    y_flat = None
    records = []
    start = 0
    while start < numel:
        stop = start + FORWARD_BLOCK
        if numel - stop < _VECTOR_TAIL:  # the last few elements join the last block (see _VECTOR_TAIL)
            stop = numel
        if kernel(*args, start, stop):
            records.append(nonfinite_positions(x_flat[start:stop].detach(), start))
        block = native(x_flat[start:stop])
        if y_flat is None:
            y_flat = _empty_cpu(numel, block.dtype)
        y_flat[start:stop].copy_(block)
        start = stop
    _zero_padding(out_np, numel, bits)
    record = None
    if records:
        record = (torch.cat([r[0] for r in records]), torch.cat([r[1] for r in records]))
    return y_flat.view(x.shape), packed, record


def _forward_two_passes(
    x: torch.Tensor,
    native: Callable[[torch.Tensor], torch.Tensor],
    boundaries: torch.Tensor,
    interval_codes: torch.Tensor,
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`forward_numba` as the codes of all of x (split over the kernel threads), then ``native(x)``.

    The fixed cost of a call: the calls :func:`_codes_numba` makes, without the ones that repeat work
    done once per table (the plan, cached) or per call here (flattening x once, for the codes and the record).
    """
    check_input(x, boundaries, interval_codes, bits)
    if not x.is_cpu:
        raise FewBitError(f"the numba backend runs on CPU tensors, got a tensor on {x.device}")
    numel = x.numel()
    if numel == 0:
        return native(x), torch.empty(0, dtype=torch.uint8), None
    plan = codes_plan(x.dtype, boundaries, interval_codes, bits)
    # numpy arrays throughout (a numpy call costs a fifth of a torch call): x as numpy, flattened by numpy (copied
    # only where x is not contiguous), the codes written into numpy memory that torch then shares
    detached = x.detach()
    x_np = detached.view(torch.int16).numpy().view(np.uint16) if plan.sixteen else detached.numpy()
    x_np = np.ascontiguousarray(x_np.reshape(-1))  # (a 1-D strided x stays strided through reshape)
    out_np = np.empty(packed_nbytes(numel, bits), dtype=np.uint8)
    nonfinite = _numba_kernels().run(plan.kernel, numel, *plan.arguments_np(x_np, out_np))
    if bits == 8:
        out_np[numel:] = 0
    record = nonfinite_positions(detached.reshape(-1), 0) if nonfinite else None
    packed = _counted(torch.from_numpy(out_np))  # (counted now: the codes are alive while native(x) runs)
    return native(x), packed, record


def fused_relu(function: Callable) -> Callable:
    """Mark ``function`` (a module's native) as torch's relu, whose CPU forward :func:`forward_numba` may compute
    in the codes kernel's pass (``torch.relu`` and ``F.relu`` are recognised as they are)."""
    function.fewbit_fused_relu = True
    return function


def _is_relu(native: Callable) -> bool:
    return getattr(native, "fewbit_fused_relu", False) or native is torch.relu or native is torch.nn.functional.relu


def _forward_relu(
    x: torch.Tensor, native: Callable, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None:
    """:func:`forward_numba` for relu and a table with one boundary (the shipped relu tables: code = x > 0): y and
    the codes in one pass over x, by a kernel that LLVM vectorises; None where it does not apply.

    For finite x, relu is +0 below 0 and x elsewhere (-0 stays -0) in every dtype and at every size; torch's NaN
    results are not (bfloat16 keeps a NaN's payload in the scalar loop of short tensors and returns 0xFFFF in the
    vector loop), so when x holds a non-finite element, y is ``native(x)`` itself (one more pass, in that rare case).
    """
    # one boundary first: the fused kernels exist only for such tables, and that test is the cheapest (the fixed
    # cost of every other table's call)
    if boundaries.numel() != 1 or not _is_relu(native) or x.dtype == torch.float64 or not x.is_contiguous():
        return None
    if x.numel() == 0:
        return None
    check_input(x, boundaries, interval_codes, bits)
    plan = codes_plan(x.dtype, boundaries, interval_codes, bits)
    if plan.relu_kernel is None:
        return None
    numel = x.numel()
    packed = _empty_cpu(packed_nbytes(numel, bits), torch.uint8)
    y = _empty_cpu(numel, x.dtype)
    flat = x.detach().view(-1)
    out_np = packed.numpy()
    nonfinite = _numba_kernels().run(plan.relu_kernel, numel, *plan.arguments(flat, out_np, y))
    _zero_padding(out_np, numel, bits)
    if nonfinite:
        return native(x), packed, nonfinite_positions(flat, 0)
    return y.view(x.shape), packed, None


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's numpy view (``detach`` only where it records autograd: each torch call is ~1 us of the fixed
    cost of a small call)."""
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()


def scale_numba(grad: torch.Tensor, packed: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    """numba CPU kernel of :func:`scale_reference` (bitwise equal)."""
    if not grad.is_cpu:
        raise FewBitError(f"the numba backend runs on CPU tensors, got a tensor on {grad.device}")
    numel = grad.numel()
    check_packed(packed, bits, numel)
    if numel == 0:
        return torch.empty_like(grad, memory_format=torch.contiguous_format)
    kernels = _numba_kernels()
    levels_np = _numpy(levels.cpu())
    packed_np = _numpy(packed)
    detached = grad.detach()
    if grad.dtype == levels.dtype:
        # grad through numpy (flattened there, copied only where grad is not contiguous), as the forward reads x
        grad_np = np.ascontiguousarray(detached.numpy().reshape(-1))
        out = _empty_cpu(numel, grad.dtype)
        kernels.run(kernels.unpack_scale(bits), numel, grad_np, packed_np, levels_np, out.numpy())
        return out.view(grad.shape)
    # float16 / bfloat16 gradients: read and written as 16-bit patterns, computed in float32 in the kernel and
    # rounded once as torch rounds (no float32 copy of the gradient, which would cost memory and a second pass)
    out = torch.empty(numel, dtype=grad.dtype)
    bfloat = grad.dtype == torch.bfloat16
    kernel = kernels.unpack_scale16(bits, bfloat)
    decode = _FLOAT16_VALUES if bfloat else _float16_values()
    grad_bits = np.ascontiguousarray(detached.view(torch.int16).numpy().reshape(-1)).view(np.uint16)
    out_bits = out.view(torch.int16).numpy().view(np.uint16)
    kernels.run(kernel, numel, grad_bits, packed_np, levels_np, decode, out_bits)
    return out.view(grad.shape)


_FLOAT16_VALUES = np.zeros(1, dtype=np.float32)  # bfloat16 needs no table (its value is the pattern << 16)


@functools.cache
def _float16_values() -> np.ndarray:
    """The float32 value of every float16 bit pattern (float32[65536], exact)."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------------
# Dispatch


class _Forced(threading.local):
    name: str | None = None  # a class default: a missing attribute of a threading.local costs 1 us (an exception)


_forced = _Forced()


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force a backend ('reference', 'numba', 'triton' or 'auto') inside the block (this thread), e.g. in tests.

    Outside any block the ``FEWBIT_BACKEND`` environment variable decides (default 'auto': CUDA -> Triton,
    CPU -> numba, other devices -> reference; a backend that cannot be imported falls back to the reference).
    """
    if name is not None:
        check_choice("backend", name, BACKENDS)
    previous = _forced.name
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous


@functools.cache
def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# The environment as CPython keeps it (os.environ's own mapping, which os.environ[...] = and monkeypatch.setenv
# update): one dict probe a call instead of os.environ.get (1.3 us: the key is encoded on every call), so that a
# change of FEWBIT_BACKEND still takes effect at the next call. Elsewhere, os.environ itself.
_ENVIRON = getattr(os.environ, "_data", None)
_ENVIRON_KEY = os.environ.encodekey(BACKEND_ENV) if _ENVIRON is not None and hasattr(os.environ, "encodekey") else None


def _environment_backend() -> str:
    if _ENVIRON_KEY is None:
        return os.environ.get(BACKEND_ENV, "auto") or "auto"
    raw = _ENVIRON.get(_ENVIRON_KEY)
    return "auto" if raw is None else (os.environ.decodevalue(raw) or "auto")


def backend_for(device: torch.device) -> str:
    """The backend that runs for tensors on ``device`` (see :func:`use_backend`)."""
    name = _forced.name or _environment_backend()
    if name == "auto":  # the common case first (this runs on every call)
        kind = device.type
        if kind == "cpu":
            return "numba" if _importable("numba") else "reference"
        return "triton" if kind == "cuda" and _importable("triton") else "reference"
    if name not in BACKENDS:  # (checked only when wrong)
        check_choice(f"backend ({BACKEND_ENV})", name, BACKENDS)
    if name in ("numba", "triton") and not _importable(name):
        raise FewBitError(
            f"backend {name!r} ({BACKEND_ENV} or use_backend) needs {name}, which is not installed: "
            f"pip install {name}, or use 'auto' (falls back to the pure-torch reference)"
        )
    return name


_QUANTIZE = {"reference": quantize_reference, "numba": quantize_numba, "triton": quantize_triton}
_SCALE = {"reference": scale_reference, "numba": scale_numba, "triton": scale_triton}


def quantize(x: torch.Tensor, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes of x with the backend for x's device."""
    return _QUANTIZE[backend_for(x.device)](x, boundaries, interval_codes, bits)


def scale(grad: torch.Tensor, packed: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    """grad * levels[code] with the backend for grad's device."""
    return _SCALE[backend_for(grad.device)](grad, packed, levels, bits)
