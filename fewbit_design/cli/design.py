"""``fewbit-design ACTIVATION ...`` (the default command, ``design``) and ``fewbit-design list``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from ..design.weights import check_design_range
from ..errors import FewBitError, check_bits, check_choice
from ._options import WEIGHT_KINDS, ActivationCommand, cli, fold_option, stage, weight_options

MODES = ("levelsets", "intervals")
SPACINGS = ("adaptive", "uniform")


def _bound_activation(activation: str | None, module: str | None, params: tuple[str, ...]):
    from ..design import activations

    parsed = dict(activations.parse_param(text) for text in params)
    if module and activation:
        raise FewBitError(
            f"give an activation name or --activation-module, not both (got {activation!r} and {module!r})"
        )
    if module:
        _current_directory_on_path()
        return activations.from_module(module, parsed)
    if not activation:
        raise FewBitError("missing ACTIVATION (a name from 'fewbit-design list', or --activation-module pkg.mod:fn)")
    return activations.bind(activation, parsed)


def _current_directory_on_path() -> None:
    """Import ``--activation-module`` the way ``python -m`` does: the current directory first on ``sys.path``.

    A console script's ``sys.path`` starts with the script's own folder, so ``mypkg.acts`` in the folder the user
    stands in would otherwise import only once installed.
    """
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def _format_params(params: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in params.items())


def _format_weight(weight: dict[str, Any]) -> str:
    options = {k: v for k, v in weight.items() if k not in ("kind", "low", "high", "sha256")}
    inner = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in options.items())
    kind = weight["kind"] + (f"({inner})" if inner else "")
    return f"{kind} on [{weight['low']:g}, {weight['high']:g}]"


def format_summary(table: Any, seconds: float) -> str:
    """The human-readable summary of a table: header, one row per interval, error, SNR and time."""
    params = _format_params(table.params)
    name = f"{table.activation}({params})" if params else table.activation
    symmetric = ", symmetric" if table.symmetric else ""
    lines = [
        f"activation: {name}",
        f"bits: {table.bits} ({2**table.bits} codes), mode: {table.mode}{symmetric}, {len(table.codes)} intervals",
        f"weight: {_format_weight(table.weight)}",
        "",
    ]
    edges = np.concatenate([[-np.inf], table.boundaries, [np.inf]])
    rows = [("interval", "code", "level")]
    for k, code in enumerate(table.codes):
        lo, hi = edges[k], edges[k + 1]
        left = "(-inf" if lo == -np.inf else f"[{lo:.6g}"
        right = "inf)" if hi == np.inf else f"{hi:.6g})"
        rows.append((f"{left}, {right}", str(int(code)), f"{table.levels[code]:.8g}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        lines.append(f"  {row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}")
    lines.append("")
    design = table.design
    lines.append(f"error L = {table.error:.6g}")
    if "grid_error" in design:
        lines.append(f"grid error (DP on {design.get('grid')} grid points) = {design['grid_error']:.6g}")
    lines.append(f"SNR = {snr_text(table)}")
    refined = "refined" if design.get("refined") else "not refined"
    lines.append(f"time: {seconds:.2f} s ({refined}, {design.get('iterations', 0)} iterations)")
    return "\n".join(lines)


def snr_text(table: Any) -> str:
    """The SNR as the summary prints it. A table with error 0 is exact (q = f' wherever w > 0); when f' is 0 there
    as well, the SNR 0/0 is undefined and the table of zeros is still exact."""
    if table.snr_db is not None:
        return f"{table.snr_db:.2f} dB"
    if not np.any(table.levels):
        return "undefined (f' = 0 wherever w > 0; the table of zeros is exact)"
    return "inf (exact: q = f' wherever w > 0)"


@cli.command("design", cls=ActivationCommand, hidden=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("activation", required=False)
@click.option("--bits", type=int, default=3, show_default=True, help="Bits per element, 1 to 8 (2**bits codes).")
@weight_options
@click.option(
    "--mode",
    default="levelsets",
    show_default=True,
    metavar="levelsets|intervals",
    callback=fold_option(MODES),
    help="levelsets: optimal quantizer of f'(X); intervals: the paper's 2**bits intervals.",
)
@click.option("--symmetric", is_flag=True, help="Intervals mode: quantize |x| (for even derivatives).")
@click.option("--grid", type=int, default=None, help="Grid points of the DP (default depends on the mode and bits).")
@click.option(
    "--spacing",
    default="adaptive",
    show_default=True,
    metavar="adaptive|uniform",
    callback=fold_option(SPACINGS),
    help="Grid spacing: half the points follow w (f'')^2, or evenly spaced (the paper's grid).",
)
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE", help="Activation parameter (repeatable).")
@click.option(
    "--activation-module",
    "module",
    default=None,
    metavar="PKG.MOD:FN",
    help="Your own activation fn(x, **params), imported as `python -m` would: the current directory comes first "
    "on sys.path, so ./mypkg/acts.py works uninstalled. f' by torch autograd or finite differences.",
)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the table JSON here.")
@click.option("--force", is_flag=True, help="Overwrite --out / --plot if they exist.")
@click.option("--json", "as_json", is_flag=True, help="Print the table JSON on stdout and nothing else.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a figure of f', q and the weight (.png, .pdf, .svg, .jpg).",
)
@click.option("--no-refine", is_flag=True, help="Keep the grid DP's solution (no continuous refinement).")
def design_command(activation, bits, weight, loc, scale, df, samples, design_range, mode, symmetric, grid, spacing,
                   params, module, out, force, as_json, plot, no_refine) -> None:  # fmt: skip
    """Design the optimal few-bit approximation of ACTIVATION's derivative.

    \b
    Examples:
      fewbit-design gelu --bits 3 --weight normal
      fewbit-design silu --bits 4 --mode intervals --json | jq .error
      fewbit-design leaky_relu --param negative_slope=0.2 --bits 2 --out leaky.json
      fewbit-design gelu --bits 1 --mode intervals --grid 1001 --spacing uniform --no-refine   (paper, Table 1)
    """
    from ..design import design
    from ..design.weights import make_weight
    from ..output_files import check_outputs
    from ..plots import figure_format

    # Every input is checked before any work.
    bits = check_bits(bits, name="--bits")
    mode = check_choice("--mode", mode, MODES)
    if symmetric and mode != "intervals":
        raise FewBitError("--symmetric applies only to --mode intervals (it quantizes |x|)")
    low, high = check_design_range(*design_range, name="--range")
    weight_kind = check_choice("--weight", weight, WEIGHT_KINDS)
    spacing = check_choice("--spacing", spacing, SPACINGS)
    if grid is not None and not 2**bits + 1 <= grid:
        raise FewBitError(f"--grid must be at least 2**bits + 1 = {2**bits + 1}, got {grid}")
    bound = _bound_activation(activation, module, params)
    w = make_weight(weight_kind, low=low, high=high, loc=loc, scale=scale, df=df, samples=samples)
    if plot is not None:
        figure_format(plot, option="--plot")
    check_outputs({"--out": out, "--plot": plot}, force=force)
    _note_first_compile()
    start = time.perf_counter()
    table = design(bound, bits, weight=w, mode=mode, symmetric=symmetric, grid=grid, spacing=spacing,
                   refine=not no_refine, progress=stage)  # fmt: skip
    seconds = time.perf_counter() - start
    _write_outputs(table, bound, w, out, plot, force=force)
    if as_json:
        click.echo(table.to_json(), nl=False)
        return
    click.echo(format_summary(table, seconds))
    for path in (out, plot):
        if path is not None:
            click.echo(f"wrote {path}")


def _write_outputs(table: Any, bound: Any, weight: Any, out: str | None, plot: str | None, *, force: bool) -> None:
    """The table JSON (``--out``) and its figure (``--plot``), both or neither."""
    from ..output_files import write_files_atomic
    from ..plots import figure_bytes, table_figure

    files = {}
    if out is not None:
        files[out] = table.to_json().encode()
    if plot is not None:
        files[plot] = figure_bytes(table_figure(table, bound, weight), plot)
    write_files_atomic(files, force=force)


@cli.command("list")
def list_command() -> None:
    """Every activation with its parameters and defaults."""
    from ..design import activations

    rows = [("activation", "parameters (defaults)", "f' even", "formula")]
    for name in activations.names():
        entry = activations.get(name)
        params = []
        for key, default in entry.defaults.items():
            choices = entry._choices.get(key)
            text = f"{key}={default!r}"
            if choices:
                text += " (" + "|".join(choices) + ")"
            params.append(text)
        even = "yes" if entry.bind().even else "no"
        rows.append((name, ", ".join(params) or "-", even, entry.description))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        click.echo(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}".rstrip())


def _note_first_compile() -> None:
    """On a terminal, one line before a design whose numba kernels have not been compiled and cached yet (the first
    design after installing waits about 15 s for it, with no other sign of life)."""
    if sys.stderr.isatty() and not _kernels_cached():
        click.echo("compiling the design kernels with numba (once per installation, about 15 s)", err=True)


def _kernels_cached() -> bool:
    """Whether numba's cache holds the dynamic program's kernels (``dp.*.nbi`` index files, in ``NUMBA_CACHE_DIR``
    when it is set, else beside the module)."""
    from ..design import dp

    root = os.environ.get("NUMBA_CACHE_DIR")
    folder = Path(root) if root else Path(dp.__file__).parent / "__pycache__"
    return any(folder.rglob("dp.*.nbi")) if folder.is_dir() else False
