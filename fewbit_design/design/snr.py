"""Signal-to-noise ratios: reconstruction by inverse layers (theory) and few-bit derivative approximations.

Terms (Hascoet et al. 2023, "Reversible designs for extreme memory cost reduction of CNN training", section 4.1):

* A layer maps ``x`` to ``y = f(x)``; backward rebuilds ``x`` from a noisy output ``y + e_y`` with the inverse,
  getting ``x + e_x``. ``SNR_y = |y|^2 / |e_y|^2`` and ``SNR_x = |x|^2 / |e_x|^2`` (mean squares over all
  elements).
* The **SNR reduction factor** of the inverse is ``alpha = SNR_y / SNR_x`` (> 1 when the inverse degrades the
  signal). In decibels ``10 log10(alpha)`` is the SNR lost by one inverse.
* Along a chain of N inverses, factors multiply (eq. 19): ``SNR_i = SNR_y / prod_j alpha_j``, i.e. dB losses add
  (eqs. 27-28 of the layer-wise and hybrid architectures). This assumes, as the paper's proofs do, that the
  noise reaching each layer is white (same power on every element and channel); a mixing layer between two
  inverses (a convolution) makes that approximately true.

The paper prints neither the batch-norm nor the leaky-ReLU formula in a readable form; both are derived below
(in the docstrings of :func:`batchnorm_alpha` and :func:`leaky_relu_alpha`) from the paper's assumptions and
reduce to its toy results. Everything here is numpy/scipy: no torch.

>>> round(leaky_relu_alpha(0.5), 4)
1.5625
>>> round(batchnorm_alpha([1.0, 2.0]), 4)      # the toy layer with rho = 2: (1 + 4)(1 + 1/4)/4
1.5625
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import FewBitError, check_finite

__all__ = [
    "effective_gamma",
    "batchnorm_alpha",
    "batchnorm_alpha_toy",
    "batchnorm_alpha_distribution",
    "leaky_relu_alpha",
    "alpha_db",
    "chain_alpha",
    "chain_snr_db",
    "accumulated_snr_db",
    "rounding_snr_db",
    "approximation_snr_db",
]


def _array(name: str, values: Any) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise FewBitError(f"{name} must be numbers, got {values!r}") from None
    if array.size == 0:
        raise FewBitError(f"{name} must not be empty")
    if not np.all(np.isfinite(array)):
        raise FewBitError(f"{name} must be finite, got {values!r}")
    return array


def _per_channel(name: str, values: Any, channels: int, default: float) -> np.ndarray:
    if values is None:
        return np.full(channels, default)
    array = _array(name, values)
    if array.size == 1:
        return np.full(channels, array[0])
    if array.size != channels:
        raise FewBitError(f"{name} must have one value per channel ({channels}), got {array.size}")
    return array


def _check_floor(floor: object) -> float:
    value = check_finite("gamma floor", floor)
    if value < 0:
        raise FewBitError(f"gamma floor must be >= 0, got {floor!r}")
    return value


def effective_gamma(gamma: Any, floor: float = 0.0) -> np.ndarray:
    """The batch-norm scale with the floor of section 4.2.1 applied: ``sign(gamma) * (|gamma| + floor)``, with
    sign(0) taken as +1 (as :class:`fewbit_design.runtime.reversible.InvertibleBatchNorm2d` does)."""
    g = _array("gamma", gamma)
    floor = _check_floor(floor)
    return np.where(g >= 0, g + floor, g - floor)


def batchnorm_alpha(
    gamma: Any,
    *,
    beta: Any = None,
    mean: Any = None,
    var: Any = None,
    eps: float = 0.0,
    floor: float = 0.0,
) -> float:
    """SNR reduction factor of the inverse of batch normalization with per-channel scales ``gamma``.

    Derivation (appendix 1.1 of the paper, generalized). Channel i of the input has mean ``m_i`` and variance
    ``v_i`` (the statistics used in forward), scale ``s_i`` (``gamma_i`` after the floor) and shift ``b_i``:

        y_i = s_i (x_i - m_i) / sqrt(v_i + eps) + b_i,      x_i = (y_i - b_i) sqrt(v_i + eps) / s_i + m_i.

    Per element, ``E[y_i^2] = s_i^2 v_i / (v_i + eps) + b_i^2`` and ``E[x_i^2] = v_i + m_i^2``. The inverse is
    affine, so output noise of power ``sigma^2`` on every element (the paper's assumption: noise identically
    distributed over channels) becomes input noise of power ``sigma^2 (v_i + eps) / s_i^2`` in channel i. With c
    channels of equal size:

        SNR_y = sum_i (s_i^2 v_i / (v_i + eps) + b_i^2) / (c sigma^2)
        SNR_x = sum_i (v_i + m_i^2) / (sigma^2 sum_i (v_i + eps) / s_i^2)
        alpha = SNR_y / SNR_x = [sum_i (s_i^2 v_i/(v_i+eps) + b_i^2)] [sum_i (v_i+eps)/s_i^2] / (c sum_i (v_i+m_i^2))

    With zero-mean unit-variance inputs, no shift and eps = 0 this is the paper's eq. 22:
    ``alpha = (1/c^2) (sum_i s_i^2)(sum_i 1/s_i^2) = mean(s^2) mean(1/s^2) >= 1`` (Cauchy-Schwarz; equality iff
    all |s_i| are equal), and for the toy layer ``s = [1, rho]``: ``(1 + rho^2)(1 + 1/rho^2) / 4``. Channels
    amplified differently in forward get their noise amplified by the inverse of their own scale in backward;
    the floor bounds ``1/s_i^2`` and therefore alpha.

    Args:
        gamma: per-channel scales (before the floor).
        beta: per-channel shifts (default 0).
        mean: per-channel mean of the input (default 0).
        var: per-channel (biased) variance of the input (default 1).
        eps: the batch-norm epsilon.
        floor: the gamma floor (0: gamma used as is).
    """
    s = effective_gamma(gamma, floor)
    if np.any(s == 0):
        raise FewBitError("batch-norm scales must be non-zero for the inverse to exist (use a floor > 0)")
    c = s.size
    b = _per_channel("beta", beta, c, 0.0)
    m = _per_channel("mean", mean, c, 0.0)
    v = _per_channel("var", var, c, 1.0)
    if np.any(v < 0):
        raise FewBitError("var must be >= 0")
    eps = check_finite("eps", eps)
    if eps < 0 or np.any(v + eps <= 0):
        raise FewBitError(f"var + eps must be > 0 in every channel, got eps={eps!r}")
    signal_y = np.sum(s**2 * v / (v + eps) + b**2)
    noise_x = np.sum((v + eps) / s**2)
    signal_x = np.sum(v + m**2)
    if signal_x <= 0:
        raise FewBitError("the input has no signal (var and mean all zero)")
    return float(signal_y * noise_x / (c * signal_x))


def batchnorm_alpha_toy(rho: Any) -> np.ndarray | float:
    """The toy batch norm of figure 5 (two channels, ``gamma = [1, rho]``): ``(1 + rho^2)(1 + rho^-2) / 4``.

    Vectorized over ``rho``; equal to ``batchnorm_alpha([1, rho])``.
    """
    r = np.asarray(rho, dtype=np.float64)
    if np.any(r == 0) or not np.all(np.isfinite(r)):
        raise FewBitError(f"rho must be finite and non-zero, got {rho!r}")
    result = (1 + r**2) * (1 + r**-2) / 4
    return float(result) if result.ndim == 0 else result


def batchnorm_alpha_distribution(distribution: Any, *, floor: float = 0.0) -> float:
    """Expected SNR reduction factor of batch norm when the scales are drawn from ``distribution``.

    For many channels the sums of :func:`batchnorm_alpha` (zero-mean unit-variance input, no shift) become
    expectations: ``alpha = E[s^2] E[1/s^2]`` with ``s = sign(gamma)(|gamma| + floor)``.

    Without a floor, any density positive at gamma = 0 makes ``E[1/gamma^2]`` diverge (the integral of
    ``p(0)/gamma^2`` near 0), hence ``inf``: the reason for the floor of section 4.2.1.

    Args:
        distribution: a frozen ``scipy.stats`` distribution (``pdf``, ``support``) of gamma.
        floor: the gamma floor.

    >>> from scipy import stats
    >>> round(batchnorm_alpha_distribution(stats.uniform(1, 1)), 6)   # gamma ~ U(1, 2): (7/3)(1/2)
    1.166667
    """
    from scipy import integrate

    floor = _check_floor(floor)
    if not (hasattr(distribution, "pdf") and hasattr(distribution, "support")):
        raise FewBitError(f"distribution must be a frozen scipy.stats distribution, got {type(distribution).__name__}")
    low, high = (float(v) for v in distribution.support())
    if floor == 0 and low <= 0 <= high and float(distribution.pdf(0.0)) > 0:
        return math.inf
    second = _expect(distribution, lambda g: (np.abs(g) + floor) ** 2, low, high, integrate)
    inverse = _expect(distribution, lambda g: (np.abs(g) + floor) ** -2.0, low, high, integrate)
    return float(second * inverse)


def _expect(distribution: Any, function: Any, low: float, high: float, integrate: Any) -> float:
    """E[function(gamma)] by adaptive quadrature, split at 0 (where 1/gamma^2 may be singular)."""
    pieces = [(low, 0.0), (0.0, high)] if low < 0 < high else [(low, high)]
    total = 0.0
    for a, b in pieces:
        value, _ = integrate.quad(lambda g: function(g) * distribution.pdf(g), a, b, limit=200)
        total += value
    return total


def leaky_relu_alpha(slope: Any, *, positive_fraction: float = 0.5, positive_energy: float | None = None) -> Any:
    """SNR reduction factor of the inverse of a leaky ReLU with negative slope ``n`` (section 4.2.2).

    Derivation (appendix 1.2 of the paper, in the regime ``|y| >> |e_y|`` where noise flips no signs). Let a
    fraction ``p`` of the N input elements be >= 0, carrying a fraction ``P`` of the input energy ``|x|^2``.
    Forward keeps the positive part and multiplies the negative part by n:
    ``|y|^2 = |x|^2 (P + n^2 (1 - P))``. The inverse divides negative outputs by n, so output noise of power
    ``sigma^2`` per element becomes ``sigma^2`` on the positive elements and ``sigma^2 / n^2`` on the negative ones:
    ``|e_x|^2 = N sigma^2 (p + (1 - p) / n^2)`` while ``|e_y|^2 = N sigma^2``. Hence

        alpha = SNR_y / SNR_x = (P + n^2 (1 - P)) (p + (1 - p) / n^2).

    For an input evenly split between signs (``p = P = 1/2``, the paper's case) this is
    ``(1 + n^2)(1 + n^-2) / 4 = (1 + n^2)^2 / (4 n^2)``: the toy batch norm with ``rho = n``; it is 1 at n = 1 and
    grows like ``1 / (4 n^2)`` as n -> 0 (1.5625 at 0.5, 6.76 at 0.2, 25.5 at 0.1).

    Args:
        slope: the negative slope n > 0 (scalar or array).
        positive_fraction: p, the fraction of input elements >= 0.
        positive_energy: P, the fraction of the input energy on those elements (default: ``positive_fraction``).
    """
    n = np.asarray(slope, dtype=np.float64)
    if not np.all(np.isfinite(n)) or np.any(n <= 0):
        raise FewBitError(f"negative slope must be > 0, got {slope!r}")
    p = check_finite("positive_fraction", positive_fraction)
    big_p = p if positive_energy is None else check_finite("positive_energy", positive_energy)
    if not (0 <= p <= 1 and 0 <= big_p <= 1):
        raise FewBitError(f"positive_fraction and positive_energy must be in [0, 1], got {p!r} and {big_p!r}")
    result = (big_p + n**2 * (1 - big_p)) * (p + (1 - p) / n**2)
    return float(result) if result.ndim == 0 else result


def alpha_db(alpha: Any) -> Any:
    """The SNR lost by an inverse, in decibels: ``10 log10(alpha)``."""
    a = np.asarray(alpha, dtype=np.float64)
    if np.any(a <= 0):
        raise FewBitError(f"SNR reduction factors must be > 0, got {alpha!r}")
    result = 10 * np.log10(a)
    return float(result) if result.ndim == 0 else result


def chain_alpha(alphas: Iterable[float]) -> float:
    """The factor of a chain of inverses: the product (eq. 19).

    Args:
        alphas: the SNR reduction factors of the inverses in the chain
    """
    a = _array("alphas", list(alphas))
    if np.any(a <= 0):
        raise FewBitError("SNR reduction factors must be > 0")
    return float(np.prod(a))


def chain_snr_db(output_snr_db: float, alphas: Sequence[float]) -> np.ndarray:
    """SNR (dB) of the reconstructed inputs along a chain, from the output down (eqs. 27-28).

    ``alphas[0]`` is the factor of the last layer (the first inverted). Entry k of the result is the SNR of the
    input of the layer ``alphas[k]`` belongs to: ``output_snr_db - sum_{j <= k} 10 log10(alphas[j])``.

    >>> chain_snr_db(100.0, [10.0, 10.0]).tolist()
    [90.0, 80.0]
    """
    snr = check_finite("output SNR (dB)", output_snr_db)
    return snr - np.cumsum(alpha_db(_array("alphas", alphas)))


def accumulated_snr_db(
    alphas: Sequence[float], *, fresh_snr_db: float | Sequence[float], output_snr_db: float = math.inf
) -> np.ndarray:
    """SNR (dB) along a chain of inverses computed in floating point: eq. 19 plus each layer's own rounding.

    Rebuilding layer k's input from a noisy output amplifies the noise arriving from above by the layer's factor
    alpha_k and adds the layer's own round-trip error (forward rounding seen through the inverse, plus the
    inverse's rounding), of relative power ``delta_k = 10^(-fresh_snr_db[k] / 10)``. In noise-to-signal ratios,
    from the output (NSR_0 from ``output_snr_db``, 0 for an exact output) down:

        NSR_k = alpha_k NSR_{k-1} + delta_k,      SNR_k = -10 log10(NSR_k).

    Far below the rounding floor the deltas are negligible and the dB losses add as in :func:`chain_snr_db`
    (``fresh_snr_db=inf``: no rounding). ``fresh_snr_db`` is one value for every layer or one per layer; the same
    ordering as :func:`chain_snr_db` (``alphas[0]`` is the last layer, inverted first).

    >>> accumulated_snr_db([10.0, 10.0], fresh_snr_db=100.0).round(3).tolist()   # 1e-10, then 1e-9 + 1e-10
    [100.0, 89.586]
    """
    a = _array("alphas", alphas)
    if np.any(a <= 0):
        raise FewBitError("SNR reduction factors must be > 0")
    if np.ndim(fresh_snr_db) == 0:
        fresh = [_nsr("fresh SNR (dB)", fresh_snr_db)] * a.size
    else:
        fresh = [_nsr("fresh SNR (dB)", value) for value in fresh_snr_db]
        if len(fresh) != a.size:
            raise FewBitError(f"fresh_snr_db must have one value per layer ({a.size}), got {len(fresh)}")
    nsr = _nsr("output SNR (dB)", output_snr_db)
    out = np.empty(a.size)
    for k, alpha in enumerate(a):
        nsr = alpha * nsr + fresh[k]
        out[k] = -10 * math.log10(nsr) if nsr > 0 else math.inf
    return out


def _nsr(name: str, snr_db: object) -> float:
    """Noise-to-signal power ratio of an SNR in dB; ``inf`` dB (no noise) gives 0."""
    if snr_db == math.inf:
        return 0.0
    return 10.0 ** (-check_finite(name, snr_db) / 10)


_MANTISSA_BITS = {"float64": 53, "float32": 24, "bfloat16": 8, "float16": 11}


def rounding_snr_db(dtype: str = "float32") -> float:
    """SNR of one round-to-nearest of a real number to ``dtype``, in dB.

    With p significand bits, a value in ``[2^e, 2^(e+1))`` is rounded with an error uniform in
    ``+-ulp/2``, ``ulp = 2^(e - p + 1)``: error power ``ulp^2 / 12 = 2^(2e - 2p) / 3``. For values spread
    uniformly over the binade, ``E[x^2] = (7/3) 2^(2e)``. So ``SNR = 7 * 2^(2p)``: 152.9 dB for float32
    (p = 24), 56.6 dB for bfloat16, 327.5 dB for float64. A layer's round trip rounds a few times, so its own
    error (the ``fresh_snr_db`` of :func:`accumulated_snr_db`) sits a few dB below this.
    """
    from ..errors import check_choice

    check_choice("dtype", dtype, list(_MANTISSA_BITS))
    p = _MANTISSA_BITS[dtype]
    return 10 * math.log10(7.0) + 20 * p * math.log10(2.0)


def approximation_snr_db(activation: str, bits: Sequence[int], **options: Any) -> list[tuple[int, float, float]]:
    """SNR (dB) of the few-bit derivative approximation of ``activation`` for each number of bits.

    Calls :func:`fewbit_design.design.design` (``options`` are passed through: ``weight``, ``mode``, ...) and
    returns ``(bits, snr_db, error)`` per entry. ``snr_db = 10 log10(integral f'^2 w / L)``.
    """
    from .engine import design

    rows = []
    for b in bits:
        table = design(activation, b, **options)
        snr = table.snr_db if table.snr_db is not None else math.inf
        rows.append((int(b), float(snr), float(table.error)))
    return rows
