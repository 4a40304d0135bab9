"""The report of a memory plan: its table (one row per block), the text :meth:`.plan.MemoryPlan.report` prints,
and the numbers behind its figure (drawn by ``fewbit_design.cli.memory``; the runtime never imports matplotlib)."""

from __future__ import annotations

from typing import Any

from .model import BlockCosts, OptionCost, replay
from .schema import APPROXIMATE_DEFAULT

#: a :class:`.plan.MemoryPlan` (which imports this module: named, not imported, here)
MemoryPlan = Any

__all__ = ["format_bytes", "retained", "rows", "report", "figure_data"]


def format_bytes(nbytes: float) -> str:
    """``1.5 MiB`` style (binary units).

    Args:
        nbytes: a number of bytes
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def retained(block: BlockCosts, option: OptionCost) -> int:
    """Bytes a block holds for backward under an option (what it keeps, plus its input/output when it saves
    them): the per-block figure of the report."""
    return (
        option.kept
        + (block.input_bytes if option.saves_input else 0)
        + (block.output_bytes if option.saves_output else 0)
    )


def rows(plan: MemoryPlan) -> list[dict[str, Any]]:
    """One row per block: option, predicted bytes saved and extra seconds (against plain), and measured saved
    bytes when measured (the plain block's saved bytes from the profile minus the measured ones).

    Args:
        plan: the memory plan
    """
    table = []
    plain_saved = plan.facts.get("saved_bytes", {})
    for block, option, plain in zip(plan.costs.blocks, plan._selected(), plan._plain(), strict=True):
        row = {
            "block": block.name,
            "technique": option.option,
            "predicted_saved_bytes": retained(block, plain) - retained(block, option),
            "predicted_extra_seconds": option.seconds - plain.seconds,
        }
        if plan.measured is not None and block.name in plain_saved:
            row["measured_saved_bytes"] = plain_saved[block.name] - plan.measured["saved_bytes"].get(block.name, 0)
        table.append(row)
    return table


def _measured_lines(plan: MemoryPlan) -> list[str]:
    """The report's lines of what :meth:`~.plan.MemoryPlan.measure` found."""
    peak = plan.measured["peak_bytes"]
    rss = plan.measured.get("rss_peak_bytes")
    allocated = format_bytes(max(peak - plan.baseline_bytes, 0))
    return [
        f"measured peak {format_bytes(peak)} ({peak / plan.predicted_peak_bytes:.3f}x predicted), "
        f"measured step time {plan.measured['step_seconds'] * 1e3:.1f} ms",
        f"process RSS over the measured step: peak +{format_bytes(rss)} above its start, beside {allocated} "
        "of live tensor bytes at the peak (they differ by allocator caching and non-tensor memory: see "
        "fewbit_design.runtime.memory)"
        if rss is not None
        else "process RSS: not measurable here (needs Linux /proc/self/clear_refs)",
    ]


def report(plan: MemoryPlan, file: Any = None) -> str:
    """The plan as a table (printed to ``file`` when given) and returned as text.

    Args:
        plan: the memory plan
        file: where to print the text too (None: nowhere)
    """
    table = rows(plan)
    measured = plan.measured is not None
    header = f"{'block':<24} {'technique':<28} {'saved (pred.)':>14} {'extra time (pred.)':>19}"
    if measured:
        header += f" {'saved (meas.)':>14}"
    lines = [header, "-" * len(header)]
    for row in table:
        line = (
            f"{row['block'][-24:]:<24} {row['technique']:<28} {format_bytes(row['predicted_saved_bytes']):>14} "
            f"{row['predicted_extra_seconds'] * 1e3:>16.2f} ms"
        )
        if measured and "measured_saved_bytes" in row:
            line += f" {format_bytes(row['measured_saved_bytes']):>14}"
        lines.append(line)
    lines.append("-" * len(header))
    if plan.model_options:
        lines.append(
            f"whole model: {', '.join(plan.model_options)} (outside the chain; 'unconverted' below is the chain plain "
            "with it)"
        )
    lines.append(
        f"budget {format_bytes(plan.budget_bytes)}; predicted peak {format_bytes(plan.predicted_peak_bytes)} "
        f"(unconverted {format_bytes(plan.unconverted_peak_bytes)}; parameters and inputs "
        f"{format_bytes(plan.baseline_bytes)})"
    )
    lines.append(
        f"predicted step time {plan.predicted_step_seconds * 1e3:.1f} ms "
        f"(unconverted {plan.step_seconds * 1e3:.1f} ms measured, {plan.predicted_extra_seconds * 1e3:+.1f} ms)"
    )
    if measured:
        lines += _measured_lines(plan)
    approximate = plan.approximate_blocks()
    needed = plan.settings.get("approximate", APPROXIMATE_DEFAULT) == "if-needed"
    reason = ""
    if approximate and needed:
        reason = " (an exact plan fits the budget)" if plan._exact_plan_fits() else " (no exact plan fits the budget)"
    lines.append(
        "gradients changed (approximate techniques, as configured) in: "
        + (", ".join(approximate) if approximate else "no block (exact)")
        + reason
    )
    reversible = plan.reversible_estimate()
    lines.append(
        f"a reversible chain would save about {format_bytes(reversible['saved_bytes'])} for about "
        f"{reversible['extra_seconds'] * 1e3:.1f} ms more per step (estimate; not applied: it changes the model)"
    )
    text = "\n".join(lines)
    if file is not None:
        print(text, file=file)
    return text


def figure_data(plan: MemoryPlan) -> dict[str, Any]:
    """The numbers behind the figure (drawn by ``fewbit_design.cli.memory.plot_plan``; the runtime never imports
    matplotlib): ``bars``: for the unconverted model and the plan, bytes at the end of the forward pass by what
    holds them (parameters and inputs, before the chain, each technique's blocks); ``timeline``: predicted
    (and measured) live bytes over one step; after :meth:`~.plan.MemoryPlan.measure`, ``marks``: where each predicted
    event ends in the measured timeline (so both share one x axis, the operators of the step)."""

    def bar(choice: list[OptionCost]) -> dict[str, int]:
        parts = {"parameters and inputs": plan.baseline_bytes, "before the chain": plan.costs.entry_bytes}
        for block, option in zip(plan.costs.blocks, choice, strict=True):
            parts[option.option] = parts.get(option.option, 0) + retained(block, option)
        return parts

    data: dict[str, Any] = {
        "bars": {"unconverted": bar(plan._plain()), "plan": bar(plan._selected())},
        "timeline": {
            "predicted": [
                [label, value + plan.baseline_bytes] for label, value in replay(plan.costs, plan._selected()).timeline
            ]
        },
        "budget_bytes": plan.budget_bytes,
    }
    if plan.measured is not None:
        data["timeline"]["measured"] = plan.measured["timeline"]
        data["marks"] = dict(plan.measured.get("marks", {}))
    return data
