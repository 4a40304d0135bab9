"""matplotlib figures (Agg backend, imported only when a plot is asked for).

Figures are drawn on a :class:`matplotlib.figure.Figure` with the Agg canvas (no pyplot, no global state) and written
atomically: a failed plot never leaves a partial PNG behind.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from .table import Table, write_bytes_atomic

__all__ = ["plot_table", "save_figure"]


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Any, path: str | os.PathLike, *, force: bool = True) -> Path:
    """Render ``figure`` to PNG in memory, then write it atomically."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return write_bytes_atomic(path, buffer.getvalue(), force=force)


def plot_table(table: Table, bound_activation: Any, weight: Any, path: str | os.PathLike) -> Path:
    """A PNG of f'(x), the table's step function q(x) and the weight w(x) over the design range.

    ``bound_activation`` provides ``df`` (the exact derivative), ``weight`` is callable with ``low``/``high``.
    The path is overwritten if it exists (callers check it with ``check_writable`` first).
    """
    low, high = float(weight.low), float(weight.high)
    x = np.linspace(low, high, 4001)
    # Put every boundary on the curve exactly so the steps are drawn sharp.
    inside = table.boundaries[(table.boundaries > low) & (table.boundaries < high)]
    x = np.unique(np.concatenate([x, inside]))
    figure = _figure(8.0, 4.8)
    axes = figure.add_subplot(1, 1, 1)
    axes.plot(x, bound_activation.df(x), color="tab:blue", linewidth=1.6, label=f"f'(x), {table.activation}")
    edges = np.concatenate([[low], inside, [high]])
    middle = (edges[:-1] + edges[1:]) / 2.0
    levels = table.q(middle)
    axes.stairs(levels, edges, color="tab:orange", linewidth=1.8, baseline=None, label=f"q(x), {table.bits} bits")
    for b in inside:
        axes.axvline(b, color="tab:orange", linewidth=0.4, alpha=0.4)
    axes.set_xlabel("x (pre-activation)")
    axes.set_ylabel("derivative")
    axes.set_xlim(low, high)
    weight_axes = axes.twinx()
    w = weight(x)
    weight_axes.fill_between(x, 0.0, w, color="tab:gray", alpha=0.18, label=f"weight w(x), {table.weight.get('kind')}")
    weight_axes.set_ylabel("weight w(x)")
    weight_axes.set_ylim(0.0, max(float(np.max(w)) * 1.15, 1e-12))
    handles, labels = axes.get_legend_handles_labels()
    more_handles, more_labels = weight_axes.get_legend_handles_labels()
    axes.legend(handles + more_handles, labels + more_labels, loc="best", fontsize=8)
    snr = "" if table.snr_db is None else f", SNR {table.snr_db:.1f} dB"
    symmetric = ", symmetric" if table.symmetric else ""
    axes.set_title(f"{table.activation}: {table.bits}-bit {table.mode}{symmetric}, error L = {table.error:.4g}{snr}")
    axes.set_zorder(weight_axes.get_zorder() + 1)
    axes.patch.set_visible(False)
    return save_figure(figure, path)
