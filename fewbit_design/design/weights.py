"""Weights w(x) >= 0: the expected distribution of pre-activations x, restricted to the design range [low, high].

The error of a table is L = integral of (f'(x) - q(x))**2 w(x) dx, and the design range [A, B] = [low, high]
bounds that integral for every weight: w(x) = 0 outside [low, high].

Kinds:

* ``uniform``: w(x) = 1 on [low, high]. Not normalised: the paper's eq. 10 uses w = 1 on [-10, 10] and its
  Table 1 errors depend on that.
* ``normal`` (loc, scale), ``laplace`` (loc, scale), ``student-t`` (df, loc, scale): the normalised densities
  (scipy.stats' formulas) restricted to [low, high] and *not* renormalised, so ``mass()`` is the probability of
  [low, high] and L is the expected squared error over pre-activations inside the range.
* ``empirical``: recorded pre-activation samples (a ``.npy`` file or an array) turned into a density: linear
  binning on a fixed fine grid, smoothed by a Gaussian kernel with Silverman's bandwidth (FFT convolution),
  linearly interpolated, normalised by the total sample count. Samples outside the range still smooth the
  density near its ends; ``mass()`` is close to the fraction of samples inside [low, high].

>>> w = make_weight("normal", low=-10, high=10)
>>> round(w.mass(), 12)
1.0
>>> w.to_dict()
{'kind': 'normal', 'loc': 0.0, 'scale': 1.0, 'low': -10.0, 'high': 10.0}
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FewBitError, check_choice, check_finite, check_positive, check_range

__all__ = ["WEIGHT_KINDS", "Weight", "make_weight", "weight_from_dict", "check_design_range", "EMPIRICAL_GRID"]

WEIGHT_KINDS = ("uniform", "normal", "laplace", "student-t", "empirical")

#: Number of grid nodes over [low, high] on which an empirical density is tabulated.
EMPIRICAL_GRID = 8193
# At most this many grid cells of kernel support on each side of the range (keeps absurd bandwidths cheap).
_MAX_PAD = 1 << 16
# The kernel is truncated at this many bandwidths (exp(-36 / 2) ~ 1.5e-8).
_KERNEL_WIDTH = 6.0

#: Limits of a design range [low, high] (:func:`check_design_range`). The design resolves f' and w on grids of about
#: 2**16 cells: a range wider than +-1e6 cannot resolve an activation's bend at scale 1 (tables there degrade, and at
#: +-1e38 gelu's error came out 0, "exact"); a range narrower than 2**-20 of its magnitude has grid cells of a few
#: ulps, and one narrower than 1e-100 has cell widths whose squares leave float64.
MAX_ABS_RANGE = 1e6
MIN_RELATIVE_WIDTH = 2.0**-20
MIN_WIDTH = 1e-100
#: The smallest scale of a normal, laplace or student-t weight, relative to the range's width: a narrower weight
#: falls between the design grid's points (scale 1e-12 on [-10, 10] read as "no mass inside the design range").
MIN_RELATIVE_SCALE = 1e-6

_USES = {
    "loc": ("normal", "laplace", "student-t"),
    "scale": ("normal", "laplace", "student-t"),
    "df": ("student-t",),
    "samples": ("empirical",),
}
_DEFAULTS = {"loc": 0.0, "scale": 1.0, "df": None, "samples": None}


@dataclass(frozen=True)
class Weight:
    """A weight w(x) on [low, high] (zero outside). Build it with :func:`make_weight`.

    >>> w = make_weight("laplace", loc=1.0, scale=2.0, low=-5, high=5)
    >>> w.breakpoints
    (1.0,)
    >>> w(np.array([-6.0, 1.0])).tolist()
    [0.0, 0.25]

    Attributes:
        kind: ``uniform``, ``normal``, ``laplace``, ``student-t`` or ``empirical``
        low: the design range's lower end (w = 0 below)
        high: its upper end (w = 0 above)
        loc: location of normal, laplace and student-t
        scale: scale of normal, laplace and student-t
        df: degrees of freedom of student-t
        file: empirical: the samples file
        sample_count: empirical: how many samples
        sha256: empirical: the samples file's sha256
        bandwidth: empirical: the Gaussian kernel's bandwidth (Silverman's rule)
    """

    kind: str
    low: float
    high: float
    loc: float | None = None
    scale: float | None = None
    df: float | None = None
    file: str | None = None
    sample_count: int | None = None
    sha256: str | None = None
    bandwidth: float | None = None
    _nodes: np.ndarray | None = field(default=None, repr=False, compare=False)
    _density: np.ndarray | None = field(default=None, repr=False, compare=False)
    _log_norm: float = field(default=0.0, repr=False, compare=False)

    def __call__(self, x: object) -> np.ndarray:
        """Density values (float64, the shape of ``x``), 0 outside [low, high]."""
        x = np.asarray(x, dtype=np.float64)
        inside = (x >= self.low) & (x <= self.high)
        if self.kind == "uniform":
            return inside.astype(np.float64)
        if self.kind == "empirical":
            values = np.interp(x, self._nodes, self._density)
        else:
            with np.errstate(over="ignore", under="ignore"):  # z * z = inf far out: exp(-inf) = 0 is the density
                z = (x - self.loc) / self.scale
                if self.kind == "normal":
                    values = np.exp(-0.5 * z * z) / (self.scale * math.sqrt(2.0 * math.pi))
                elif self.kind == "laplace":
                    values = np.exp(-np.abs(z)) / (2.0 * self.scale)
                else:  # student-t
                    values = np.exp(self._log_norm - 0.5 * (self.df + 1.0) * np.log1p(z * z / self.df))
        return np.where(inside, values, 0.0)

    @property
    def breakpoints(self) -> tuple[float, ...]:
        """Points strictly inside (low, high) where w is not smooth (laplace: loc).

        An empirical w is linear between its :attr:`nodes` (spacing (high - low) / 8192); those nodes are not
        listed: the kinks are O(spacing**2) small and would otherwise dictate the design grid.
        """
        if self.kind == "laplace" and self.low < self.loc < self.high:
            return (float(self.loc),)
        return ()

    @property
    def nodes(self) -> np.ndarray | None:
        """For ``empirical``: the grid on which the density is tabulated (w is linear between nodes)."""
        return None if self._nodes is None else self._nodes.copy()

    def to_dict(self) -> dict[str, Any]:
        """The JSON description stored in a table's ``weight`` field."""
        d: dict[str, Any] = {"kind": self.kind}
        if self.kind == "student-t":
            d["df"] = self.df
        if self.kind in ("normal", "laplace", "student-t"):
            d["loc"] = self.loc
            d["scale"] = self.scale
        if self.kind == "empirical":
            d.update(file=self.file, samples=self.sample_count, sha256=self.sha256, bandwidth=self.bandwidth)
        d["low"] = self.low
        d["high"] = self.high
        return d

    def mass(self) -> float:
        """The integral of w over [low, high] (closed form; for ``empirical`` the exact integral of the interpolant)."""
        if self.kind == "uniform":
            return self.high - self.low
        if self.kind == "empirical":
            return float(np.sum(np.diff(self._nodes) * (self._density[1:] + self._density[:-1])) / 2.0)
        a = (self.low - self.loc) / self.scale
        b = (self.high - self.loc) / self.scale
        if self.kind == "normal":
            from scipy.special import ndtr

            # difference of whichever tail is smaller, for accuracy far from loc
            return float(ndtr(b) - ndtr(a)) if a < 0 else float(ndtr(-a) - ndtr(-b))
        if self.kind == "laplace":
            return _laplace_cdf(b) - _laplace_cdf(a) if a < 0 else _laplace_cdf(-a) - _laplace_cdf(-b)
        from scipy.special import stdtr

        return float(stdtr(self.df, b) - stdtr(self.df, a)) if a < 0 else float(stdtr(self.df, -a) - stdtr(self.df, -b))


