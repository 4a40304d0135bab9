"""The fused BLPA units ``BatchNorm -> ReLU -> Conv2d/Linear`` and their autograd function.

See :mod:`fewbit_design.runtime.blpa` for the method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FewBitError, check_bits
from .._torchscript import NotScriptable
from . import quant

__all__ = ["BNReLUConv2d", "BNReLULinear", "BNReLUPoolLinear", "set_backend", "unit_backward"]

set_backend = quant.set_backend

MIN_BITS = 2
MAX_BITS = 8


def _check_unit_bits(context: str, bits: object, naive: object) -> int | None:
    if bits is not None:
        try:
            bits = check_bits(bits, low=MIN_BITS, high=MAX_BITS)
        except FewBitError:
            raise FewBitError(
                f"{context}: bits must be an integer from {MIN_BITS} to {MAX_BITS}, or None for exact, got {bits!r}"
            ) from None
    if not isinstance(naive, bool):
        raise FewBitError(f"{context}: naive must be True or False, got {naive!r}")
    if naive and bits is None:
        raise FewBitError(f"{context}: naive=True needs bits (the naive baseline quantizes the forward pass)")
    return bits


@dataclass(frozen=True)
class _Spec:
    """What the autograd function needs to know about a unit (no tensors)."""

    kind: str  # "conv2d", "linear" or "pool_linear"
    bits: int | None
    naive: bool
    stride: tuple[int, ...] = (1, 1)
    padding: tuple[int, ...] = (0, 0)
    dilation: tuple[int, ...] = (1, 1)
    groups: int = 1


def _reduce_dims(ndim: int) -> list[int]:
    return [0] + list(range(2, ndim))


def _per_channel(values: torch.Tensor, ndim: int) -> torch.Tensor:
    return values.view((1, -1) + (1,) * (ndim - 2))


def _op_forward(a3: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: _Spec) -> torch.Tensor:
    if spec.kind == "conv2d":
        return F.conv2d(a3, weight, bias, spec.stride, spec.padding, spec.dilation, spec.groups)
    if spec.kind == "linear":
        return F.linear(a3, weight, bias)
    return F.linear(a3.mean(dim=(2, 3)), weight, bias)


def _op_backward(
    grad_out: torch.Tensor, a3: torch.Tensor, weight: torch.Tensor, has_bias: bool, spec: _Spec, needs: tuple
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(grad to A3, grad to W, grad to bias) of the linear op, with W's gradient taken at ``a3`` (eq. 5)."""
    need_a3, need_w, need_b = needs
    if spec.kind == "conv2d":
        grads = torch.ops.aten.convolution_backward(
            grad_out,
            a3,
            weight,
            [weight.shape[0]] if has_bias else None,
            list(spec.stride),
            list(spec.padding),
            list(spec.dilation),
            False,
            [0, 0],
            spec.groups,
            [need_a3, need_w, need_b and has_bias],
        )
        return grads[0], grads[1], grads[2]
    grad_b = grad_out.sum(0) if need_b and has_bias else None
    if spec.kind == "linear":
        grad_a3 = grad_out @ weight if need_a3 else None
        grad_w = grad_out.t() @ a3 if need_w else None
        return grad_a3, grad_w, grad_b
    height, width = a3.shape[2], a3.shape[3]
    grad_a3 = None
    if need_a3:
        grad_pooled = (grad_out @ weight) / (height * width)
        grad_a3 = grad_pooled[:, :, None, None].expand(a3.shape)
    grad_w = grad_out.t() @ a3.mean(dim=(2, 3)) if need_w else None
    return grad_a3, grad_w, grad_b


@dataclass
class UnitGrads:
    """Gradients of one unit (any may be None when not requested); ``relu_input`` is the gradient to A2."""

    input: torch.Tensor | None
    gamma: torch.Tensor | None
    beta: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    relu_input: torch.Tensor | None


