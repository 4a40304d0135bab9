"""fewbit_design.snr: the derived SNR reduction factors against brute-force simulation, and the measured SNR of
real reversible networks against them.

Independent checks: numpy simulations of the paper's definition (inject white noise at a layer's output, invert,
compare SNRs), closed-form expectations for a uniform distribution, Monte Carlo for a normal one, and numpy's
own rounding to float32/float16.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from fewbit_design.design import snr
from fewbit_design.errors import FewBitError


def measured_alpha(forward, inverse, x: np.ndarray, *, noise: float = 1e-6, seed: int = 0) -> float:
    """The paper's definition of alpha, simulated: SNR_y / SNR_x for white noise injected at the output."""
    y = forward(x)
    e = np.random.default_rng(seed).standard_normal(y.shape) * noise * np.sqrt(np.mean(y**2))
    x_hat = inverse(y + e)
    snr_y = np.sum(y**2) / np.sum(e**2)
    snr_x = np.sum(x**2) / np.sum((x_hat - x) ** 2)
    return snr_y / snr_x


def leaky(n):
    return (lambda x: np.where(x >= 0, x, n * x)), (lambda y: np.where(y >= 0, y, y / n))


def batchnorm(gamma, beta, eps, x):
    """Forward and inverse of a batch norm on x of shape (channels, samples), statistics from x."""
    mean = x.mean(axis=1, keepdims=True)
    var = x.var(axis=1, keepdims=True)
    g = np.asarray(gamma)[:, None]
    b = np.asarray(beta)[:, None]
    return (lambda z: g * (z - mean) / np.sqrt(var + eps) + b), (lambda y: (y - b) * np.sqrt(var + eps) / g + mean)


@pytest.mark.parametrize("slope", [0.1, 0.2, 0.5, 1.0])
def test_leaky_relu_alpha_matches_simulation(slope):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(400_000)
    forward, inverse = leaky(slope)
    assert snr.leaky_relu_alpha(slope) == pytest.approx(measured_alpha(forward, inverse, x), rel=0.02)
    assert snr.leaky_relu_alpha(slope) == pytest.approx((1 + slope**2) ** 2 / (4 * slope**2), rel=1e-12)


def test_leaky_relu_alpha_general_form_for_an_input_not_split_evenly():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(400_000) + 1.5  # mostly positive
    forward, inverse = leaky(0.2)
    measured = measured_alpha(forward, inverse, x)
    p = np.mean(x >= 0)
    energy = np.sum(x[x >= 0] ** 2) / np.sum(x**2)
    general = snr.leaky_relu_alpha(0.2, positive_fraction=p, positive_energy=energy)
    assert general == pytest.approx(measured, rel=0.02)
    assert snr.leaky_relu_alpha(0.2) > 2 * measured  # the even-split formula does not apply


@pytest.mark.parametrize("rho", [0.125, 0.5, 3.0])
def test_batchnorm_toy_alpha_matches_simulation(rho):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 200_000))
    forward, inverse = batchnorm([1.0, rho], [0.0, 0.0], 0.0, x)
    measured = measured_alpha(forward, inverse, x)
    assert snr.batchnorm_alpha_toy(rho) == pytest.approx(measured, rel=0.02)
    assert snr.batchnorm_alpha([1.0, rho]) == pytest.approx(snr.batchnorm_alpha_toy(rho), rel=1e-12)


def test_batchnorm_general_alpha_with_shift_input_statistics_eps_and_floor():
    rng = np.random.default_rng(1)
    channels = 6
    gamma = np.array([-0.05, 0.0, 0.3, 1.0, -2.0, 0.8])
    beta = np.array([0.5, -1.0, 0.0, 0.2, 0.1, -0.3])
    floor = 0.1
    means = np.array([3.0, -1.0, 0.0, 0.5, 2.0, -4.0])
    stds = np.array([0.1, 2.0, 1.0, 0.5, 3.0, 1.5])
    x = rng.standard_normal((channels, 100_000)) * stds[:, None] + means[:, None]
    scale = np.where(gamma >= 0, gamma + floor, gamma - floor)
    forward, inverse = batchnorm(scale, beta, 1e-2, x)
    measured = measured_alpha(forward, inverse, x)
    predicted = snr.batchnorm_alpha(gamma, beta=beta, mean=x.mean(axis=1), var=x.var(axis=1), eps=1e-2, floor=floor)
    assert predicted == pytest.approx(measured, rel=0.02)
    np.testing.assert_array_equal(snr.effective_gamma(gamma, floor), scale)


