"""The memory plan: which option each block of the chain runs, what it is predicted to cost, and (after
:meth:`MemoryPlan.measure`) what it measured; applying it, reporting it, and its JSON form."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ...errors import FewBitError, check_choice
from .. import memory
from .model import BlockCosts, ChainCosts, OptionCost, minimum_budget, optimise, replay
from .techniques import TECHNIQUES, apply_option, parse_option

__all__ = ["MemoryPlan", "load_plan", "choose", "format_bytes", "FORMAT", "OBJECTIVES"]

FORMAT = "fewbit-memory-plan/1"
APPROXIMATE = ("fewbit", "blpa")  # techniques that change gradients


def format_bytes(nbytes: float) -> str:
    """``1.5 MiB`` style (binary units)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _retained(block: BlockCosts, option: OptionCost) -> int:
    """Bytes a block holds for backward under an option (what it keeps, plus its input/output when it saves
    them): the per-block figure of the report."""
    return (
        option.kept
        + (block.input_bytes if option.saves_input else 0)
        + (block.output_bytes if option.saves_output else 0)
    )


@dataclass
class MemoryPlan:
    """A plan from :func:`fewbit_design.runtime.plan_memory` (see its docstring for the algorithm).

    Attributes:
        chain: qualified name of the chain ("" for the model itself).
        choices: one option per block (``"plain"``, ``"fewbit"``, ``"fewbit+checkpoint"``, ...).
        costs: the profile: every measured option of every block and the fixed parts of the step.
        budget_bytes: the budget (bytes for the whole step: parameters, inputs and everything allocated in it).
        baseline_bytes: parameters, buffers and example inputs (alive before the step).
        step_seconds: the measured time of one plain training step of the whole model.
        settings: ``allow``, ``bits``, ``blpa_bits``, ``objective`` and the offload options.
        measured: after :meth:`measure`: ``peak_bytes`` (whole step, like the prediction), ``step_seconds``,
            ``saved_bytes`` per block and a ``timeline``; None before.
    """

    chain: str
    choices: tuple[str, ...]
    costs: ChainCosts
    budget_bytes: int
    baseline_bytes: int
    step_seconds: float
    settings: dict[str, Any]
    facts: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] | None = None

    # --- predictions -----------------------------------------------------------------------------------------
    def _selected(self) -> list[OptionCost]:
        return [block.option(choice) for block, choice in zip(self.costs.blocks, self.choices, strict=True)]

    def _plain(self) -> list[OptionCost]:
        return [block.option("plain") for block in self.costs.blocks]

    @property
    def predicted_peak_bytes(self) -> int:
        """Predicted peak of the whole step: baseline plus the peak of bytes allocated in it."""
        return self.baseline_bytes + replay(self.costs, self._selected()).peak

    @property
    def unconverted_peak_bytes(self) -> int:
        """Predicted peak of the step with every block plain (measured as ``facts['measured_peak_bytes']``)."""
        return self.baseline_bytes + replay(self.costs, self._plain()).peak

    @property
    def predicted_step_seconds(self) -> float:
        """The measured plain step time plus every block's extra time under its option."""
        return self.step_seconds + self.predicted_extra_seconds

    @property
    def predicted_extra_seconds(self) -> float:
        return sum(o.seconds - p.seconds for o, p in zip(self._selected(), self._plain(), strict=True))

    def techniques_used(self) -> set[str]:
        """The techniques the plan uses anywhere."""
        return {t for choice in self.choices for t in parse_option(choice)}

    def approximate_blocks(self) -> list[str]:
        """The blocks whose gradients the plan changes (few-bit or BLPA)."""
        return [
            block.name
            for block, choice in zip(self.costs.blocks, self.choices, strict=True)
            if any(t in APPROXIMATE for t in parse_option(choice))
        ]

    def reversible_estimate(self) -> dict[str, float]:
        """What a reversible version of the chain would save: the bytes the plain chain holds at its exit minus one
        hidden state (a reversible chain keeps only its output and rebuilds the rest from it), and an extra time
        of one forward pass of the chain (the inverses), taken as a third of the blocks' forward + backward time."""
        plain = self._plain()
        held = sum(_retained(b, o) for b, o in zip(self.costs.blocks, plain, strict=True))
        saved = max(held - self.costs.blocks[-1].output_bytes, 0)
        return {"saved_bytes": saved, "extra_seconds": sum(o.seconds for o in plain) / 3}

    # --- planning again from the same profile ---------------------------------------------------------------
    def replan(
        self, budget: int | str | float | None = None, *, allow: Any = None, objective: str = "time"
    ) -> MemoryPlan:
        """A new plan from this plan's profile (no model run): another ``budget`` (as in ``plan_memory``), a subset
        of the profiled techniques (``allow``), or another ``objective``. Raises :class:`FewBitError` when nothing
        fits."""
        allow = tuple(self.settings["allow"]) if allow is None else allow
        return choose(
            self.chain,
            self.costs,
            dict(self.facts),
            baseline=self.baseline_bytes,
            step_seconds=self.step_seconds,
            settings={**self.settings, "objective": objective},
            budget=budget,
            allow=allow,
        )

    # --- applying --------------------------------------------------------------------------------------------
    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Convert ``model`` (in place) as planned and return it. ``model`` must have the profiled architecture
        (the same chain, as many blocks, the same names); apply before wrapping in DDP/FSDP."""
        named = dict(model.named_modules())
        if self.chain not in named:
            raise FewBitError(f"the plan is for a model with a chain {self.chain!r}; this model has no such submodule")
        container = named[self.chain]
        keys = list(container._modules)
        expected = [b.name.rpartition(".")[2] if self.chain else b.name for b in self.costs.blocks]
        if keys != expected:
            where = self.chain or "the model"
            raise FewBitError(f"the plan is for a chain of blocks {expected}, but {where} has {keys}")
        offloaded = []
        settings = self.settings
        for key, choice in zip(keys, self.choices, strict=True):
            block = apply_option(container, key, choice, bits=settings["bits"], blpa_bits=settings["blpa_bits"])
            if "offload" in parse_option(choice):
                offloaded.append(block)
        if offloaded:
            from .. import offload

            handle = offload.apply(model, offloaded, **settings["offload"])
            model.fewbit_offload = handle  # keeps .stats reachable; handle.remove() undoes the offloading
        return model

    # --- measuring -------------------------------------------------------------------------------------------
    def measure(
        self,
        model: torch.nn.Module,
        *inputs: Any,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        steps: int = 3,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Run one training step of the applied ``model`` under :func:`memory.peak` and :func:`memory.saved_bytes`,
        then ``steps`` timed steps; gradients are set to None before and after (no optimizer step). The result is
        kept in ``measured`` (and shown by :meth:`report`)."""
        from .profile import default_loss

        loss_fn = loss_fn or default_loss
        parameters = list(model.parameters())
        for parameter in parameters:
            parameter.grad = None
        alive = [t for t in (*inputs, *kwargs.values()) if isinstance(t, torch.Tensor)]
        with memory.peak(model, *alive, timeline=True) as result:
            with memory.saved_bytes(model) as saved:
                loss = loss_fn(model(*inputs, **kwargs))
            loss.backward()
            del loss
        times = []
        for _ in range(steps):
            for parameter in parameters:
                parameter.grad = None
            start = time.perf_counter()
            loss_fn(model(*inputs, **kwargs)).backward()
            times.append(time.perf_counter() - start)
        for parameter in parameters:
            parameter.grad = None
        per_block = {}
        for block in self.costs.blocks:
            prefix = block.name + "."
            inside = (v for k, v in saved.by_module.items() if k == block.name or k.startswith(prefix))
            per_block[block.name] = sum(inside)
        timeline = result.timeline or []
        stride = max(1, len(timeline) // 400)
        self.measured = {
            "peak_bytes": result.max_bytes,
            "step_seconds": statistics.median(times) if times else float("nan"),
            "saved_bytes": per_block,
            "timeline": [[name, value + result.baseline_bytes] for name, value in timeline[::stride]],
        }
        return self.measured

    # --- reporting -------------------------------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """One row per block: option, predicted bytes saved and extra seconds (against plain), and measured saved
        bytes when measured (the plain block's saved bytes from the profile minus the measured ones)."""
        rows = []
        plain_saved = self.facts.get("saved_bytes", {})
        for block, option, plain in zip(self.costs.blocks, self._selected(), self._plain(), strict=True):
            row = {
                "block": block.name,
                "technique": option.option,
                "predicted_saved_bytes": _retained(block, plain) - _retained(block, option),
                "predicted_extra_seconds": option.seconds - plain.seconds,
            }
            if self.measured is not None and block.name in plain_saved:
                row["measured_saved_bytes"] = plain_saved[block.name] - self.measured["saved_bytes"].get(block.name, 0)
            rows.append(row)
        return rows

    def report(self, *, file: Any = None) -> str:
        """The plan as a table (printed to ``file`` when given) and returned as text."""
        rows = self.rows()
        measured = self.measured is not None
        header = f"{'block':<24} {'technique':<28} {'saved (pred.)':>14} {'extra time (pred.)':>19}"
        if measured:
            header += f" {'saved (meas.)':>14}"
        lines = [header, "-" * len(header)]
        for row in rows:
            line = (
                f"{row['block'][-24:]:<24} {row['technique']:<28} {format_bytes(row['predicted_saved_bytes']):>14} "
                f"{row['predicted_extra_seconds'] * 1e3:>16.2f} ms"
            )
            if measured and "measured_saved_bytes" in row:
                line += f" {format_bytes(row['measured_saved_bytes']):>14}"
            lines.append(line)
        lines.append("-" * len(header))
        lines.append(
            f"budget {format_bytes(self.budget_bytes)}; predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"(unconverted {format_bytes(self.unconverted_peak_bytes)}; parameters and inputs "
            f"{format_bytes(self.baseline_bytes)})"
        )
        lines.append(
            f"predicted step time {self.predicted_step_seconds * 1e3:.1f} ms "
            f"(unconverted {self.step_seconds * 1e3:.1f} ms measured, {self.predicted_extra_seconds * 1e3:+.1f} ms)"
        )
        if measured:
            peak = self.measured["peak_bytes"]
            lines.append(
                f"measured peak {format_bytes(peak)} ({peak / self.predicted_peak_bytes:.3f}x predicted), "
                f"measured step time {self.measured['step_seconds'] * 1e3:.1f} ms"
            )
        approximate = self.approximate_blocks()
        lines.append(
            "gradients changed (few-bit/BLPA) in: " + (", ".join(approximate) if approximate else "no block (exact)")
        )
        reversible = self.reversible_estimate()
        lines.append(
            f"a reversible chain would save about {format_bytes(reversible['saved_bytes'])} for about "
            f"{reversible['extra_seconds'] * 1e3:.1f} ms more per step (estimate; not applied: it changes the model)"
        )
        text = "\n".join(lines)
        if file is not None:
            print(text, file=file)
        return text

    def figure_data(self) -> dict[str, Any]:
        """The numbers behind the figure (drawn by ``fewbit_design.cli.memory.plot_plan``; the runtime never imports
        matplotlib): ``bars``: for the unconverted model and the plan, bytes at the end of the forward pass by what
        holds them (parameters and inputs, before the chain, each technique's blocks); ``timeline``: predicted
        (and measured) live bytes over one step."""

        def bar(choice: list[OptionCost]) -> dict[str, int]:
            parts = {"parameters and inputs": self.baseline_bytes, "before the chain": self.costs.entry_bytes}
            for block, option in zip(self.costs.blocks, choice, strict=True):
                parts[option.option] = parts.get(option.option, 0) + _retained(block, option)
            return parts

        data: dict[str, Any] = {
            "bars": {"unconverted": bar(self._plain()), "plan": bar(self._selected())},
            "timeline": {
                "predicted": [
                    [label, value + self.baseline_bytes]
                    for label, value in replay(self.costs, self._selected()).timeline
                ]
            },
            "budget_bytes": self.budget_bytes,
        }
        if self.measured is not None:
            data["timeline"]["measured"] = self.measured["timeline"]
        return data

    # --- JSON ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = FORMAT
        return data

    def to_json(self) -> str:
        """The plan as JSON (:func:`load_plan` reads it back into an equal plan)."""
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_json` to ``path`` (atomically)."""
        path = os.fspath(path)
        temporary = f"{path}.tmp{os.getpid()}"
        with open(temporary, "w") as handle:
            handle.write(self.to_json())
        os.replace(temporary, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryPlan:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise FewBitError(f"a memory plan must have format {FORMAT!r}, got {found!r}")
        try:
            costs = data["costs"]
            blocks = tuple(
                BlockCosts(
                    name=b["name"],
                    input_bytes=int(b["input_bytes"]),
                    output_bytes=int(b["output_bytes"]),
                    gradient_bytes=int(b["gradient_bytes"]),
                    options=tuple(OptionCost(**o) for o in b["options"]),
                )
                for b in costs["blocks"]
            )
            chain = ChainCosts(blocks, **{k: int(v) for k, v in costs.items() if k != "blocks"})
            settings = dict(data["settings"])
            settings["allow"] = tuple(settings["allow"])
            plan = cls(
                chain=str(data["chain"]),
                choices=tuple(data["choices"]),
                costs=chain,
                budget_bytes=int(data["budget_bytes"]),
                baseline_bytes=int(data["baseline_bytes"]),
                step_seconds=float(data["step_seconds"]),
                settings=settings,
                facts=dict(data.get("facts") or {}),
                measured=data.get("measured"),
            )
            for block, choice in zip(plan.costs.blocks, plan.choices, strict=True):
                block.option(choice)
        except (KeyError, TypeError, ValueError) as error:
            raise FewBitError(f"malformed memory plan: {type(error).__name__}: {error}") from None
        return plan


def load_plan(path: str | os.PathLike) -> MemoryPlan:
    """Read a plan that :meth:`MemoryPlan.save` wrote; ``load_plan(path).apply(model)`` applies it."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except OSError as error:
        raise FewBitError(f"cannot read memory plan {os.fspath(path)!r}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise FewBitError(f"memory plan {os.fspath(path)!r} is not JSON: {error}") from None
    try:
        return MemoryPlan.from_dict(data)
    except FewBitError as error:
        raise FewBitError(f"memory plan {os.fspath(path)!r}: {error}") from None


OBJECTIVES = ("time", "memory")


def _budget(budget: Any, plain_peak: int, minimum: int) -> int:
    if isinstance(budget, float) and not isinstance(budget, bool):
        if not 0 < budget <= 1:
            raise FewBitError(f"a budget given as a fraction of the unconverted peak must be in (0, 1], got {budget}")
        return max(int(budget * plain_peak), 1)
    if isinstance(budget, str) and budget.strip().lower() == "min":
        return minimum
    from ..checkpoint import parse_budget

    return parse_budget(budget)


def choose(
    chain_name: str,
    costs: ChainCosts,
    facts: dict[str, Any],
    *,
    baseline: int,
    step_seconds: float,
    settings: dict[str, Any],
    budget: Any,
    allow: Any,
) -> MemoryPlan:
    """Optimise over a profile: the options of each block whose techniques are all in ``allow``."""
    if isinstance(allow, str):
        allow = (allow,)
    allow = tuple(check_choice("allowed technique", t, TECHNIQUES) for t in allow)
    objective = check_choice("objective", settings["objective"], OBJECTIVES)
    allowed = [[o.option for o in b.options if set(parse_option(o.option)) <= set(allow)] for b in costs.blocks]
    plain = replay(costs, [b.option("plain") for b in costs.blocks]).peak
    smallest = minimum_budget(costs, allowed)
    if objective == "memory" or budget is None:
        target = plain if budget is None and objective == "time" else smallest
    else:
        target = _budget(budget, baseline + plain, baseline + smallest) - baseline
    choices = optimise(costs, target, allowed)
    if choices is None:
        raise FewBitError(
            f"no plan fits a budget of {format_bytes(target + baseline)} with {', '.join(allow) or 'no technique'}: "
            f"the smallest feasible peak is {format_bytes(smallest + baseline)} (unconverted: "
            f"{format_bytes(plain + baseline)})"
        )
    facts = {**facts, "minimum_budget_bytes": smallest + baseline}
    return MemoryPlan(
        chain=chain_name,
        choices=tuple(choices),
        costs=costs,
        budget_bytes=target + baseline,
        baseline_bytes=baseline,
        step_seconds=step_seconds,
        settings={**settings, "allow": allow},
        facts=facts,
    )
