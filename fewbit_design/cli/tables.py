"""The CLI commands ``fewbit-design tables build|verify`` (the shipped set), ``fewbit-design plot`` and ``curves``."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from ..errors import FewBitError, parse_int_spec
from ..output_files import check_outputs, write_files_atomic
from ..plots import figure_format
from ._options import WEIGHT_KINDS, cli, weight_options

# Activations of the default `curves` figure: the paper's Table 1 and the other smooth ones.
DEFAULT_CURVES = ("gelu", "silu", "mish", "selu", "elu", "softplus", "sigmoid", "tanh", "logsigmoid", "softsign")


def _progress(total: int, label: str):
    return click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True, show_eta=True)


@cli.group("tables")
def tables_group() -> None:
    """Build or verify the shipped table set (every activation x bits 1-8 x both modes x two weights)."""


@tables_group.command("build")
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder (default: the package's shipped tables folder).",
)
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Worker processes (default: all cores).")
@click.option("--activation", "activations", multiple=True, help="Only these activations (repeatable).")
@click.option(
    "--check",
    is_flag=True,
    help="Write nothing: rebuild in memory and compare with the tables in --out (default: the shipped set) by the "
    "cross-machine definition of the same table; exit 2 naming each table and field that differs.",
)
def tables_build(out: str | None, jobs: int | None, activations: tuple[str, ...], check: bool) -> None:
    """Regenerate every shipped table deterministically (same bytes on every run on one machine)."""
    from ..design import activations as registry
    from ..tables import build, read_index, table_specs

    names = [registry.get(name).name for name in activations] or None
    total = len(table_specs(names))
    start = time.perf_counter()
    if check:
        from ..tables import check as check_set

        read_index(out)  # a missing or broken index is one clear error, before any work
        with _progress(total, "designing tables") as bar:
            problems = check_set(out, jobs=jobs, activations=names, progress=lambda _spec: bar.update(1))
        _report(problems, "tables build --check")
        elapsed = time.perf_counter() - start
        click.echo(f"ok: {total} tables rebuilt in memory are the same as the set ({elapsed:.1f} s)")
        return
    if out is None:
        _refuse_installed_package()
    with _progress(total, "designing tables") as bar:
        root = build(out, jobs=jobs, activations=names, progress=lambda _spec: bar.update(1))
    click.echo(f"wrote {total} tables and index.json to {root} in {time.perf_counter() - start:.1f} s")


def _refuse_installed_package() -> None:
    """``tables build`` without ``--out`` writes into the package's own tables folder: right in a source checkout,
    wrong in an installed package (a wheel's files belong to pip, and other environments may share them)."""
    from .. import tables

    folder = Path(tables.__file__).resolve().parent
    if installed_package(folder):
        raise FewBitError(
            f"tables build: the shipped tables are inside the installed package ({folder}); pass --out DIR to "
            "write the set elsewhere (tables build rewrites the package's own folder only in a source checkout)"
        )


def installed_package(folder: Path) -> bool:
    """Whether ``folder`` is inside an installed package (under site-packages or dist-packages), not a checkout."""
    return any(part in ("site-packages", "dist-packages") for part in folder.parts)


@tables_group.command("verify")
@click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False),
    default=None,
    help="Tables folder to check (default: the shipped one).",
)
@click.option(
    "--sample",
    type=click.IntRange(min=1),
    default=None,
    help="Recompute only N tables, chosen to cover every activation (default: all).",
)
@click.option("--seed", type=int, default=0, help="Seed of the sample.")
@click.option("--activation", "activations", multiple=True, help="Recompute only these activations (repeatable).")
def tables_verify(root: str | None, sample: int | None, seed: int, activations: tuple[str, ...]) -> None:
    """Validate every shipped table and recompute them (or a sample); fail naming the table and field."""
    from ..design import activations as registry
    from ..tables import read_index, sample_specs, table_specs, verify

    read_index(root)  # a missing or broken index is one clear error, before any work
    names = [registry.get(name).name for name in activations] or None
    specs = table_specs(names)
    count = len(specs) if sample is None else len(sample_specs(specs, sample, seed=seed))
    with _progress(count, "recomputing tables") as bar:
        problems = verify(root, sample=sample, seed=seed, activations=names, progress=lambda _spec: bar.update(1))
    _report(problems, "tables verify")
    click.echo(f"ok: every table validates; {count} recomputed, each the same table as the one in the set")


