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

__all__ = ["plot_table", "plot_bits_grid", "plot_curves", "save_figure"]


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Any, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Render ``figure`` to PNG in memory, then write it with :func:`~fewbit_design.table.write_bytes_atomic`
    (an existing file is replaced only with ``force``)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return write_bytes_atomic(path, buffer.getvalue(), force=force)


def plot_table(
    table: Table, bound_activation: Any, weight: Any, path: str | os.PathLike, *, force: bool = False
) -> Path:
    """A PNG of f'(x), the table's step function q(x) and the weight w(x) over the design range.

    ``bound_activation`` provides ``df`` (the exact derivative), ``weight`` is callable with ``low``/``high``.
    An existing file at ``path`` is replaced only with ``force``.
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
    return save_figure(figure, path, force=force)


def _view_range(tables: list[Table], weight: Any) -> tuple[float, float]:
    """The x range worth showing for all panels: every table's boundaries, padded, inside the design range."""
    low, high = float(weight.low), float(weight.high)
    boundaries = np.concatenate([t.boundaries for t in tables])
    if boundaries.size:
        pad = max(2.0, 0.25 * float(boundaries.max() - boundaries.min()))
        low = max(low, float(boundaries.min()) - pad)
        high = min(high, float(boundaries.max()) + pad)
    return low, high


def _activation_label(bound_activation: Any) -> str:
    params = ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v:g}" for k, v in bound_activation.params.items())
    return f"{bound_activation.name}({params})" if params else bound_activation.name


def _weight_label(weight: Any) -> str:
    d = weight.to_dict()
    extra = ", ".join(f"{k}={d[k]:g}" for k in ("loc", "scale", "df") if d.get(k) is not None)
    name = f"{d['kind']}({extra})" if extra else d["kind"]
    return f"{name} on [{d['low']:g}, {d['high']:g}]"


def plot_bits_grid(
    tables: list[Table], bound_activation: Any, weight: Any, path: str | os.PathLike, *, force: bool = False
) -> Path:
    """One panel per table (bit width): f'(x), the step function q(x) and the weight shaded; the error in each
    panel's title (like the paper's Figure 8 grid). Written atomically to ``path``."""
    count = len(tables)
    columns = 2 if count in (2, 4) else min(count, 4)
    rows = -(-count // columns)
    low, high = _view_range(tables, weight)
    figure = _figure(4.3 * columns, 3.6 * rows + 0.6)
    for index, table in enumerate(tables):
        axes = figure.add_subplot(rows, columns, index + 1)
        inside = table.boundaries[(table.boundaries > low) & (table.boundaries < high)]
        x = np.unique(np.concatenate([np.linspace(low, high, 2001), inside]))
        shade = axes.twinx()
        density = weight(x)
        shade.fill_between(x, 0.0, density, color="tab:gray", alpha=0.18, label="weight w(x)")
        shade.set_ylim(0.0, max(float(np.max(density)) * 1.15, 1e-12))
        shade.set_yticks([])
        axes.set_zorder(shade.get_zorder() + 1)
        axes.patch.set_visible(False)
        axes.plot(x, bound_activation.df(x), color="tab:blue", linewidth=1.5, label="f'(x)")
        edges = np.concatenate([[low], inside, [high]])
        axes.stairs(
            table.q((edges[:-1] + edges[1:]) / 2.0),
            edges,
            color="tab:orange",
            linewidth=1.8,
            baseline=None,
            label="q(x)",
        )
        snr = "exact" if table.snr_db is None else f"SNR {table.snr_db:.1f} dB"
        mode = table.mode + (", symmetric" if table.symmetric else "")
        axes.set_title(f"{table.bits}-bit {mode}\nerror L = {table.error:.4g}, {snr}", fontsize=9)
        axes.set_xlabel("x (pre-activation)")
        axes.set_ylabel("derivative")
        axes.set_xlim(low, high)
        axes.grid(alpha=0.3)
        handles, labels = axes.get_legend_handles_labels()
        more_handles, more_labels = shade.get_legend_handles_labels()
        axes.legend(handles + more_handles, labels + more_labels, fontsize=7, loc="best")
    figure.suptitle(f"{_activation_label(bound_activation)}: few-bit derivative, weight {_weight_label(weight)}")
    figure.tight_layout()
    return save_figure(figure, path, force=force)


def plot_curves(rows: list[dict[str, Any]], path: str | os.PathLike, *, title: str = "", force: bool = False) -> Path:
    """Error (log scale) and SNR (dB) against bits, one line per activation, the two modes side by side.

    ``rows`` are dicts with activation, mode, bits, error and snr_db. Exact tables (error 0) are left off the
    log-scale panel and the SNR panel.
    """
    names = list(dict.fromkeys(row["activation"] for row in rows))
    figure = _figure(12.0, 8.6)
    grid = figure.subplots(2, 2, sharex=True, sharey="row")
    markers = "os^vD<>ph*"
    for column, mode in enumerate(("levelsets", "intervals")):
        for index, name in enumerate(names):
            series = sorted((r for r in rows if r["activation"] == name and r["mode"] == mode), key=lambda r: r["bits"])
            kept = [r for r in series if r["error"] > 0 and r["snr_db"] is not None]
            style = {"color": f"C{index % 10}", "marker": markers[index % 10], "linewidth": 1.3, "markersize": 4}
            grid[0, column].plot([r["bits"] for r in kept], [r["error"] for r in kept], label=name, **style)
            grid[1, column].plot([r["bits"] for r in kept], [r["snr_db"] for r in kept], label=name, **style)
        grid[0, column].set_yscale("log")
        label = "intervals (symmetric where f' is even)" if mode == "intervals" else "level sets (default)"
        grid[0, column].set_title(f"mode: {label}")
        grid[0, column].set_ylabel("error L (log scale)")
        grid[1, column].set_ylabel("SNR (dB)")
        grid[1, column].set_xlabel("bits per element")
        for axes in grid[:, column]:
            axes.grid(alpha=0.3, which="both")
    grid[0, 0].legend(fontsize=8, ncol=2)
    figure.suptitle("Few-bit derivative approximations: error and SNR against bits" + (f"\n{title}" if title else ""))
    figure.tight_layout()
    return save_figure(figure, path, force=force)
