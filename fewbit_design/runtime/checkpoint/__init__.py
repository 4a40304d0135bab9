"""Checkpoint planning: profile a chain of blocks, plan which segments to recompute, apply the plan.

>>> import torch
>>> from fewbit_design.runtime import checkpoint
>>> blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
...                                                    torch.nn.Linear(128, 32)) for _ in range(4)])
>>> x = torch.randn(64, 32)
>>> profile = checkpoint.profile(blocks, x)
>>> plan = checkpoint.plan(profile, strategy="sqrt")
>>> model = checkpoint.apply(blocks, plan)          # or checkpoint.wrap(blocks, x, budget="1MiB")
>>> model(x).sum().backward()
>>> plan.save("plan.json"); model = checkpoint.apply(blocks, checkpoint.load_plan("plan.json"))  # doctest: +SKIP

This package owns the chain's cost model and the checkpoint schedules: ``profile.py`` (measure blocks),
``cost.py`` (the peak/time model of a schedule, pure Python), ``plan.py`` (strategies: none, sqrt, greedy,
recursive, optimal DP; budgets; the plan file), ``apply.py`` (run a plan with ``torch.utils.checkpoint``; ``wrap``:
profile, plan and apply in one call), ``fingerprint.py`` (what a plan was made for, checked when it is applied). It
imports torch, numpy, the project's errors and :mod:`fewbit_design.runtime.memory`, nothing else of the runtime.
For the memory planner: :class:`Profile` / :class:`BlockProfile` hold per-block saved bytes, output bytes and time,
and :func:`predict` gives the peak bytes and extra time of any set of segments.
"""

from .apply import CheckpointedSequential, apply, remove, wrap
from .cost import Prediction, Segment, predict
from .plan import STRATEGIES, Plan, load_plan, minimum_budget, parse_budget, plan
from .profile import BlockProfile, Profile, profile

__all__ = [
    "BlockProfile",
    "CheckpointedSequential",
    "Plan",
    "Prediction",
    "Profile",
    "STRATEGIES",
    "Segment",
    "apply",
    "load_plan",
    "minimum_budget",
    "parse_budget",
    "plan",
    "predict",
    "profile",
    "remove",
    "wrap",
]
