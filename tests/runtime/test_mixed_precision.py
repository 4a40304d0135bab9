"""Mixed precision end to end: a converted model under torch.autocast with GradScaler.

* float16 + GradScaler("cpu"), forced to overflow (a huge loss scale; an input that overflows float16): the
  converted model skips exactly the steps the unconverted one skips (the scaler's found-inf and its scale sequence
  are the same; parameters are unchanged on a skipped step).
* bfloat16: the loss curve of the converted model follows the unconverted one within noise. Both runs are
  deterministic, so "noise" is measured as what bfloat16 rounding itself does to the curve: the largest relative
  difference between the unconverted model's bfloat16 and float32 curves. Tolerance: every loss of the converted
  bfloat16 run within 3x that noise (at least 0.1%) of the unconverted bfloat16 run's. Measured (60 full-batch SGD
  steps, 4-bit tables): deviation 0.034%, noise 0.043%.
"""

import copy

import pytest
import torch

from fewbit_design.runtime import convert


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.SiLU(), torch.nn.Linear(64, 1)
    )


def data(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 1, generator=generator)
    batches = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=generator)
        batches.append((x, torch.sin(x @ teacher)))
    return batches


def pair(bits=4):
    model = make_model()
    converted = convert(copy.deepcopy(model), bits=bits, only_if_smaller=False)
    assert type(converted[1]).__module__.startswith("fewbit_design"), converted
    return model, converted


def train_fp16(model, batches, init_scale):
    """Steps with autocast float16 + GradScaler; per step: (found_inf, scale after update, params changed)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    history = []
    for x, y in batches:
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        found_inf = sum(v.item() for v in scaler._found_inf_per_device(optimizer).values()) > 0
        scaler.step(optimizer)
        scaler.update()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        history.append((found_inf, scaler.get_scale(), changed))
    return history


def test_float16_huge_loss_scale_skips_the_same_steps():
    model, converted = pair()
    batches = data(4)
    # 2**40: the scaled float16 gradients overflow; the scaler halves the scale after each skipped step
    plain, fewbit = train_fp16(model, batches, 2.0**40), train_fp16(converted, batches, 2.0**40)
    assert [step[0] for step in plain] == [True] * 4
    assert plain == fewbit


@pytest.mark.parametrize("bad_step", [0, 2])
def test_float16_overflowing_input_skips_the_same_steps(bad_step):
    model, converted = pair()
    batches = data(4)
    x, y = batches[bad_step]
    x = x.clone()
    x[3, 5] = 1e6  # float16 overflow inside the first Linear: inf reaches the activations
    batches[bad_step] = (x, y)
    plain, fewbit = train_fp16(model, batches, 2.0**8), train_fp16(converted, batches, 2.0**8)
    assert [step[0] for step in plain] == [step == bad_step for step in range(4)]
    assert [step[:2] for step in plain] == [step[:2] for step in fewbit]
    assert [step[2] for step in fewbit] == [step != bad_step for step in range(4)]


def train(model, batches, dtype):
    """Full-batch SGD; autocast to ``dtype`` (None: plain float32). The losses, one per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def test_bfloat16_loss_curve_follows_the_unconverted_one():
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 1, generator=generator)
    x = torch.randn(256, 16, generator=generator)
    batches = [(x, torch.sin(x @ teacher))] * 60
    model, converted = pair()
    plain = train(copy.deepcopy(model), batches, torch.bfloat16)
    fewbit = train(converted, batches, torch.bfloat16)
    exact = train(model, batches, None)
    assert plain[-1] < 0.85 * plain[0]  # it learns
    # noise: what bfloat16 rounding alone does to the curve (bfloat16 against float32, both unconverted)
    noise = ((plain - exact).abs() / exact).max().item()
    deviation = ((fewbit - plain).abs() / plain).max().item()
    assert deviation <= max(3 * noise, 1e-3), (deviation, noise)