def check_design_range(low: object, high: object, name: str = "range") -> tuple[float, float]:
    """A design range [low, high]: :func:`~fewbit_design.errors.check_range`, within +-:data:`MAX_ABS_RANGE` and at
    least :data:`MIN_WIDTH` and :data:`MIN_RELATIVE_WIDTH` of its magnitude wide.

    >>> check_design_range(-1e7, 1.0)
    Traceback (most recent call last):
    ...
    fewbit_design.errors.FewBitError: range must lie within +-1e+06 (the design grid resolves an activation's bend at \
scale 1 only up to there), got [-1e+07, 1]

    Args:
        low: A
        high: B
        name: what the range is, for the error message
    """
    low, high = check_range(low, high, name=name)
    magnitude = max(abs(low), abs(high))
    if magnitude > MAX_ABS_RANGE:
        raise FewBitError(
            f"{name} must lie within +-{MAX_ABS_RANGE:g} (the design grid resolves an activation's bend at scale 1 "
            f"only up to there), got [{low:g}, {high:g}]"
        )
    if high - low < max(MIN_WIDTH, MIN_RELATIVE_WIDTH * magnitude):
        raise FewBitError(
            f"{name} [{low:.17g}, {high:.17g}] is too narrow: it must be at least {MIN_WIDTH:g} wide and "
            f"2**-20 of its magnitude (its grid cells would be a few float64 ulps)"
        )
    return low, high


