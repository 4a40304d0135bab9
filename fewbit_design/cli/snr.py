"""``fewbit-design snr``: SNR figures.

Two modes:

* **reconstruction** (default): how much signal the inverse layers of reversible networks lose, theory against
  measurement, in the spirit of figures 5, 6, 10 and 11 of Hascoet et al. 2023. Needs PyTorch.
* **approximation** (``--bits 1-8 ACTIVATION...``): the SNR in dB of the few-bit derivative approximations
  against the number of bits. Needs only the design engine.

The reconstruction theory: batch-norm and leaky-ReLU factors from the closed forms of :mod:`fewbit_design.design.snr`
evaluated with each layer's measured input statistics; other blocks (couplings, poolings) with their factor
measured by noise injection; the chain by :func:`fewbit_design.design.snr.accumulated_snr_db` (eq. 19: factors multiply
along the chain), where each block also adds its own round-trip rounding error, measured on that block alone.
"""

from __future__ import annotations

import csv
import io
import sys
from typing import Any

import click
import numpy as np

from ..design import snr as theory
from ..errors import FewBitError, check_choice, check_integer, check_positive, parse_int_spec
from ..output_files import check_outputs, write_files_atomic
from ..plots import figure_bytes, figure_format
from ._options import WEIGHT_KINDS, cli, fold_option

ARCHS = ("layerwise", "hybrid", "both")
DTYPES = ("float32", "float64")
CSV_COLUMNS = ("panel", "arch", "slope", "rho", "depth", "index", "layer", "kind", "measured", "theory")


# Limits of the reconstruction mode, far beyond the figure's toy networks (the defaults) and within a few GiB of
# memory. Each leaky ReLU's inverse loses 10 log10((1 + n²)² / 4n²) dB: 74 dB at n = 1e-4 or 1e4, so that after a few
# layers even float64 (about 300 dB) keeps nothing of the input, and far beyond, the noise injection overflows. The
# weights grow with channels² x depth (4.5 channels² per unit: 75 M at 256 channels and depth 256); the measurement
# keeps every layer's input: measured, about 30 bytes per value of batch x channels x size² x depth in float32 and
# 120 with the hybrid in float64, so 2 GiB at MAX_VALUES.
SLOPE_RANGE = (1e-4, 1e4)
MAX_CHANNELS = 256
MAX_BATCH = 1024
MAX_SIZE = 1024
MAX_VALUES = 2**24  # batch x channels x size² x the largest depth
MAX_SEED = 2**32 - 1


def _parse_slopes(text: str) -> list[float]:
    low, high = SLOPE_RANGE
    slopes = []
    for part in str(text).split(","):
        if not part.strip():
            raise FewBitError(f"--slope must be a comma-separated list of numbers > 0, got {text!r}")
        try:
            value = float(part)
        except ValueError:
            raise FewBitError(f"--slope must be a comma-separated list of numbers > 0, got {text!r}") from None
        value = check_positive("--slope value", value)
        if not low <= value <= high:
            raise FewBitError(f"--slope values must be from {low:g} to {high:g}, got {part.strip()}")
        slopes.append(value)
    return sorted(set(slopes))


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise FewBitError(
            "fewbit-design snr needs PyTorch for the reconstruction measurements (pip install torch); "
            "the --bits ACTIVATION mode does not"
        ) from None
    return torch


