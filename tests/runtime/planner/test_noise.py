"""Timing noise does not flip the plan: with a fake clock (time = operators run, each timed run slowed by a random
factor, as on a loaded machine) the plans of several noise draws are the same."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fewbit_design import runtime
from fewbit_design.runtime.planner import profile
from fewbit_design.runtime.planner.model import BlockCosts, ChainCosts, OptionCost, optimise, settle_ties


class NoisyClock(TorchDispatchMode):
    """A clock whose time is the number of operators run (1 us each), each interval between two readings
    stretched by a random factor in [1, 1 + noise): load only slows a run down. No wall time is read."""

    def __init__(self, seed: int, noise: float) -> None:
        super().__init__()
        self.rng, self.noise = random.Random(seed), noise
        self.operators = self.read = 0
        self.now = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operators += 1
        return func(*args, **(kwargs or {}))

    def __call__(self) -> float:
        ran, self.read = self.operators - self.read, self.operators
        self.now += ran * 1e-6 * (1 + self.noise * self.rng.random())
        return self.now


def _mlp(seed: int = 0, width: int = 32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(3)]
    )


def _plans(monkeypatch, seed: int, x: torch.Tensor) -> list[tuple[str, ...]]:
    # repeats=5: since blocks are profiled on a clone of their input (offload then moves it out), 'offload' and
    # 'linear+offload' differ by 15% in operators, inside this clock's 20% noise; three runs per option left the
    # spreads too rough to judge that pair the same way in every draw (12 draws checked with five)
    clock = NoisyClock(seed, noise=0.2)
    monkeypatch.setattr(profile, "clock", clock)
    with clock:
        base = runtime.plan_memory(_mlp(), x, budget=None, approximate="allowed", offload_min_bytes=1 << 12, repeats=5)
    return [base.replan(budget).choices for budget in (None, 0.9, "min")]


def test_noisy_timings_choose_the_same_plan(monkeypatch):
    """Regression: the planner took the least of a few timed runs and compared options by it, so options of
    (nearly) equal cost swapped places from one profile to the next (the issue's plans changed with load). Then
    (issue 26) the per-option tie rule charged an option slower than plain within the noise its own noisy time, so
    combinations of such options across blocks swapped with the draw (4 distinct plan triples in 12 draws); a tie
    now costs exactly the ranked-first option's time, and options are timed against plain round by round. Checked
    over seeds 0-11 (one plan triple); four here to keep the suite fast."""
    x = torch.randn(64, 32)
    plans = [_plans(monkeypatch, seed, x) for seed in range(4)]
    assert all(p == plans[0] for p in plans), plans


def _block(*options: OptionCost) -> BlockCosts:
    return BlockCosts("b", 100, 100, 0, options)


def _option(name: str, seconds: float, spread: float, kept: int = 100) -> OptionCost:
    return OptionCost(name, 200, kept, 300, saves_input=False, saves_output=False, seconds=seconds, spread=spread)


@pytest.mark.parametrize("fewbit_seconds", [0.99, 0.97, 1.0, 1.02])
def test_a_tie_goes_to_fewer_techniques(fewbit_seconds):
    """Few-bit within the noise of plain (1.5% faster, as in the issue): charged as plain, and the plan at a budget
    that both fit is plain, whichever of the two measured faster."""
    chain = ChainCosts((_block(_option("plain", 1.0, 0.02), _option("fewbit", fewbit_seconds, 0.02, kept=50)),))
    settled = settle_ties(chain)
    assert settled.blocks[0].option("fewbit").seconds >= 1.0
    assert optimise(settled, 10**6) == ["plain"]


def test_a_measurably_faster_option_keeps_its_time():
    chain = ChainCosts((_block(_option("plain", 1.0, 0.01), _option("fewbit", 0.8, 0.01, kept=50)),))
    settled = settle_ties(chain)
    assert settled.blocks[0].option("fewbit").seconds == 0.8
    assert optimise(settled, 10**6) == ["fewbit"]


def test_options_without_a_measured_spread_never_tie():
    """Plans saved before spreads existed (and costs built by hand) keep the fastest plan by their times."""
    chain = ChainCosts((_block(_option("plain", 1.0, 0.0), _option("fewbit", 0.999, 0.0, kept=50)),))
    assert optimise(settle_ties(chain), 10**6) == ["fewbit"]
