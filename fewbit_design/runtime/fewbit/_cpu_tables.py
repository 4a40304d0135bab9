"""The few-bit table in the forms the numba CPU kernels read, built once per table and cached.

Terms (see :mod:`fewbit_design`): sorted ``boundaries`` cut the real line into intervals, interval m (the number of
boundaries <= x) has code ``interval_codes[m]``. The float32 kernels look the code up by the top 16 bits of x's bit
pattern (:func:`build_lut32`, :func:`direct_lut32`), the 16-bit ones by the whole pattern (:func:`build_lut16`); a
table with one boundary is a threshold (:func:`_threshold_key16` for 16-bit patterns). :func:`codes_plan` picks the
kernel of :mod:`._numba_kernels` for a (table, dtype, bits) and holds its table arguments, so that a call does no
per-call Python work on the table. The launchers are in :mod:`.backends`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from ...errors import FewBitError

__all__ = ["BRANCHLESS_SPLITS", "MULTI", "build_lut32", "direct_lut32", "build_lut16", "codes_plan"]


_LUT_CACHE: dict[tuple, Any] = {}
_LUT_CACHE_SIZE = 256
# A float32 table with more buckets holding a boundary than this runs the branchless kernel (see _numba_kernels):
# gelu has 9-20 boundaries at 3-4 bits (direct kernel, faster there), 39-353 at 5-8 bits (branchless, 3.4x faster
# at 8 bits on N(0, 1) input).
BRANCHLESS_SPLITS = 24
#: float32 tables with at most this many boundaries compute codes by compare-and-add (no lookup): one vectorised
#: pass per boundary; 9 boundaries (gelu, silu at 3 bits) took 105 us on 2^18 elements against 165 us by the LUT,
#: which wins from about 15 boundaries on (2-core dev machine, loaded, one thread, process time).
STEPS_BOUNDARIES = 12
#: The entry of :func:`build_lut32` for a bucket with several code changes (t = 0 with A != B: no other bucket has it).
MULTI = 0xFF00


def build_lut32(boundaries32: np.ndarray, interval_codes: np.ndarray) -> np.ndarray:
    """The float32 lookup table of ``quantize_pack_lut32`` (uint32[65536]).

    Bucket = top 16 bits of x's float32 bit pattern; entry = t << 16 | A << 8 | B means code = A if
    (pattern & 0xFFFF) >= t else B (t = 0 and A = B for a bucket without a boundary). A bucket holding two or more
    code changes (boundaries closer than 2^-7 relative, e.g. in silu's 8-bit table) gets the entry ``MULTI``
    (t = 0, A = 0xFF != B = 0, which no other bucket has), and its elements are resolved by a binary search over the
    boundaries: rare, so the kernels stay a table lookup for almost every element. Built by evaluating the exact
    float32 comparisons (numpy searchsorted, NaN last) at every pattern of the buckets where the interval changes.
    """
    boundaries32 = np.ascontiguousarray(boundaries32, dtype=np.float32)
    codes = np.asarray(interval_codes, dtype=np.int64)

    def intervals(patterns: np.ndarray) -> np.ndarray:
        return np.searchsorted(boundaries32, patterns.astype(np.uint32).view(np.float32), side="right")

    buckets = np.arange(65536, dtype=np.uint64) << np.uint64(16)
    first = intervals(buckets)
    last = intervals(buckets | np.uint64(0xFFFF))
    threshold = np.zeros(65536, dtype=np.uint64)
    above = codes[first].astype(np.uint64)
    below = above.copy()
    multi = np.zeros(65536, dtype=bool)
    lows = np.arange(65536, dtype=np.uint64)
    for bucket in np.nonzero(first != last)[0]:
        bucket_codes = codes[intervals((np.uint64(bucket) << np.uint64(16)) | lows)]
        changes = np.nonzero(bucket_codes[1:] != bucket_codes[:-1])[0]
        if len(changes) == 0:
            continue
        if len(changes) > 1:
            multi[bucket] = True
            continue
        threshold[bucket] = changes[0] + 1
        below[bucket] = bucket_codes[0]
        above[bucket] = bucket_codes[-1]
    entries = (threshold << np.uint64(16)) | (above << np.uint64(8)) | below
    entries[multi] = MULTI
    return entries.astype(np.uint32)


def direct_lut32(lut: np.ndarray) -> np.ndarray:
    """The bucket codes of :func:`build_lut32` (uint16[65536]): ``SPLIT`` (0x100) where a bucket holds one boundary,
    ``SPLIT_MULTI`` (0x200) where it holds several."""
    direct = np.where((lut >> 16) == 0, lut & 0xFF, 0x100).astype(np.uint16)
    direct[lut == MULTI] = 0x200
    return direct


def build_lut16(dtype: torch.dtype, boundaries32: np.ndarray, interval_codes: np.ndarray) -> np.ndarray:
    """Code of every float16 or bfloat16 bit pattern (uint8[65536]), compared in float32 (exact upcast)."""
    patterns = np.arange(65536, dtype=np.uint32)
    if dtype == torch.float16:
        values = patterns.astype(np.uint16).view(np.float16).astype(np.float32)
    elif dtype == torch.bfloat16:
        values = (patterns << np.uint32(16)).view(np.float32)
    else:
        raise FewBitError(f"build_lut16 takes float16 or bfloat16, got {dtype}")
    intervals = np.searchsorted(np.asarray(boundaries32, dtype=np.float32), values, side="right")
    return np.asarray(interval_codes, dtype=np.uint8)[intervals]


def _cached_lut(dtype: torch.dtype, boundaries: torch.Tensor, interval_codes: torch.Tensor) -> Any:
    # keyed by content (a few hundred bytes), so equal tables share a LUT and a reused address never aliases
    boundaries_np = boundaries.detach().cpu().numpy()
    codes_np = interval_codes.detach().cpu().numpy()
    key = (str(dtype), boundaries_np.tobytes(), codes_np.tobytes())
    if key not in _LUT_CACHE:
        if len(_LUT_CACHE) >= _LUT_CACHE_SIZE:
            _LUT_CACHE.clear()
        if dtype == torch.float32:
            lut = build_lut32(boundaries_np, codes_np)
            direct = direct_lut32(lut)
            _LUT_CACHE[key] = (direct, lut, int(np.count_nonzero(direct == 0x100)) > BRANCHLESS_SPLITS)
        else:
            _LUT_CACHE[key] = build_lut16(dtype, boundaries_np, codes_np)
    return _LUT_CACHE[key]


class _CodesPlan(NamedTuple):
    """What a quantize kernel needs beside x and the output, prepared once per (table, dtype, bits)."""

    kernel: Callable[..., int]
    #: the kernel that also writes y = relu(x) (for finite x), for tables with one boundary; else None
    relu_kernel: Callable[..., int] | None
    # how x enters the arguments: "lut16" / "steps16" / "threshold16" (x as uint16 patterns), "compare" (x), "lut32"
    # (x as uint16 halves first, then the LUTs, then x before the last two tables, the boundaries and codes of the
    # binary search)
    layout: str
    tables: tuple  # the arguments beside x's (before the output)
    owners: tuple  # the table tensors, held so that their addresses (part of the key) are not reused

    @property
    def sixteen(self) -> bool:
        """Whether the kernel reads x as uint16 bit patterns (float16 / bfloat16)."""
        return self.layout in ("lut16", "threshold16", "steps16")

    def arguments(self, flat: torch.Tensor, out_np: np.ndarray, y: torch.Tensor | None = None) -> tuple:
        sixteen = self.sixteen
        x_np = flat.view(torch.int16).numpy().view(np.uint16) if sixteen else flat.numpy()
        return self.arguments_np(x_np, out_np, y)

    def arguments_np(self, x_np: np.ndarray, out_np: np.ndarray, y: torch.Tensor | None = None) -> tuple:
        """:meth:`arguments` for x already as the flat numpy array the kernel reads (uint16 where :attr:`sixteen`)."""
        sixteen = self.sixteen
        if self.layout == "lut32":
            return (x_np.view(np.uint16), *self.tables[:-2], x_np, *self.tables[-2:], out_np)
        if self.layout.startswith("threshold"):  # y: written by relu_kernel only
            y_np = x_np if y is None else (y.view(torch.int16).numpy().view(np.uint16) if sixteen else y.numpy())
            return (x_np, *self.tables, y_np, out_np)
        return (x_np, *self.tables, out_np)


_PLAN_CACHE: dict[tuple, _CodesPlan] = {}


def _plan_key(dtype: torch.dtype, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int) -> tuple:
    # the tensors' addresses and version counters (an in-place change of a table tensor bumps its version); the plan
    # holds the tensors, so an address in the key cannot be reused by another table while the plan is cached
    return (
        dtype,
        bits,
        boundaries.data_ptr(),
        boundaries._version,
        boundaries.numel(),
        interval_codes.data_ptr(),
        interval_codes._version,
        interval_codes.numel(),
    )


def codes_plan(dtype: torch.dtype, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int) -> _CodesPlan:
    """The cached :class:`_CodesPlan`: a call with a table seen before does no per-call Python work on the table
    (converting it to numpy and hashing its bytes for the LUT cache cost 8 us a call, half a native GELU of 2^14)."""
    if boundaries.device.type != "cpu" or interval_codes.device.type != "cpu" or boundaries.is_inference():
        return _build_plan(dtype, boundaries, interval_codes, bits)
    key = _plan_key(dtype, boundaries, interval_codes, bits)
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        if len(_PLAN_CACHE) >= _LUT_CACHE_SIZE:
            _PLAN_CACHE.clear()
        plan = _PLAN_CACHE[key] = _build_plan(dtype, boundaries, interval_codes, bits)
    return plan


def _key16(patterns: np.ndarray) -> np.ndarray:
    """The integer key of 16-bit float patterns that grows with the value (sign flipped for positives, all bits for
    negatives; -0 and +0 get neighbouring keys): the order of ``threshold_pack16``."""
    patterns = patterns.astype(np.uint32)
    return patterns ^ np.where(patterns >> 15 == 1, 0xFFFF, 0x8000).astype(np.uint32)


def _threshold_key16(lut16: np.ndarray, above: int, exponent: int) -> int | None:
    """The key K with code = ``above`` exactly where key(x) >= K or x is NaN (``exponent``: the exponent mask), checked
    on every 16-bit pattern against the exact LUT ``lut16``; None when the codes are no such threshold."""
    patterns = np.arange(65536, dtype=np.uint32)
    nan = (patterns & 0x7FFF) > exponent
    keys = _key16(patterns)
    is_above = lut16 == above
    candidates = keys[is_above & ~nan]
    key = int(candidates.min()) if candidates.size else 0x10000  # 0x10000: only NaN is above
    return key if np.array_equal(is_above, (keys >= key) | nan) else None


def _steps_keys16(dtype: torch.dtype, lut16: np.ndarray, boundaries32: np.ndarray, interval_codes: np.ndarray):
    """The tables of ``quantize_pack_steps16`` (int16 keys, uint8 steps, first code, NaN's code), checked on all
    65536 patterns against the exact LUT ``lut16``; None where they do not reproduce it."""
    patterns = np.arange(65536, dtype=np.uint32)
    if dtype == torch.float16:
        values, exponent = patterns.astype(np.uint16).view(np.float16).astype(np.float32), 0x7C00
    else:
        values, exponent = (patterns << np.uint32(16)).view(np.float32), 0x7F80
    nan = (patterns & 0x7FFF) > exponent
    signed = (_key16(patterns) ^ 0x8000).astype(np.uint16).view(np.int16)  # the kernel's key, in signed order
    keys = []
    for boundary in np.asarray(boundaries32, dtype=np.float32):
        above = (values >= boundary) & ~nan
        if not above.any():
            return None
        key = int(signed[above].min())
        if not np.array_equal(above, (signed >= key) & ~nan):
            return None
        keys.append(key)
    keys = np.array(keys, dtype=np.int16)
    codes = np.asarray(interval_codes, dtype=np.int64)
    steps = ((codes[1:] - codes[:-1]) & 0xFF).astype(np.uint8)
    computed = (codes[0] + (signed[:, None] >= keys[None, :]).astype(np.int64) @ steps.astype(np.int64)) & 0xFF
    computed[nan] = codes[-1]
    if not np.array_equal(computed, lut16.astype(np.int64)):
        return None
    return keys, steps, np.uint8(codes[0]), np.uint8(codes[-1])


def _build_plan(dtype: torch.dtype, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int) -> _CodesPlan:
    kernels = _numba_kernels()
    owners = (boundaries, interval_codes)
    if dtype in (torch.float16, torch.bfloat16):
        lut16 = _cached_lut(dtype, boundaries, interval_codes)
        exponent = 0x7C00 if dtype == torch.float16 else 0x7F80
        if boundaries.numel() == 1:
            below, above = (int(code) for code in interval_codes.tolist())
            key = _threshold_key16(lut16, above, exponent) if below != above else 0
            if key is not None:
                tables = (key, exponent, below, above)
                relu = kernels.threshold_pack16(bits, True)
                return _CodesPlan(kernels.threshold_pack16(bits, False), relu, "threshold16", tables, owners)
        if boundaries.numel() <= STEPS_BOUNDARIES:
            boundaries_np, codes_np = boundaries.detach().cpu().numpy(), interval_codes.detach().cpu().numpy()
            tables = _steps_keys16(dtype, lut16, boundaries_np, codes_np)
            if tables is not None:
                return _CodesPlan(kernels.quantize_pack_steps16(bits), None, "steps16", (*tables, exponent), owners)
        return _CodesPlan(kernels.quantize_pack_lut16(bits), None, "lut16", (lut16, exponent), owners)
    # copies: the plan outlives no change of the table tensors (a change bumps their version, hence the key)
    boundaries_np = boundaries.detach().cpu().numpy().copy()
    codes_np = interval_codes.detach().cpu().numpy().copy()
    if dtype == torch.float32 and boundaries.numel() == 1:
        tables = (boundaries_np[0], codes_np[0], codes_np[1])
        relu = kernels.threshold_pack32(bits, True)
        return _CodesPlan(kernels.threshold_pack32(bits, False), relu, "threshold32", tables, owners)
    if dtype == torch.float32 and boundaries.numel() <= STEPS_BOUNDARIES:
        steps = ((codes_np[1:].astype(np.int64) - codes_np[:-1]) & 0xFF).astype(np.uint8)
        tables = (boundaries_np, steps, codes_np[0], codes_np[-1])
        return _CodesPlan(kernels.quantize_pack_steps32(bits), None, "compare", tables, owners)
    # the float32 tables read the high half of each element: little-endian only (else the compare kernel)
    if dtype == torch.float32 and sys.byteorder == "little":
        direct, lut32, branchless = _cached_lut(dtype, boundaries, interval_codes)
        if branchless:  # the direct table is not read
            kernel = kernels.quantize_pack_lut32_branchless(bits)
            return _CodesPlan(kernel, None, "lut32", (lut32, boundaries_np, codes_np), owners)
        if bits < 8:  # a uint8 table with a free marker (RESOLVE): the kernel that lists the rare buckets
            buckets = np.arange(65536)
            resolve = (direct >= 0x100) | ((buckets & 0x7F80) == 0x7F80)
            direct8 = np.where(resolve, kernels.RESOLVE, direct).astype(np.uint8)
            kernel = kernels.quantize_pack_lut32_fixup(bits)
            return _CodesPlan(kernel, None, "lut32", (direct8, direct, lut32, boundaries_np, codes_np), owners)
        kernel = kernels.quantize_pack_lut32(bits)
        return _CodesPlan(kernel, None, "lut32", (direct, lut32, boundaries_np, codes_np), owners)
    return _CodesPlan(kernels.quantize_pack_compare, None, "compare", (boundaries_np, codes_np, bits), owners)


@functools.cache
def _numba_kernels():
    from . import _numba_kernels  # lazily: importing it loads numba

    return _numba_kernels