@cli.command("snr")
@click.argument("activations", nargs=-1)
@click.option("--bits", default=None, help="Approximation mode: bits to design, e.g. 1-8 or 2,4 (needs ACTIVATION).")
@click.option(
    "--weight",
    default="uniform",
    show_default=True,
    callback=fold_option(WEIGHT_KINDS),
    help="Approximation mode: weight kind w(x).",
)
@click.option(
    "--mode",
    "design_mode",
    default="levelsets",
    show_default=True,
    callback=fold_option(("levelsets", "intervals")),
    help="Approximation mode: design mode.",
)
@click.option("--slope", default=None, help="Leaky-ReLU negative slopes, 1e-4 to 1e4 [default: 0.1,0.2,0.5].")
@click.option("--depth", default=None, help="Depths (units or blocks), 1 to 256, e.g. 1-64 [default: 1,2,4,8,16].")
@click.option("--arch", default=None, callback=fold_option(ARCHS), help="layerwise, hybrid or both [default: both].")
@click.option(
    "--channels", type=int, default=None, help="Channels after the stem, 4 to 256, divisible by 4 [default: 8]."
)
@click.option("--batch", type=int, default=None, help="Batch size of the measurement, 1 to 1024 [default: 4].")
@click.option("--size", type=int, default=None, help="Height and width of the input, even, 2 to 1024 [default: 8].")
@click.option("--dtype", default=None, callback=fold_option(DTYPES), help="float32 or float64 [default: float32].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of weights and inputs, 0 to 2**32 - 1.")
@click.option(
    "--out", "out", required=True, type=click.Path(dir_okay=False), help="Figure file (.png, .pdf, .svg, .jpg)."
)
@click.option("--csv", "csv_path", default=None, type=click.Path(dir_okay=False), help="Also write the numbers.")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
def snr_command(
    activations: tuple[str, ...],
    bits: str | None,
    weight: str,
    design_mode: str,
    slope: str | None,
    depth: str | None,
    arch: str | None,
    channels: int | None,
    batch: int | None,
    size: int | None,
    dtype: str | None,
    seed: int,
    out: str,
    csv_path: str | None,
    force: bool,
) -> None:
    """SNR figures: reversible reconstruction (theory vs measurement) or few-bit approximations vs bits.

    \b
    Examples:
      fewbit-design snr --slope 0.1,0.2,0.5 --depth 1-16 --arch both --out snr.png --csv snr.csv
      fewbit-design snr --bits 1-8 gelu silu --out bits.png

    \b
    Reconstruction figure panels: (a) leaky-ReLU factor alpha vs slope, (b) batch-norm factor of the toy
    layer gamma = [1, rho] vs rho, (c) SNR of every reconstructed layer at the largest depth, (d) SNR of the
    reconstructed network input vs depth. CSV columns: panel, arch, slope, rho, depth, index, layer, kind,
    measured, theory (alpha for panels a-b, dB for c-d).

    The limits keep one measurement within a few GiB and the numbers meaningful: every layer's input is kept, so
    batch x channels x size² x the largest depth is at most 2**24 values (the defaults: 2**15); the weights grow
    with channels²; beyond slopes 1e-4 and 1e4 each leaky ReLU loses over 74 dB and nothing of the input is left.
    """
    figure_format(out, option="--out")
    check_outputs({"--out": out, "--csv": csv_path}, force=force)
    if bits is not None or activations:
        given = {
            "--slope": slope,
            "--depth": depth,
            "--arch": arch,
            "--channels": channels,
            "--batch": batch,
            "--size": size,
            "--dtype": dtype,
        }
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise FewBitError(f"{', '.join(extra)} apply to the reconstruction mode, not to --bits ACTIVATION")
        if not activations:
            raise FewBitError("--bits needs at least one ACTIVATION, e.g. fewbit-design snr --bits 1-8 gelu")
        bit_list = parse_int_spec(bits if bits is not None else "1-8", name="bits", low=1, high=8)
        rows, figure = _approximation(list(activations), bit_list, weight=weight, mode=design_mode)
    else:
        slopes = _parse_slopes(slope if slope is not None else "0.1,0.2,0.5")
        depths = parse_int_spec(depth if depth is not None else "1,2,4,8,16", name="depth", low=1, high=256)
        arch_name = check_choice("--arch", arch if arch is not None else "both", ARCHS)
        archs = ["layerwise", "hybrid"] if arch_name == "both" else [arch_name]
        dtype_name = check_choice("--dtype", dtype if dtype is not None else "float32", DTYPES)
        network = _network_size(channels, batch, size, max(depths))
        seed = check_integer("--seed", seed, low=0, high=MAX_SEED)
        rows, figure = _reconstruction(slopes, depths, archs, **network, dtype=dtype_name, seed=seed)
    files = {out: figure_bytes(figure, out)}
    _pyplot().close(figure)
    if csv_path is not None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=CSV_COLUMNS if rows and "panel" in rows[0] else list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        files[csv_path] = text.getvalue().encode()
    write_files_atomic(files, force=force)
    click.echo(f"wrote {out}" + (f" and {csv_path}" if csv_path is not None else ""))


