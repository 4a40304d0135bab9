"""matplotlib figures (Agg backend, imported only when a plot is asked for).

Figures are drawn on a :class:`matplotlib.figure.Figure` with the Agg canvas (no pyplot, no global state) and written
atomically: a failed plot never leaves a partial file behind. A figure file's suffix names its format
(:data:`FIGURE_FORMATS`, checked up front by :func:`figure_format`).
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from .errors import FewBitError
from .output_files import write_bytes_atomic
from .table import Table

__all__ = [
    "FIGURE_FORMATS",
    "figure_format",
    "figure_bytes",
    "save_figure",
    "table_figure",
    "bits_grid_figure",
    "curves_figure",
    "plot_table",
    "plot_bits_grid",
    "plot_curves",
]

#: The format matplotlib writes for each figure file suffix (any case). JPEG goes through pillow, which matplotlib
#: requires.
FIGURE_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg", ".jpg": "jpeg", ".jpeg": "jpeg"}


def figure_format(path: str | os.PathLike, *, option: str = "figure file") -> str:
    """The format a figure written to ``path`` has, from its suffix (:data:`FIGURE_FORMATS`); an existing FIFO or
    character device without a suffix (``/dev/stdout``) gets PNG. Any other name is one error listing the suffixes.

    >>> figure_format("gelu.PDF")
    'pdf'

    Args:
        path: the figure file
        option: what names it, for the error message (``--plot``)
    """
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix in FIGURE_FORMATS:
        return FIGURE_FORMATS[suffix]
    if not suffix and _is_stream(path):
        return "png"
    accepted = ", ".join(list(FIGURE_FORMATS)[:-1]) + f" or {list(FIGURE_FORMATS)[-1]}"
    raise FewBitError(f"{option} must end in {accepted} (the figure's format), got {os.fspath(path)!r}")


def _is_stream(path: str | os.PathLike) -> bool:
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(figure)
    return figure


def figure_bytes(figure: Any, path: str | os.PathLike) -> bytes:
    """``figure`` rendered in memory in the format of ``path`` (:func:`figure_format`), at 120 dpi.

    Args:
        figure: a matplotlib figure
        path: the file it is for (only its name is used)
    """
    buffer = io.BytesIO()
    figure.savefig(buffer, format=figure_format(path), dpi=120, bbox_inches="tight")
    return buffer.getvalue()


def save_figure(figure: Any, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Render ``figure`` in memory in the format of ``path``, then write it with
    :func:`~fewbit_design.output_files.write_bytes_atomic` (an existing file is replaced only with ``force``).

    Args:
        figure: a matplotlib figure
        path: the file to write; its suffix names the format
        force: replace an existing file
    """
    return write_bytes_atomic(path, figure_bytes(figure, path), force=force)


#: how the weight is drawn: a density curve on its own (right-hand) y axis, labelled, never a band at an arbitrary
#: height
WEIGHT_STYLE = {"color": "tab:gray", "linestyle": "--", "linewidth": 1.3}
WEIGHT_AXIS_LABEL = "weight w(x) (density)"
#: the line styles of :func:`plot_curves` (with the markers and colours, no two activations look alike)
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = "os^vD<>ph*"