def _report(problems: list[str], command: str) -> None:
    if problems:
        for problem in problems:
            click.echo(f"FAIL {problem}", err=True)
        raise FewBitError(f"{command} found {len(problems)} problem(s); the first: {problems[0]}")


def weight_kwargs(weight: str, loc, scale, df, samples, design_range) -> dict[str, Any]:
    from ..design.weights import check_design_range
    from ..errors import check_choice

    weight = check_choice("--weight", weight, WEIGHT_KINDS)
    low, high = check_design_range(*design_range, name="--range")
    kwargs: dict[str, Any] = {"weight": weight, "low": low, "high": high}
    for name, value in (("loc", loc), ("scale", scale), ("df", df), ("samples", samples)):
        if value is not None:
            kwargs[name] = value
    return kwargs


def _shipped_weight_name(kwargs: dict[str, Any]) -> str | None:
    """The shipped weight name matching these design keyword arguments, if any."""
    if (kwargs.get("low"), kwargs.get("high")) != (-10.0, 10.0) or "samples" in kwargs or "df" in kwargs:
        return None
    if kwargs["weight"] == "uniform" and "loc" not in kwargs and "scale" not in kwargs:
        return "uniform"
    if kwargs["weight"] == "normal" and kwargs.get("loc", 0.0) == 0.0 and kwargs.get("scale", 1.0) == 1.0:
        return "normal"
    return None


def get_table(bound, bits: int, mode: str, kwargs: dict[str, Any]):
    """The shipped table for this request when there is one, else a freshly designed one.

    In intervals mode an activation with an even derivative gets the symmetric design (as shipped).
    """
    from ..design import design
    from ..design.activations import names as registry_names
    from ..table import load
    from ..tables import TABLES_DIR, TableSpec

    symmetric = mode == "intervals" and bound.even
    weight_name = _shipped_weight_name(kwargs)
    if weight_name is not None and bound.name in registry_names():
        # torch's defaults, or a shipped variant (gelu approximate='tanh' in gelu_tanh/)
        defaults = bound.activation.bind().params
        variant = tuple(sorted((k, v) for k, v in bound.params.items() if v != defaults.get(k)))
        path = TABLES_DIR / TableSpec(bound.name, bits, mode, symmetric, weight_name, variant).file
        if path.exists():
            table = load(path)
            if table.params == bound.params:
                return table
    return design(bound, bits, mode=mode, symmetric=symmetric, **kwargs)


def _param_dict(params: tuple[str, ...]) -> dict[str, Any]:
    from ..design.activations import parse_param

    return dict(parse_param(text) for text in params)


@cli.command("plot")
@click.argument("activation")
@click.option("--bits", "bits_spec", default="1-4", show_default=True, help="A number, a range 1-4 or a list 1,3,4.")
@click.option("--mode", type=click.Choice(["levelsets", "intervals"]), default="levelsets", show_default=True)
@weight_options
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE", help="Activation parameter (repeatable).")
@click.option(
    "--out", required=True, type=click.Path(dir_okay=False), help="Figure file to write (.png, .pdf, .svg, .jpg)."
)
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
def plot_command(activation, bits_spec, mode, weight, loc, scale, df, samples, design_range, params, out, force):
    """One panel per bit width: f'(x), the step function q(x), the weight shaded, the error in the title."""
    from ..design.activations import bind

    bits_list = parse_int_spec(bits_spec, name="--bits")
    bound = bind(activation, _param_dict(params))
    kwargs = weight_kwargs(weight, loc, scale, df, samples, design_range)
    figure_format(out, option="--out")
    check_outputs({"--out": out}, force=force)
    tables = [get_table(bound, bits, mode, kwargs) for bits in bits_list]
    from ..design.weights import make_weight
    from ..plots import bits_grid_figure, figure_bytes

    figure = bits_grid_figure(tables, bound, make_weight(**_weight_only(kwargs)))
    write_files_atomic({out: figure_bytes(figure, out)}, force=force)
    click.echo(f"wrote {out}")


