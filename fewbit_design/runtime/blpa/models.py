"""The paper's CIFAR network: a pre-activation bottleneck ResNet built from fused BLPA units."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FewBitError
from .nn import BNReLUConv2d, BNReLUPoolLinear, _check_unit_bits

__all__ = ["PreActBottleneck", "PreActResNet", "preact_resnet"]


class PreActBottleneck(nn.Module):
    """Pre-activation bottleneck residual unit (He et al. 2016) built from three fused BN-ReLU-Conv units.

    The shortcut is parameter-free: identity, or a strided subsample with zero-padded extra channels.

    Args:
        in_channels: input channels
        planes: bottleneck channels (the output has 4x)
        stride: stride of the middle convolution and the shortcut
        bits: bits per element (None: exact fused)
        naive: the paper's naive baseline
    """

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1, *, bits: int | None = 4, naive: bool = False):
        super().__init__()
        out_channels = planes * self.expansion
        self.units = nn.Sequential(
            BNReLUConv2d(in_channels, planes, 1, bits=bits, naive=naive),
            BNReLUConv2d(planes, planes, 3, stride=stride, padding=1, bits=bits, naive=naive),
            BNReLUConv2d(planes, out_channels, 1, bits=bits, naive=naive),
        )
        self.stride = stride
        self.extra_channels = out_channels - in_channels
        assert self.extra_channels >= 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        if self.stride != 1:
            shortcut = shortcut[:, :, :: self.stride, :: self.stride]
        if self.extra_channels:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, 0, self.extra_channels))
        return self.units(x) + shortcut


class PreActResNet(nn.Module):
    """CIFAR-style pre-activation bottleneck ResNet of depth 9n + 2 (see :func:`preact_resnet`).

    Args:
        blocks_per_stage: n, units per stage
        num_classes: outputs of the head
        bits: bits per element (None: exact fused)
        width: multiplies every stage's channels
        naive: the paper's naive baseline
        in_channels: input image channels
    """

    def __init__(
        self,
        blocks_per_stage: int,
        num_classes: int = 10,
        *,
        bits: int | None = 4,
        width: int = 1,
        naive: bool = False,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        base = 16 * width
        self.stem = nn.Conv2d(in_channels, base, 3, padding=1, bias=False)
        stages = []
        channels = base
        for index, planes in enumerate((base, 2 * base, 4 * base)):
            blocks = []
            for block in range(blocks_per_stage):
                stride = 2 if index > 0 and block == 0 else 1
                blocks.append(PreActBottleneck(channels, planes, stride, bits=bits, naive=naive))
                channels = planes * PreActBottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.head = BNReLUPoolLinear(channels, num_classes, bits=bits, naive=naive)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def preact_resnet(
    depth: int,
    num_classes: int = 10,
    *,
    bits: int | None = 4,
    width: int = 1,
    naive: bool = False,
    in_channels: int = 3,
) -> PreActResNet:
    """The paper's pre-activation bottleneck ResNet for CIFAR: depth 9n + 2 (164: n = 18, 1001: n = 111).

    Stages of n bottleneck units with 16, 32, 64 (times ``width``) bottleneck channels and 4x that on the residual
    path, parameter-free shortcuts, a 3x3 stem convolution and a BN-ReLU-pool-linear head. Every BN-ReLU-Conv is a
    fused unit storing ``bits`` bits per element (``bits=None``: exact fused baseline; ``naive=True``: naive).

    >>> model = preact_resnet(20, bits=4)
    >>> model(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])

    Args:
        depth: 9n + 2
        num_classes: outputs of the head
        bits: bits per element (None: exact fused)
        width: multiplies every stage's channels
        naive: the paper's naive baseline
        in_channels: input image channels
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 11 or (depth - 2) % 9:
        raise FewBitError(
            f"preact_resnet: depth must be 9n + 2 with n >= 1 (11, 20, ..., 164, ..., 1001), got {depth!r}"
        )
    for name, value in (("num_classes", num_classes), ("width", width), ("in_channels", in_channels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FewBitError(f"preact_resnet: {name} must be a positive integer, got {value!r}")
    bits = _check_unit_bits("preact_resnet", bits, naive)
    return PreActResNet((depth - 2) // 9, num_classes, bits=bits, width=width, naive=naive, in_channels=in_channels)
