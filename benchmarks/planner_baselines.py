"""The memory planner against the baselines a user would reach for, same run, same model, same batches.

Two models whose memory is dominated by activations (small width, long sequence, small vocabulary), built from
configs (no downloads): a 12-layer LLaMA-style (``transformers.LlamaConfig``) and a 12-layer GPT-2-style
(``transformers.GPT2Config``; its ``gelu_new`` swapped for the identical ``nn.GELU(approximate="tanh")`` so few-bit
recognises it). Rows, each a fresh copy of the model (same seed) trained on the same batches (Adam):

* ``eager``: the unconverted model, the baseline of every ratio;
* ``hf checkpointing``: ``model.gradient_checkpointing_enable()`` (Hugging Face's defaults);
* ``save_on_cpu``: the step under ``torch.autograd.graph.save_on_cpu()``. On a CPU-only machine the saved tensors
  are already on the CPU and ``save_on_cpu`` keeps them as they are (``tensor.cpu()`` is the tensor itself): its
  peak is eager's and its time is the cost of the saved-tensor hooks alone; on CUDA it moves them to host memory;
* ``compiled amb=B``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = B`` for B from 1.0
  down to 0.1 (the min-cut partitioner recomputes more as B falls). On CPU the backend is
  ``aot_eager_decomp_partition``: AOTAutograd's decompositions and partitioner (so the budget applies) run as eager
  ATen ops, which ``memory.peak`` counts exactly. Inductor would also fuse (fewer, different temporaries) and its
  generated code allocates outside the dispatcher, where ``memory.peak`` cannot see it: with ``--inductor`` extra
  rows time the inductor build, with no peak;
* ``<technique> alone``: the planner's profile restricted to one technique, at its smallest peak;
* ``offload alone, prefetch 2``: offload applied to every block with its transfers on the target's thread (two in
  flight each way, ``blockwise`` as under the planner), beside the planner's synchronous offload (``offload alone``,
  ``--offload-prefetch`` sets the planner's): what overlapping the copies with compute buys on this machine;
* ``plan <k>``: the planner's budget sweep (budgets of the unconverted activation bytes / k, down to the smallest
  feasible), applied in eager mode, and the same plans compiled the same way as the compiled baseline
  (``plan <k> compiled``, at the partitioner's default budget 1.0); ``plan <k> allowed``: the plan at the same
  budget with ``approximate="allowed"`` (few-bit and compressed linear inputs wherever they profiled faster), where
  it differs from the default ``"if-needed"`` plan (eager only).

Per row: ``peak_mib`` (``memory.peak`` over one training step: forward and backward, with the parameters, their
gradients and Adam's state alive, as in training), ``activation_mib`` (that peak minus parameters, gradients and
optimizer state), the median step time (forward + backward, one torch thread by default) with its quartiles, and
ratios against ``eager``: peak, activation memory, and step time (the median over rounds of each round's ratio: the
candidates run in turn, one step each per round, so a slow spell of the shared machine hits them alike). Then the
target checks are printed (:func:`target_checks`), each with why where it does not hold.

    python benchmarks/planner.py --baselines            # the full run (10-20 minutes on a loaded 2-core CPU)
    python benchmarks/planner_baselines.py --quick      # tiny models, a few steps (seconds; writes to the temp folder)
    python benchmarks/planner_baselines.py --models llama --dtype bfloat16 --inductor

Writes ``benchmarks/results/planner_baselines.csv`` and ``docs/figures/planner_baselines.png`` (peak against step
time, every baseline and plan).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # fewbit_design from this checkout; harness.py beside this file

import harness  # noqa: E402

from fewbit_design.runtime import memory  # noqa: E402
from fewbit_design.runtime.planner import TECHNIQUES, MemoryPlan, plan_memory  # noqa: E402

MIB = 2.0**20
CPU_BACKEND = "aot_eager_decomp_partition"
#: (layers, width, heads, sequence, batch, vocabulary)
SHAPES = {"full": (12, 64, 4, 512, 2, 256), "quick": (2, 16, 2, 32, 2, 64)}
COMPILE_BUDGETS = {"full": (1.0, 0.8, 0.6, 0.4, 0.2, 0.1), "quick": (0.5,)}
#: plan budgets: the unconverted activation bytes divided by k ("min": the smallest feasible peak)
PLAN_DIVISORS: dict[str, tuple[float | str, ...]] = {"full": (2, 3, 4, 6, 8, "min"), "quick": ("min",)}


# --- models -------------------------------------------------------------------------------------------------------
def build(model_name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The model from its config, seeded, in training mode; caches off (a training step does not use them)."""
    import transformers

    layers, width, heads, sequence, _, vocab = shape
    torch.manual_seed(seed)
    if model_name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=round(width * 8 / 3 / 8) * 8,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=sequence, use_cache=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=vocab, n_positions=sequence, n_embd=width, n_layer=layers, n_head=heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # None (GPT-2's) logs a warning in every forward: a graph break
        for block in model.transformer.h:
            block.mlp.act = nn.GELU(approximate="tanh")  # gelu_new, as a torch.nn activation
    return model.to(dtype).train()


