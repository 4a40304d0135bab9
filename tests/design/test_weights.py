"""Weights w(x): densities and masses against scipy.stats / scipy.integrate, empirical densities, errors, round trip."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from scipy import integrate, stats

from fewbit_design.design.weights import WEIGHT_KINDS, Weight, make_weight, silverman_bandwidth, weight_from_dict
from fewbit_design.errors import FewBitError

# (kind, options, the matching scipy.stats distribution)
PARAMETRIC = [
    ("normal", {}, stats.norm()),
    ("normal", {"loc": 1.0, "scale": 2.0, "low": -3.0, "high": 5.0}, stats.norm(1.0, 2.0)),
    ("normal", {"low": 5.0, "high": 10.0}, stats.norm()),  # far tail: needs the sf difference
    ("normal", {"low": 8.0, "high": 10.0}, stats.norm()),
    ("laplace", {}, stats.laplace()),
    ("laplace", {"loc": 0.5, "scale": 1.5, "low": -4.0, "high": 2.0}, stats.laplace(0.5, 1.5)),
    ("laplace", {"loc": 3.0, "low": 4.0, "high": 9.0}, stats.laplace(3.0)),
    ("laplace", {"low": 38.0, "high": 40.0}, stats.laplace()),
    ("student-t", {"df": 3.0}, stats.t(3.0)),
    ("student-t", {"df": 0.5, "loc": -1.0, "scale": 0.7}, stats.t(0.5, -1.0, 0.7)),
    ("student-t", {"df": 30, "low": 0.0, "high": 2.0}, stats.t(30.0)),
    ("student-t", {"df": 5.0, "low": 9.0, "high": 10.0, "scale": 0.2}, stats.t(5.0, 0.0, 0.2)),
]
PARAMETRIC_IDS = [f"{kind}-{i}" for i, (kind, _, _) in enumerate(PARAMETRIC)]


@pytest.mark.parametrize(("kind", "options", "dist"), PARAMETRIC, ids=PARAMETRIC_IDS)
def test_parametric_density_and_mass_match_scipy(kind, options, dist):
    weight = make_weight(kind, **options)
    low, high = weight.low, weight.high
    x = np.linspace(low, high, 1001)
    np.testing.assert_allclose(weight(x), dist.pdf(x), rtol=1e-12, atol=1e-300)
    # mass: scipy.stats cdf (sf in the upper tail) and adaptive quadrature of w itself
    expected = dist.sf(low) - dist.sf(high) if low > dist.median() else dist.cdf(high) - dist.cdf(low)
    assert weight.mass() == pytest.approx(expected, rel=1e-12, abs=0)
    quad, _ = integrate.quad(weight, low, high, points=weight.breakpoints or None, epsabs=0, epsrel=1e-12, limit=200)
    assert weight.mass() == pytest.approx(quad, rel=1e-10, abs=0)


def test_uniform_is_one_on_the_range_and_not_normalised():
    weight = make_weight()
    assert (weight.low, weight.high) == (-10.0, 10.0)
    assert weight(np.array([-10.0, 0.0, 10.0])).tolist() == [1.0, 1.0, 1.0]
    assert weight.mass() == 20.0  # the paper's eq. 10: w = 1 on [-10, 10]
    assert make_weight("uniform", low=-1, high=3).mass() == 4.0
    assert weight.breakpoints == ()


@pytest.mark.parametrize("kind", ["uniform", "normal", "laplace", "student-t", "empirical"])
def test_zero_outside_the_range(kind):
    options = {"df": 2.0} if kind == "student-t" else {}
    if kind == "empirical":
        options = {"samples": np.random.default_rng(1).normal(0, 3, 5000)}
    weight = make_weight(kind, low=-2.0, high=1.5, **options)
    outside = np.array([-np.inf, -100.0, np.nextafter(-2.0, -np.inf), np.nextafter(1.5, np.inf), 7.0, np.inf])
    assert weight(outside).tolist() == [0.0] * outside.size
    inside = np.linspace(-2.0, 1.5, 101)
    values = weight(inside)
    assert values.dtype == np.float64 and values.shape == inside.shape and np.all(values > 0)
    assert weight(inside.reshape(101, 1)).shape == (101, 1)


def test_laplace_breakpoint_only_inside_the_range():
    assert make_weight("laplace", loc=1.0).breakpoints == (1.0,)
    assert make_weight("laplace", loc=20.0).breakpoints == ()
    assert make_weight("normal", loc=1.0).breakpoints == ()


KINDS_TEXT = "'uniform', 'normal', 'laplace', 'student-t' or 'empirical'"
USERS_TEXT = "weights 'normal', 'laplace' or 'student-t'"


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("gauss", {}, f"weight must be {KINDS_TEXT}, got 'gauss'"),
        ("uniform", {"low": 1.0, "high": 1.0}, "range must satisfy A < B, got A=1, B=1"),
        ("uniform", {"low": 2.0, "high": -2.0}, "range must satisfy A < B, got A=2, B=-2"),
        ("uniform", {"low": float("-inf")}, "range start must be a finite number, got -inf"),
        ("normal", {"scale": 0.0}, "scale must be > 0, got 0.0"),
        ("laplace", {"scale": -1}, "scale must be > 0, got -1"),
        ("normal", {"loc": float("nan")}, "loc must be a finite number, got nan"),
        ("student-t", {}, "weight 'student-t' needs df, its degrees of freedom (> 0): --df X"),
        ("student-t", {"df": 0}, "df must be > 0, got 0"),
        ("normal", {"df": 3.0}, "df applies only to weight 'student-t', got weight 'normal'"),
        ("uniform", {"loc": 2.0}, f"loc applies only to {USERS_TEXT}, got weight 'uniform'"),
        (
            "empirical",
            {"scale": 2.0, "samples": [0.0, 1.0]},
            f"scale applies only to {USERS_TEXT}, got weight 'empirical'",
        ),
        ("normal", {"samples": "x.npy"}, "samples applies only to weight 'empirical', got weight 'normal'"),
        (
            "empirical",
            {},
            "weight 'empirical' needs samples: a .npy file of recorded pre-activations (--samples FILE.npy)",
        ),
    ],
)
def test_bad_weight_options(kind, options, message):
    with pytest.raises(FewBitError) as info:
        make_weight(kind, **options)
    assert str(info.value) == message


def test_default_valued_options_are_accepted_for_any_kind():
    # the CLI may pass its defaults (loc 0, scale 1) whatever the kind
    assert make_weight("uniform", loc=0.0, scale=1.0, df=None) == make_weight("uniform")
    assert make_weight("normal", loc=None, scale=None) == make_weight("normal")


# ----------------------------------------------------------------------------------------------------------------------
# Empirical


def _direct_kde(samples: np.ndarray, x: np.ndarray, bandwidth: float) -> np.ndarray:
    """The Gaussian KDE divided by the total count, summed directly (independent of the binned FFT)."""
    z = (x[:, None] - samples[None, :]) / bandwidth
    return np.exp(-0.5 * z * z).sum(axis=1) / (samples.size * bandwidth * np.sqrt(2 * np.pi))


def test_empirical_matches_the_direct_kernel_sum():
    rng = np.random.default_rng(2)
    samples = np.concatenate([rng.normal(-1.0, 0.5, 1500), rng.normal(2.0, 1.5, 1500)])  # some beyond the range
    weight = make_weight("empirical", samples=samples, low=-2.0, high=3.0)
    x = np.linspace(-2.0, 3.0, 357)
    expected = _direct_kde(samples, x, weight.bandwidth)
    np.testing.assert_allclose(weight(x), expected, rtol=2e-4, atol=1e-5)


def test_empirical_from_normal_samples_is_close_to_the_normal_pdf():
    samples = np.random.default_rng(3).standard_normal(200_000)
    weight = make_weight("empirical", samples=samples)
    x = np.linspace(-4.0, 4.0, 801)
    np.testing.assert_allclose(weight(x), stats.norm.pdf(x), atol=0.01)
    assert weight.mass() == pytest.approx(1.0, abs=1e-9)


def test_empirical_mass_is_the_fraction_inside_the_range():
    samples = np.random.default_rng(4).standard_normal(100_000)
    weight = make_weight("empirical", samples=samples, low=-1.0, high=2.0)
    inside = np.mean((samples >= -1.0) & (samples <= 2.0))
    assert weight.mass() == pytest.approx(inside, abs=0.005)  # kernel smoothing moves a little mass over the ends
    quad, _ = integrate.quad(weight, -1.0, 2.0, limit=500, points=np.linspace(-1, 2, 50)[1:-1])
    assert weight.mass() == pytest.approx(quad, rel=1e-6)


def test_silverman_bandwidth():
    samples = np.random.default_rng(5).standard_normal(10_000) * 3.0
    std = np.std(samples, ddof=1)
    iqr = stats.iqr(samples)
    assert silverman_bandwidth(samples) == pytest.approx(0.9 * min(std, iqr / 1.34) * 10_000 ** (-0.2), rel=1e-12)
    # more than half the samples equal: the IQR is 0 and the standard deviation takes over
    mostly_zero = np.concatenate([np.zeros(80), np.linspace(-1, 1, 20)])
    assert silverman_bandwidth(mostly_zero) == pytest.approx(0.9 * np.std(mostly_zero, ddof=1) * 100 ** (-0.2))


def test_empirical_from_file_to_dict_and_round_trip(tmp_path):
    samples = np.random.default_rng(6).normal(0.5, 2.0, (300, 10)).astype(np.float32)  # 2-D: flattened
    path = tmp_path / "pre.npy"
    np.save(path, samples)
    weight = make_weight("empirical", samples=str(path))
    d = weight.to_dict()
    assert d == {
        "kind": "empirical",
        "file": "pre.npy",
        "samples": 3000,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "bandwidth": weight.bandwidth,
        "low": -10.0,
        "high": 10.0,
    }
    assert json.loads(json.dumps(d)) == d
    rebuilt = weight_from_dict(d, samples=path)
    assert rebuilt == weight
    np.testing.assert_array_equal(rebuilt(np.linspace(-10, 10, 11)), weight(np.linspace(-10, 10, 11)))
    with pytest.raises(FewBitError, match=r"needs its samples file \(pre.npy\)"):
        weight_from_dict(d)
    other = tmp_path / "other.npy"
    np.save(other, samples[:100])
    with pytest.raises(FewBitError, match="does not match"):
        weight_from_dict(d, samples=other)


def test_empirical_from_an_array_round_trip():
    samples = np.random.default_rng(9).laplace(0.0, 2.0, 4000)
    weight = make_weight("empirical", samples=samples, low=-5.0, high=5.0)
    d = weight.to_dict()
    assert d["file"] is None and d["samples"] == 4000 and len(d["sha256"]) == 64
    assert weight_from_dict(d, samples=samples) == weight
    assert weight.nodes[0] == -5.0 and weight.nodes[-1] == 5.0 and np.all(np.diff(weight.nodes) > 0)


def test_empirical_is_fast_enough_for_a_million_samples():
    # not a timing assertion: just that 10^6 samples go through (the binned FFT keeps this ~0.1 s)
    samples = np.random.default_rng(7).standard_normal(1_000_000)
    weight = make_weight("empirical", samples=samples)
    assert weight.to_dict()["samples"] == 1_000_000
    assert weight.mass() == pytest.approx(1.0, abs=1e-6)


def test_empirical_with_a_kernel_much_wider_than_the_range():
    samples = np.random.default_rng(8).normal(0.0, 1e5, 1000)
    samples[0] = 0.0  # one sample inside
    weight = make_weight("empirical", samples=samples, low=-1.0, high=1.0)
    x = np.linspace(-1.0, 1.0, 5)
    np.testing.assert_allclose(weight(x), _direct_kde(samples, x, weight.bandwidth), rtol=1e-3)


def _save(tmp_path, name, array, **kwargs):
    path = tmp_path / name
    np.save(path, array, **kwargs)
    return path


@pytest.mark.parametrize(
    ("make", "pieces"),
    [
        (lambda p: p / "missing.npy", ["missing.npy", "does not exist"]),
        (lambda p: p, ["is not a file"]),
        (lambda p: _save(p, "obj.npy", np.array([1.0, "a"], dtype=object), allow_pickle=True), ["Python objects"]),
        (lambda p: _save(p, "nan.npy", np.array([0.0, np.nan, 1.0])), ["finite", "1 non-finite value(s) of 3"]),
        (lambda p: _save(p, "same.npy", np.full(10, 2.0)), ["at least 2 distinct values", "2"]),
        (lambda p: _save(p, "one.npy", np.array([1.0])), ["at least 2 samples", "got 1"]),
        (lambda p: _save(p, "far.npy", np.array([20.0, 30.0])), ["no samples inside", "[-10, 10]", "[20, 30]"]),
        (lambda p: _save(p, "str.npy", np.array(["a", "b"])), ["real numbers", "dtype"]),
        (lambda p: _save(p, "cplx.npy", np.array([1j, 2.0])), ["real numbers", "complex"]),
    ],
)
def test_bad_samples_files(tmp_path, make, pieces):
    path = make(tmp_path)
    with pytest.raises(FewBitError) as info:
        make_weight("empirical", samples=path)
    message = str(info.value)
    assert "\n" not in message
    for piece in pieces:
        assert piece in message, (piece, message)


def test_samples_file_that_is_not_npy(tmp_path):
    path = tmp_path / "samples.txt"
    path.write_text("1 2 3\n")
    with pytest.raises(FewBitError, match=r"samples file '.*samples.txt' is not a .npy array"):
        make_weight("empirical", samples=path)
    np.savez(tmp_path / "two.npz", a=np.arange(3.0), b=np.arange(3.0))
    with pytest.raises(FewBitError, match=r"two.npz' is an .npz archive"):
        make_weight("empirical", samples=tmp_path / "two.npz")
    truncated = tmp_path / "cut.npy"
    np.save(truncated, np.arange(100.0))
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(FewBitError, match=r"cut.npy' is not a .npy array"):
        make_weight("empirical", samples=truncated)


# ----------------------------------------------------------------------------------------------------------------------
# JSON round trip


@pytest.mark.parametrize(
    "weight",
    [
        make_weight(),
        make_weight("uniform", low=0.0, high=6.0),
        make_weight("normal", loc=0.5, scale=2.0),
        make_weight("laplace", scale=0.25, low=-3.0, high=3.0),
        make_weight("student-t", df=4.0, loc=-1.0, scale=1.5),
    ],
    ids=lambda w: w.kind,
)
def test_round_trip(weight):
    d = weight.to_dict()
    assert d["kind"] == weight.kind and d["low"] == weight.low and d["high"] == weight.high
    assert json.loads(json.dumps(d)) == d
    rebuilt = weight_from_dict(json.loads(json.dumps(d)))
    assert rebuilt == weight
    x = np.linspace(-12, 12, 97)
    np.testing.assert_array_equal(rebuilt(x), weight(x))


def test_to_dict_layout():
    assert make_weight().to_dict() == {"kind": "uniform", "low": -10.0, "high": 10.0}
    assert make_weight("normal").to_dict() == {"kind": "normal", "loc": 0.0, "scale": 1.0, "low": -10.0, "high": 10.0}
    assert make_weight("student-t", df=3).to_dict()["df"] == 3.0


@pytest.mark.parametrize(
    ("d", "piece"),
    [
        ({"kind": "beta", "low": 0.0, "high": 1.0}, "weight kind must be"),
        ({"kind": "normal", "low": 0.0, "high": 1.0}, "missing field(s) loc, scale"),
        ({"kind": "uniform", "low": 0.0, "high": 1.0, "loc": 0.0}, "unknown field(s) loc"),
        ({"kind": "uniform", "low": 1.0, "high": 0.0}, "A < B"),
        ([1, 2], "JSON object"),
    ],
)
def test_weight_from_bad_dict(d, piece):
    with pytest.raises(FewBitError) as info:
        weight_from_dict(d)
    assert piece in str(info.value)


def test_kinds_constant():
    assert WEIGHT_KINDS == ("uniform", "normal", "laplace", "student-t", "empirical")
    assert isinstance(make_weight(), Weight)
