"""Layer-wise invertible layers (section 4.2): batch norm, leaky ReLU, convolution, and the 2x2 poolings."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FewBitError, check_positive
from ._autograd import State
from .couplings import AdditiveCoupling, InvertibleModule

# --------------------------------------------------------------------------------------------------------------
# Layer-wise invertible layers (section 4.2).


def _check_image(x: torch.Tensor, owner: str) -> None:
    if x.dim() != 4:
        raise FewBitError(f"{owner} expects a 4-D input (batch, channels, height, width), got shape {tuple(x.shape)}")


class InvertibleBatchNorm2d(InvertibleModule, nn.BatchNorm2d):
    """Batch normalization with an inverse (section 4.2.1) and a lower bound on the scale.

    Forward: ``y = s * (x - mean) / sqrt(var + eps) + beta`` per channel, where ``mean`` and ``var`` are the batch
    mean and *biased* variance in training mode (the running statistics in eval mode) and the effective scale is

        ``s = sign(gamma) * (|gamma| + gamma_floor)``   (sign(0) taken as +1)

    so ``|s| >= gamma_floor`` always: the floor of section 4.2.1 (the paper's epsilon_i added to |gamma|). It keeps
    the inverse finite as gamma crosses zero, and bounds the SNR reduction factor (see
    :func:`~fewbit_design.design.snr.batchnorm_alpha`), since that factor grows with the spread of the |s| across
    channels.
    Its derivative with respect to gamma is 1 everywhere (gamma = 0 included), so training is unaffected otherwise.

    Inverse: ``x = (y - beta) * sqrt(var + eps) / s + mean``, with exactly the statistics used in forward: in
    training mode those of the most recent forward call (``last_mean``, ``last_var``; inside a
    :class:`ReversibleSequence` they are saved for backward per call), in eval mode the running statistics.

    Running statistics follow ``nn.BatchNorm2d`` (unbiased variance, ``momentum``, ``num_batches_tracked``).

    Args:
        num_features: channels C
        gamma_floor: the lower bound added to |gamma| (above)
        eps: as in ``nn.BatchNorm2d``
        momentum: as in ``nn.BatchNorm2d``
        track_running_stats: as in ``nn.BatchNorm2d``
        device: as in torch.nn
        dtype: as in torch.nn
    """

    def __init__(
        self,
        num_features: int,
        *,
        gamma_floor: float = 0.1,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
    ):
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise FewBitError(f"InvertibleBatchNorm2d num_features must be a positive integer, got {num_features!r}")
        floor = float(gamma_floor)
        if not math.isfinite(floor) or floor < 0:
            raise FewBitError(f"InvertibleBatchNorm2d gamma_floor must be a finite number >= 0, got {gamma_floor!r}")
        check_positive("InvertibleBatchNorm2d eps", eps)
        nn.BatchNorm2d.__init__(
            self,
            num_features,
            eps=eps,
            momentum=momentum,
            affine=True,
            track_running_stats=track_running_stats,
            device=device,
            dtype=dtype,
        )
        self.gamma_floor = floor
        self.last_mean: torch.Tensor | None = None
        self.last_var: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return super().extra_repr() + f", gamma_floor={self.gamma_floor}"

    def effective_weight(self) -> torch.Tensor:
        """The scale actually applied: ``sign(gamma) * (|gamma| + gamma_floor)``."""
        w = self.weight
        return torch.where(w >= 0, w + self.gamma_floor, w - self.gamma_floor)

    def _uses_batch_stats(self) -> bool:
        return self.training or self.running_mean is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_image(x, type(self).__name__)
        if x.shape[1] != self.num_features:
            raise FewBitError(
                f"InvertibleBatchNorm2d({self.num_features}) got an input with {x.shape[1]} channels "
                f"(shape {tuple(x.shape)})"
            )
        if self._uses_batch_stats():
            count = x.numel() // x.shape[1]
            if self.training and count < 2:
                raise FewBitError(
                    f"InvertibleBatchNorm2d needs more than 1 value per channel in training, got shape {tuple(x.shape)}"
                )
            mean = x.mean(dim=(0, 2, 3))
            var = (x - mean[None, :, None, None]).square().mean(dim=(0, 2, 3))  # biased
            if self.training and self.track_running_stats:
                self._update_running_stats(mean.detach(), var.detach(), count)
        else:
            mean, var = self.running_mean, self.running_var
        self.last_mean, self.last_var = mean.detach(), var.detach()
        return self._normalize(x, mean, var)

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
            unbiased = var * (count / (count - 1))
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

    def _normalize(self, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        scale = self.effective_weight() * torch.rsqrt(var + self.eps)
        return (x - mean[None, :, None, None]) * scale[None, :, None, None] + self.bias[None, :, None, None]

    def _invert(self, y: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        _check_image(y, type(self).__name__)
        factor = torch.sqrt(var + self.eps) / self.effective_weight()
        return (y - self.bias[None, :, None, None]) * factor[None, :, None, None] + mean[None, :, None, None]

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        if self._uses_batch_stats():
            if self.last_mean is None:
                raise FewBitError("InvertibleBatchNorm2d.inverse in training mode needs a forward call first")
            return self._invert(y, self.last_mean, self.last_var)
        return self._invert(y, self.running_mean, self.running_var)

    def _forward_keep(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        y = self(x)
        return y, ((self.last_mean, self.last_var) if self._uses_batch_stats() else ())

    def _inverse_kept(self, y: torch.Tensor, state: State) -> torch.Tensor:
        if state:
            return self._invert(y, *state)
        return self._invert(y, self.running_mean, self.running_var)


class InvertibleLeakyReLU(InvertibleModule):
    """Leaky ReLU with its inverse (section 4.2.2): ``y = x`` for ``x >= 0`` else ``n x``; ``x = y`` for
    ``y >= 0`` else ``y / n``.

    The slope ``n`` sets the SNR reduction factor of the inverse, ``(1 + n^2)^2 / (4 n^2)``
    (:func:`fewbit_design.design.snr.leaky_relu_alpha`): 1.56 for n = 0.5, 6.8 for 0.2, 26 for 0.1. Hence the default
    0.2 rather than torch's 0.01 (whose factor, 2500, leaves nothing of a float32 signal after 5 layers).

    Args:
        negative_slope: the slope n (> 0, so the inverse exists)
    """

    def __init__(self, negative_slope: float = 0.2):
        super().__init__()
        self.negative_slope = check_positive("InvertibleLeakyReLU negative_slope", negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, self.negative_slope)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return torch.where(y >= 0, y, y / self.negative_slope)


class InvertibleConv2d(AdditiveCoupling):
    """An invertible convolution (section 4.3.3): a coupling whose ``f`` and ``g`` are single convolutions of
    ``channels / 2`` to ``channels / 2`` channels, same padding, so the shape is kept.

    Raises :class:`FewBitError` at construction when ``channels`` is odd (the halves would not match) or the
    kernel size is even (the spatial size would change).

    Args:
        channels: channels (even)
        kernel_size: odd kernel size
        bias: whether the convolutions have a bias
        device: as in torch.nn
        dtype: as in torch.nn
    """

    def __init__(
        self, channels: int, *, kernel_size: int = 3, bias: bool = True, device: Any = None, dtype: Any = None
    ):
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 2 or channels % 2:
            raise FewBitError(
                f"InvertibleConv2d couples two halves of the channels, so channels must be an even integer >= 2, "
                f"got {channels!r}"
            )
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise FewBitError(f"InvertibleConv2d kernel_size must be an odd positive integer, got {kernel_size!r}")
        half = channels // 2
        options = dict(padding=kernel_size // 2, bias=bias, device=device, dtype=dtype)
        super().__init__(nn.Conv2d(half, half, kernel_size, **options), nn.Conv2d(half, half, kernel_size, **options))
        self.channels = channels

    def extra_repr(self) -> str:
        return f"channels={self.channels}"


class _Pool2d(InvertibleModule):
    """Shared checks of the two volume-preserving 2x2 poolings."""

    def __init__(self, *, input_size: tuple[int, int] | None = None):
        super().__init__()
        if input_size is not None:
            _check_even_size(tuple(input_size), type(self).__name__)

    def _check(self, x: torch.Tensor) -> None:
        _check_image(x, type(self).__name__)
        h, w = x.shape[-2:]
        if h % 2 or w % 2:
            raise FewBitError(
                f"{type(self).__name__} stacks 2x2 blocks, so height and width must be even, "
                f"got an input of shape {tuple(x.shape)}"
            )

    def _reverse(self, y, grad_y, state, params):
        # A permutation of elements: its Jacobian transpose is its inverse.
        with torch.no_grad():
            return self.inverse(y), self.inverse(grad_y), []


def _check_even_size(size: tuple[int, ...], owner: str) -> None:
    if len(size) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 2 or s % 2 for s in size):
        raise FewBitError(f"{owner} stacks 2x2 blocks, so height and width must be even integers, got {size!r}")


class ChannelPool2d(_Pool2d):
    """Invertible pooling into channels (i-RevNet; section 4.2.4, P_c): ``(b, c, h, w) -> (b, 4c, h/2, w/2)``.

    Output channel ``4 k + 2 i + j`` holds the element at offset ``(i, j)`` of each 2x2 block of input channel
    ``k`` (``F.pixel_unshuffle``). Height and width must be even (not necessarily equal).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return F.pixel_unshuffle(x, 2)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        _check_image(y, type(self).__name__)
        if y.shape[1] % 4:
            raise FewBitError(f"ChannelPool2d.inverse needs channels divisible by 4, got shape {tuple(y.shape)}")
        return F.pixel_shuffle(y, 2)


class BatchPool2d(_Pool2d):
    """Invertible pooling into the batch (section 4.2.4, P_b): ``(b, c, h, w) -> (4b, c, h/2, w/2)``.

    Output sample ``(2 i + j) b + n`` is the sub-image at offset ``(i, j)`` of the 2x2 blocks of input sample
    ``n``: four quarter-resolution copies of the batch, one after another. Channels stay the same, so the
    parameters of later convolutions do not grow. Height and width must be even (not necessarily equal).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        b, c, h, w = x.shape
        blocks = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(3, 5, 0, 1, 2, 4)
        return blocks.reshape(4 * b, c, h // 2, w // 2)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        _check_image(y, type(self).__name__)
        b4, c, h, w = y.shape
        if b4 % 4:
            raise FewBitError(f"BatchPool2d.inverse needs a batch divisible by 4, got shape {tuple(y.shape)}")
        blocks = y.reshape(2, 2, b4 // 4, c, h, w).permute(2, 3, 4, 0, 5, 1)
        return blocks.reshape(b4 // 4, c, 2 * h, 2 * w)
