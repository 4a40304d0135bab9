"""``fewbit-design memory MODULE:FACTORY``: plan which memory technique runs where under a budget; ``fewbit-design
memory --hf-config FILE.json --seq N``: what each way of training a Hugging Face model needs on a device one may
not have (:func:`fewbit_design.runtime.estimate.estimate`: bytes measured under fake mode, times predicted).

``FACTORY()`` builds the model (``MODULE`` is imported with the current directory first on ``sys.path``, like
``--activation-module``); ``--input-shape`` gives the example batch (random normal floats, or token ids below
``--vocab``). The command profiles the model, plans (:func:`fewbit_design.runtime.plan_memory`), prints the report,
and on request measures one step of the converted model (``--measure``), draws the figure (``--plot``) and writes
the plan (``--save``; ``runtime.load_plan(path).apply(model)`` applies it in a training script).

The figure is drawn here (:func:`plot_plan`), not in the runtime, which never imports matplotlib.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from ..errors import FewBitError, parse_budget
from ..output_files import check_outputs, write_bytes_atomic, write_files_atomic
from ..plots import figure_bytes, figure_format
from ._options import cli, stage

__all__ = [
    "memory",
    "plot_plan",
    "plan_figure_bytes",
    "load_factory",
    "parse_shape",
    "example_inputs",
    "check_model_runs",
    "estimate_figure_bytes",
]

#: Largest size of a tensor dimension and of a whole example input, in elements (torch counts them in int64).
MAX_ELEMENTS = 2**62


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,3,224,224"`` -> ``(8, 3, 224, 224)``; every size a positive integer, the product within int64."""
    parts = [p.strip() for p in str(text).replace("x", ",").split(",")]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(size < 1 for size in shape):
        raise FewBitError(
            f"--input-shape must be positive integers separated by commas, like 8,3,224,224; got {text!r}"
        )
    if math.prod(shape) > MAX_ELEMENTS:
        raise FewBitError(
            f"--input-shape {text!r} has more than 2**62 elements (torch's limit); got {math.prod(shape):.3g}"
        )
    return shape


def _memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - platforms without sysconf
        return None


def example_inputs(shapes: list[tuple[int, ...]], vocab: int | None) -> list[Any]:
    """Random example inputs: normal floats, or token ids in [0, vocab). Inputs larger than this machine's memory
    are refused before they are allocated, and a failed allocation is one clear error."""
    import torch

    element = 8 if vocab is not None else 4  # int64 token ids, float32 values
    needed = sum(math.prod(shape) for shape in shapes) * element
    available = _memory_bytes()
    what = ", ".join("x".join(map(str, shape)) for shape in shapes)
    if available is not None and needed > available:
        raise FewBitError(
            f"the example inputs ({what}, {'int64' if vocab is not None else 'float32'}) alone take "
            f"{needed / 2**30:.3g} GiB, more than this machine's {available / 2**30:.3g} GiB: give a smaller "
            "--input-shape"
        )
    generator = torch.Generator().manual_seed(0)
    try:
        if vocab is not None:
            return [torch.randint(0, vocab, shape, generator=generator) for shape in shapes]
        return [torch.randn(shape, generator=generator) for shape in shapes]
    except (RuntimeError, MemoryError) as error:
        raise FewBitError(f"cannot allocate the example inputs ({what}): {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def check_model_runs(model: Any, inputs: list[Any], spec: str, vocab: int | None) -> None:
    """One forward pass without gradients before any planning: a model that cannot take the example inputs (a shape
    it does not accept, token ids beyond its embedding) is one line naming the inputs, not a traceback from the
    middle of the profiler."""
    import torch

    shapes = ", ".join("x".join(map(str, tensor.shape)) for tensor in inputs)
    try:
        with torch.no_grad():
            model(*inputs)
    except (Exception, SystemExit) as error:
        hint = ""
        if vocab is not None:
            rows = sorted({m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)})
            if rows and vocab > rows[-1]:
                hint = f"; --vocab {vocab} is beyond the model's embedding of {rows[-1]} rows"
        inputs_text = f"token ids below {vocab}" if vocab is not None else "random floats"
        raise FewBitError(
            f"model {spec!r} cannot run on the example inputs ({shapes}, {inputs_text}): {_first_line(error)}{hint}"
        ) from None