def _laplace_cdf(z: float) -> float:
    return 0.5 * math.exp(z) if z < 0 else 1.0 - 0.5 * math.exp(-z)


def _given(name: str, value: object) -> bool:
    """Whether an option was set to something other than its default (None also means 'not given')."""
    return value is not None and not (_DEFAULTS[name] is not None and value == _DEFAULTS[name])


def make_weight(
    kind: str = "uniform",
    *,
    low: float = -10.0,
    high: float = 10.0,
    loc: float | None = 0.0,
    scale: float | None = 1.0,
    df: float | None = None,
    samples: str | os.PathLike | np.ndarray | None = None,
) -> Weight:
    """Build and validate a weight on the design range [low, high].

    ``loc``/``scale`` apply to normal, laplace and student-t; ``df`` (required) to student-t; ``samples`` (required:
    a ``.npy`` path or an array) to empirical. Setting an option the kind does not use is an error (passing its
    default value, or None, is allowed).

    >>> make_weight("student-t", df=3).to_dict()
    {'kind': 'student-t', 'df': 3.0, 'loc': 0.0, 'scale': 1.0, 'low': -10.0, 'high': 10.0}
    >>> make_weight("normal", df=3)
    Traceback (most recent call last):
    ...
    fewbit_design.errors.FewBitError: df applies only to weight 'student-t', got weight 'normal'
    """
    kind = check_choice("weight", kind, WEIGHT_KINDS)
    low, high = check_design_range(low, high)
    options = {"loc": loc, "scale": scale, "df": df, "samples": samples}
    for name, value in options.items():
        if kind not in _USES[name] and _given(name, value):
            users = _USES[name]
            quoted = [repr(user) for user in users]
            which = f"weight {quoted[0]}" if len(quoted) == 1 else f"weights {', '.join(quoted[:-1])} or {quoted[-1]}"
            raise FewBitError(f"{name} applies only to {which}, got weight {kind!r}")
    if kind == "uniform":
        return Weight(kind, low, high)
    if kind == "empirical":
        if samples is None:
            raise FewBitError(
                "weight 'empirical' needs samples: a .npy file of recorded pre-activations (--samples FILE.npy)"
            )
        return _empirical(samples, low, high)
    loc = 0.0 if loc is None else check_finite("loc", loc)
    scale = 1.0 if scale is None else check_positive("scale", scale)
    if scale < MIN_RELATIVE_SCALE * (high - low):
        raise FewBitError(
            f"scale {scale:g} of weight {kind!r} is too small for the design range [{low:g}, {high:g}]: the design "
            f"grid resolves a weight at least {MIN_RELATIVE_SCALE:g} of the range wide (scale >= "
            f"{MIN_RELATIVE_SCALE * (high - low):.3g}); narrow the range"
        )
    if kind != "student-t":
        return Weight(kind, low, high, loc=loc, scale=scale)
    if df is None:
        raise FewBitError("weight 'student-t' needs df, its degrees of freedom (> 0): --df X")
    df = check_positive("df", df)
    from scipy.special import betaln

    # log Gamma((df+1)/2) - log Gamma(df/2) - log(df pi)/2 = -log B(df/2, 1/2) - log(df)/2, without the cancellation
    # of two huge log Gammas (df = 1e100 gave a density e**-115 times too small; 1e308 gave nan)
    log_norm = -betaln(0.5 * df, 0.5) - 0.5 * math.log(df) - math.log(scale)
    return Weight(kind, low, high, loc=loc, scale=scale, df=df, _log_norm=float(log_norm))


