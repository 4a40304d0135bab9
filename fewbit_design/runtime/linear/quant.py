"""K-bit group quantization of a linear layer's saved input: per-group affine codes, stochastic or nearest rounding.

Terms. A tensor ``x`` of shape (..., features) is read as ``rows`` rows of ``features`` values; each row is cut
along the feature dimension into ``groups = ceil(features / group_size)`` *groups* of ``group_size`` consecutive
values (the last one shorter when ``group_size`` does not divide ``features``). Group g of a row has its
``low = min`` and ``high = max`` and the *step* ``(high - low) / (2**bits - 1)``; a value's *code* is its position on
the grid ``low + k * step`` (k = 0 .. 2**bits - 1), and it decodes to ``low + code * step``. The *scales* tensor
(float32, shape (rows, groups, 2)) holds ``(low, step)`` per group: 8 bytes per group.

Rounding. ``t = (x - low) / step`` lies in [0, 2**bits - 1]. ``nearest``: code = floor(t + 1/2), so
``|decode - x| <= step / 2``. ``stochastic``: code = floor(t + u) with u ~ U[0, 1) drawn per element, so
``E[decode] = x`` (unbiased: a gradient that is linear in the decoded values is unbiased too) and
``|decode - x| < step``, with variance ``frac(t) (1 - frac(t)) step**2 <= step**2 / 4``. The grid ends are the
group's extremes, so no value is ever clipped and the bounds hold for every element. A constant group
(``step == 0``) decodes exactly. Arithmetic runs in float32 (float64 input is quantized in float32 too: the rounding
of float32 is 2**-24 relative, far below one step at 8 bits, 2**-8 of the range). Non-finite values make their
group's step or low non-finite, so the whole group decodes to NaN: never a finite value from a non-finite input.

Storage: the codes go through the project's packing (:mod:`fewbit_design.runtime._packing`, ``ceil(n / 8) * bits``
bytes for n = rows * features codes, row-major), so :func:`saved_nbytes` is ``ceil(n / 8) * bits + 8 * rows *
groups`` bytes.

Group size (default :data:`GROUP_SIZE` = 64): the scales cost 64 bits per group, i.e. 1 bit per element at 64 (an
8-bit code takes 1.125 bytes, 0.28x of float32 and 0.56x of bfloat16), 0.5 bit at 128. The step is the group's range
over ``2**bits - 1``; for Gaussian values the expected range of 64 samples is about 4.8 sigma against 5.2 sigma for
128 (8% smaller), and much smaller than a row's range when a few outlier features carry large values (as in
transformer hidden states): a group confines an outlier's large step to its 64 features. 64 is the smallest group
whose scales cost at most one bit per element.

Determinism: the noise of stochastic rounding is a counter-based hash of (seed, row, column)
(:func:`noise_reference`: 24 random bits per element, computed where needed, no generator state and no noise tensor),
so the codes are a function of (x, bits, group_size, rounding, seed), the same on every device and thread count. The
callers draw ``seed`` from torch's default CPU generator, so ``torch.manual_seed`` makes a run reproducible (as for
dropout). (Before the fused CPU kernel the noise was ``torch.rand`` from a generator seeded with ``seed``: the
stochastic codes of a given seed changed then, their distribution did not; nearest rounding is bitwise as before.)

Kernels: :func:`quantize_groups` and :func:`dequantize_groups` run one fused pass: numba on CPU
(:mod:`._numba_quant`), Triton on CUDA (:mod:`.triton_quant`, where it serves the shape: features and group size
multiples of 8), and the pure-torch ``*_reference`` elsewhere (and where numba or triton is not installed); all
give the same bytes and values.

>>> x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
>>> packed, scales = quantize_groups(x, 2, 4, stochastic=False, seed=0)
>>> dequantize_groups(packed, scales, 4, 2, 4, torch.float32).tolist()
[[0.0, 1.0, 2.0, 3.0]]
"""

from __future__ import annotations

import functools
import importlib.util
import threading
import weakref

