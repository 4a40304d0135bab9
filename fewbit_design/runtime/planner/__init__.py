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

Where things are: :func:`plan_memory` and :class:`MemoryPlan` in :mod:`.plan`, options (combinations of the
techniques of :mod:`fewbit_design.runtime.registry`, applied through their contract) in :mod:`.techniques`, the plan
file's schema in :mod:`.schema`. The planner knows no technique by name: each registered technique gives its seam,
whether its gradients are exact, its config, ``apply`` and its cost model (how a measured option is charged).

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

Few-bit and BLPA change gradients slightly: by default (``approximate="if-needed"``) the plan uses them only where
no exact plan fits the budget, ``approximate="allowed"`` takes the fastest plan whatever the gradients, and
``allow=("checkpoint", "offload")`` keeps gradients exact at any budget; the report lists the blocks where the plan
uses them. Reversible layers change the architecture, so they
are never inserted; the report estimates what a reversible chain would save.
"""

from .plan import APPROXIMATE_CHOICES, FORMAT, OBJECTIVES, MemoryPlan, format_bytes, load_plan, plan_memory
from .techniques import TECHNIQUES

__all__ = [
    "plan_memory",
    "load_plan",
    "MemoryPlan",
    "TECHNIQUES",
    "OBJECTIVES",
    "APPROXIMATE_CHOICES",
    "FORMAT",
    "format_bytes",
]