def batches(shape: tuple[int, ...], count: int, seed: int = 1) -> list[torch.Tensor]:
    """Token batches of a Markov chain (each token has 4 likely successors): the same for every row."""
    _, _, _, sequence, batch, vocab = shape
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=generator)
    out = []
    for _ in range(count):
        ids = torch.empty(batch, sequence, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
        for t in range(1, sequence):
            pick = torch.randint(0, 4, (batch,), generator=generator)
            ids[:, t] = successors[ids[:, t - 1], pick]
        out.append(ids)
    return out


# --- candidates ---------------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    """One row: a model (as converted) and how one training step runs it."""

    name: str
    kind: str  # eager, hf-checkpoint, save_on_cpu, compiled, single, plan, plan-compiled (+ "-inductor")
    model: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]  # ids -> loss
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    plan: MemoryPlan | None = None
    budget: float = math.nan  # activation_memory_budget (compiled rows) or the plan's budget (MiB)
    measure_peak: bool = True
    optimizer: torch.optim.Optimizer | None = None
    row: dict = field(default_factory=dict)
    position: int = 0

    def step(self, data: list[torch.Tensor]) -> None:
        ids = data[self.position % len(data)]
        self.position += 1
        with self.context():
            loss = self.forward(ids)
        loss.backward()


def _loss(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: model(input_ids=ids, labels=ids).loss


def compiled_forward(
    model: nn.Module, backend: str, label: str, *, fullgraph: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``torch.compile`` of one step's forward, with its own code object (dynamo caches compiled code per code
    object, and the inlined model's parameters are graph inputs: without this, every model of the same class would
    reuse the first one's graph, partitioned under the first one's activation_memory_budget). ``fullgraph``: no
    graph break, so no frame of the model's own code is compiled (and cached) apart from this one."""
    namespace: dict = {}
    source = "def forward(ids):\n    return model(input_ids=ids, labels=ids).loss\n"
    exec(compile(source, f"<compiled step: {label}>", "exec"), {"model": model}, namespace)  # noqa: S102
    return torch.compile(namespace["forward"], backend=backend, fullgraph=fullgraph)


def budget_context(budget: float) -> Callable[[], contextlib.AbstractContextManager]:
    """The partitioner reads the budget when it compiles (and recompiles): every call runs under it."""
    return lambda: torch._functorch.config.patch(activation_memory_budget=budget)


def candidates(model_name: str, shape, dtype, args, example: torch.Tensor) -> list[Candidate]:
    """Every row of one model: baselines, each technique alone, and the planner's sweep (eager and compiled)."""
    fresh = lambda: build(model_name, shape, dtype)  # noqa: E731
    rows = [Candidate("eager", "eager", model := fresh(), _loss(model))]
    model = fresh()
    model.gradient_checkpointing_enable()
    rows.append(Candidate("hf checkpointing", "hf-checkpoint", model, _loss(model)))
    model = fresh()
    save = lambda: torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())  # noqa: E731
    rows.append(Candidate("save_on_cpu", "save_on_cpu", model, _loss(model), context=save))
    backends = [(CPU_BACKEND, "")] + ([("inductor", "-inductor")] if args.inductor else [])
    for backend, suffix in backends:
        for budget in COMPILE_BUDGETS[args.mode]:
            model = fresh()
            name = f"compiled{suffix} amb={budget:g}"
            forward = compiled_forward(model, backend, f"{model_name} {name}", fullgraph=True)
            rows.append(
                Candidate(name, "compiled" + suffix, model, forward, budget_context(budget), budget=budget,
                          measure_peak=not suffix)
            )  # fmt: skip
    start = time.perf_counter()
    base = plan_memory(
        fresh(),
        example,
        example_kwargs={"labels": example},
        budget=None,
        offload_min_bytes=args.offload_min_bytes,
        offload_prefetch=args.offload_prefetch,
        repeats=args.profile_repeats,
        approximate=args.approximate,
    )
    print(f"[{model_name}] profiled in {time.perf_counter() - start:.1f} s: chain {base.chain!r}, "
          f"{len(base.choices)} blocks")  # fmt: skip
    for technique in TECHNIQUES:
        if any(technique in o.option.split("+") for b in base.costs.blocks for o in b.options):
            plan = base.replan("min", allow=(technique,), approximate="allowed")
            model = plan.apply(fresh())
            rows.append(Candidate(f"{technique} alone", "single", model, _loss(model), plan=plan))
    if any("offload" in o.option.split("+") for b in base.costs.blocks for o in b.options):
        from fewbit_design.runtime import offload

        model = fresh()
        blocks = list(model.get_submodule(base.chain))
        offload.apply(model, blocks, min_bytes=args.offload_min_bytes, prefetch=2, blockwise=True)
        rows.append(Candidate("offload alone, prefetch 2", "single", model, _loss(model)))
    unconverted, baseline = base.unconverted_peak_bytes, base.baseline_bytes
    smallest = base.facts["minimum_budget_bytes"]
    seen = set()
    for divisor in PLAN_DIVISORS[args.mode]:
        budget = smallest if divisor == "min" else max(smallest, baseline + (unconverted - baseline) / divisor)
        plan = base.replan(round(budget))
        if plan.choices in seen:
            continue
        seen.add(plan.choices)
        label = f"plan {divisor}" if divisor == "min" else f"plan /{divisor:g}"
        model = plan.apply(fresh())
        rows.append(Candidate(label, "plan", model, _loss(model), plan=plan, budget=plan.budget_bytes / MIB))
        for backend, suffix in backends:
            model = plan.apply(fresh())
            forward = compiled_forward(model, backend, f"{model_name} {label}{suffix}", fullgraph=False)
            rows.append(
                Candidate(f"{label} compiled{suffix}", "plan-compiled" + suffix, model, forward,
                          budget_context(1.0), plan=plan, budget=plan.budget_bytes / MIB, measure_peak=not suffix)
            )  # fmt: skip
        if args.approximate != "allowed" and args.mode == "full":  # (quick: the rows of the test's fixed kinds)
            allowed = base.replan(round(budget), approximate="allowed")
            if allowed.choices not in seen:
                seen.add(allowed.choices)
                model = allowed.apply(fresh())
                rows.append(Candidate(f"{label} allowed", "plan-allowed", model, _loss(model), plan=allowed,
                                      budget=allowed.budget_bytes / MIB))  # fmt: skip
    return rows