import torch

from ...errors import check_bits, check_choice, check_integer
from .._eager import tracing
from .._packing import _numba_available, pack, packed_nbytes, unpack

__all__ = [
    "GROUP_SIZE",
    "ROUNDINGS",
    "check_options",
    "kernels_for",
    "saved_nbytes",
    "noise_reference",
    "quantize_groups",
    "quantize_groups_reference",
    "dequantize_groups",
    "dequantize_groups_reference",
    "dequantize_shared",
    "quantize_codes",
    "dequantize_codes",
    "group_quantize",
    "group_dequantize",
]

GROUP_SIZE = 64
ROUNDINGS = ("stochastic", "nearest")


def check_options(bits: object, group_size: object, rounding: object) -> tuple[int, int, str]:
    """The validated ``(bits, group_size, rounding)``: bits 2..8, a positive group size, a known rounding."""
    return (
        check_bits(bits, low=2, high=8),
        check_integer("group_size", group_size, low=1),
        check_choice("rounding", rounding, ROUNDINGS),
    )


def saved_nbytes(shape: torch.Size | tuple[int, ...], bits: int, group_size: int) -> int:
    """Bytes kept for an input of ``shape`` (features last): packed codes plus float32 (low, step) per group.

    Args:
        shape: the input's shape (features last)
        bits: bits per code
        group_size: values per group
    """
    features = int(shape[-1]) if len(shape) else 1
    numel = 1
    for size in shape:
        numel *= int(size)
    rows = numel // features if features else 0
    groups = -(-features // group_size)
    return -(-numel // 8) * bits + 8 * rows * groups


def _grouped(x2d: torch.Tensor, group_size: int) -> torch.Tensor:
    """(rows, groups, group_size) view of float32 rows, the last group padded with copies of the row's last value
    (so padding changes no group's min or max)."""
    rows, features = x2d.shape
    groups = -(-features // group_size)
    pad = groups * group_size - features
    if pad:
        x2d = torch.cat([x2d, x2d[:, -1:].expand(rows, pad)], dim=1)
    return x2d.reshape(rows, groups, group_size)


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # a 32-bit integer hash (Wellons' "lowbias32") on int64 values below 2**32 (a product may wrap past 2**63: the
    # low 32 bits, all that is kept, are still exact)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def noise_reference(rows: int, columns: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The stochastic-rounding noise u in [0, 1) of every (row, column), float32 (rows, columns): a counter-based
    hash of (seed, row, column), so any element's noise is computed where it is needed (the CPU kernel draws it in
    registers) and is the same on every device and thread count.

    ``key(row) = mix32((mix32((row mod 2**32) ^ seed_low) + seed_high + row // 2**32) mod 2**32)``,
    ``u = (mix32((column * 0x9E3779B9 + key(row)) mod 2**32) >> 8) * 2**-24``, with ``seed = seed_high * 2**32 +
    seed_low`` and ``mix32`` a 32-bit integer hash. For a given row, distinct columns get distinct hash inputs.

    Args:
        rows: the rows
        columns: the columns
        seed: a non-negative integer below 2**63
        device: where to compute
    """
    row = torch.arange(rows, dtype=torch.int64, device=device)
    column = torch.arange(columns, dtype=torch.int64, device=device)
    seed = int(seed)
    first = _mix32((row & _MASK32) ^ (seed & _MASK32))
    key = _mix32((first + ((seed >> 32) & _MASK32) + (row >> 32)) & _MASK32)
    hashed = _mix32((column * 0x9E3779B9 + key.unsqueeze(1)) & _MASK32)
    return (hashed >> 8).to(torch.float32) * 2.0**-24


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernels_for(device: torch.device) -> str:
    """The kernels that run for tensors on ``device``: 'numba' on the CPU and 'triton' on CUDA where the package is
    installed, else 'reference' (pure torch).

    Args:
        device: where the tensors are
    """
    if device.type == "cpu":
        return "numba" if _numba_available() else "reference"
    return "triton" if device.type == "cuda" and _triton_available() else "reference"


def quantize_groups(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, scales)`` of ``x`` (features last; any float dtype, any device): packed uint8 codes of the
    ``rows * features`` values in row-major order, and float32 ``(low, step)`` per group, shape (rows, groups, 2).
    One fused pass with the kernels of :func:`kernels_for` (numba: :mod:`._numba_quant`, bfloat16 read natively;
    Triton: :mod:`.triton_quant`); else :func:`quantize_groups_reference`. All give the same bytes.

    Args:
        x: the values, features last
        bits: bits per code
        group_size: values per group along the features
        stochastic: stochastic rounding (unbiased) instead of nearest
        seed: the seed of the stochastic rounding
    """
    kernels = kernels_for(x.device)
    if kernels == "triton":
        from . import triton_quant

        if x.numel() and triton_quant.kernel_serves(x.shape[-1] if x.dim() else 1, group_size):
            return triton_quant.quantize_groups_triton(x, bits, group_size, stochastic=stochastic, seed=seed)
    if kernels != "numba" or x.numel() == 0:
        return quantize_groups_reference(x, bits, group_size, stochastic=stochastic, seed=seed)
    from .. import _numba_packing
    from . import _numba_quant as kernels

    features = x.shape[-1] if x.dim() else 1
    rows = x.numel() // features
    values = x.detach().reshape(rows, features)
    if values.dtype == torch.bfloat16:
        kernel, source = kernels.quantize_bfloat16, values.contiguous().view(torch.uint16)
    else:
        kernel, source = kernels.quantize_float32, values.to(torch.float32).contiguous()
    numel = rows * features
    packed = torch.empty(packed_nbytes(numel, bits), dtype=torch.uint8)
    if bits == 8:
        packed[numel:] = 0  # the padding of the last group (8-bit codes are written in place, the rest packed)
    scales = torch.empty(rows, -(-features // group_size), 2, dtype=torch.float32)
    _numba_packing.run(
        kernel, rows, source.reshape(-1).numpy(), features, group_size, bits, bool(stochastic), int(seed),
        packed.numpy(), scales.numpy(), grain=8, min_task=max(8, _numba_packing.MIN_TASK // features),
    )  # fmt: skip
    return packed, scales


def quantize_groups_reference(
    x: torch.Tensor, bits: int, group_size: int, *, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_groups` in pure torch (any device; the oracle of the CPU kernel and the path on other
    devices): float32 arithmetic, the noise of :func:`noise_reference`.

    Args:
        x: the values, features last
        bits: bits per code
        group_size: values per group along the features
        stochastic: stochastic rounding (unbiased) instead of nearest
        seed: the seed of the stochastic rounding
    """
    features = x.shape[-1] if x.dim() else 1
    rows = x.numel() // features if features else 0
    groups = -(-features // group_size)
    if x.numel() == 0:
        return (
            torch.zeros(0, dtype=torch.uint8, device=x.device),
            torch.zeros(rows, groups, 2, dtype=torch.float32, device=x.device),
        )
    top = float((1 << bits) - 1)
    values = _grouped(x.detach().reshape(rows, features).to(torch.float32), group_size)
    low, high = torch.aminmax(values, dim=-1)
    step = (high - low) / top
    inverse = torch.where(step > 0, 1.0 / step, torch.zeros((), dtype=torch.float32, device=x.device))
    # t = (x - low) / step in [0, 2**bits - 1]; code = floor(t + u), u ~ U[0, 1) (stochastic) or u = 1/2 (nearest)
    position = (values - low.unsqueeze(-1)) * inverse.unsqueeze(-1)
    if stochastic:
        position += noise_reference(rows, groups * group_size, seed, x.device).view(position.shape)
    else:
        position += 0.5
    codes = position.floor_().clamp_(0.0, top).nan_to_num_(0.0).to(torch.uint8)
    codes = codes.reshape(rows, groups * group_size)[:, :features]
    # a non-finite group decodes to NaN: low = NaN there (a finite low with step = inf would give inf * 0 = NaN too,
    # but only for code 0)
    finite = torch.isfinite(low) & torch.isfinite(step)
    low = torch.where(finite, low, torch.full((), float("nan"), device=x.device))
    return pack(codes, bits), torch.stack([low, step], dim=-1)


def dequantize_groups(
    packed: torch.Tensor, scales: torch.Tensor, features: int, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The decoded values ``low + code * step`` as a (rows, features) tensor of ``dtype`` (computed in float32, as
    one fused multiply-add). One pass with the kernels of :func:`kernels_for` (numba: :mod:`._numba_quant`, float32
    and bfloat16 written natively; Triton: :mod:`.triton_quant`); else :func:`dequantize_groups_reference`. All give
    the same values.

    Args:
        packed: the packed codes from :func:`quantize_groups`
        scales: its (low, step) per group
        features: the feature count (the last dimension)
        bits: bits per code
        group_size: values per group
        dtype: the dtype of the result
    """
    rows = scales.shape[0]
    kernels = kernels_for(scales.device)
    if kernels == "triton":
        from . import triton_quant

        if rows * features and triton_quant.kernel_serves(features, group_size):
            return triton_quant.dequantize_groups_triton(packed, scales, features, bits, group_size, dtype)
    if kernels != "numba" or rows * features == 0:
        return dequantize_groups_reference(packed, scales, features, bits, group_size, dtype)
    from .. import _numba_packing
    from . import _numba_quant as kernels

    if dtype == torch.bfloat16:
        out = torch.empty(rows, features, dtype=torch.bfloat16)
        kernel, target = kernels.dequantize_bfloat16, out.view(torch.uint16)
    else:
        out = target = torch.empty(rows, features, dtype=torch.float32)
        kernel = kernels.dequantize_float32
    codes = packed.detach().reshape(-1).contiguous().numpy()
    group_scales = scales.detach().to(torch.float32).contiguous().numpy()
    _numba_packing.run(
        kernel, rows, codes, group_scales, features, group_size, bits, target.view(-1).numpy(), grain=8,
        min_task=max(8, _numba_packing.MIN_TASK // features),
    )  # fmt: skip
    return out if out.dtype == dtype else out.to(dtype)


def dequantize_groups_reference(
    packed: torch.Tensor, scales: torch.Tensor, features: int, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize_groups` in pure torch (any device): ``torch.addcmul`` in float32, then ``dtype``.

    Args:
        packed: the packed codes from :func:`quantize_groups`
        scales: its (low, step) per group
        features: the feature count (the last dimension)
        bits: bits per code
        group_size: values per group
        dtype: the dtype of the result
    """
    rows, groups = scales.shape[0], scales.shape[1]
    if rows * features == 0:
        return torch.zeros(rows, features, dtype=dtype, device=scales.device)
    codes = unpack(packed, bits, rows * features).reshape(rows, features)
    pad = groups * group_size - features
    if pad:
        codes = torch.cat([codes, codes.new_zeros(rows, pad)], dim=1)
    codes = codes.reshape(rows, groups, group_size).to(torch.float32)
    values = torch.addcmul(scales[..., :1], codes, scales[..., 1:])
    return values.reshape(rows, groups * group_size)[:, :features].to(dtype)


def quantize_codes(
    x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fewbit::group_quantize`` of ``x.detach()``: the custom op under ``torch.compile``, :func:`quantize_groups`
    itself in eager (the same bytes, without the custom-op dispatch).

    Args:
        x: the values, features last
        bits: bits per code
        group_size: values per group along the features
        stochastic: stochastic rounding instead of nearest
        seed: the seed, a 0-dim int64 tensor
    """
    if tracing(x, seed):
        return torch.ops.fewbit.group_quantize(x.detach(), bits, group_size, stochastic, seed)
    return quantize_groups(x.detach(), bits, group_size, stochastic=stochastic, seed=int(seed))


def dequantize_codes(
    packed: torch.Tensor, scales: torch.Tensor, features: int, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """``fewbit::group_dequantize``: the custom op under ``torch.compile`` (a traced backward included),
    :func:`dequantize_shared` itself in eager. The result must only be read.

    Args:
        packed: the packed codes
        scales: their (low, step) per group
        features: the feature count (the last dimension)
        bits: bits per code
        group_size: values per group
        dtype: the dtype of the result
    """
    if tracing(packed, scales):
        return torch.ops.fewbit.group_dequantize(packed, scales, features, bits, group_size, dtype)
    return dequantize_shared(packed, scales, features, bits, group_size, dtype)


# ----------------------------------------------------------------------------------------------------------------------
# Custom ops (fake kernels for torch.compile); ``seed`` is a 0-dim int64 tensor so that compiled graphs do not
# specialise on its value


@torch.library.custom_op("fewbit::group_quantize", mutates_args=())
def group_quantize(
    x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_groups` as a custom op (``torch.ops.fewbit.group_quantize``)."""
    return quantize_groups(x, bits, group_size, stochastic=stochastic, seed=int(seed))


@group_quantize.register_fake
def _(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: torch.Tensor):
    features = x.shape[-1] if x.dim() else 1
    rows = x.numel() // features if features else 0
    groups = (features + group_size - 1) // group_size
    packed = x.new_empty(((x.numel() + 7) // 8) * bits, dtype=torch.uint8)
    return packed, x.new_empty((rows, groups, 2), dtype=torch.float32)


class _LastDecoded:
    """The last decoded (packed, scales) pair, one slot: the backward passes of the layers that share one set of
    codes (a norm's output read by the q, k and v projections, or by a gated MLP) run one after the other, so the
    second to the last of them reuse the first one's decoded tensor instead of decoding again (one pass and one
    allocation each). The values are a pure function of the codes and options, so a hit returns what a decode would.
    The slot holds a weak reference to the codes (freed codes drop it) and at most one decoded tensor; consumers
    only read it (codes or a decoded tensor changed in place, whose version moved on, are decoded afresh)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple | None = None

    def get(
        self, packed: torch.Tensor, scales: torch.Tensor, features: int, bits: int, group_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        options = (features, bits, group_size, dtype)
        with self._lock:
            entry = self._entry
        if entry is not None:
            packed_ref, scales_ref, entry_options, decoded, versions = entry
            if (
                packed_ref() is packed
                and scales_ref() is scales
                and entry_options == options
                and versions == (packed._version, scales._version, decoded._version)
            ):
                return decoded
        decoded = dequantize_groups(packed, scales, features, bits, group_size, dtype)

        def forget(_ref, slot=self):
            with slot._lock:
                if slot._entry is not None and slot._entry[0] is _ref:
                    slot._entry = None

        versions = (packed._version, scales._version, decoded._version)
        with self._lock:
            self._entry = (weakref.ref(packed, forget), weakref.ref(scales), options, decoded, versions)
        return decoded

    def clear(self) -> None:
        with self._lock:
            self._entry = None


_LAST_DECODED = _LastDecoded()


def dequantize_shared(
    packed: torch.Tensor, scales: torch.Tensor, features: int, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize_groups` for codes that several consumers decode in a row (the inputs of compressed linear
    layers, shared in eager): the previous call's result when it decoded these very tensors with these options.
    The result must only be read."""
    return _LAST_DECODED.get(packed, scales, features, bits, group_size, dtype)


@torch.library.custom_op("fewbit::group_dequantize", mutates_args=())
def group_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, features: int, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize_shared` as a custom op (``torch.ops.fewbit.group_dequantize``): the codes of a linear input
    that several layers share are decoded once (eager; the result must only be read)."""
    return dequantize_shared(packed, scales, features, bits, group_size, dtype)


@group_dequantize.register_fake
def _(packed: torch.Tensor, scales: torch.Tensor, features: int, bits: int, group_size: int, dtype: torch.dtype):
    return scales.new_empty((scales.shape[0], features), dtype=dtype)