def _network_size(channels: int | None, batch: int | None, size: int | None, depth: int) -> dict[str, int]:
    """--channels, --batch and --size (defaults 8, 4, 8) checked against their ranges, and the values one
    measurement keeps against :data:`MAX_VALUES`."""
    channels = check_integer("--channels", 8 if channels is None else channels, low=4, high=MAX_CHANNELS)
    if channels % 4:
        raise FewBitError(f"--channels must be divisible by 4 (the hybrid splits twice), got {channels}")
    batch = check_integer("--batch", 4 if batch is None else batch, low=1, high=MAX_BATCH)
    size = check_integer("--size", 8 if size is None else size, low=2, high=MAX_SIZE)
    if size % 2:
        raise FewBitError(f"--size must be an even number >= 2 (the batch pooling stacks 2x2 blocks), got {size}")
    values = batch * channels * size * size * depth
    if values > MAX_VALUES:
        raise FewBitError(
            f"--batch x --channels x --size² x the largest --depth is {batch} x {channels} x {size}² x {depth} = "
            f"{values} values, over the limit of 2**24 = {MAX_VALUES} (every layer's input is kept: about 2 GiB at "
            "the limit); give smaller values"
        )
    return {"channels": channels, "batch": batch, "size": size}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ----------------------------------------------------------------------------------------------------------------
# Approximation mode.


def _approximation(activations: list[str], bits: list[int], *, weight: str, mode: str):
    try:
        from ..design import design  # noqa: F401
    except ImportError:
        raise FewBitError("the design engine (fewbit_design.design) is not available in this installation") from None
    rows = []
    curves = {}
    for activation in activations:
        results = theory.approximation_snr_db(activation, bits, weight=weight, mode=mode)
        curves[activation] = results
        rows.extend(
            {"activation": activation, "bits": b, "snr_db": snr_db, "error": error} for b, snr_db, error in results
        )
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.4))
    for activation, results in curves.items():
        axes.plot([r[0] for r in results], [r[1] for r in results], marker="o", label=activation)
    axes.set_xlabel("bits per element")
    axes.set_ylabel("SNR of the derivative approximation (dB)")
    axes.set_title(f"Few-bit derivative approximations ({mode}, weight {weight})")
    axes.set_xticks(bits)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return rows, figure


# ----------------------------------------------------------------------------------------------------------------
# Reconstruction mode.


def _theory_alpha(record: Any, reversible: Any) -> float:
    """Closed-form factor of a batch norm or leaky ReLU with its measured input statistics; injected otherwise."""
    module = record.module
    if isinstance(module, reversible.InvertibleLeakyReLU):
        return theory.leaky_relu_alpha(
            module.negative_slope, positive_fraction=record.positive_fraction, positive_energy=record.positive_energy
        )
    if isinstance(module, reversible.InvertibleBatchNorm2d):
        return theory.batchnorm_alpha(
            module.weight.detach().double().cpu().numpy(),
            beta=module.bias.detach().double().cpu().numpy(),
            mean=record.channel_mean,
            var=record.channel_var,
            eps=module.eps,
            floor=module.gamma_floor,
        )
    return float(record.alpha)


def _measure_network(arch: str, slope: float, depth: int, *, channels, batch, size, dtype, seed, torch, reversible):
    torch.manual_seed(seed)
    build = reversible.layerwise_net if arch == "layerwise" else reversible.hybrid_net
    model = build(depth, channels, negative_slope=slope, pooling=("batch",), input_size=(size, size))
    model = model.to(getattr(torch, dtype))
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 3, size, size, generator=generator, dtype=getattr(torch, dtype))
    records = reversible.reconstruction_snr(model, x, alphas=True, seed=seed)
    top = [r for r in records if r.sequence == "body"]
    alphas = [_theory_alpha(r, reversible) for r in top]
    fresh = [r.roundtrip_snr_db for r in top]
    predicted = theory.accumulated_snr_db(alphas[::-1], fresh_snr_db=fresh[::-1])[::-1]
    return records, {id(r): float(p) for r, p in zip(top, predicted, strict=True)}, top[0]