def unit_backward(
    grad_out: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    spec: _Spec,
    input_shape: torch.Size,
    has_bias: bool,
    needs: tuple[bool, bool, bool, bool, bool] = (True, True, True, True, True),
    *,
    reference: bool = False,
) -> UnitGrads:
    """The backward of a fused unit (eqs. 5-8) from what its forward saved.

    ``saved`` is ``(A1 or packed codes, invstd, gamma, beta, weight)`` as saved by the unit's forward (available as
    ``output.grad_fn.saved_tensors``); ``needs`` says which of (input, gamma, beta, weight, bias) need gradients.
    ``reference=True`` runs the pure-torch reference, which also returns the gradient to A2 (``relu_input``);
    otherwise the numba kernels run where they apply (see :func:`set_backend`). Exposed for tests and experiments;
    modules call it through autograd.

    Args:
        grad_out: the gradient of the unit's output
        saved: what the forward saved (above)
        spec: the unit's description (kind, bits, naive, convolution geometry)
        input_shape: the unit input's shape
        has_bias: whether the Conv/Linear has a bias
        needs: which gradients to compute (above)
        reference: run the pure-torch reference (above)
    """
    stored, invstd, gamma, beta, weight = saved
    need_x, need_gamma, need_beta, need_w, need_b = needs
    need_a2 = need_x or need_gamma or need_beta
    dtype = invstd.dtype
    ndim = len(input_shape)
    bits = spec.bits
    if not reference and quant.use_kernels(invstd):
        state = quant.decoder(stored, input_shape, gamma, beta, bits, dtype)
        a3 = quant.decode_a3_kernel(state, input_shape, dtype)
        grad_a3, grad_w, grad_b = _op_backward(
            grad_out, a3.to(grad_out.dtype), weight, has_bias, spec, (need_a2, need_w, need_b)
        )
        del a3
        grads = UnitGrads(None, None, None, grad_w, grad_b, None)
        if need_a2:
            grad_beta, grad_gamma, grad_x = quant.backward_kernel(state, grad_a3, gamma, invstd, need_x)
            grads.beta = grad_beta.to(beta.dtype) if need_beta else None
            grads.gamma = grad_gamma.to(gamma.dtype) if need_gamma else None
            grads.input = grad_x
        return grads
    g = _per_channel(gamma.detach().to(dtype), ndim)
    if bits is None:
        a1 = stored
        a2 = a1 * g + _per_channel(beta.detach().to(dtype), ndim)
        mask = a2 > 0
        a3 = torch.relu(a2)
        del a2
    else:
        codes = quant.unpack_codes(stored, bits, input_shape.numel()).view(input_shape)
        mask, a1, a3 = quant.dequantize(codes, quant.channel_grid(gamma, beta, bits), gamma, beta)
        a1, a3 = a1.to(dtype), a3.to(dtype)
        del codes
    grad_a3, grad_w, grad_b = _op_backward(
        grad_out, a3.to(grad_out.dtype), weight, has_bias, spec, (need_a2, need_w, need_b)
    )
    del a3
    grads = UnitGrads(None, None, None, grad_w, grad_b, None)
    if not need_a2:
        return grads
    dims = _reduce_dims(ndim)
    # eq. (6): the ReLU mask comes from the codes and equals (A2 > 0) exactly
    grad_a2 = torch.where(mask, grad_a3.to(dtype), 0.0)
    del grad_a3, mask
    # eq. (7)
    if need_beta:
        grads.beta = grad_a2.sum(dims).to(beta.dtype)
    if need_gamma:
        grads.gamma = (a1 * grad_a2).sum(dims).to(gamma.dtype)
    if need_x:
        grad_a1 = grad_a2 * g
        # eq. (8): A1~ only in the variance term
        mean_grad = grad_a1.mean(dims, keepdim=True)
        mean_proj = (a1 * grad_a1).mean(dims, keepdim=True)
        grads.input = grad_a1.sub_(mean_grad).sub_(a1 * mean_proj).mul_(_per_channel(invstd, ndim))
    grads.relu_input = grad_a2
    return grads