def load_factory(spec: str) -> Any:
    """Import ``MODULE:FUNCTION`` (current directory first on ``sys.path``) and return the function."""
    module_name, _, function_name = str(spec).partition(":")
    if not module_name or not function_name:
        raise FewBitError(f"the model factory must be given as MODULE:FUNCTION, like mypkg.models:small; got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise FewBitError(f"cannot import model factory module {module_name!r}: {error}") from None
    except (Exception, SystemExit) as error:  # the user's module: one line naming what failed
        raise FewBitError(f"importing model factory module {module_name!r} failed: {_raised(error)}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise FewBitError(f"module {module_name!r} has no callable {function_name!r} (the model factory)")
    return function


def _build(factory: Any, spec: str) -> Any:
    import torch

    try:
        model = factory()
    except (Exception, SystemExit) as error:  # the user's code: one line naming what failed
        raise FewBitError(f"model factory {spec!r} {_raised(error)}") from None
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"model factory {spec!r} must return a torch.nn.Module, got {type(model).__name__}")
    return model.train()


def _raised(error: BaseException) -> str:
    """What the user's code did, for a message: ``raised RuntimeError: ...`` or ``called sys.exit(3)``."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r}) instead of returning a model"
    return f"raised {_first_line(error)}"


def _given(context: click.Context, option: str) -> bool:
    """Whether ``option`` was given on the command line (not left at its default)."""
    name = option.lstrip("-").replace("-", "_")
    name = {"input_shape": "shapes", "save": "save_path"}.get(name, name)
    source = context.get_parameter_source(name)
    return source is not None and source != click.core.ParameterSource.DEFAULT


def _allow(values: tuple[str, ...]) -> tuple[str, ...]:
    from ..runtime.registry import names

    techniques = names()  # the registered techniques
    chosen: list[str] = []
    for value in values:
        for part in value.split(","):
            name = part.strip().lower().replace("-", "")
            if name not in techniques:
                raise FewBitError(f"--allow takes {', '.join(techniques)} (comma-separated), got {part.strip()!r}")
            if name not in chosen:
                chosen.append(name)
    return tuple(chosen) if chosen else techniques


def event_edges(labels: list[str], marks: dict[str, int], operators: int) -> list[float]:
    """The x edges (operator indices of the measured step) of the predicted events ``labels``: event k spans
    ``[edges[k], edges[k + 1])``. An event without a mark (a block whose input needs no gradient) shares the gap up
    to the next mark evenly with its unmarked neighbours; the last event ends at ``operators``.

    >>> event_edges(["a", "b", "c", "d"], {"a": 2, "c": 10}, 12)
    [0.0, 2.0, 6.0, 10.0, 12.0]
    """
    ends: list[float | None] = [float(marks[label]) if label in marks else None for label in labels]
    ends[-1] = float(operators)
    edges, start, pending = [0.0], 0.0, 0
    for end in ends:
        if end is None:
            pending += 1
            continue
        end = max(end, start)
        step = (end - start) / (pending + 1)
        edges += [start + step * (k + 1) for k in range(pending)] + [end]
        start, pending = end, 0
    return edges


def _draw_timeline(timeline: Any, data: dict[str, Any], mib: float) -> None:
    """Predicted and measured live bytes on one x axis, the operators of the measured step (without a
    measurement: the predicted events in order), each with its peak marked and labelled."""
    predicted = data["timeline"]["predicted"]
    measured = data["timeline"].get("measured")
    labels = [label for label, _ in predicted]
    values = [value / mib for _, value in predicted]
    if measured:
        edges = event_edges(labels, data.get("marks", {}), len(measured))
        timeline.set_xlabel("operators of the step, in order (forward, then backward)")
    else:
        edges = [float(k) for k in range(len(values) + 1)]
        timeline.set_xlabel("events of the predicted step, in order (forward, then backward; --measure: operators)")
    timeline.stairs(values, edges, baseline=None, color="tab:blue", linewidth=1.8, label="predicted")
    peak = max(range(len(values)), key=values.__getitem__)
    where = (edges[peak] + edges[peak + 1]) / 2
    timeline.plot([where], [values[peak]], marker="v", markersize=10, color="tab:blue", markeredgecolor="white",
                  linestyle="none", label=f"predicted peak {values[peak]:.2f} MiB")  # fmt: skip
    if measured:
        live = [value / mib for _, value in measured]
        timeline.plot(range(len(live)), live, drawstyle="steps-post", color="tab:orange", linewidth=1.1,
                      label="measured")  # fmt: skip
        top = max(range(len(live)), key=live.__getitem__)
        timeline.plot([top], [live[top]], marker="^", markersize=10, color="tab:orange", markeredgecolor="black",
                      linestyle="none", label=f"measured peak {live[top]:.2f} MiB")  # fmt: skip
    forward = [k for k, label in enumerate(labels) if label.startswith("forward ")]
    if forward:
        timeline.axvline(edges[forward[-1] + 1], color="gray", linestyle=":", linewidth=1, label="forward | backward")
    timeline.axhline(data["budget_bytes"] / mib, color="black", linestyle="--", linewidth=1, label="budget")
    timeline.set_ylabel("live MiB")
    timeline.set_title("peak-memory timeline")
    timeline.margins(y=0.12)
    timeline.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_plan(plan: Any, path: str | os.PathLike, *, force: bool = False) -> None:
    """Draw ``plan``'s figure (:func:`plan_figure_bytes`) and write it to ``path``; its suffix names the format."""
    write_bytes_atomic(path, plan_figure_bytes(plan, path), force=force)


def plan_figure_bytes(plan: Any, path: str | os.PathLike) -> bytes:
    """``plan``'s figure in the format of ``path`` (only its name is used): a stacked bar of memory at the end of
    the forward pass by technique (unconverted against the plan), and the live bytes over one step (predicted;
    measured too after ``plan.measure``, on the same x axis: the operators of the measured step, with both peaks
    marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure_format(path, option="--plot")
    data = plan.figure_data()
    mib = 2.0**20
    figure, (bars, timeline) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    categories: list[str] = []
    for parts in data["bars"].values():
        categories += [c for c in parts if c not in categories]
    colours = plt.get_cmap("tab10")
    names = list(data["bars"])
    bottoms = [0.0] * len(names)
    for k, category in enumerate(categories):
        heights = [data["bars"][name].get(category, 0) / mib for name in names]
        bars.bar(names, heights, bottom=bottoms, label=category, color=colours(k % 10))
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    bars.set_ylabel("MiB alive at the end of the forward pass")
    bars.legend(fontsize=7)
    bars.set_title("memory by technique")
    _draw_timeline(timeline, data, mib)
    figure.tight_layout()
    try:
        return figure_bytes(figure, path)
    finally:
        plt.close(figure)


def estimate_figure_bytes(result: Any, path: str | os.PathLike) -> bytes:
    """A bar chart of ``result``'s variants (:class:`fewbit_design.runtime.estimate.Estimate`): bytes kept for
    backward per token per layer (measured), and each step's peak against the device's memory (measured), in the
    format of ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure_format(path, option="--plot")
    names = [item.name for item in result.variants]
    figure, (kept, peaks) = plt.subplots(1, 2, figsize=(12, 4.5))
    kept.bar(names, [item.bytes_per_token_per_layer / 1024 for item in result.variants], color="tab:blue")
    kept.set_ylabel("KiB per token per layer (measured)")
    kept.set_title(f"{result.model}: kept for backward")
    colours = ["tab:green" if item.fits else "tab:red" for item in result.variants]
    peaks.bar(names, [item.peak_bytes / 1e9 for item in result.variants], color=colours)
    peaks.axhline(result.device.memory_bytes / 1e9, color="black", linestyle="--", linewidth=1,
                  label=f"{result.device.name}: {result.device.memory_bytes / 1e9:.0f} GB")  # fmt: skip
    peaks.set_ylabel("GB at the step's peak (measured)")
    ranks = f", FSDP x{result.gpus}" if result.fsdp else ""
    peaks.set_title(f"batch {result.batch} x {result.sequence} tokens, {result.dtype}{ranks}")
    peaks.legend(fontsize=8)
    for axis in (kept, peaks):
        axis.tick_params(axis="x", labelrotation=30, labelsize=8)
    figure.tight_layout()
    try:
        return figure_bytes(figure, path)
    finally:
        plt.close(figure)


def _estimate_command(
    config_path: str, seq: int | None, batch: int, dtype: str, device: str, gpus: int, fsdp: bool, master: bool,
    json_path: str | None, plot_path: str | None, force: bool,
) -> None:  # fmt: skip
    """``memory --hf-config``: check everything, estimate, print the table, write the files (all or nothing)."""
    from ..runtime import devices, estimate

    if gpus < 1:
        raise FewBitError(f"--gpus must be a positive number of GPUs, got {gpus}")
    if batch < 1:
        raise FewBitError(f"--batch must be a positive number of sequences, got {batch}")
    if fsdp and gpus == 1:
        raise FewBitError("--fsdp shards over --gpus N: give --gpus 2 or more")
    if plot_path is not None:
        figure_format(plot_path, option="--plot")
    check_outputs({"--json": json_path, "--plot": plot_path}, force=force)
    target = devices.device(device)
    config = estimate.load_config(config_path)
    if seq is None:
        seq = estimate.sequence_limit(config) if config.model_type == "vit" else None
        if seq is None:
            raise FewBitError("--hf-config needs --seq, the tokens per sequence")
    if seq < 1:
        raise FewBitError(f"--seq must be a positive number of tokens, got {seq}")
    result = estimate.estimate(
        config, batch=batch, sequence=seq, device=target, dtype=dtype, gpus=gpus, fsdp=fsdp, master_weights=master,
        progress=stage,
    )  # fmt: skip
    _show_and_write(result, estimate_figure_bytes, ("rows", json_path), plot_path, force=force)


_FACTORY_ONLY = ("--input-shape", "--vocab", "--budget", "--allow", "--chain", "--measure", "--save")


@cli.command("memory")
@click.argument("factory", metavar="MODULE:FACTORY", required=False)
@click.option(
    "--input-shape",
    "shapes",
    multiple=True,
    help="Example batch shape, like 8,3,224,224 (repeat for more inputs; with MODULE:FACTORY).",
)
@click.option("--vocab", type=int, default=None, help="Integer token ids in [0, VOCAB) instead of random floats.")
@click.option(
    "--budget",
    default=None,
    help="Whole-step memory budget: 2GiB, 512MiB, bytes, a fraction like 0.5 of "
    "the unconverted peak, or 'min'. Default: the unconverted peak.",
)
@click.option(
    "--allow",
    "allow",
    multiple=True,
    help="Techniques the plan may use (comma-separated; default all: fewbit,blpa,checkpoint,offload).",
)
@click.option("--bits", type=int, default=3, show_default=True, help="Few-bit table bits.")
@click.option("--objective", type=click.Choice(["time", "memory"]), default="time", show_default=True)
@click.option(
    "--approximate",
    type=click.Choice(["if-needed", "allowed"]),
    default="if-needed",
    show_default=True,
    help="Few-bit and BLPA (approximate gradients) only where no exact plan fits the budget, or wherever faster.",
)
@click.option("--chain", default=None, help="Qualified name of the Sequential/ModuleList to plan over.")
@click.option("--measure", is_flag=True, help="Apply the plan to a fresh model and measure one step.")
@click.option("--plot", "plot_path", default=None, help="Write the figure (.png, .pdf, .svg, .jpg).")
@click.option("--save", "save_path", default=None, help="Write the plan as JSON.")
@click.option("--force", is_flag=True, help="Overwrite existing output files.")
@click.option(
    "--hf-config",
    "hf_config",
    default=None,
    help="Instead of MODULE:FACTORY: a Hugging Face config.json (or a shipped one: llama-3-8b, llama-3-70b, "
    "mistral-7b, qwen2.5-7b, gpt2-xl, bert-large, vit-l-16); estimates every way of training it without allocating it.",
)
@click.option("--seq", type=int, default=None, help="With --hf-config: tokens per sequence.")
@click.option("--batch", type=int, default=1, show_default=True, help="With --hf-config: sequences per step (per GPU).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option(
    "--device",
    default="h100-80gb",
    show_default=True,
    help="With --hf-config: h100-80gb, h200, a100-80gb, l4, rtx-4090, or cpu (this machine, measured).",
)
@click.option("--gpus", type=int, default=1, show_default=True, help="With --hf-config: GPUs (data parallel).")
@click.option("--fsdp", is_flag=True, help="With --hf-config: shard parameters, gradients and optimizer over --gpus.")
@click.option(
    "--master-weights/--no-master-weights",
    default=True,
    show_default=True,
    help="With --hf-config: float32 master weights for 16-bit parameters.",
)
@click.option("--json", "json_path", default=None, help="With --hf-config: write the rows as JSON.")
@click.pass_context
def memory(
    context, factory, shapes, vocab, budget, allow, bits, objective, approximate, chain, measure, plot_path, save_path,
    force, hf_config, seq, batch, dtype, device, gpus, fsdp, master_weights, json_path,
):  # fmt: skip
    """Plan few-bit, BLPA, checkpointing and offloading for the model FACTORY() builds, under a budget; or, with
    --hf-config, estimate each way of training a Hugging Face model on a device (bytes measured, times predicted)."""
    if hf_config is not None:
        given = [name for name in _FACTORY_ONLY if _given(context, name)]
        if factory is not None or given:
            what = f"MODULE:FACTORY ({factory})" if factory is not None else given[0]
            raise FewBitError(f"--hf-config estimates a config; {what} belongs to the MODULE:FACTORY form")
        _estimate_command(hf_config, seq, batch, dtype, device, gpus, fsdp, master_weights, json_path, plot_path, force)
        return
    if factory is None:
        raise FewBitError("memory takes MODULE:FACTORY (with --input-shape) or --hf-config FILE.json")
    if not shapes:
        raise FewBitError("MODULE:FACTORY needs --input-shape, the example batch's shape")
    input_shapes = [parse_shape(s) for s in shapes]
    allowed = _allow(allow)
    budget_value = None if budget is None else parse_budget(budget, name="--budget")  # the planner's own syntax
    if plot_path is not None:
        figure_format(plot_path, option="--plot")
    check_outputs({"--save": save_path, "--plot": plot_path}, force=force)
    if vocab is not None and not 1 <= vocab <= 2**63 - 1:
        raise FewBitError(f"--vocab must be a positive integer below 2**63 (int64 token ids), got {vocab}")
    function = load_factory(factory)
    from ..runtime import planner

    stage(f"building {factory} and running it once")
    model = _build(function, factory)
    inputs = example_inputs(input_shapes, vocab)
    check_model_runs(model, inputs, factory, vocab)
    try:
        stage("profiling every block with each technique, then planning")
        plan = planner.plan_memory(
            model,
            *inputs,
            budget=budget_value,
            allow=allowed,
            bits=bits,
            objective=objective,
            approximate=approximate,
            chain=chain,
        )
        if measure:
            stage("measuring one step of the plan on a fresh model")
            fresh = plan.apply(_build(function, factory))
            plan.measure(fresh, *inputs)
    except (RuntimeError, MemoryError) as error:
        if isinstance(error, RuntimeError) and "allocate" not in str(error):
            raise
        raise FewBitError(
            f"out of memory planning {factory!r} on the example inputs: {_first_line(error)}; "
            "give a smaller --input-shape"
        ) from None
    _show_and_write(plan, plan_figure_bytes, ("plan", save_path), plot_path, force=force)


def _show_and_write(
    result: Any,
    figure: Callable[[Any, str], bytes],
    json: tuple[str, str | None],
    plot_path: str | None,
    *,
    force: bool,
) -> None:
    """Prints ``result``'s report, writes its JSON (``json``: what it is called, and the path or None) and its figure
    (made by ``figure``) together, all or none, and says where each went."""
    click.echo(result.report())
    label, json_path = json
    files = {}
    if json_path is not None:
        files[json_path] = result.to_json().encode()
    if plot_path is not None:
        files[plot_path] = figure(result, plot_path)
    write_files_atomic(files, force=force)
    for what, path in ((label, json_path), ("figure", plot_path)):
        if path is not None:
            click.echo(f"{what} written to {path}")
