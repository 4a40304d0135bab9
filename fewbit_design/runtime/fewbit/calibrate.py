"""Per-layer calibration: record each activation's pre-activations on real data, design a table per layer.

:func:`calibrate` hooks every activation module that :func:`~.convert.convert` would replace, runs the model on the
given batches (no grad), and feeds each module's input into a :class:`StreamingHistogram`: a fixed number of equal
bins over a symmetric range [-R, R] that doubles (merging bin pairs, so no sample is ever re-read) when a value
falls outside. Memory is ``bins`` counts per layer whatever the number of batches; the histogram is exact up to the
bin width 2R / bins. Non-finite values are counted apart and left out.

Each layer's table is then designed with the empirical weight (:func:`fewbit_design.design.design` with
``weight='empirical'``) from samples taken at evenly spaced quantiles of the histogram (deterministic: sample k is
the (k + 1/2) / n quantile, linear inside its bin). The design toolkit is imported inside :func:`calibrate` only:
the runtime does not load scipy when it is imported. The tables come back keyed by module name, ready for
``convert(model, tables=...)``; ``save_dir=`` also writes each layer's quantile samples as ``<name>.npy`` so the CLI
can design from them (``fewbit-design gelu --weight empirical --samples <name>.npy --bits 3``).

>>> tables = runtime.calibrate(model, batches, bits=3)               # doctest: +SKIP
>>> runtime.convert(model, tables=tables)                            # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import FewBitError, check_bits, check_positive
from ...table import Table
from ..probe import run_example
from .matching import _Candidate, _recognise, _slots, canonical_name
from .nn import FewBitModule

__all__ = ["StreamingHistogram", "calibrate"]


class StreamingHistogram:
    """Counts of values in ``bins`` equal bins over [-R, R]; R doubles when a value falls outside.

    >>> h = StreamingHistogram(bins=4, initial_range=1.0)
    >>> h.update(np.array([-0.9, 0.1, 3.0]))
    >>> h.range, h.counts.tolist()
    (4.0, [0, 1, 1, 1])
    """

    def __init__(self, bins: int = 4096, initial_range: float = 1.0):
        if bins < 2 or bins % 2:
            raise FewBitError(f"StreamingHistogram: bins must be an even integer >= 2, got {bins!r}")
        check_positive("initial_range", initial_range)
        self.bins = int(bins)
        self.range = float(initial_range)
        self.counts = np.zeros(self.bins, dtype=np.int64)
        self.non_finite = 0

    @property
    def edges(self) -> np.ndarray:
        """The bin edges (``bins + 1`` values from -range to range)."""
        return np.linspace(-self.range, self.range, self.bins + 1)

    @property
    def total(self) -> int:
        """Number of finite values counted."""
        return int(self.counts.sum())

    def _grow(self) -> None:
        # [-R, R] -> [-2R, 2R]: pairs of bins merge into the middle half
        merged = self.counts.reshape(-1, 2).sum(axis=1)
        quarter = self.bins // 4
        counts = np.zeros(self.bins, dtype=np.int64)
        counts[quarter : quarter + merged.size] = merged
        self.counts = counts
        self.range *= 2.0

    def update(self, values: np.ndarray | torch.Tensor) -> None:
        """Count ``values`` (any shape; converted to float64)."""
        if isinstance(values, torch.Tensor):
            values = values.detach().to(torch.float32).cpu().numpy()
        flat = np.asarray(values, dtype=np.float64).ravel()
        finite = np.isfinite(flat)
        self.non_finite += int(flat.size - np.count_nonzero(finite))
        flat = flat[finite]
        if flat.size == 0:
            return
        largest = float(np.abs(flat).max())
        while largest >= self.range:
            self._grow()
        index = np.floor((flat + self.range) * (self.bins / (2.0 * self.range))).astype(np.int64)
        self.counts += np.bincount(np.clip(index, 0, self.bins - 1), minlength=self.bins)

    def quantile_samples(self, count: int = 100_000) -> np.ndarray:
        """``count`` values at the (k + 1/2) / count quantiles of the histogram (linear inside each bin)."""
        if self.total == 0:
            raise FewBitError("StreamingHistogram: no finite value was recorded, so there is nothing to sample")
        cumulative = np.concatenate([[0.0], np.cumsum(self.counts, dtype=np.float64)]) / self.total
        levels = (np.arange(count) + 0.5) / count
        return np.interp(levels, cumulative, self.edges)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``edges`` and ``counts`` to an .npz file."""
        np.savez(path, edges=self.edges, counts=self.counts, non_finite=self.non_finite)