#: the paper the reconstruction figures and equations are from (figures and equation numbers in the panel titles)
PAPER = "Reversible designs for extreme memory cost reduction of CNN training (2023)"
#: below 0 dB the reconstruction is noise; far below, numbers mean nothing (drawn at the floor)
FLOOR_DB = -20.0
RHOS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def _reconstruction(slopes, depths, archs, *, channels, batch, size, dtype, seed):
    """The measurement of ``snr --reconstruction``: its CSV rows and its figure."""
    rows, measured = _measure_reconstruction(slopes, depths, archs, channels, batch, size, dtype, seed)
    return rows, _reconstruction_figure(slopes, depths, archs, dtype, measured)


def _measure_reconstruction(slopes, depths, archs, channels, batch, size, dtype, seed):
    """(CSV rows, what the figure draws): the closed forms against noise injection in float64, then networks."""
    torch = _import_torch()
    from ..runtime import reversible

    rows: list[dict[str, Any]] = []

    def row(panel, **values):
        entry = dict.fromkeys(CSV_COLUMNS, "")
        entry.update(panel=panel, **values)
        rows.append(entry)

    # leaky ReLU and a toy batch norm: closed form vs noise injection in float64
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(64, 2, 16, 16, generator=generator, dtype=torch.float64)
    slope_measured = {}
    for n in slopes:
        slope_measured[n] = reversible.inverse_snr_factor(reversible.InvertibleLeakyReLU(n), z, noise=1e-6, seed=seed)
        row("alpha_slope", slope=n, measured=slope_measured[n], theory=theory.leaky_relu_alpha(n))
    rho_measured = {}
    for rho in RHOS:
        bn = reversible.InvertibleBatchNorm2d(2, gamma_floor=0.0).double()
        with torch.no_grad():
            bn.weight.copy_(torch.tensor([1.0, rho], dtype=torch.float64))
        rho_measured[rho] = reversible.inverse_snr_factor(bn, z, noise=1e-6, seed=seed)
        row("alpha_bn_toy", rho=rho, measured=rho_measured[rho], theory=theory.batchnorm_alpha_toy(rho))
    options = dict(
        channels=channels, batch=batch, size=size, dtype=dtype, seed=seed, torch=torch, reversible=reversible
    )
    profiles, bottom = {}, {}
    with click.progressbar(length=len(archs) * len(slopes) * len(depths), label="measuring", file=sys.stderr) as bar:
        for arch in archs:
            for n in slopes:
                for d in depths:
                    records, predicted, first = _measure_network(arch, n, d, **options)
                    bottom[arch, n, d] = (first.snr_db, predicted[id(first)])
                    row("input_vs_depth", arch=arch, slope=n, depth=d, layer=first.name, kind=first.kind,
                        measured=first.snr_db, theory=predicted[id(first)])  # fmt: skip
                    if d == max(depths):
                        profiles[arch, n] = [(r, predicted.get(id(r))) for r in records]
                        for index, (r, p) in enumerate(profiles[arch, n]):
                            row("per_layer", arch=arch, slope=n, depth=d, index=index, layer=r.name, kind=r.kind,
                                measured=r.snr_db, theory="" if p is None else p)  # fmt: skip
                    bar.update(1)
    return rows, {"slope": slope_measured, "rho": rho_measured, "bottom": bottom, "profiles": profiles}


def _reconstruction_figure(slopes, depths, archs, dtype, measured):
    """The figure of ``snr --reconstruction``: panels (a) to (e), in reading order, citing :data:`PAPER`."""
    plt = _pyplot()
    from matplotlib.gridspec import GridSpec

    figure = plt.figure(figsize=(16, 9.5))
    grid = GridSpec(2, 6, figure=figure)
    colors = {n: f"C{i}" for i, n in enumerate(slopes)}
    _alpha_panels(figure, grid, slopes, measured)
    _depth_panel(figure.add_subplot(grid[0, 4:6]), slopes, depths, archs, colors, measured["bottom"])
    for column, arch in enumerate(archs):
        span = slice(0, 3) if len(archs) > 1 and column == 0 else slice(3, 6) if len(archs) > 1 else slice(0, 6)
        letter = "de"[column]
        _profile_panel(figure.add_subplot(grid[1, span]), letter, arch, slopes, depths, colors, measured["profiles"])
    for ax in figure.axes:
        ax.grid(True, alpha=0.3)
    for ax in figure.axes[2:]:
        ax.axhline(0, color="grey", linewidth=0.6)
        ax.set_ylim(bottom=FLOOR_DB - 5)
    figure.suptitle(
        f"Reversible designs ({dtype}): SNR of activations reconstructed by inverses, theory vs measurement "
        f"(values below {FLOOR_DB:g} dB drawn at {FLOOR_DB:g}); figures and equations of {PAPER}"
    )
    figure.tight_layout()
    return figure