def test_batchnorm_alpha_of_a_distribution():
    from scipy import stats

    # gamma ~ U(0.5, 2): E[g^2] = (a^2 + ab + b^2)/3 = 1.75 and E[1/g^2] = 1/(ab) = 1, in closed form
    assert snr.batchnorm_alpha_distribution(stats.uniform(0.5, 1.5)) == pytest.approx(1.75, rel=1e-9)
    normal = stats.norm(1.0, 0.5)
    assert snr.batchnorm_alpha_distribution(normal) == math.inf  # E[1/g^2] diverges without the floor
    g = normal.rvs(size=2_000_000, random_state=1)
    s = np.abs(g) + 0.2
    monte_carlo = np.mean(s**2) * np.mean(s**-2.0)
    assert snr.batchnorm_alpha_distribution(normal, floor=0.2) == pytest.approx(monte_carlo, rel=0.01)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chain_of_batchnorm_and_leaky_relu_layers_multiplies_the_factors(seed):
    """Eq. 19 on a chain BN -> mix -> leaky ReLU -> mix -> ...: a random orthogonal channel mixing between layers
    (standing for a convolution) keeps the noise white, and the measured factor of the whole chain is the product
    of the per-layer factors, each computed from that layer's own input statistics."""
    rng = np.random.default_rng(seed)
    channels, samples, layers = 64, 20_000, 3
    x0 = rng.standard_normal((channels, samples))
    forwards, inverses, alphas = [], [], []
    z = x0
    for _ in range(layers):
        gamma = rng.uniform(0.3, 2.0, channels) * rng.choice([-1, 1], channels)
        beta = rng.normal(0, 0.3, channels)
        f, inv = batchnorm(gamma, beta, 0.0, z)
        alphas.append(snr.batchnorm_alpha(gamma, beta=beta, mean=z.mean(axis=1), var=z.var(axis=1)))
        mix = np.linalg.qr(rng.standard_normal((channels, channels)))[0]
        forwards += [f, lambda v, q=mix: q @ v]
        inverses += [inv, lambda v, q=mix: q.T @ v]
        z = mix @ f(z)
        p = np.mean(z >= 0)
        energy = np.sum(z[z >= 0] ** 2) / np.sum(z**2)
        alphas.append(snr.leaky_relu_alpha(0.3, positive_fraction=p, positive_energy=energy))
        f, inv = leaky(0.3)
        mix = np.linalg.qr(rng.standard_normal((channels, channels)))[0]
        forwards += [f, lambda v, q=mix: q @ v]
        inverses += [inv, lambda v, q=mix: q.T @ v]
        z = mix @ f(z)

    def forward(v):
        for f in forwards:
            v = f(v)
        return v

    def inverse(v):
        for inv in reversed(inverses):
            v = inv(v)
        return v

    measured = measured_alpha(forward, inverse, x0)
    predicted = snr.chain_alpha(alphas)
    assert predicted > 20  # a real loss, not a trivial chain
    assert snr.alpha_db(predicted) == pytest.approx(snr.alpha_db(measured), abs=0.5)  # within 0.5 dB (12%)
    assert snr.chain_snr_db(100.0, alphas)[-1] == pytest.approx(100 - 10 * math.log10(predicted), abs=1e-9)


def test_accumulated_snr_recursion():
    # constant alpha a, fresh noise d per layer: NSR_k = d (1 + a + ... + a^(k-1)), summed by hand
    a, d = 2.0, 1e-12
    got = snr.accumulated_snr_db([a] * 5, fresh_snr_db=120.0)
    want = [-10 * math.log10(d * sum(a**j for j in range(k))) for k in range(1, 6)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # no rounding: eq. 19 exactly
    np.testing.assert_allclose(
        snr.accumulated_snr_db([3.0, 5.0], fresh_snr_db=math.inf, output_snr_db=90.0),
        snr.chain_snr_db(90.0, [3.0, 5.0]),
        rtol=1e-12,
    )
    with pytest.raises(FewBitError, match="one value per layer"):
        snr.accumulated_snr_db([1.0, 2.0], fresh_snr_db=[100.0])


@pytest.mark.parametrize("dtype,numpy_type", [("float32", np.float32), ("float16", np.float16)])
def test_rounding_snr_matches_numpys_rounding(dtype, numpy_type):
    rng = np.random.default_rng(1)
    x = rng.uniform(1.0, 2.0, 1_000_000)  # uniform over one binade
    rounded = x.astype(numpy_type).astype(np.float64)
    measured = 10 * math.log10(np.sum(x**2) / np.sum((x - rounded) ** 2))
    assert snr.rounding_snr_db(dtype) == pytest.approx(measured, abs=0.2)


def test_bad_inputs_raise_one_clear_error():
    with pytest.raises(FewBitError, match="negative slope must be > 0"):
        snr.leaky_relu_alpha(0.0)
    with pytest.raises(FewBitError, match="non-zero"):
        snr.batchnorm_alpha([1.0, 0.0])
    with pytest.raises(FewBitError, match="one value per channel"):
        snr.batchnorm_alpha([1.0, 2.0], beta=[0.0, 0.0, 0.0])
    with pytest.raises(FewBitError, match="gamma floor must be >= 0"):
        snr.effective_gamma([1.0], -0.1)
    with pytest.raises(FewBitError, match="dtype must be"):
        snr.rounding_snr_db("int8")


def test_imports_stay_lean():
    import subprocess

    code = (
        "import sys, fewbit_design.design.snr, fewbit_design.cli.snr\n"
        "assert 'torch' not in sys.modules and 'scipy' not in sys.modules and 'matplotlib' not in sys.modules\n"
        "import fewbit_design.runtime.reversible\n"
        "assert 'scipy' not in sys.modules and 'matplotlib' not in sys.modules and 'numba' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