def _batches(batches: Any) -> Iterable[Any]:
    if isinstance(batches, torch.Tensor | Mapping | tuple):
        return [batches]
    return batches


def calibrate(
    model: torch.nn.Module,
    batches: Iterable[Any] | torch.Tensor,
    *,
    bits: int = 3,
    mode: str = "levelsets",
    bins: int = 4096,
    samples: int = 100_000,
    low: float = -10.0,
    high: float = 10.0,
    save_dir: str | os.PathLike | None = None,
) -> dict[str, Table]:
    """Per-layer tables designed from the pre-activations ``model`` sees on ``batches``.

    ``batches`` is an iterable of model inputs (a tensor, a tuple of positional arguments or a dict of keyword
    arguments each), or one input. Every activation module that ``convert`` recognises (and that has a registry
    entry) gets a table at ``bits`` bits, designed on [``low``, ``high``] (widened to the recorded range when the
    data go beyond it) with the empirical weight of its recorded inputs. Returns ``{module name: Table}`` (a shared
    module is calibrated once, under its first name; names are those of the uncompiled model: a model wrapped by
    ``torch.compile`` gives the same names as the model itself, without ``_orig_mod.``; a model that is itself an
    activation module is named ''). ``save_dir`` also receives ``<name>.npy`` (quantile samples, the CLI's
    ``--samples`` input) and ``<name>.npz`` (the histogram) per layer (``model.npy`` for the name '').

    Args:
        bins: histogram bins per layer (the range doubles by merging bins, so memory stays bounded)
    """
    bits = check_bits(bits)
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"calibrate takes a torch.nn.Module, got {type(model).__name__}")
    candidates: dict[str, tuple[torch.nn.Module, _Candidate]] = {}
    for slot in _slots(model, root=True):
        if isinstance(slot.module, FewBitModule):
            continue
        recognised = _recognise(slot.module)
        if isinstance(recognised, _Candidate):
            # named as in the uncompiled model (no '_orig_mod.' of torch.compile), so the tables apply to either
            candidates[canonical_name(slot.names[0])] = (slot.module, recognised)
    if not candidates:
        raise FewBitError(f"calibrate: {type(model).__name__} has no activation module that convert recognises")
    histograms = {name: StreamingHistogram(bins) for name in candidates}
    handles = []
    for name, (module, _) in candidates.items():

        def record(_module, inputs, _name=name):
            if inputs and isinstance(inputs[0], torch.Tensor):
                histograms[_name].update(inputs[0])

        handles.append(module.register_forward_pre_hook(record))
    count = 0
    try:
        with torch.no_grad():
            for batch in _batches(batches):
                run_example(model, batch)
                count += 1
    finally:
        for handle in handles:
            handle.remove()
    if count == 0:
        raise FewBitError("calibrate: batches is empty; give at least one model input")

    from ...design import design  # lazily: the design toolkit loads scipy

    folder = Path(save_dir) if save_dir is not None else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    tables: dict[str, Table] = {}
    for name, (_, candidate) in candidates.items():
        histogram = histograms[name]
        values = histogram.quantile_samples(samples)
        if folder is not None:
            stem = name or "model"  # the model itself is an activation module: its name is ''
            np.save(folder / f"{stem}.npy", values)
            histogram.save(folder / f"{stem}.npz")
        span_low, span_high = min(low, float(values.min())), max(high, float(values.max()))
        # design() puts torch's thread count back after numba's OpenMP pool has reset it
        tables[name] = design(
            candidate.activation,
            bits,
            params=candidate.params,
            weight="empirical",
            samples=values,
            low=span_low,
            high=span_high,
            mode=mode,
        )
    return tables
