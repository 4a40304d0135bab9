"""Reconstruction SNR: how much signal the inverses lose, measured per block on a real backward pass."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import FewBitError, check_positive
from ._autograd import _Recorder, frozen_running_stats, recording
from .couplings import InvertibleModule, ReversibleSequence

# --------------------------------------------------------------------------------------------------------------
# Reconstruction SNR.


@dataclass(frozen=True)
class LayerSNR:
    """The reconstruction of one invertible block's input during backward.

    Attributes:
        name: qualified module name in the model.
        kind: the block's class name.
        snr_db: ``10 log10(mean(z^2) / mean((z - z_reconstructed)^2))``; ``inf`` when exact, ``nan`` when the
            reconstruction is not finite.
        signal: ``mean(z^2)``.
        noise: ``mean((z - z_reconstructed)^2)``.
        channel_mean, channel_var: per-channel mean and biased variance of the forward input ``z``.
        positive_fraction: fraction of elements of ``z`` that are >= 0.
        positive_energy: fraction of ``sum(z^2)`` carried by those elements.
        module: the block itself (for its parameters: batch-norm scales, leaky-ReLU slope).
        sequence: qualified name of the :class:`ReversibleSequence` the block belongs to.
        alpha: the block's SNR reduction factor measured by noise injection on ``z``
            (:func:`inverse_snr_factor`), when asked for with ``alphas=True``; else ``None``.
        roundtrip_snr_db: SNR of ``inverse(forward(z))`` against ``z`` for this block alone, in the model's dtype
            (its own rounding error), with ``alphas=True``; else ``None``.
    """

    name: str
    kind: str
    snr_db: float
    signal: float
    noise: float
    channel_mean: tuple[float, ...]
    channel_var: tuple[float, ...]
    positive_fraction: float
    positive_energy: float
    module: nn.Module
    sequence: str = ""
    alpha: float | None = None
    roundtrip_snr_db: float | None = None


def _snr_db(z: torch.Tensor, z_hat: torch.Tensor) -> tuple[float, float, float]:
    """(SNR in dB, signal power, noise power) of ``z_hat`` as an estimate of ``z``, computed in float64."""
    z = z.double()
    signal = float(z.square().mean())
    noise = float((z - z_hat.double()).square().mean())
    if not math.isfinite(noise):
        return math.nan, signal, noise
    if noise == 0:
        return math.inf, signal, noise
    return (10 * math.log10(signal / noise) if signal > 0 else -math.inf), signal, noise


def _roundtrip_snr_db(block: InvertibleModule, z: torch.Tensor) -> float:
    with torch.no_grad(), frozen_running_stats(block):
        y, state = block._forward_keep(z)
        return _snr_db(z, block._inverse_kept(y, state))[0]


def _layer_snr(
    name: str,
    block: nn.Module,
    z: torch.Tensor,
    z_hat: torch.Tensor,
    sequence: str,
    alpha: float | None,
    roundtrip: float | None,
) -> LayerSNR:
    snr_db, signal, noise = _snr_db(z, z_hat)
    z = z.double()
    dims = [d for d in range(z.dim()) if d != 1] if z.dim() > 1 else [0]
    channel_mean = z.mean(dim=dims).reshape(-1)
    channel_var = (z - z.mean(dim=dims, keepdim=True)).square().mean(dim=dims).reshape(-1)
    positive = z >= 0
    energy = float(z.square().sum())
    return LayerSNR(
        name=name,
        kind=type(block).__name__,
        snr_db=snr_db,
        signal=signal,
        noise=noise,
        channel_mean=tuple(channel_mean.tolist()),
        channel_var=tuple(channel_var.tolist()),
        positive_fraction=float(positive.double().mean()),
        positive_energy=float(z.square()[positive].sum()) / energy if energy > 0 else 0.5,
        module=block,
        sequence=sequence,
        alpha=alpha,
        roundtrip_snr_db=roundtrip,
    )


def reconstruction_snr(
    model: nn.Module,
    x: torch.Tensor,
    *,
    grad_output: torch.Tensor | None = None,
    seed: int = 0,
    alphas: bool = False,
    noise: float = 1e-4,
) -> list[LayerSNR]:
    """Per-block SNR of the activations reconstructed by backward, on one real forward and backward.

    Every block of every :class:`ReversibleSequence` in ``model`` is measured: its input ``z`` as computed in
    forward against the input ``z_reconstructed`` that backward rebuilt from the block's output. The errors come
    only from floating-point rounding in forward and in the inverses (run the model in float32 to see the
    paper's figures 10-11). Results are in forward order (for the hybrid, a coupling comes before the layers of
    its ``f`` and ``g``).

    The model's parameters, gradients (``.grad``) and buffers (running statistics) are left as they were;
    the gradient fed to the output is ``grad_output`` or a fixed random tensor drawn from ``seed``. With
    ``alphas=True`` each block's SNR reduction factor is also measured by injecting white noise of relative
    amplitude ``noise`` at its output (:func:`inverse_snr_factor`, on the block's forward input), and its own
    round-trip error ``inverse(forward(z))`` in the model's dtype.
    """
    if not isinstance(model, nn.Module):
        raise FewBitError(f"reconstruction_snr needs an nn.Module, got {type(model).__name__}")
    sequences = [m for m in model.modules() if isinstance(m, ReversibleSequence)]
    if not any(s.reconstruct for s in sequences):
        raise FewBitError("reconstruction_snr needs a model with a ReversibleSequence built with reconstruct=True")
    names = {id(m): name for name, m in model.named_modules()}
    parents = {id(block): names.get(id(seq), "") for seq in sequences for block in seq.blocks}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    inputs = [p for p in model.parameters() if p.requires_grad]
    if x.requires_grad:
        inputs.append(x)
    if not inputs:
        raise FewBitError("reconstruction_snr needs parameters or an input that require grad, to run backward")
    recorder = _Recorder()
    try:
        with recording(recorder), torch.enable_grad():
            output = model(x)
            if grad_output is None:
                generator = torch.Generator(device="cpu").manual_seed(seed)
                grad_output = torch.randn(output.shape, generator=generator, dtype=torch.float64)
            recorder.phase = "backward"
            torch.autograd.grad(output, inputs, grad_output.to(output.dtype).to(output.device), allow_unused=True)
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    results = []
    for block in recorder.order:
        forward_inputs = recorder.inputs[id(block)]
        rebuilt = list(reversed(recorder.reconstructed.get(id(block), [])))
        for call, z in enumerate(forward_inputs):
            if call >= len(rebuilt):
                continue  # not reconstructed (e.g. a sequence run with plain autograd)
            name = names.get(id(block), type(block).__name__)
            if len(forward_inputs) > 1:
                name = f"{name}[{call}]"
            alpha = roundtrip = None
            if alphas:
                alpha = inverse_snr_factor(block, z, noise=noise, seed=seed)
                roundtrip = _roundtrip_snr_db(block, z)
            results.append(_layer_snr(name, block, z, rebuilt[call], parents.get(id(block), ""), alpha, roundtrip))
    return results


def inverse_snr_factor(block: InvertibleModule, x: torch.Tensor, *, noise: float = 1e-6, seed: int = 0) -> float:
    """The SNR reduction factor ``alpha = SNR_y / SNR_x`` of ``block``'s inverse, measured by noise injection.

    The paper's definition (section 4.1) taken literally: ``y = block(x)``; white Gaussian noise ``e_y`` of
    standard deviation ``noise * rms(y)`` is added to ``y``; the inverse (with the statistics of this forward)
    gives ``x_hat``; ``SNR_y = |y|^2 / |e_y|^2`` and ``SNR_x = |x|^2 / |x_hat - x|^2``. Run it in float64 so that
    rounding is negligible against the injected noise. Running statistics are left untouched.

    Args:
        block: the invertible module
        x: its input
        noise: the noise's standard deviation relative to rms(y)
        seed: the noise's random seed
    """
    if not isinstance(block, InvertibleModule):
        raise FewBitError(f"inverse_snr_factor needs an InvertibleModule, got {type(block).__name__}")
    check_positive("noise", noise)
    with torch.no_grad(), frozen_running_stats(block):
        y, state = block._forward_keep(x)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        e = torch.randn(y.shape, generator=generator, dtype=y.dtype).to(y.device)
        e = e * (noise * y.double().square().mean().sqrt().item())
        x_hat = block._inverse_kept(y + e, state)
        snr_y = float(y.double().square().sum() / e.double().square().sum())
        snr_x = float(x.double().square().sum() / (x_hat.double() - x.double()).square().sum())
    return snr_y / snr_x
