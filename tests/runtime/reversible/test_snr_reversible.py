"""Measured reconstruction SNR of the runtime's invertible layers and networks against fewbit_design.snr.

Single layers: the factor measured by noise injection on the torch layers (float64) against the closed forms.
Networks: float32 forward/backward, where every error comes from rounding; the layer-wise prediction chains the
closed-form factors with each layer's own round-trip error (eq. 19 plus rounding).
"""

from __future__ import annotations

import math

import pytest
import torch

from fewbit_design.cli.snr import _measure_network
from fewbit_design.design import snr
from fewbit_design.runtime import reversible as R

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def z_input(seed: int = 0) -> torch.Tensor:
    return torch.randn(32, 4, 16, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("slope", [0.1, 0.2, 0.5])
def test_leaky_relu_layer_factor_matches_the_formula(slope):
    measured = R.inverse_snr_factor(R.InvertibleLeakyReLU(slope), z_input(), noise=1e-6)
    assert measured == pytest.approx(snr.leaky_relu_alpha(slope), rel=0.03)


@pytest.mark.parametrize("rho", [0.25, 4.0])
def test_batchnorm_layer_factor_matches_the_formula(rho):
    bn = R.InvertibleBatchNorm2d(4, gamma_floor=0.0).double()
    gamma = torch.tensor([1.0, rho, 1.0, rho], dtype=torch.float64)
    with torch.no_grad():
        bn.weight.copy_(gamma)
    measured = R.inverse_snr_factor(bn, z_input(), noise=1e-6)
    assert measured == pytest.approx(snr.batchnorm_alpha_toy(rho), rel=0.03)
    # the floor applies: with floor 0.5 the scales are [1.5, rho + 0.5] and the factor follows them
    bn.gamma_floor = 0.5
    measured = R.inverse_snr_factor(bn, z_input(), noise=1e-6)
    assert measured == pytest.approx(snr.batchnorm_alpha(gamma.numpy(), floor=0.5), rel=0.03)


def measure(arch: str, slope: float, depth: int):
    options = dict(channels=8, batch=4, size=8, dtype="float32", seed=0, torch=torch, reversible=R)
    records, predicted, first = _measure_network(arch, slope, depth, **options)
    return records, predicted, first


@pytest.mark.parametrize("slope", [0.2, 0.5])
def test_layerwise_float32_snr_follows_the_chained_factors(slope):
    """Tolerance: the measured loss below the top layer is within 15% (or 6 dB) of the predicted loss, at every
    layer whose SNR is above 20 dB (below it, noise flips signs and the small-noise theory stops holding)."""
    records, predicted, first = measure("layerwise", slope, 6)
    top = max(r.snr_db for r in records if math.isfinite(r.snr_db))
    checked = 0
    for r in records:
        if r.sequence != "body" or not 20 < r.snr_db < math.inf:
            continue
        loss, predicted_loss = top - r.snr_db, top - predicted[id(r)]
        assert abs(loss - predicted_loss) <= max(6.0, 0.15 * predicted_loss), (r.name, r.snr_db, predicted[id(r)])
        checked += 1
    assert checked >= 15
    # and it falls with depth: tens of dB over 6 units, at a rate set by the factors
    assert predicted[id(first)] < top - 30 and first.snr_db < top - 30


def input_snr(arch: str, depth: int, *, slope: float = 0.1, seed: int = 0, **options) -> float:
    """SNR (dB) of the network input (the body's first block input) as reconstructed by a float32 backward: the
    same model, input and output gradient as ``measure`` (the figure's panel (d)), without the per-layer alphas."""
    torch.manual_seed(seed)
    build = R.layerwise_net if arch == "layerwise" else R.hybrid_net
    model = build(depth, 8, negative_slope=slope, pooling=("batch",), input_size=(8, 8), **options).float()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed + 1))
    return next(r for r in R.reconstruction_snr(model, x, seed=seed) if r.sequence == "body").snr_db


def test_layerwise_snr_falls_with_depth_while_the_hybrids_stays_flat():
    """Tolerances from 30 seeds (model and input seeds 0-29, slope 0.1, float32), measured with this function:
    hybrid SNR(4) - SNR(32) from -1.3 to 4.7 dB (tolerance 6), largest loss over one doubling 4.5 dB (6),
    SNR(32) from 124 to 129 dB (> 115); with branch_scale=1 (no 1/depth scale) SNR(4) - SNR(32) from 37 to 50 dB
    (> 30); layer-wise SNR(4) - SNR(32) from 557 to 576 dB (> 100)."""
    layerwise = {d: input_snr("layerwise", d) for d in (2, 4, 8, 32)}
    hybrid = {d: input_snr("hybrid", d) for d in (4, 8, 16, 32)}
    unscaled = {d: input_snr("hybrid", d, branch_scale=1.0) for d in (4, 32)}
    hybrid_slope = input_snr("hybrid", 8, slope=0.5)
    # layer-wise: linear in depth in dB (about 19 dB per unit at n = 0.1): garbage by depth 8
    assert layerwise[2] - layerwise[4] > 25
    assert layerwise[4] - layerwise[8] > 1.5 * (layerwise[2] - layerwise[4])
    assert layerwise[8] < 20
    assert layerwise[4] - layerwise[32] > 100 or math.isnan(layerwise[32]), layerwise
    # hybrid (each block holds 4 layer-wise units; couplings scaled by 1/depth, the default): the block inputs
    # are rebuilt by the couplings' inverses, whose SNR loss summed over the blocks does not grow with depth,
    # so the input's SNR stays at the float32 rounding level (~128 dB) from depth 4 to 32 and does not
    # depend on the slope; it falls by tens of dB over the same depths without the scale (the contrast that
    # shows the measurement can see a trend)
    assert abs(hybrid[4] - hybrid[32]) < 6, hybrid
    for shallow, deep in ((4, 8), (8, 16), (16, 32)):
        assert hybrid[shallow] - hybrid[deep] < 6, hybrid
    assert min(hybrid.values()) > 115, hybrid
    assert unscaled[4] - unscaled[32] > 30, unscaled
    assert abs(hybrid[8] - hybrid_slope) < 6