def _forward_reference(x, mean, invstd, gamma, beta, spec: _Spec) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = invstd.dtype
    ndim = x.dim()
    a1 = (x.to(dtype) - _per_channel(mean, ndim)) * _per_channel(invstd, ndim)
    a2 = a1 * _per_channel(gamma.to(dtype), ndim) + _per_channel(beta.to(dtype), ndim)
    if spec.bits is None:
        return torch.relu(a2), a1
    grid = quant.channel_grid(gamma, beta, spec.bits)
    codes = quant.quantize(a1, a2, grid)
    del a1
    if spec.naive:
        a3 = quant.dequantize(codes, grid, gamma, beta)[2].to(dtype)
    else:
        a3 = torch.relu(a2)
    return a3, quant.pack_codes(codes, spec.bits)


def _all_finite(a3: torch.Tensor, *per_channel: torch.Tensor) -> bool:
    """Whether A1 (hence A2) is finite: per-channel statistics and parameters finite and A3 = relu(A2) finite.

    A non-finite x makes its channel's mean non-finite; an overflow inside (x - mean) * invstd gives NaN or +inf
    in A2, which relu keeps, so the sum of A3 sees it (a sum that overflows on finite values errs on the safe side).
    """
    values = [torch.isfinite(tensor.detach()).all() for tensor in per_channel if tensor is not None]
    values.append(torch.isfinite(torch.sum(a3.detach(), dtype=torch.float64)))
    return bool(torch.stack(values).all())


SECOND_ORDER_MESSAGE = (
    "BLPA units do not support higher-order gradients (backward with create_graph=True): their backward is written "
    "by hand from what the forward kept (K-bit codes of the pre-activation); use the unfused "
    "BatchNorm -> ReLU -> Conv2d/Linear modules for double backward"
)


def _exact(spec: _Spec) -> _Spec:
    return dataclasses.replace(spec, bits=None, naive=False)


class _BNReLUFunction(torch.autograd.Function):
    """One fused unit: exact forward, K-bit (or exact) A2 saved, backward per eqs. (5)-(8)."""

    @staticmethod
    def forward(ctx, x, mean, invstd, gamma, beta, weight, bias, spec: _Spec):
        if quant.use_kernels(x):
            a3, stored = quant.forward_kernel(x, mean, invstd, gamma, beta, spec.bits, spec.naive)
        else:
            a3, stored = _forward_reference(x, mean, invstd, gamma, beta, spec)
        if spec.bits is not None and not _all_finite(a3, mean, invstd, gamma, beta):
            # non-finite rule (as for few-bit activations): codes cannot carry NaN or +-inf, so a call
            # whose A1 has a non-finite element keeps A1 exactly (the bits=None storage) and its backward is the exact
            # unit's: NaN and inf reach the gradients as they do without BLPA (GradScaler still sees them). Finite
            # calls pay one sum over A3 and per-channel checks, and store exactly what they stored before.
            spec = _exact(spec)
            a3, stored = _forward_reference(x, mean, invstd, gamma, beta, spec)
        out = _op_forward(a3.to(x.dtype), weight, bias, spec)
        del a3
        ctx.save_for_backward(stored, invstd, gamma, beta, weight)
        ctx.spec = spec
        ctx.input_shape = x.shape
        ctx.input_dtype = x.dtype
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: refuse now rather than differentiate a kernel (or half)
            raise FewBitError(SECOND_ORDER_MESSAGE)
        needs = ctx.needs_input_grad
        grads = unit_backward(
            grad_out.contiguous(),
            ctx.saved_tensors,
            ctx.spec,
            ctx.input_shape,
            ctx.has_bias,
            (needs[0], needs[3], needs[4], needs[5], needs[6]),
        )
        grad_x = grads.input.to(ctx.input_dtype) if grads.input is not None else None
        return grad_x, None, None, grads.gamma, grads.beta, grads.weight, grads.bias, None


