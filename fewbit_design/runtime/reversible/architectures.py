"""Architectures: revnet, layerwise_net, hybrid_net and the plain resnet baseline."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...errors import FewBitError, check_choice, check_positive
from .couplings import AdditiveCoupling, InvertibleModule, ReversibleSequence
from .layers import BatchPool2d, ChannelPool2d, InvertibleBatchNorm2d, InvertibleConv2d, InvertibleLeakyReLU

POOLING_KINDS = ("channel", "batch")


# --------------------------------------------------------------------------------------------------------------
# Architectures.


class _ClassifierHead(nn.Module):
    """Not reversible: average over space and over the copies made by batch pooling, then a linear layer."""

    def __init__(self, channels: int, num_classes: int, batch_factor: int):
        super().__init__()
        self.batch_factor = batch_factor
        self.linear = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        features = x.reshape(self.batch_factor, n // self.batch_factor, c, h, w).mean(dim=(0, 3, 4))
        return self.linear(features)


class ReversibleNet(nn.Module):
    """A stem convolution (not reversible), a body and a classifier head.

    Attributes:
        arch: 'revnet', 'layerwise', 'hybrid' or 'resnet'.
        stem: ``nn.Conv2d(in_channels, channels, 3)``.
        body: a :class:`ReversibleSequence` (a plain ``nn.Sequential`` for 'resnet').
        head: average pooling (undoing batch pooling) and ``nn.Linear``.
    """

    def __init__(self, arch: str, stem: nn.Module, body: nn.Module, head: nn.Module):
        super().__init__()
        self.arch = arch
        self.stem = stem
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)))


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise FewBitError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _stage_depths(depth: int, stages: int) -> list[int]:
    """``depth`` units spread over ``stages`` stages, the earlier stages taking the remainder."""
    return [depth // stages + (1 if i < depth % stages else 0) for i in range(stages)]


def _plan(
    arch: str, depth: int, channels: int, pooling: Sequence[str], input_size: tuple[int, int] | None, multiple: int
) -> list[tuple[int, int, str | None]]:
    """Check the shape of every stage at construction; return (units, channels, pool after) per stage."""
    _check_int(f"{arch} depth", depth, 1)
    _check_int(f"{arch} channels", channels, 1)
    if isinstance(pooling, str):
        pooling = [p.strip() for p in pooling.split(",") if p.strip()]
    pooling = [check_choice(f"{arch} pooling kind", kind, POOLING_KINDS) for kind in pooling]
    size = None if input_size is None else tuple(input_size)
    if size is not None and (
        len(size) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in size)
    ):
        raise FewBitError(f"{arch} input_size must be (height, width), two positive integers, got {input_size!r}")
    plan = []
    width = channels
    for stage, units in enumerate(_stage_depths(depth, len(pooling) + 1)):
        if width % multiple:
            raise FewBitError(
                f"{arch} stage {stage} has {width} channels, which its invertible blocks cannot split: "
                f"channels must be divisible by {multiple}"
            )
        kind = pooling[stage] if stage < len(pooling) else None
        if kind is not None and size is not None:
            if size[0] % 2 or size[1] % 2:
                raise FewBitError(
                    f"{arch} pooling {stage} ({kind}) stacks 2x2 blocks, but stage {stage} has an odd spatial size "
                    f"{size[0]}x{size[1]} (input_size={tuple(input_size)})"
                )
            size = (size[0] // 2, size[1] // 2)
        plan.append((units, width, kind))
        if kind == "channel":
            width *= 4
    return plan


def _make_pool(kind: str) -> InvertibleModule:
    return ChannelPool2d() if kind == "channel" else BatchPool2d()


def _finish(arch: str, in_channels: int, channels: int, num_classes: int, plan, blocks, reconstruct: bool):
    _check_int(f"{arch} in_channels", in_channels, 1)
    _check_int(f"{arch} num_classes", num_classes, 1)
    stem = nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)
    out_channels = plan[-1][1]
    batch_factor = 4 ** sum(1 for _, _, kind in plan if kind == "batch")
    body = ReversibleSequence(*blocks, reconstruct=reconstruct) if arch != "resnet" else nn.Sequential(*blocks)
    return ReversibleNet(arch, stem, body, _ClassifierHead(out_channels, num_classes, batch_factor))


def _bn_relu_conv(channels: int, dropout: float) -> nn.Sequential:
    layers: list[nn.Module] = [nn.BatchNorm2d(channels), nn.ReLU()]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Conv2d(channels, channels, 3, padding=1, bias=False))
    return nn.Sequential(*layers)


def _check_dropout(arch: str, dropout: float) -> float:
    p = float(dropout)
    if not 0.0 <= p < 1.0:
        raise FewBitError(f"{arch} dropout must be in [0, 1), got {dropout!r}")
    return p


def _branch_scale(arch: str, branch_scale: float | None, depth: int) -> float:
    """The branch scale ``h`` of every coupling: ``1 / depth`` by default (a flow of total time 1)."""
    if branch_scale is None:
        return 1.0 / depth
    return check_positive(f"{arch} branch_scale", branch_scale)


def revnet(
    depth: int,
    channels: int,
    *,
    pooling: Sequence[str] = ("channel", "batch"),
    in_channels: int = 3,
    num_classes: int = 10,
    input_size: tuple[int, int] | None = None,
    dropout: float = 0.0,
    branch_scale: float | None = None,
    reconstruct: bool = True,
) -> ReversibleNet:
    """RevNet-style network: ``depth`` additive couplings whose ``f`` and ``g`` are BN-ReLU-conv-BN-ReLU-conv
    stacks on half the channels (dropout before the second convolution when ``dropout > 0``), in
    ``len(pooling) + 1`` stages separated by invertible poolings ('channel' multiplies the channels by 4,
    'batch' keeps them). Activation memory does not grow with ``depth``.

    Args:
        in_channels: input image channels
        num_classes: outputs of the head
        dropout: dropout probability inside ``f`` and ``g`` (replayed in backward)
        depth: number of couplings, spread over the stages.
        channels: channels after the stem (even).
        pooling: pooling kind after each stage but the last.
        input_size: (height, width) of the input; when given, odd spatial sizes at a pooling are rejected at
            construction (otherwise at the first forward).
        branch_scale: the scale ``h`` of ``f`` and ``g`` in every coupling (``y1 = x1 + h f(x2)``, ...);
            ``None`` (default) is ``1 / depth``, 1.0 is the unscaled RevNet block. See :func:`hybrid_net` for why:
            in float32 at initialisation the reconstructed input of the unscaled net loses about 5-11 dB per
            doubling of depth (138, 128, 114, 103, 92 dB at depth 1, 4, 16, 32, 64), the scaled one none
            (138, 142, 142, 142, 142 dB).
        reconstruct: ``False`` stores every activation with plain autograd (the oracle).
    """
    p = _check_dropout("revnet", dropout)
    plan = _plan("revnet", depth, channels, pooling, input_size, 2)
    h = _branch_scale("revnet", branch_scale, depth)
    blocks: list[nn.Module] = []
    for units, width, kind in plan:
        for _ in range(units):
            half = width // 2
            f = nn.Sequential(*_bn_relu_conv(half, 0.0), *_bn_relu_conv(half, p))
            g = nn.Sequential(*_bn_relu_conv(half, 0.0), *_bn_relu_conv(half, p))
            blocks.append(AdditiveCoupling(f, g, scale=h))
        if kind is not None:
            blocks.append(_make_pool(kind))
    return _finish("revnet", in_channels, channels, num_classes, plan, blocks, reconstruct)


def _invertible_unit(channels: int, negative_slope: float, gamma_floor: float) -> list[InvertibleModule]:
    return [
        InvertibleBatchNorm2d(channels, gamma_floor=gamma_floor),
        InvertibleLeakyReLU(negative_slope),
        InvertibleConv2d(channels),
    ]


def layerwise_net(
    depth: int,
    channels: int,
    *,
    pooling: Sequence[str] = ("channel", "batch"),
    negative_slope: float = 0.2,
    gamma_floor: float = 0.1,
    in_channels: int = 3,
    num_classes: int = 10,
    input_size: tuple[int, int] | None = None,
    reconstruct: bool = True,
) -> ReversibleNet:
    """Layer-wise invertible network (section 4.3): ``depth`` units of InvertibleBatchNorm2d ->
    InvertibleLeakyReLU -> InvertibleConv2d, with invertible poolings between stages, all in one
    :class:`ReversibleSequence` of single layers. Backward reconstructs every layer's input from the layer above,
    so errors compound over the 2 x depth batch-norm and leaky-ReLU inverses (SNR falls with depth).

    Args:
        depth: number of units, spread over the stages
        channels: channels after the stem (even)
        pooling: pooling kind after each stage but the last (``'channel'`` or ``'batch'``)
        negative_slope: the leaky ReLUs' slope
        gamma_floor: the batch norms' scale floor
        in_channels: input image channels
        num_classes: outputs of the head
        input_size: (height, width) of the input; when given, odd spatial sizes at a pooling are rejected at
            construction
        reconstruct: ``False`` stores every activation with plain autograd (the oracle)
    """
    check_positive("layerwise_net negative_slope", negative_slope)
    plan = _plan("layerwise_net", depth, channels, pooling, input_size, 2)
    blocks: list[nn.Module] = []
    for units, width, kind in plan:
        for _ in range(units):
            blocks.extend(_invertible_unit(width, negative_slope, gamma_floor))
        if kind is not None:
            blocks.append(_make_pool(kind))
    return _finish("layerwise", in_channels, channels, num_classes, plan, blocks, reconstruct)


def hybrid_net(
    depth: int,
    channels: int,
    *,
    pooling: Sequence[str] = ("channel", "batch"),
    negative_slope: float = 0.2,
    gamma_floor: float = 0.1,
    units_per_function: int = 2,
    in_channels: int = 3,
    num_classes: int = 10,
    input_size: tuple[int, int] | None = None,
    branch_scale: float | None = None,
    reconstruct: bool = True,
) -> ReversibleNet:
    """Hybrid network (section 4.4): ``depth`` additive couplings whose ``f`` and ``g`` are layer-wise invertible
    chains of ``units_per_function`` units (InvertibleBatchNorm2d -> InvertibleLeakyReLU -> InvertibleConv2d) on
    half the channels. Block inputs are reconstructed by the couplings' inverses (stable); hidden activations
    inside ``f`` and ``g`` by layer-wise inverses along the gradient, so no block keeps its hidden activations
    (no local bottleneck) and errors do not compound across blocks. Channels must be divisible by 4.

    Args:
        pooling: pooling kind after each stage but the last (``'channel'`` or ``'batch'``)
        negative_slope: the leaky ReLUs' slope
        gamma_floor: the batch norms' scale floor
        in_channels: input image channels
        num_classes: outputs of the head
        input_size: (height, width) of the input; when given, odd spatial sizes at a pooling are rejected at
            construction
        units_per_function: layer-wise units in each ``f`` and ``g``
        branch_scale: the scale ``h`` of ``f`` and ``g`` in every coupling: ``y1 = x1 + h f(x2)``,
            ``y2 = x2 + h g(y1)``. ``None`` (default) is ``1 / depth``; 1.0 is the unscaled block of the paper.
            Inverse, gradients (equal to the store-everything network's), saved bytes and running statistics do
            not depend on it; a 1-block net is the same either way.

    Why ``h = 1 / depth``. The couplings' inverse is exact in real arithmetic, but in floating point its error
    grows with depth unless the total size of the branches is bounded. Each branch starts with a batch norm, so
    its Jacobian with respect to its input is of order ``h G / sigma`` (``sigma`` the stream's per-channel
    spread, ``G`` the branch's gain): the inverse ``x1 = y1 - h f(x2)`` hands the error of ``x2`` on to ``x1``
    amplified by about ``1 + h G / sigma``, and every coupling adds a rounding error proportional to ``sigma``.
    Unscaled, every branch adds an O(1) term correlated with the stream (identity-plus convolutions fed by a
    normalised signal), so ``sigma`` grows linearly with depth and the error gains ``1 + G / sigma_k`` multiply
    to a power of the depth. Measured at initialisation (float32, 8 channels, batch 4, 8x8, slope 0.1, depth 32):
    the stream's RMS goes from 0.55 (first block) to 29 (last); the error gains of the first blocks are 6.0, 2.3,
    1.8, 1.4 and their product over the 32 blocks is 900 (59 dB), on top of the 34 dB by which the last
    rounding error (relative to a stream 53 times larger than the input) exceeds the input's; the SNR of the
    reconstructed input is 133, 119, 106, 90, 76, 64, 48 dB at depth 1, 2, 4, 8, 16, 32, 64 (14 dB per
    doubling; the paper's alpha_Rev, by noise injection in float64: 16 dB for the first block, 47 dB summed).
    With ``h = 1 / depth`` the couplings are steps of a flow of total time 1 (the leapfrog view of reversible
    networks, Haber & Ruthotto 2017, Chang et al. 2018), so the stream stays bounded (RMS 0.55 to 1.1) and the
    product of the error gains is at most ``exp(G / sigma_0)`` whatever the depth (measured: 21, 26 dB;
    alpha_Rev 0.1-0.2 dB per block, 7 dB summed): the SNR is 133, 131, 130, 128, 127, 127, 126 dB at the same
    depths, flat (over 30 seeds, depth 32 within -1.3 to 4.7 dB of depth 4, against 37 to 50 dB unscaled), as
    in the paper's figure 10. Like SkipInit or Fixup this starts a deep network nearer the identity; the
    branches' batch-norm scales stay learnable, so training can still grow them.
    """
    check_positive("hybrid_net negative_slope", negative_slope)
    units = _check_int("hybrid_net units_per_function", units_per_function, 1)
    plan = _plan("hybrid_net", depth, channels, pooling, input_size, 4)
    h = _branch_scale("hybrid_net", branch_scale, depth)
    blocks: list[nn.Module] = []
    for count, width, kind in plan:
        for _ in range(count):
            half = width // 2
            f = ReversibleSequence(
                *[m for _ in range(units) for m in _invertible_unit(half, negative_slope, gamma_floor)],
                reconstruct=reconstruct,
            )
            g = ReversibleSequence(
                *[m for _ in range(units) for m in _invertible_unit(half, negative_slope, gamma_floor)],
                reconstruct=reconstruct,
            )
            blocks.append(AdditiveCoupling(f, g, scale=h))
        if kind is not None:
            blocks.append(_make_pool(kind))
    return _finish("hybrid", in_channels, channels, num_classes, plan, blocks, reconstruct)


class _ResidualBlock(nn.Module):
    """``x + F(x)``, F = BN-ReLU-conv(c -> c/2)-BN-ReLU-conv(c/2 -> c): as many weights as a RevNet coupling."""

    def __init__(self, channels: int):
        super().__init__()
        half = channels // 2
        self.residual = nn.Sequential(
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, half, 3, padding=1, bias=False),
            nn.BatchNorm2d(half),
            nn.ReLU(),
            nn.Conv2d(half, channels, 3, padding=1, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.residual(x)


def resnet(
    depth: int,
    channels: int,
    *,
    pooling: Sequence[str] = ("channel", "batch"),
    in_channels: int = 3,
    num_classes: int = 10,
    input_size: tuple[int, int] | None = None,
) -> ReversibleNet:
    """A plain (vanilla) residual network with the stages and poolings of :func:`revnet` and as many weights:
    every activation is stored, so its memory grows linearly with ``depth``. The baseline of the benchmarks.

    Args:
        depth: number of residual blocks
        channels: channels after the stem
        pooling: pooling kind after each stage but the last
        in_channels: input image channels
        num_classes: outputs of the head
        input_size: (height, width) of the input, checked at construction when given
    """
    plan = _plan("resnet", depth, channels, pooling, input_size, 2)
    blocks: list[nn.Module] = []
    for units, width, kind in plan:
        blocks.extend(_ResidualBlock(width) for _ in range(units))
        if kind is not None:
            blocks.append(_make_pool(kind))
    return _finish("resnet", in_channels, channels, num_classes, plan, blocks, False)