def _weight_only(kwargs: dict[str, Any]) -> dict[str, Any]:
    result = {("kind" if k == "weight" else k): v for k, v in kwargs.items()}
    return result


@cli.command("curves")
@click.argument("activations", nargs=-1)
@click.option("--bits", "bits_spec", default="1-8", show_default=True, help="A number, a range 1-8 or a list 1,3,4.")
@weight_options
@click.option(
    "--out", required=True, type=click.Path(dir_okay=False), help="Figure file to write (.png, .pdf, .svg, .jpg)."
)
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="Also write the numbers as CSV.")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
def curves_command(activations, bits_spec, weight, loc, scale, df, samples, design_range, out, csv_path, force):
    """Error (log scale) and SNR in dB against bits, both modes side by side; the numbers as a text table."""
    from ..design.activations import bind

    bits_list = parse_int_spec(bits_spec, name="--bits")
    bounds = [bind(name) for name in (activations or DEFAULT_CURVES)]
    kwargs = weight_kwargs(weight, loc, scale, df, samples, design_range)
    figure_format(out, option="--out")
    check_outputs({"--out": out, "--csv": csv_path}, force=force)
    rows = []
    for bound in bounds:
        for mode in ("levelsets", "intervals"):
            for bits in bits_list:
                table = get_table(bound, bits, mode, kwargs)
                rows.append(
                    {
                        "activation": bound.name,
                        "mode": mode,
                        "symmetric": table.symmetric,
                        "bits": bits,
                        "error": table.error,
                        "snr_db": table.snr_db,
                    }
                )
    click.echo(format_curves_table(rows, bits_list))
    from ..plots import curves_figure, figure_bytes

    figure = curves_figure(rows, title=f"weight: {weight} on [{design_range[0]:g}, {design_range[1]:g}]")
    files = {out: figure_bytes(figure, out)}
    if csv_path:
        files[csv_path] = curves_csv(rows).encode()
    write_files_atomic(files, force=force)
    click.echo(f"wrote {out}" + (f" and {csv_path}" if csv_path else ""))


def format_curves_table(rows: list[dict[str, Any]], bits_list: list[int]) -> str:
    """Rows activations, columns bits, one block per mode (like the paper's Table 1)."""
    lines = []
    names = list(dict.fromkeys(row["activation"] for row in rows))
    width = max(len(name) for name in names) + 2
    for mode in ("levelsets", "intervals"):
        lines.append(f"error, mode {mode}" + (" (symmetric where f' is even)" if mode == "intervals" else ""))
        lines.append(" " * width + "".join(f"{b:>10d}-bit" for b in bits_list))
        for name in names:
            cells = {row["bits"]: row["error"] for row in rows if row["activation"] == name and row["mode"] == mode}
            lines.append(f"{name:<{width}}" + "".join(f"{cells[b]:>14.4g}" for b in bits_list))
        lines.append("")
    return "\n".join(lines).rstrip()


def curves_csv(rows: list[dict[str, Any]]) -> str:
    """The rows of ``curves`` as CSV text: activation, mode, symmetric, bits, error, snr_db."""
    header = "activation,mode,symmetric,bits,error,snr_db"
    lines = [header] + [
        f"{r['activation']},{r['mode']},{str(r['symmetric']).lower()},{r['bits']},{r['error']:.12g},"
        + ("" if r["snr_db"] is None else f"{r['snr_db']:.6f}")
        for r in rows
    ]
    return "\n".join(lines) + "\n"
