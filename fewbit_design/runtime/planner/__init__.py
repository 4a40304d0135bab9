"""The memory planner: one model, one batch, one budget; which technique runs where, and what it costs.

>>> import torch
>>> from fewbit_design import runtime
>>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
...                                                   torch.nn.Linear(256, 64)) for _ in range(6)])
>>> x = torch.randn(128, 64)
>>> plan = runtime.plan_memory(model, x, budget=0.5)          # half the unconverted peak  # doctest: +SKIP
>>> print(plan.report())                                                                   # doctest: +SKIP
>>> model = plan.apply(model)                                                              # doctest: +SKIP
>>> plan.save("plan.json"); runtime.load_plan("plan.json").apply(other_model)              # doctest: +SKIP

How it decides (the algorithm, stated; :mod:`.model` has the details and the proof sketch):

1. **Profile once** (:mod:`.profile`): find the chain (the model's ``nn.Sequential``/``nn.ModuleList`` of blocks),
   measure one plain training step around it, and run every block alone under every applicable option: plain,
   few-bit (blocks with a supported activation), BLPA (blocks holding a BatchNorm -> ReLU -> Conv2d/Linear run),
   offload (blocks saving tensors of at least ``offload_min_bytes``), checkpoint (every block), and their
   combinations (offload is not combined with checkpoint). Each option gets measured bytes (forward peak, bytes
   kept for backward, backward peak, whether it keeps its input/output) and a measured forward + backward time.
2. **Optimise** (:func:`.model.optimise`): an exact dynamic program over the chain that picks one option per
   block, minimising the summed time subject to every peak event of the predicted step staying within the budget.
   Checkpointing and per-block savings interact exactly as measured: a checkpointed block keeps only its input in
   the forward pass, and its inner option's bytes come back during its own backward.
3. **Predict** (:func:`.model.replay`): the step's live bytes event by event, so the report shows the predicted
   peak; :meth:`MemoryPlan.measure` measures the real one with :func:`memory.peak`.

Few-bit and BLPA change gradients slightly: the report lists the blocks where the plan uses them, and
``allow=("checkpoint", "offload")`` keeps gradients exact. Reversible layers change the architecture, so they
are never inserted; the report estimates what a reversible chain would save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...errors import FewBitError, check_choice, parse_budget
from ..checkpoint.fingerprint import fingerprint
from .plan import FORMAT, OBJECTIVES, MemoryPlan, choose, format_bytes, load_plan
from .techniques import TECHNIQUES

__all__ = ["plan_memory", "load_plan", "MemoryPlan", "TECHNIQUES", "OBJECTIVES", "FORMAT", "format_bytes"]


def plan_memory(
    model: torch.nn.Module,
    *example_inputs: Any,
    budget: int | str | float | None = None,
    allow: tuple[str, ...] | list[str] = TECHNIQUES,
    bits: int = 3,
    blpa_bits: int = 4,
    objective: str = "time",
    chain: str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    offload_min_bytes: int = 1 << 20,
    offload_target: str = "auto",
    repeats: int = 3,
    example_kwargs: dict[str, Any] | None = None,
) -> MemoryPlan:
    """Profile ``model`` on example inputs once and choose per block of its chain the fastest combination of
    techniques whose predicted peak fits ``budget`` (see the package docstring for the algorithm).

    Args:
        model: the model in training mode; it is run, not changed (gradients, buffers and the random state are
            restored).
        example_inputs: positional inputs of one training step, with the training batch size (bytes scale with it).
        budget: the whole step's memory (parameters, inputs and everything the step allocates), in the syntax of
            :func:`fewbit_design.errors.parse_budget` (shared with ``checkpoint.plan`` and the CLI): bytes, a string
            such as ``"2GiB"``, a fraction in (0, 1] of the unconverted predicted peak (``0.5`` or ``"0.5"``),
            ``"min"`` (the smallest feasible peak) or None (the unconverted peak: nothing to save).
        allow: the techniques the plan may use, from ``("fewbit", "blpa", "checkpoint", "offload")``.
        bits: few-bit table bits; ``blpa_bits``: BLPA's bits (2..8).
        objective: ``"time"`` (the fastest plan within the budget) or ``"memory"`` (the smallest feasible peak,
            then the fastest plan at it; the budget is ignored).
        chain: the qualified name of the chain (default: found, see :func:`.profile.find_chain`).
        loss_fn: the step's loss from the model's output (default: ``output.loss`` or the mean of the first
            floating-point tensor).
        offload_min_bytes: saved tensors smaller than this stay in memory (offload's ``min_bytes``).
        offload_target: offload's ``target``; offloading runs with ``prefetch=0`` (synchronous: the tensor leaves
            memory when it is saved, so the prediction holds).
        repeats: timed runs per measurement (median).
        example_kwargs: keyword inputs of the step.

    Raises :class:`FewBitError` when no plan fits the budget (naming the smallest feasible one), for a bad
    argument before anything runs (a bad budget included), and when the model cannot run a training step on the
    example inputs (naming what it raised).

    The plan stores the chain's fingerprint (each block's class and parameter shapes); :meth:`MemoryPlan.apply`
    refuses a model whose blocks differ.
    """
    if not isinstance(model, torch.nn.Module):
        raise FewBitError(f"plan_memory takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(allow, str):
        allow = (allow,)
    allow = tuple(check_choice("allowed technique", t, TECHNIQUES) for t in allow)
    check_choice("objective", objective, OBJECTIVES)
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise FewBitError(f"few-bit bits must be an integer in 1..8, got {bits!r}")
    if isinstance(blpa_bits, bool) or not isinstance(blpa_bits, int) or not 2 <= blpa_bits <= 8:
        raise FewBitError(f"BLPA bits must be an integer in 2..8, got {blpa_bits!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise FewBitError(f"repeats must be a positive integer, got {repeats!r}")
    if not model.training:
        raise FewBitError("plan_memory plans a training step: call model.train() first")
    if budget is not None:
        parse_budget(budget)  # a bad budget fails before the model is profiled
    if not example_inputs and not example_kwargs:
        raise FewBitError(
            "plan_memory needs example inputs of one training step, with the training batch size: "
            "plan_memory(model, x, ...) or example_kwargs={...}"
        )
    offload = {"min_bytes": int(offload_min_bytes), "target": offload_target, "prefetch": 0}
    from .profile import profile_model

    chain_name, costs, facts = profile_model(
        model,
        tuple(example_inputs),
        dict(example_kwargs or {}),
        chain=chain,
        allow=allow,
        bits=bits,
        blpa_bits=blpa_bits,
        offload_options=offload,
        loss_fn=loss_fn,
        repeats=repeats,
    )
    baseline = facts.pop("baseline_bytes")
    step_seconds = facts.pop("step_seconds")
    container = model.get_submodule(chain_name) if chain_name else model
    settings = {"allow": allow, "bits": bits, "blpa_bits": blpa_bits, "objective": objective, "offload": offload}
    return choose(
        chain_name,
        costs,
        facts,
        baseline=baseline,
        step_seconds=step_seconds,
        settings=settings,
        budget=budget,
        allow=allow,
        fingerprint=fingerprint(list(container)),
    )