def _alpha_panels(figure, grid, slopes, measured) -> None:
    """(a) the leaky ReLU inverse's SNR loss, (b) the toy batch norm's: closed form against noise injection."""
    from matplotlib.ticker import NullFormatter

    ax = figure.add_subplot(grid[0, 0:2])
    xs = np.geomspace(0.05, 1.0, 200)
    ax.plot(xs, theory.alpha_db(theory.leaky_relu_alpha(xs)), "k-", label="theory (1+n²)²/(4n²)")
    ax.plot(slopes, [theory.alpha_db(measured["slope"][n]) for n in slopes], "ro", label="measured (noise injection)")
    ax.set_xscale("log")
    ax.set_xlabel("leaky ReLU negative slope n")
    ax.set_ylabel("SNR lost by the inverse, 10 log10 α (dB)")
    ax.set_title("(a) Leaky ReLU inverse (paper's fig. 6)")
    ax.legend()
    ax = figure.add_subplot(grid[0, 2:4])
    xs = np.geomspace(RHOS[0], RHOS[-1], 200)
    ax.plot(xs, theory.alpha_db(theory.batchnorm_alpha_toy(xs)), "k-", label="theory (1+ρ²)(1+ρ⁻²)/4")
    ax.plot(RHOS, [theory.alpha_db(measured["rho"][r]) for r in RHOS], "ro", label="measured (noise injection)")
    ax.set_xscale("log")
    ax.set_xticks(RHOS)
    ax.set_xticklabels([f"{r:g}" for r in RHOS])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("scale imbalance ρ (γ = [1, ρ])")
    ax.set_ylabel("SNR lost by the inverse, 10 log10 α (dB)")
    ax.set_title("(b) Batch-norm inverse, toy layer (paper's fig. 5)")
    ax.legend()


def _depth_panel(ax, slopes, depths, archs, colors, bottom) -> None:
    """(c) the SNR of the reconstructed network input against depth, measured and by the paper's eq. 19."""
    from matplotlib.ticker import NullFormatter

    markers = {"layerwise": "o-", "hybrid": "s:"}
    for arch in archs:
        for n in slopes:
            measured = [max(bottom[arch, n, d][0], FLOOR_DB) for d in depths]
            predicted = [max(bottom[arch, n, d][1], FLOOR_DB) for d in depths]
            ax.plot(depths, measured, markers[arch], color=colors[n], label=f"{arch}, n={n:g}")
            ax.plot(depths, predicted, "--", color=colors[n], alpha=0.45, linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths)
    ax.set_xticklabels([str(d) for d in depths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("depth (units for layerwise, blocks of 4 units for hybrid)")
    ax.set_ylabel("SNR of the reconstructed network input (dB)")
    ax.plot([], [], "k--", alpha=0.45, linewidth=1, label="paper's eq. 19 (theory)")
    ax.set_title("(c) Input reconstruction vs depth (paper's fig. 11)")
    ax.legend(fontsize="small")


def _profile_panel(ax, letter, arch, slopes, depths, colors, profiles) -> None:
    """(d), (e): the per-layer reconstruction SNR of the deepest network of ``arch``."""
    for n in slopes:
        profile = profiles.get((arch, n), [])
        ax.plot(
            range(len(profile)),
            [max(r.snr_db, FLOOR_DB) for r, _ in profile],
            "-",
            color=colors[n],
            linewidth=1,
            label=f"n={n:g} measured",
        )
        known = [(i, max(p, FLOOR_DB)) for i, (_, p) in enumerate(profile) if p is not None]
        if known:
            ax.plot(*zip(*known, strict=True), "--", color=colors[n], alpha=0.5, label=f"n={n:g} eq. 19")
    ax.set_xlabel(
        "layer, forward order" + (" (couplings, then the layers of their f and g)" if arch == "hybrid" else "")
    )
    ax.set_ylabel("SNR of the reconstructed input (dB)")
    ax.set_title(f"({letter}) {arch}, depth {max(depths)}: per-layer reconstruction (paper's fig. 10)")
    ax.legend(fontsize="small", ncol=2)