# ----------------------------------------------------------------------------------------------------------------------
# Empirical densities


def _load_samples(samples: str | os.PathLike | np.ndarray) -> tuple[np.ndarray, str | None, str, str]:
    """The flat float64 samples, the file's basename (None for an array), its sha256 and a label for messages."""
    if isinstance(samples, str | os.PathLike):
        path = Path(samples)
        label = f"samples file '{path}'"
        if not path.is_file():
            raise FewBitError(f"{label} does not exist" if not path.exists() else f"{label} is not a file")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise FewBitError(f"{label} cannot be read: {exc.strerror or exc}") from None
        if data.startswith(b"PK\x03\x04"):
            raise FewBitError(f"{label} is an .npz archive; save one array with numpy.save")
        if not data.startswith(b"\x93NUMPY"):
            raise FewBitError(f"{label} is not a .npy array (no .npy header; write it with numpy.save)")
        import io

        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as exc:
            if "pickle" in str(exc).lower():
                raise FewBitError(f"{label} holds Python objects; it must be a numeric .npy array") from None
            raise FewBitError(f"{label} is not a .npy array ({exc})") from None
        except Exception as exc:
            raise FewBitError(f"{label} is not a .npy array ({type(exc).__name__}: {exc})") from None
        name: str | None = path.name
        digest = hashlib.sha256(data).hexdigest()
    else:
        label = "samples array"
        array = np.asarray(samples)
        name = None
        digest = ""
    if array.dtype.kind not in "iuf":
        raise FewBitError(f"{label} must hold real numbers, got dtype {array.dtype}")
    flat = np.ascontiguousarray(array, dtype=np.float64).ravel()
    if name is None:
        digest = hashlib.sha256(flat.tobytes()).hexdigest()
    if flat.size < 2:
        raise FewBitError(f"{label} must hold at least 2 samples, got {flat.size}")
    finite = np.isfinite(flat)
    if not finite.all():
        bad = int(np.count_nonzero(~finite))
        raise FewBitError(f"{label} must be finite, got {bad} non-finite value(s) of {flat.size}")
    return flat, name, digest, label


def silverman_bandwidth(samples: np.ndarray) -> float:
    """Silverman's rule of thumb: 0.9 min(std, IQR / 1.34) n**(-1/5) (std alone when the IQR is 0)."""
    # samples near +-1e308 (or 1e-308) go in units of the largest |sample|: their squares (and IQR) over/underflow
    largest = float(np.max(np.abs(samples)))
    unit = largest if largest > 1e150 or 0.0 < largest < 1e-150 else 1.0
    scaled = samples / unit
    std = float(np.std(scaled, ddof=1)) * unit
    q75, q25 = np.percentile(scaled, [75.0, 25.0])
    spread = min(std, float(q75 - q25) / 1.34 * unit)
    if spread <= 0:
        spread = std
    return 0.9 * spread * samples.size ** (-0.2)


def _empirical(samples: str | os.PathLike | np.ndarray, low: float, high: float) -> Weight:
    flat, name, digest, label = _load_samples(samples)
    lo, hi = float(flat.min()), float(flat.max())
    if lo == hi:
        raise FewBitError(f"{label} must hold at least 2 distinct values, got only {lo:g}")
    count_inside = int(np.count_nonzero((flat >= low) & (flat <= high)))
    if count_inside == 0:
        raise FewBitError(
            f"{label} has no samples inside the design range [{low:g}, {high:g}] (samples span [{lo:g}, {hi:g}])"
        )
    bandwidth = silverman_bandwidth(flat)
    nodes, density = _kde_on_grid(flat, low, high, bandwidth)
    return Weight(
        "empirical",
        low,
        high,
        file=name,
        sample_count=int(flat.size),
        sha256=digest,
        bandwidth=bandwidth,
        _nodes=nodes,
        _density=density,
    )