def _explicit_padding(context: str, conv: nn.Conv2d) -> tuple[int, int]:
    padding = conv.padding
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0)
        # 'same' (stride 1): total padding d * (k - 1) per dimension, split evenly when it is even
        totals = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size, strict=True)]
        if any(total % 2 for total in totals):
            raise FewBitError(
                f"{context}: padding='same' with kernel_size={tuple(conv.kernel_size)} and "
                f"dilation={tuple(conv.dilation)} pads asymmetrically, which is not supported; pass explicit padding"
            )
        return (totals[0] // 2, totals[1] // 2)
    return (int(padding[0]), int(padding[1]))


class _FusedUnit(NotScriptable, nn.Module):
    """Shared machinery: submodules named like ``nn.Sequential(BatchNorm, ReLU, ..., Linear-op)``."""

    _kind = "conv2d"
    _bn_type: type = nn.BatchNorm2d
    _op_type: type = nn.Conv2d
    _op_name = "2"
    _input_ndim = 4

    def _setup(self, bn: nn.Module, parts: list[nn.Module], op: nn.Module, bits: int | None, naive: bool) -> None:
        self.add_module("0", bn)
        for index, part in enumerate(parts, start=1):
            self.add_module(str(index), part)
        self.add_module(self._op_name, op)
        self.bits = bits
        self.naive = naive
        self._padding = _explicit_padding(type(self).__name__, op) if isinstance(op, nn.Conv2d) else (0, 0)

    @property
    def bn(self) -> nn.Module:
        """The BatchNorm module (parameters gamma = ``bn.weight``, beta = ``bn.bias``, running statistics)."""
        return self._modules["0"]

    @property
    def op(self) -> nn.Module:
        """The Conv2d or Linear module."""
        return self._modules[self._op_name]

    def _spec(self) -> _Spec:
        op = self.op
        if self._kind == "conv2d":
            return _Spec(
                "conv2d",
                self.bits,
                self.naive,
                tuple(op.stride),
                self._padding,
                tuple(op.dilation),
                int(op.groups),
            )
        return _Spec(self._kind, self.bits, self.naive)

    def _check_input(self, x: torch.Tensor) -> None:
        name = type(self).__name__
        channels = self.bn.num_features
        if x.dim() != self._input_ndim:
            layout = "(N, C, H, W)" if self._input_ndim == 4 else "(N, C)"
            raise FewBitError(f"{name} expects a {self._input_ndim}-D input {layout}, got shape {tuple(x.shape)}")
        if x.shape[1] != channels:
            raise FewBitError(f"{name} expects {channels} channels (dim 1), got input shape {tuple(x.shape)}")

    def _eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        a2 = F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
        return _op_forward(F.relu(a2), self.op.weight, self.op.bias, self._spec())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        bn = self.bn
        use_batch_stats = self.training or (bn.running_mean is None and bn.running_var is None)
        if not use_batch_stats:
            return self._eval_forward(x)
        if x.numel() == 0:  # an empty batch: what the unfused modules give (an empty output; torch's running stats)
            return _op_forward(F.relu(bn(x)), self.op.weight, self.op.bias, self._spec())
        count = x.numel() // x.shape[1]
        if count <= 1:
            raise FewBitError(
                f"{type(self).__name__}: batch statistics need more than 1 value per channel when training, "
                f"got input shape {tuple(x.shape)}"
            )
        dtype = quant.compute_dtype(x.dtype)
        with torch.no_grad():
            var, mean = torch.var_mean(x.to(dtype), dim=_reduce_dims(x.dim()), correction=0)
            invstd = torch.rsqrt(var + bn.eps)
            if self.training and bn.track_running_stats:
                factor = 0.0 if bn.momentum is None else bn.momentum
                if bn.num_batches_tracked is not None:
                    bn.num_batches_tracked.add_(1)
                    if bn.momentum is None:  # cumulative moving average
                        factor = 1.0 / float(bn.num_batches_tracked)
                unbiased = var * (count / (count - 1))
                bn.running_mean.mul_(1.0 - factor).add_(mean.to(bn.running_mean.dtype), alpha=factor)
                bn.running_var.mul_(1.0 - factor).add_(unbiased.to(bn.running_var.dtype), alpha=factor)
        return _BNReLUFunction.apply(x, mean, invstd, bn.weight, bn.bias, self.op.weight, self.op.bias, self._spec())

    def extra_repr(self) -> str:
        mode = "exact" if self.bits is None else f"bits={self.bits}"
        return mode + (", naive=True" if self.naive else "")

    @classmethod
    def _validate_parts(cls, context: str, bn: nn.Module, relu: nn.Module, op: nn.Module, in_size: int) -> None:
        bn_name, op_name = cls._bn_type.__name__, cls._op_type.__name__
        if not isinstance(bn, cls._bn_type):
            raise FewBitError(f"{context}: the first module must be nn.{bn_name}, got {type(bn).__name__}")
        if not isinstance(relu, nn.ReLU):
            raise FewBitError(
                f"{context}: the second module must be nn.ReLU (BLPA needs an activation whose gradient depends "
                f"only on the sign), got {type(relu).__name__}"
            )
        if not isinstance(op, cls._op_type) or isinstance(op, nn.modules.lazy.LazyModuleMixin):
            raise FewBitError(f"{context}: the last module must be nn.{op_name}, got {type(op).__name__}")
        if isinstance(bn, nn.modules.lazy.LazyModuleMixin) and bn.has_uninitialized_params():
            raise FewBitError(f"{context}: lazy {type(bn).__name__} is not initialized yet; run one batch first")
        if not bn.affine:
            raise FewBitError(f"{context}: {bn_name} must have affine=True (BLPA quantizes A2 around beta +- 3|gamma|)")
        if bn.num_features != in_size:
            field = "in_channels" if cls._op_type is nn.Conv2d else "in_features"
            raise FewBitError(
                f"{context}: channels mismatch: {bn_name} has {bn.num_features} channels but {op_name} expects "
                f"{field}={in_size}"
            )
        if isinstance(op, nn.Conv2d) and op.padding_mode != "zeros":
            raise FewBitError(f"{context}: Conv2d padding_mode={op.padding_mode!r} is not supported, only 'zeros'")

    def _build(
        self,
        context: str,
        features: int,
        parts: list[nn.Module],
        make_op: Callable[..., nn.Module],
        bits: int | None,
        naive: bool,
        eps: float,
        momentum: float | None,
        device: Any,
        dtype: torch.dtype | None,
    ) -> None:
        """The units' ``__init__``: ``bits`` checked, a new BatchNorm of ``features`` channels, ``parts`` and the op
        ``make_op(device=device, dtype=dtype)``."""
        bits = _check_unit_bits(context, bits, naive)
        factory = {"device": device, "dtype": dtype}
        bn = self._bn_type(features, eps=eps, momentum=momentum, **factory)
        self._setup(bn, parts, make_op(**factory), bits, naive)

    @classmethod
    def _fuse(
        cls, context: str, bn: nn.Module, relu: nn.Module, op: nn.Module, in_size: int, bits: int | None, naive: bool
    ) -> _FusedUnit:
        """The units' ``from_modules``: the parts checked, then reused (parameters stay shared)."""
        bits = _check_unit_bits(context, bits, naive)
        cls._validate_parts(context, bn, relu, op, in_size)
        if isinstance(op, nn.Conv2d):
            _explicit_padding(context, op)
        unit = cls.__new__(cls)
        nn.Module.__init__(unit)
        unit._setup(bn, [relu], op, bits, naive)
        return unit


class BNReLUConv2d(_FusedUnit):
    """``BatchNorm2d -> ReLU -> Conv2d`` that stores ``bits`` bits per element of A2 for backward.

    State dict keys equal those of ``nn.Sequential(nn.BatchNorm2d(...), nn.ReLU(), nn.Conv2d(...))``
    ("0.weight", "0.bias", "0.running_mean", "0.running_var", "0.num_batches_tracked", "2.weight",
    and "2.bias" with a bias), so weights load either way. ``bits=None``: exact fused baseline; ``naive=True``: the
    paper's naive baseline.

    Examples:
        >>> unit = BNReLUConv2d(16, 32, 3, stride=2, padding=1, bits=4)
        >>> sorted(unit.state_dict())[:2]
        ['0.bias', '0.num_batches_tracked']

    Args:
        in_channels: as in ``nn.Conv2d`` (the BatchNorm's channels)
        out_channels: as in ``nn.Conv2d``
        kernel_size: as in ``nn.Conv2d``
        stride: as in ``nn.Conv2d``
        padding: as in ``nn.Conv2d``
        dilation: as in ``nn.Conv2d``
        groups: as in ``nn.Conv2d``
        bias: as in ``nn.Conv2d``
        bits: bits per element of A2, 2..8 (None: the exact fused baseline)
        naive: the paper's naive baseline (approximate activations in forward too)
        eps: as in the BatchNorm
        momentum: as in the BatchNorm
        device: as in torch.nn
        dtype: as in torch.nn
    """

    _kind = "conv2d"
    _bn_type = nn.BatchNorm2d
    _op_type = nn.Conv2d
    _op_name = "2"
    _input_ndim = 4

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = False,
        *,
        bits: int | None = 4,
        naive: bool = False,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        make_op = partial(nn.Conv2d, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias)
        self._build("BNReLUConv2d", in_channels, [nn.ReLU()], make_op, bits, naive, eps, momentum, device, dtype)

    @classmethod
    def from_modules(
        cls, bn: nn.Module, relu: nn.Module, conv: nn.Module, *, bits: int | None = 4, naive: bool = False
    ) -> BNReLUConv2d:
        """Fuse existing ``bn``, ``relu`` and ``conv`` modules (they are reused: parameters stay shared).

        Raises FewBitError for anything but ``BatchNorm2d(affine=True) -> ReLU -> Conv2d`` with matching channels.
        """
        return cls._fuse("BNReLUConv2d.from_modules", bn, relu, conv, getattr(conv, "in_channels", -1), bits, naive)


class BNReLULinear(_FusedUnit):
    """``BatchNorm1d -> ReLU -> Linear`` on (N, C) inputs, storing ``bits`` bits per element of A2 for backward.

    State dict keys equal those of ``nn.Sequential(nn.BatchNorm1d(...), nn.ReLU(), nn.Linear(...))``.

    Args:
        in_features: as in ``nn.Linear`` (the BatchNorm's features)
        out_features: as in ``nn.Linear``
        bias: as in ``nn.Linear``
        bits: bits per element of A2, 2..8 (None: the exact fused baseline)
        naive: the paper's naive baseline (approximate activations in forward too)
        eps: as in the BatchNorm
        momentum: as in the BatchNorm
        device: as in torch.nn
        dtype: as in torch.nn
    """

    _kind = "linear"
    _bn_type = nn.BatchNorm1d
    _op_type = nn.Linear
    _op_name = "2"
    _input_ndim = 2

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        bits: int | None = 4,
        naive: bool = False,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        make_op = partial(nn.Linear, in_features, out_features, bias)
        self._build("BNReLULinear", in_features, [nn.ReLU()], make_op, bits, naive, eps, momentum, device, dtype)

    @classmethod
    def from_modules(
        cls, bn: nn.Module, relu: nn.Module, linear: nn.Module, *, bits: int | None = 4, naive: bool = False
    ) -> BNReLULinear:
        """Fuse existing ``bn``, ``relu`` and ``linear`` modules (reused: parameters stay shared)."""
        return cls._fuse("BNReLULinear.from_modules", bn, relu, linear, getattr(linear, "in_features", -1), bits, naive)


class BNReLUPoolLinear(_FusedUnit):
    """Classifier head ``BatchNorm2d -> ReLU -> global average pool -> Linear``, stored with ``bits`` bits.

    Global average pooling is folded into the linear op (as the paper does). State dict keys equal those of
    ``nn.Sequential(nn.BatchNorm2d(C), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(C, classes))``.

    Args:
        in_channels: the BatchNorm's channels C
        out_features: the classes
        bias: as in ``nn.Linear``
        bits: bits per element of A2, 2..8 (None: the exact fused baseline)
        naive: the paper's naive baseline (approximate activations in forward too)
        eps: as in the BatchNorm
        momentum: as in the BatchNorm
        device: as in torch.nn
        dtype: as in torch.nn
    """

    _kind = "pool_linear"
    _bn_type = nn.BatchNorm2d
    _op_type = nn.Linear
    _op_name = "4"
    _input_ndim = 4

    def __init__(
        self,
        in_channels: int,
        out_features: int,
        bias: bool = True,
        *,
        bits: int | None = 4,
        naive: bool = False,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        parts = [nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        make_op = partial(nn.Linear, in_channels, out_features, bias)
        self._build("BNReLUPoolLinear", in_channels, parts, make_op, bits, naive, eps, momentum, device, dtype)