def _density(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The weight normalised to a probability density over the plotted range (the weights are defined up to a
    factor: the uniform one is 1 on its range): what the axis label says it is."""
    area = float(np.trapezoid(weight, x)) if hasattr(np, "trapezoid") else float(np.trapz(weight, x))
    return weight / area if area > 0 else weight


def _weight_axis(axes: Any, x: np.ndarray, density: np.ndarray, label: str) -> Any:
    """The weight as a density curve on a secondary y axis of ``axes`` (ticks and label on the right, in the curve's
    colour), drawn behind the data; returns that axis."""
    weight_axes = axes.twinx()
    weight_axes.plot(x, density, label=label, **WEIGHT_STYLE)
    weight_axes.fill_between(x, 0.0, density, color=WEIGHT_STYLE["color"], alpha=0.08)
    weight_axes.set_ylim(0.0, max(float(np.max(density)) * 1.15, 1e-12))
    weight_axes.set_ylabel(WEIGHT_AXIS_LABEL, color=WEIGHT_STYLE["color"])
    weight_axes.tick_params(axis="y", colors=WEIGHT_STYLE["color"])
    axes.set_zorder(weight_axes.get_zorder() + 1)
    axes.patch.set_visible(False)
    return weight_axes


def _legend(axes: Any, weight_axes: Any, **options: Any) -> Any:
    """One legend for the data and the weight (the two axes of a panel)."""
    handles, labels = axes.get_legend_handles_labels()
    more_handles, more_labels = weight_axes.get_legend_handles_labels()
    return axes.legend(handles + more_handles, labels + more_labels, **options)


def plot_table(
    table: Table, bound_activation: Any, weight: Any, path: str | os.PathLike, *, force: bool = False
) -> Path:
    """Write :func:`table_figure` to ``path`` (its suffix names the format); an existing file is replaced only with
    ``force``."""
    figure_format(path)  # a bad suffix is refused before any drawing
    return save_figure(table_figure(table, bound_activation, weight), path, force=force)


def table_figure(table: Table, bound_activation: Any, weight: Any) -> Any:
    """f'(x), the table's step function q(x) and the weight w(x) over the design range.

    ``bound_activation`` provides ``df`` (the exact derivative), ``weight`` is callable with ``low``/``high``.
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
    weight_axes = _weight_axis(axes, x, _density(x, weight(x)), f"weight w(x), {table.weight.get('kind')}")
    _legend(axes, weight_axes, loc="upper left", fontsize=8)
    snr = "" if table.snr_db is None else f", SNR {table.snr_db:.1f} dB"
    symmetric = ", symmetric" if table.symmetric else ""
    axes.set_title(f"{table.activation}: {table.bits}-bit {table.mode}{symmetric}, error L = {table.error:.4g}{snr}")
    return figure


def _view_range(tables: list[Table], weight: Any) -> tuple[float, float]:
    """The x range shown: the whole design range (the weight's support, over which the error is measured), so that
    the weight's density and the step function are seen where they count."""
    return float(weight.low), float(weight.high)


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
    """Write :func:`bits_grid_figure` to ``path`` atomically (its suffix names the format)."""
    figure_format(path)  # a bad suffix is refused before any drawing
    return save_figure(bits_grid_figure(tables, bound_activation, weight), path, force=force)


def bits_grid_figure(tables: list[Table], bound_activation: Any, weight: Any) -> Any:
    """One panel per table (bit width): f'(x), the step function q(x) and the weight as a density curve on the
    panel's right-hand axis; the error in each panel's title (like the paper's Figure 8 grid)."""
    count = len(tables)
    columns = 2 if count in (2, 4) else min(count, 4)
    rows = -(-count // columns)
    low, high = _view_range(tables, weight)
    figure = _figure(4.3 * columns, 3.6 * rows + 0.6)
    for index, table in enumerate(tables):
        axes = figure.add_subplot(rows, columns, index + 1)
        inside = table.boundaries[(table.boundaries > low) & (table.boundaries < high)]
        x = np.unique(np.concatenate([np.linspace(low, high, 2001), inside]))
        shade = _weight_axis(axes, x, _density(x, weight(x)), "weight w(x)")
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
        _legend(axes, shade, fontsize=7, loc="upper left")
    figure.suptitle(f"{_activation_label(bound_activation)}: few-bit derivative, weight {_weight_label(weight)}")
    figure.tight_layout()
    return figure


def plot_curves(rows: list[dict[str, Any]], path: str | os.PathLike, *, title: str = "", force: bool = False) -> Path:
    """Write :func:`curves_figure` to ``path`` atomically (its suffix names the format)."""
    figure_format(path)  # a bad suffix is refused before any drawing
    return save_figure(curves_figure(rows, title=title), path, force=force)


def curves_figure(rows: list[dict[str, Any]], *, title: str = "") -> Any:
    """Error (log scale) and SNR (dB) against bits, one line per activation, the two modes side by side.

    ``rows`` are dicts with activation, mode, bits, error and snr_db. Exact tables (error 0) are left off the
    log-scale panel and the SNR panel. Each activation has its own colour, marker and line style (lines that
    coincide stay visible: open markers of different shapes, dashes), and the one legend sits outside the panels,
    to their right.
    """
    names = list(dict.fromkeys(row["activation"] for row in rows))
    figure = _figure(13.0, 8.6)
    grid = figure.subplots(2, 2, sharex=True, sharey="row")
    for column, mode in enumerate(("levelsets", "intervals")):
        for index, name in enumerate(names):
            series = sorted((r for r in rows if r["activation"] == name and r["mode"] == mode), key=lambda r: r["bits"])
            kept = [r for r in series if r["error"] > 0 and r["snr_db"] is not None]
            style = {
                "color": f"C{index % 10}",
                "marker": MARKERS[index % len(MARKERS)],
                "linestyle": LINESTYLES[index % len(LINESTYLES)],
                "markerfacecolor": "none",
                "linewidth": 1.4,
                "markersize": 6 + 2 * (index % 3),
            }
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
    grid[1, 0].xaxis.get_major_locator().set_params(integer=True)
    figure.suptitle("Few-bit derivative approximations: error and SNR against bits" + (f"\n{title}" if title else ""))
    figure.tight_layout(rect=(0.0, 0.0, 0.88, 1.0))
    handles, labels = grid[0, 0].get_legend_handles_labels()
    for axes in grid.flat:  # an activation drawn only in some panels (exact elsewhere) still gets its entry
        for handle, label in zip(*axes.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    figure.legend(handles, labels, loc="upper left", bbox_to_anchor=(0.885, 0.93), title="activation", fontsize=9)
    return figure
