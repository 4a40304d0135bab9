"""Sign-preserving K-bit quantization of pre-ReLU activations for BLPA (Chakrabarti & Moseley, eqs. 9-10).

Terms (per channel c of a batch-normalized unit):

* ``A1`` the normalized input, ``A2 = gamma * A1 + beta`` the pre-ReLU activation, ``A3 = relu(A2)``.
* ``delta = 6 / 2**K`` the bin width in A1 units, i.e. ``Delta = 6 |gamma| / 2**K`` in A2 units (eq. 9).
* ``s = sign(gamma) * A1`` (``sign(0) = +1``), so ``A2 = |gamma| s + beta`` grows with ``s``.
* ``r = beta / Delta``: where beta sits in bin units; ``k = ceil(r + 1/2)`` and ``f = k - r`` in [0.5, 1.5).

Codes. ``raw = ceil(s / delta - f) + 2**(K-1)``: code ``c`` is the bin ``s / delta - f`` in ``(c - 2**(K-1) - 1,
c - 2**(K-1)]``, i.e. the paper's 2**K bins of width Delta, with bin edges aligned so that ``A2 = 0`` is always an
edge (there ``s / delta - f = -k``, an integer), and the window placed as close to centred on beta as that
alignment allows: in A1 units it is ``(-3 + delta (f - 1), 3 + delta (f - 1)]``, within half a bin of
``[-3, 3]`` (eq. 9 clips to about ``beta +- 3|gamma|`` the same way). Bins are open on the left and closed on the
right, so ``A2 == 0`` falls in a non-positive bin. ``z = 2**(K-1) + 1 - k`` is the first code whose bin is
positive. Clipping to the 2**K codes must not cross zero, so codes are clamped by sign:

* ``p = clamp(z, 1, 2**K - 1)`` is the first code that means "A2 > 0"; positive elements get codes in
  ``[p, 2**K)``, non-positive ones codes in ``[0, p)``. When the paper's window lies entirely on one side of zero
  (``|beta| > ~3|gamma|``), the code at the window's edge next to zero becomes a catch-all for the other sign
  (reconstructed at the centre of the bin next to zero, ``+-Delta/2``); otherwise the window straddles zero and
  plain clipping already keeps signs.
* ``gamma == 0``: then ``A2 = beta`` exactly, so the sign is constant per channel and needs no bits; all 2**K codes
  quantize A1 itself on ``(-3, 3]`` (``r = 0``, ``f = 1``), and ``p = 0`` (beta > 0, all positive) or
  ``p = 2**K`` (beta <= 0, none). This keeps the gradient to gamma finite and informative at gamma == 0 (A1 cannot
  be recovered from A2 = beta there).

Decoding gives ``mask = code >= p`` (equal to ``A2 > 0`` for every element, by construction) and
``A1~ = sign(gamma) * delta * (c - 2**(K-1) - 0.5 + f)`` (bin centre), or for a catch-all code
``A1~ = sign(gamma) * delta * (+-0.5 - r)``; then ``A2~ = gamma * A1~ + beta`` and
``A3~ = mask * max(A2~, 0)``.

Error bound: for elements inside the window (at least ``|A1| <= 3 - delta / 2``) ``|A1~ - A1| <= 3 / 2**K`` and
``|A2~ - A2|, |A3~ - A3| <= 3 |gamma| / 2**K`` (half a bin), so errors halve with every extra bit; clipped elements
add their distance to the window edge (this part does not shrink with K); a catch-all element has
``A3~ = A3 = 0`` (non-positive side) or ``A3~ = Delta / 2`` (positive side). The sign, hence the ReLU mask, is
always exact.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import torch

from ...errors import FewBitError, check_choice
from .._packing import pack, packed_nbytes, unpack

__all__ = [
    "ChannelGrid",
    "channel_grid",
    "quantize",
    "dequantize",
    "pack_codes",
    "unpack_codes",
    "compute_dtype",
    "BACKENDS",
    "set_backend",
    "get_backend",
    "use_kernels",
    "forward_kernel",
    "decoder",
    "decode_a3_kernel",
    "backward_kernel",
]

# |r| beyond this: f = k - r is meaningless in floating point; the grid offset is then arbitrary anyway
_HUGE_R = 2.0**40

BACKENDS = ("auto", "torch", "numba")
_state = {"backend": "auto"}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype A1, A2, A3 and gradients are computed in: float64 stays, everything else uses float32.

    Bin arithmetic (codes, A1~) always runs in float64 on per-channel float64 constants, in the reference and in the
    kernels alike, so both give the same codes.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


class ChannelGrid:
    """Per-channel constants of the quantizer (1-D float64 tensors of length C, on gamma's device).

    Attributes:
        scale: sign(gamma) * 2**K / 6, from A1 to bin units (sign(0) = +1).
        step: sign(gamma) * 6 / 2**K, from bin units back to A1.
        f: k - r with k = ceil(r + 1/2), the grid offset in [0.5, 1.5) (1 where gamma == 0 or |r| is huge).
        offset: f - 2**(K-1) - 1/2, so a regular code c decodes to (c + offset) * step.
        r: beta / Delta (0 where gamma == 0; only used for catch-all codes).
        z: first code of a positive bin, unclamped (equals p where gamma == 0).
        p: first code meaning "A2 > 0", in [0, 2**K].

    The constants are computed with numpy in float64 on the host (C values), then moved to gamma's device; the
    ``numpy`` attribute keeps the host arrays (a dict) for the CPU kernels.
    """

    def __init__(self, gamma: torch.Tensor, beta: torch.Tensor, bits: int):
        levels = 1 << bits
        half = levels >> 1
        g = parameter_numpy(gamma, torch.float64)
        b = parameter_numpy(beta, torch.float64)
        zero = g == 0
        self.bits = bits
        inv_delta = levels / 6.0
        sign = np.where(g < 0, -1.0, 1.0)
        abs_g = np.where(zero, 1.0, np.abs(g))
        with np.errstate(over="ignore", invalid="ignore"):
            r = np.where(zero, 0.0, b * inv_delta / abs_g)
            k = np.ceil(r + 0.5)
            f = np.where(np.abs(r) < _HUGE_R, k - r, 1.0)
        z = half + 1 - k
        p_zero = np.where(b > 0, 0.0, float(levels))
        arrays = {
            "scale": sign * inv_delta,
            "step": sign / inv_delta,
            "f": f,
            "offset": (f - half) - 0.5,
            "r": r,
            "z": np.where(zero, p_zero, z),
            "p": np.where(zero, p_zero, np.clip(z, 1, levels - 1)),
        }
        self.numpy = {name: np.ascontiguousarray(value, dtype=np.float64) for name, value in arrays.items()}
        device = gamma.device
        for name, value in self.numpy.items():
            setattr(self, name, torch.from_numpy(value).to(device))


def channel_grid(gamma: torch.Tensor, beta: torch.Tensor, bits: int) -> ChannelGrid:
    """The per-channel quantizer constants for scale ``gamma`` and shift ``beta`` at ``bits`` bits."""
    return ChannelGrid(gamma, beta, bits)


def _per_channel(values: torch.Tensor, ndim: int) -> torch.Tensor:
    return values.view((1, -1) + (1,) * (ndim - 2))


def quantize(a1: torch.Tensor, a2: torch.Tensor, grid: ChannelGrid) -> torch.Tensor:
    """Codes (uint8, shape of ``a1``) of the normalized activations ``a1``; ``a2`` (same shape) gives the signs.

    Channels are along dim 1. Reference implementation (any device).
    """
    levels = 1 << grid.bits
    half = levels >> 1
    ndim = a1.dim()
    raw = torch.ceil(a1.to(torch.float64) * _per_channel(grid.scale, ndim) - _per_channel(grid.f, ndim)) + half
    positive = a2 > 0
    p = _per_channel(grid.p, ndim)
    low = torch.where(positive, p, 0.0)
    high = torch.where(positive, float(levels - 1), p - 1)
    codes = torch.minimum(torch.maximum(raw, low), high)
    return codes.nan_to_num_(0.0).to(torch.uint8)


def dequantize(
    codes: torch.Tensor, grid: ChannelGrid, gamma: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mask, a1, a3)``: the ReLU mask (bool), the approximate A1 and A3 (float64). Reference (any device).

    ``codes`` has channels along dim 1; ``gamma`` and ``beta`` are the per-channel parameters.
    """
    ndim = codes.dim()
    c = codes.to(torch.float64)
    mask = c >= _per_channel(grid.p, ndim)
    z = _per_channel(grid.z, ndim)
    step = _per_channel(grid.step, ndim)
    a1 = (c + _per_channel(grid.offset, ndim)) * step
    catch = torch.where(mask, c < z, c >= z)
    if bool(catch.any()):
        r = _per_channel(grid.r, ndim)
        centre = torch.where(mask, 0.5, -0.5)
        a1 = torch.where(catch, (centre - r) * step, a1)
    g = _per_channel(gamma.detach().to(torch.float64), ndim)
    b = _per_channel(beta.detach().to(torch.float64), ndim)
    a2 = a1 * g + b
    a3 = torch.where(mask, a2.clamp_min(0.0), 0.0)
    return mask, a1, a3


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (any shape, flattened in logical order) into the project's layout (``packing``)."""
    flat = codes.reshape(-1)
    numel = flat.numel()
    if bits in (2, 4, 8):
        per_byte = 8 // bits
        padded_len = -(-numel // 8) * 8
        if padded_len != numel:
            flat = torch.cat([flat, flat.new_zeros(padded_len - numel)])
        if bits == 8:
            return flat
        grouped = flat.view(-1, per_byte)
        packed = grouped[:, 0].clone()
        for k in range(1, per_byte):
            packed |= grouped[:, k] << (k * bits)
        return packed
    return pack(flat, bits)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes, flat (uint8 or int64)."""
    assert packed.numel() == packed_nbytes(numel, bits)
    if bits in (2, 4, 8):
        if bits == 8:
            return packed[:numel]
        per_byte = 8 // bits
        mask = (1 << bits) - 1
        parts = [(packed >> (k * bits)) & mask for k in range(per_byte)]
        return torch.stack(parts, dim=1).reshape(-1)[:numel]
    return unpack(packed, bits, numel)


# ----------------------------------------------------------------------------------------------- CPU kernels


def set_backend(name: str) -> None:
    """Where the element-wise BLPA work runs: 'auto' (numba kernels for float32/float64 CPU tensors when numba is
    installed, the torch reference otherwise), 'torch' (always the reference) or 'numba' (always the kernels).

    Args:
        name: ``'auto'``, ``'torch'`` or ``'numba'``
    """
    _state["backend"] = check_choice("backend", name, BACKENDS)


def get_backend() -> str:
    """The current backend name (see :func:`set_backend`)."""
    return _state["backend"]


@lru_cache(maxsize=1)
def _numba_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("numba") is not None


def use_kernels(tensor: torch.Tensor) -> bool:
    """Whether the numba kernels handle ``tensor`` under the current backend."""
    backend = _state["backend"]
    if backend == "torch":
        return False
    supported = tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64)
    if backend == "numba" and not (supported and _numba_available()):
        raise FewBitError(
            f"backend 'numba' needs numba and a float32/float64 CPU tensor, got {tensor.dtype} on {tensor.device}"
        )
    return supported and _numba_available()


def _numpy(tensor: torch.Tensor, dtype: torch.dtype):
    """A flat numpy view of an activation or gradient (a copy only where the dtype or layout needs one)."""
    return tensor.detach().to(dtype).contiguous().reshape(-1).numpy()


def parameter_numpy(tensor: torch.Tensor, dtype: torch.dtype):
    """A flat numpy copy of a parameter (gamma, beta) on the host, never a view of its storage.

    ``Tensor.numpy()`` marks the storage it views as not resizable, and FSDP2 (``fully_shard``) frees an unsharded
    parameter after forward by resizing its storage to 0: a view here would make that raise
    ``RuntimeError: Trying to resize storage that is not resizable``. The copy is one value per channel."""
    return tensor.detach().to("cpu", dtype, copy=True).reshape(-1).numpy()


_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()
_MIN_ELEMENTS_PER_THREAD = 1 << 15


def _forget_pool() -> None:
    # a forked child inherits the executor but not its threads: start a fresh one there
    _POOL.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL:
            workers = max(1, (os.cpu_count() or 1) - 1)
            _POOL.append(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fewbit-blpa"))
        return _POOL[0]


def _run_planes(kernel, planes: int, inner: int, *args) -> None:
    """``kernel(*args, plane_start, plane_stop)`` over all planes, split over ``torch.get_num_threads()`` threads
    at plane indices that are multiples of 8 (so each range starts a packing group); small inputs run inline."""
    parts = min(torch.get_num_threads(), max(1, planes * inner // _MIN_ELEMENTS_PER_THREAD), max(1, planes // 8))
    if parts <= 1:
        kernel(*args, 0, planes)
        return
    edges = [min(planes, -(-(planes * index // parts) // 8) * 8) for index in range(parts + 1)]
    edges[-1] = planes
    ranges = [(edges[i], edges[i + 1]) for i in range(parts) if edges[i] < edges[i + 1]]
    futures = [_pool().submit(kernel, *args, start, stop) for start, stop in ranges[1:]]
    kernel(*args, *ranges[0])
    for future in futures:
        future.result()


def _kernel_tables(grid: ChannelGrid, gamma: torch.Tensor, beta: torch.Tensor, dtype: torch.dtype):
    """(lut_a1, lut_a3, a1_table, mask_table) of shape (C, 2**K), built by the numba kernel."""
    from . import _numba_kernels as kernels

    numpy_dtype = np.float64 if dtype == torch.float64 else np.float32
    shape = (gamma.numel(), 1 << grid.bits)
    lut_a1, lut_a3 = np.empty(shape, dtype=numpy_dtype), np.empty(shape, dtype=numpy_dtype)
    a1_table, mask_table = np.empty(shape, dtype=np.float64), np.empty(shape, dtype=np.float64)
    arrays = grid.numpy
    kernels.tables(
        arrays["p"], arrays["z"], arrays["step"], arrays["offset"], arrays["r"],
        parameter_numpy(gamma, torch.float64), parameter_numpy(beta, torch.float64),
        lut_a1, lut_a3, a1_table, mask_table,
    )  # fmt: skip
    return lut_a1, lut_a3, a1_table, mask_table


def _layout(shape: torch.Size) -> tuple[int, int, int]:
    channels = shape[1]
    planes = shape[0] * channels
    return channels, planes, shape.numel() // planes


def forward_kernel(
    x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, bits, naive
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A3, stored)``: A3 in the compute dtype (relu of A2, or of A2~ when naive) and what backward keeps (the
    packed codes, or A1 when ``bits`` is None), computed in one fused pass (numba)."""
    from . import _numba_kernels as kernels

    dtype = invstd.dtype
    numpy_dtype = np.float64 if dtype == torch.float64 else np.float32
    channels, planes, inner = _layout(x.shape)
    a3 = torch.empty(x.shape, dtype=dtype)
    empty = np.zeros(channels, dtype=np.float64)
    if bits is None:
        mode, scale, f, p = 0, empty, empty, empty
        lut_a3 = np.zeros((channels, 1), dtype=numpy_dtype)
        stored = torch.empty(x.shape, dtype=dtype)
        packed = torch.empty(0, dtype=torch.uint8)
        store_array = stored.view(-1).numpy()
    else:
        mode, grid = 1, ChannelGrid(gamma, beta, bits)
        scale, f, p = grid.numpy["scale"], grid.numpy["f"], grid.numpy["p"]
        lut_a3 = _kernel_tables(grid, gamma, beta, dtype)[1] if naive else np.zeros((channels, 1), dtype=numpy_dtype)
        packed = torch.zeros(packed_nbytes(x.numel(), bits), dtype=torch.uint8)
        stored = packed
        store_array = np.zeros(0, dtype=numpy_dtype)
    scratch = np.empty(x.numel() if bits is not None else 0, dtype=np.uint8)
    _run_planes(
        kernels.forward, planes, inner,
        _numpy(x, dtype), _numpy(mean, dtype), _numpy(invstd, dtype),
        parameter_numpy(gamma, dtype), parameter_numpy(beta, dtype),
        channels, inner, mode, bool(naive), bits or 8, scale, f, p, lut_a3, a3.view(-1).numpy(), scratch,
        packed.numpy(), store_array,
    )  # fmt: skip
    return a3, stored


class _Decoder:
    """What the backward kernels need to decode a unit's stored activations (built once per backward)."""

    def __init__(
        self, stored: torch.Tensor, shape: torch.Size, gamma: torch.Tensor, beta: torch.Tensor, bits, dtype
    ) -> None:
        from . import _numba_kernels as kernels

        numpy_dtype = np.float64 if dtype == torch.float64 else np.float32
        channels, planes, inner = _layout(shape)
        self.gamma = parameter_numpy(gamma, dtype)
        self.beta = parameter_numpy(beta, dtype)
        if bits is None:
            self.mode = 0
            self.codes = np.zeros(0, dtype=np.uint8)
            self.values = stored.contiguous().view(-1).numpy()
            self.mask_table = self.a1_table = np.zeros((channels, 1), dtype=np.float64)
            self.lut_a3 = np.zeros((channels, 1), dtype=numpy_dtype)
        else:
            self.mode = 1
            self.codes = np.empty(shape.numel(), dtype=np.uint8)  # unpacked once, for the three passes
            _run_planes(kernels.unpack, planes, inner, stored.numpy(), bits, inner, self.codes)
            self.values = np.zeros(0, dtype=numpy_dtype)
            grid = ChannelGrid(gamma, beta, bits)
            _, self.lut_a3, self.a1_table, self.mask_table = _kernel_tables(grid, gamma, beta, dtype)


def decoder(
    stored: torch.Tensor, shape: torch.Size, gamma: torch.Tensor, beta: torch.Tensor, bits, dtype: torch.dtype
) -> _Decoder:
    """Per-backward decoding state (codes unpacked to uint8, per-channel tables) for the backward kernels."""
    return _Decoder(stored, shape, gamma, beta, bits, dtype)


def decode_a3_kernel(state: _Decoder, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A3~ (compute dtype, ``shape``) from what the forward stored (numba)."""
    from . import _numba_kernels as kernels

    channels, planes, inner = _layout(shape)
    a3 = torch.empty(shape, dtype=dtype)
    _run_planes(
        kernels.decode_a3, planes, inner,
        state.codes, state.values, state.gamma, state.beta, channels, inner, state.mode, state.lut_a3,
        a3.view(-1).numpy(),
    )  # fmt: skip
    return a3


def backward_kernel(
    state: _Decoder, grad_a3: torch.Tensor, gamma: torch.Tensor, invstd: torch.Tensor, need_x: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(grad_beta, grad_gamma, grad_x)`` (float64, float64, compute dtype) of eqs. (6)-(8) (numba)."""
    from . import _numba_kernels as kernels

    dtype = invstd.dtype
    shape = grad_a3.shape
    channels, planes, inner = _layout(shape)
    grad = _numpy(grad_a3, grad_a3.dtype if grad_a3.dtype in (torch.float32, torch.float64) else dtype)
    sum_beta = torch.empty(planes, dtype=torch.float64)
    sum_gamma = torch.empty(planes, dtype=torch.float64)
    _run_planes(
        kernels.reduce_grads, planes, inner,
        state.codes, state.values, grad, state.gamma, state.beta, channels, inner, state.mode, state.mask_table,
        state.a1_table, sum_beta.numpy(), sum_gamma.numpy(),
    )  # fmt: skip
    grad_beta = sum_beta.view(-1, channels).sum(0)
    grad_gamma = sum_gamma.view(-1, channels).sum(0)
    grad_x = None
    if need_x:
        count = (planes // channels) * inner
        gamma64 = torch.from_numpy(parameter_numpy(gamma, torch.float64))  # (a copy: see parameter_numpy)
        mean_grad = (gamma64 * grad_beta / count).numpy()
        mean_proj = (gamma64 * grad_gamma / count).numpy()
        invstd64 = invstd.detach().to(torch.float64).numpy()
        # per code: grad_x = grad_A3 * mask * gamma * invstd - (mean_grad + A1~ * mean_proj) * invstd
        scale_table = state.mask_table * (gamma64.numpy() * invstd64)[:, None]
        offset_table = (mean_grad[:, None] + state.a1_table * mean_proj[:, None]) * invstd64[:, None]
        grad_x = torch.empty(shape, dtype=dtype)
        _run_planes(
            kernels.grad_input, planes, inner,
            state.codes, state.values, grad, state.gamma, state.beta, _numpy(invstd, dtype), mean_grad, mean_proj,
            channels, inner, state.mode, scale_table, offset_table, grad_x.view(-1).numpy(),
        )  # fmt: skip
    return grad_beta, grad_gamma, grad_x