def _kde_on_grid(samples: np.ndarray, low: float, high: float, bandwidth: float) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian KDE (divided by the total count) at the nodes of a fixed grid over [low, high].

    Samples within the kernel's reach of the range are linearly binned on the grid extended by the kernel width;
    the binned counts are convolved (FFT) with the kernel sampled on the grid, normalised to unit sum.
    """
    from scipy.signal import fftconvolve

    cells = EMPIRICAL_GRID - 1
    step = (high - low) / cells
    # Ratios are formed as bandwidth / step (never their product): a bandwidth near 1e308 or 0 must not overflow.
    if bandwidth / step > _MAX_PAD / _KERNEL_WIDTH:  # the kernel is far wider than the range: a coarser grid will do
        cells = max(2, math.floor(min((high - low) / bandwidth * (_MAX_PAD / _KERNEL_WIDTH), float(cells))))
        step = (high - low) / cells
    reach = _KERNEL_WIDTH * (bandwidth / step)
    pad = math.ceil(reach) if reach <= 4 * _MAX_PAD else 4 * _MAX_PAD
    if bandwidth < step / 64.0:  # narrower than a grid cell: the kernel is a unit spike (linear binning alone)
        pad = 0
    start = low - pad * step
    size = cells + 1 + 2 * pad
    near = samples[(samples >= start) & (samples <= start + (size - 1) * step)]  # (far samples would overflow)
    position = (near - start) / step
    keep = (position >= 0) & (position <= size - 1)
    position = position[keep]
    index = np.minimum(np.floor(position).astype(np.int64), size - 2)
    fraction = position - index
    counts = np.bincount(index, weights=1.0 - fraction, minlength=size)
    counts += np.bincount(index + 1, weights=fraction, minlength=size)
    offsets = np.arange(-pad, pad + 1, dtype=np.float64) * (step / bandwidth if pad else 0.0)
    kernel = np.exp(-0.5 * offsets * offsets)
    kernel /= kernel.sum()
    smoothed = fftconvolve(counts, kernel, mode="same") / (samples.size * step)
    density = np.maximum(smoothed[pad : pad + cells + 1], 0.0)  # FFT round-off can dip below 0
    nodes = low + step * np.arange(cells + 1, dtype=np.float64)
    nodes[-1] = high
    return nodes, density


# ----------------------------------------------------------------------------------------------------------------------
# JSON round trip

_FIELDS = {
    "uniform": ("low", "high"),
    "normal": ("loc", "scale", "low", "high"),
    "laplace": ("loc", "scale", "low", "high"),
    "student-t": ("df", "loc", "scale", "low", "high"),
    "empirical": ("file", "samples", "sha256", "bandwidth", "low", "high"),
}


def weight_from_dict(d: Mapping[str, Any], *, samples: str | os.PathLike | np.ndarray | None = None) -> Weight:
    """Rebuild a weight from :meth:`Weight.to_dict` output.

    An empirical weight needs its samples again (``samples=`` a path or an array); when both the description and
    ``samples`` name a file, the file's sha256 must match.

    >>> weight_from_dict({"kind": "laplace", "loc": 0.0, "scale": 2.0, "low": -10.0, "high": 10.0}).scale
    2.0
    """
    if not isinstance(d, Mapping):
        raise FewBitError(f"weight must be a JSON object, got {type(d).__name__}")
    kind = check_choice("weight kind", d.get("kind"), WEIGHT_KINDS)
    expected = set(_FIELDS[kind])
    missing = [key for key in _FIELDS[kind] if key not in d]
    unknown = sorted(set(d) - expected - {"kind"})
    if missing:
        raise FewBitError(f"weight {kind!r} is missing field(s) {', '.join(missing)}")
    if unknown:
        raise FewBitError(f"weight {kind!r} has unknown field(s) {', '.join(unknown)}")
    if kind == "empirical":
        if samples is None:
            raise FewBitError(
                f"weight 'empirical' needs its samples file ({d.get('file') or 'an array'}) to be rebuilt: "
                "pass samples= (--samples FILE.npy)"
            )
        weight = make_weight(kind, low=d["low"], high=d["high"], samples=samples)
        if d.get("file") and weight.file is not None and d.get("sha256") and d["sha256"] != weight.sha256:
            raise FewBitError(
                f"samples file '{samples}' does not match the weight's (sha256 {weight.sha256[:12]}... "
                f"!= {str(d['sha256'])[:12]}...)"
            )
        return weight
    options = {key: d[key] for key in ("loc", "scale", "df") if key in d}
    return make_weight(kind, low=d["low"], high=d["high"], **options)