# --- measuring ----------------------------------------------------------------------------------------------------
def _fixed_tensors(candidate: Candidate) -> list[torch.Tensor]:
    """Parameters, their gradients and the optimizer's state: what a training step keeps whatever the technique."""
    tensors = []
    for parameter in candidate.model.parameters():
        tensors.append(parameter)
        if parameter.grad is not None:
            tensors.append(parameter.grad)
    for state in candidate.optimizer.state.values():
        tensors.extend(t for t in state.values() if isinstance(t, torch.Tensor))
    return tensors


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({memory.storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def _compile_counts() -> tuple[int, int]:
    """(graphs built, graph breaks met) by dynamo so far in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def prepare(candidate: Candidate, data: list[torch.Tensor], warmup: int) -> None:
    """Warm up (compiles), then measure one step's peak with gradients and Adam's state alive (as in training)."""
    candidate.optimizer = torch.optim.Adam(candidate.model.parameters(), lr=1e-3)
    built = _compile_counts()
    for _ in range(max(warmup, 1)):  # at least one: Adam's state exists from the first optimizer step
        candidate.optimizer.zero_grad(set_to_none=True)
        candidate.step(data)
        candidate.optimizer.step()
    if candidate.kind.startswith(("compiled", "plan-compiled")):
        after = _compile_counts()
        candidate.row.update(graphs=after[0] - built[0], graph_breaks=after[1] - built[1])
    candidate.optimizer.zero_grad(set_to_none=False)  # gradients alive and zero: the peak counts them once
    if not candidate.measure_peak:
        return
    fixed = _fixed_tensors(candidate)
    ids = data[candidate.position % len(data)]
    with memory.peak(candidate.model, ids, *fixed) as peak:
        candidate.step(data)
    candidate.row.update(peak_mib=peak.max_bytes / MIB, activation_mib=(peak.max_bytes - _distinct_bytes(fixed)) / MIB)


def time_candidates(live: list[Candidate], data: list[torch.Tensor], repeats: int) -> None:
    """Interleaved rounds, one step each; the median step time, its quartiles, and the median of per-round ratios
    against the first candidate (eager)."""
    calls = {c.name: (lambda c=c: c.step(data)) for c in live}
    by_name = {c.name: c for c in live}
    timings = harness.measure(
        calls,
        repeats=repeats,
        warmup=0,
        alternate=True,
        before=lambda name: by_name[name].optimizer.zero_grad(set_to_none=True),
        after=lambda name, _: by_name[name].optimizer.step(),
        baseline=live[0].name,
    )
    reference = timings[live[0].name].samples
    for candidate in live:
        timing = timings[candidate.name]
        ratios = [t / r for t, r in zip(timing.samples, reference, strict=True)]
        low, high = harness.Timing(tuple(ratios)).quartiles
        candidate.row.update(
            step_ms=timing.median * 1e3,
            step_q1_ms=timing.quartiles[0] * 1e3,
            step_q3_ms=timing.quartiles[1] * 1e3,
            step_vs_eager=statistics.median(ratios),
            step_vs_eager_q1=low,
            step_vs_eager_q3=high,
        )


def run_model(model_name: str, args) -> list[dict]:
    shape = SHAPES[args.mode]
    dtype = getattr(torch, args.dtype)
    data = batches(shape, count=8)
    rows = candidates(model_name, shape, dtype, args, data[0])
    live = []
    for candidate in rows:
        start = time.perf_counter()
        candidate.row.update(model=model_name, kind=candidate.kind, config=candidate.name, dtype=args.dtype)
        if candidate.plan is not None:
            plan = candidate.plan
            candidate.row.update(
                techniques="+".join(sorted(plan.techniques_used())) or "none",
                choices=" ".join(plan.choices),
                predicted_peak_mib=plan.predicted_peak_bytes / MIB,
                approximate_blocks=len(plan.approximate_blocks()),
            )
        if candidate.kind.startswith("compiled"):
            candidate.row["activation_memory_budget"] = candidate.budget
        elif candidate.plan is not None:
            candidate.row["budget_mib"] = candidate.budget if candidate.kind != "single" else math.nan
        try:
            prepare(candidate, data, args.warmup)
        except Exception as error:  # a baseline or plan that cannot run here is a finding: keep it in the table
            candidate.row["note"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            print(f"[{model_name}] {candidate.name}: {candidate.row['note']}")
            if args.verbose:
                traceback.print_exc()
            continue
        live.append(candidate)
        print(f"[{model_name}] {candidate.name:<28} ready in {time.perf_counter() - start:5.1f} s, peak "
              f"{candidate.row.get('peak_mib', math.nan):8.2f} MiB")  # fmt: skip
    if not live or live[0].kind != "eager":
        raise SystemExit(f"[{model_name}] the eager baseline failed: nothing to compare against")
    time_candidates(live, data, args.repeats)
    eager = live[0].row
    for candidate in rows:
        row = candidate.row
        row["peak_vs_eager"] = row.get("peak_mib", math.nan) / eager["peak_mib"]
        row["activation_reduction"] = eager["activation_mib"] / row.get("activation_mib", math.nan)
        print(f"[{model_name}] {row['config']:<28} peak {row.get('peak_mib', math.nan):8.2f} MiB, activations "
              f"{row.get('activation_mib', math.nan):8.2f} MiB ({row['activation_reduction']:5.2f}x less), step "
              f"{row.get('step_ms', math.nan):7.1f} ms ({row.get('step_vs_eager', math.nan):.3f}x, quartiles "
              f"{row.get('step_vs_eager_q1', math.nan):.3f}-{row.get('step_vs_eager_q3', math.nan):.3f}) "
              f"{row.get('note', '')}")  # fmt: skip
    return [c.row for c in rows]


# --- targets ------------------------------------------------------------------------------------------------------
def _ok(value: bool) -> str:
    return "holds" if value else "DOES NOT HOLD"


def target_checks(rows: list[dict]) -> list[str]:
    """The planner's targets checked on one model's rows, each a line (with why where it does not hold).

    Targets: 5x less activation memory at most 1.10x eager's step time, 3x at most 1.00x, and plans at least as
    fast as HF checkpointing (eager plans) and compiled PyTorch (compiled plans) at or below their peaks.
    """

    def measured(row):
        return not math.isnan(row.get("activation_mib", math.nan)) and not math.isnan(row.get("step_ms", math.nan))

    model = rows[0]["model"]
    plans = [r for r in rows if r["kind"] in ("plan", "plan-compiled", "plan-allowed") and measured(r)]
    lines = []
    for factor, limit in ((5.0, 1.10), (3.0, 1.00)):
        reaching = [r for r in plans if r["activation_reduction"] >= factor]
        within = [r for r in reaching if r["step_vs_eager"] <= limit]
        if within:
            best = min(within, key=lambda r: r["step_vs_eager"])
            why = ""
        else:
            best = min(reaching, key=lambda r: r["step_vs_eager"]) if reaching else None
            why = (
                f": the fastest plan reaching {factor:g}x takes {best['step_vs_eager']:.3f}x"
                if best
                else f": no plan reaches {factor:g}x (largest "
                f"{max((r['activation_reduction'] for r in plans), default=math.nan):.2f}x)"
            )
        shown = f" ({best['config']}: {best['activation_reduction']:.2f}x less at {best['step_vs_eager']:.3f}x)" if (
            best and within) else ""  # fmt: skip
        lines.append(f"{model}: >= {factor:g}x less activation memory at <= {limit:.2f}x step time: "
                     f"{_ok(bool(within))}{shown}{why}")  # fmt: skip
    for kind, baseline_kind in (("plan", "hf-checkpoint"), ("plan-compiled", "compiled")):
        for baseline in (r for r in rows if r["kind"] == baseline_kind and measured(r)):
            fitting = [r for r in rows if r["kind"] == kind and measured(r) and r["peak_mib"] <= baseline["peak_mib"]]
            if not fitting:
                smallest = min((r["peak_mib"] for r in rows if r["kind"] == kind and measured(r)), default=math.nan)
                lines.append(f"{model}: {kind} at or below {baseline['config']}'s peak ({baseline['peak_mib']:.2f} "
                             f"MiB) at least as fast: DOES NOT HOLD: no {kind} reaches that peak (smallest "
                             f"{smallest:.2f} MiB)")  # fmt: skip
                continue
            best = min(fitting, key=lambda r: r["step_vs_eager"])
            holds = best["step_vs_eager"] <= baseline["step_vs_eager"]
            spread = best["step_vs_eager_q3"] >= baseline["step_vs_eager_q1"] and not holds
            lines.append(
                f"{model}: {kind} at or below {baseline['config']}'s peak ({baseline['peak_mib']:.2f} MiB) at least "
                f"as fast: {_ok(holds)} ({best['config']}: {best['peak_mib']:.2f} MiB at {best['step_vs_eager']:.3f}x "
                f"against {baseline['step_vs_eager']:.3f}x"
                + ("; within the spread of the timings" if spread else "")
                + ")"
            )
    return lines


# --- outputs ------------------------------------------------------------------------------------------------------
COLUMNS = [
    "model", "dtype", "kind", "config", "techniques", "choices", "approximate_blocks", "activation_memory_budget",
    "budget_mib", "predicted_peak_mib", "peak_mib", "activation_mib", "peak_vs_eager", "activation_reduction",
    "step_ms", "step_q1_ms", "step_q3_ms", "step_vs_eager", "step_vs_eager_q1", "step_vs_eager_q3", "graphs",
    "graph_breaks", "note",
]  # fmt: skip
STYLE = {  # kind -> marker, colour, label
    "eager": ("s", "black", "eager (unconverted)"),
    "hf-checkpoint": ("D", "tab:red", "HF gradient_checkpointing_enable()"),
    "save_on_cpu": ("X", "tab:brown", "save_on_cpu"),
    "compiled": ("^", "tab:orange", "torch.compile, activation_memory_budget 1.0..0.1"),
    "single": ("P", "tab:purple", "one technique alone"),
    "plan": ("o", "tab:blue", "planner sweep (eager)"),
    "plan-compiled": ("v", "tab:green", "planner sweep (compiled)"),
    "plan-allowed": ("*", "tab:cyan", "planner sweep, approximate allowed (eager)"),
}


def figure(rows: list[dict], path: Path, title: str) -> None:
    plt = harness.pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models) + 3.5, 4.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model and not math.isnan(r.get("peak_mib", math.nan))]
        mine = [r for r in mine if not math.isnan(r.get("step_ms", math.nan))]
        for kind, (marker, colour, label) in STYLE.items():
            points = sorted((r for r in mine if r["kind"] == kind), key=lambda r: r["peak_mib"])
            if not points:
                continue
            x = [r["peak_mib"] for r in points]
            y = [r["step_vs_eager"] for r in points]
            error = [[v - r["step_vs_eager_q1"] for v, r in zip(y, points, strict=True)],
                     [r["step_vs_eager_q3"] - v for v, r in zip(y, points, strict=True)]]  # fmt: skip
            style = "-" if kind in ("compiled", "plan", "plan-compiled", "plan-allowed") else "none"
            ax.errorbar(x, y, yerr=error, marker=marker, color=colour, linestyle=style, markersize=7, capsize=2,
                        label=label)  # fmt: skip
            if kind == "single":
                for r in points:
                    ax.annotate(r["config"].replace(" alone", ""), (r["peak_mib"], r["step_vs_eager"]), fontsize=7,
                                textcoords="offset points", xytext=(4, 4))  # fmt: skip
        ax.axhline(1.0, color="grey", linewidth=0.6, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel("peak of live tensor bytes over a training step (MiB, memory.peak)")
        ax.set_ylabel("step time / eager step time (median; bars: quartiles)")
        ax.set_title(f"{model}", fontsize=10)
        ax.grid(True, which="both", linewidth=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0 - 3.4 / fig.get_figwidth(), 0.5), fontsize=8,
               frameon=False)  # fmt: skip
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1.0 - 3.5 / fig.get_figwidth(), 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps: seconds (writes to temp)")
    parser.add_argument("--models", default="llama,gpt2", help="comma-separated, of llama and gpt2 (default both)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameters and compute")
    parser.add_argument("--approximate", default="if-needed", choices=("if-needed", "allowed"),
                        help="the planner's rule for few-bit, BLPA, compressed linear inputs")  # fmt: skip
    parser.add_argument("--inductor", action="store_true", help="also time the compiled rows with inductor (no peak)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before measuring (default 2; --quick 1)")
    parser.add_argument("--profile-repeats", type=int, default=None, help="planner's timed runs (default 5; quick 1)")
    parser.add_argument("--offload-min-bytes", type=int, default=1 << 16, help="offload's smallest saved tensor")
    parser.add_argument("--offload-prefetch", type=int, default=0, help="the planner's offload_prefetch (default 0)")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of a row that fails")
    harness.add_options(parser, out=None, figure=None, repeats=None, threads=1)
    parser.add_argument("--compile-budgets", default=None, help="activation_memory_budget values (comma-separated)")
    parser.add_argument("--plan-divisors", default=None, help="plan budgets: activation bytes / k, or min (commas)")
    args = parser.parse_args(argv)
    args.mode = "quick" if args.quick else "full"
    if args.compile_budgets:
        COMPILE_BUDGETS[args.mode] = tuple(float(b) for b in args.compile_budgets.split(","))
    if args.plan_divisors:
        PLAN_DIVISORS[args.mode] = tuple(d if d == "min" else float(d) for d in args.plan_divisors.split(","))
    args.repeats = args.repeats or (2 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.profile_repeats = args.profile_repeats or (1 if args.quick else 5)
    if args.quick:  # a quick run never overwrites measured results
        args.out = args.out or harness.scratch("planner_baselines-quick.csv")
        args.figure = args.figure or harness.scratch("planner_baselines-quick.png")
    args.out = Path(args.out or harness.RESULTS / "planner_baselines.csv")
    args.figure = Path(args.figure or harness.FIGURES / "planner_baselines.png")
    harness.set_threads(args.threads)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)
    layers, width, heads, sequence, batch, vocab = SHAPES[args.mode]
    header = (f"{args.mode}: {layers} layers, width {width}, {heads} heads, sequence {sequence}, batch {batch}, "
              f"vocabulary {vocab}, {args.dtype}, {torch.get_num_threads()} thread(s), CPU backend {CPU_BACKEND}, "
              f"torch {torch.__version__}")  # fmt: skip
    print(f"planner baselines: {header}")
    rows = []
    for model_name in (m.strip() for m in args.models.split(",")):
        if model_name not in ("llama", "gpt2"):
            parser.error(f"--models: unknown model {model_name!r} (llama, gpt2)")
        mine = run_model(model_name, args)
        rows += mine
        # written after each model: a long run stopped early keeps the models it finished
        harness.write_csv(args.out, rows, columns=COLUMNS, float_format=".4g", extrasaction="ignore")
        figure(rows, args.figure, header)
        print(f"wrote {args.out} and {args.figure}")
        print(f"target checks, {model_name}:")
        for line in target_checks(mine):
            print("  " + line)
    return rows


if __name__ == "__main__":
    main()
