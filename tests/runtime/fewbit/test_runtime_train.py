"""Training with converted models: a transformer block (GELU) and a small CNN (SiLU), 3-bit tables.

Each model learns a fixed random teacher of the same architecture (regression, Adam, fixed seeds, CPU, one
thread). The native and the converted student start from the same weights and see the same batches, so the loss
curves differ only by the gradient approximation. The comparison: the mean loss over the last 30 steps of the
converted model is within 10% of the native one. For scale (measured when this test was written): changing only
the student's initial weights moves the native final loss by 0.054-0.108 (block) and 0.124-0.136 (CNN), while the
converted models land within 1.5% of native (0.0872 vs 0.0875, 0.133 vs 0.134). A deliberately broken table lands
far outside and the same comparison rejects it (tested too, so the check can fail): levels rolled by 3 codes give
3.3x (block) and 4.7x (CNN) the native loss, negated levels 9-10x.
"""

import numpy as np
import pytest
import torch

from fewbit_design import runtime
from fewbit_design.table import Table

STEPS = 150
TAIL = 30
TOLERANCE = 0.10


class Block(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim)
        self.attention = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.head = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(dim, 1))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.SiLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1),
        torch.nn.SiLU(),
        torch.nn.AdaptiveAvgPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64, 4),
    )


MODELS = {"block": (Block, (16, 8, 16)), "cnn": (cnn, (32, 1, 8, 8))}


def train(kind, tables):
    """Loss per step of a student trained on the teacher; ``tables`` None = native, else {module class: table}."""
    make, shape = MODELS[kind]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(1000)
        teacher = make()
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            scale = teacher(torch.randn(shape, generator=generator)).std()
        torch.manual_seed(0)
        student = make()
        if tables is not None:
            runtime.convert(student, filter=tables)
        optimizer = torch.optim.Adam(student.parameters(), lr=3e-3)
        losses = []
        for _ in range(STEPS):
            x = torch.randn(shape, generator=generator)
            with torch.no_grad():
                target = teacher(x) / scale
            loss = torch.nn.functional.mse_loss(student(x), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return np.array(losses)


def within_noise(native, converted):
    """The converted model's final loss is within TOLERANCE of the native one (mean of the last TAIL steps)."""
    reference, candidate = native[-TAIL:].mean(), converted[-TAIL:].mean()
    return abs(candidate - reference) <= TOLERANCE * reference


def broken(table, how):
    data = table.to_dict()
    levels = np.array(data["levels"])
    data["levels"] = list(np.roll(levels, 3) if how == "shuffled" else -levels)
    return Table.from_dict(data)


@pytest.fixture(scope="module")
def tables(make_table):
    return {torch.nn.GELU: make_table("gelu", 3), torch.nn.SiLU: make_table("silu", 3)}


@pytest.fixture(scope="module")
def native_losses():
    return {kind: train(kind, None) for kind in MODELS}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_converted_model_trains_like_the_native_one(kind, tables, native_losses):
    native = native_losses[kind]
    converted = train(kind, tables)
    assert converted[0] == pytest.approx(native[0], rel=1e-6)  # same start: the forward is exact
    assert native[-TAIL:].mean() < 0.5 * native[:TAIL].mean()  # the task is learned at all
    assert within_noise(native, converted), (native[-TAIL:].mean(), converted[-TAIL:].mean())


@pytest.mark.parametrize("how", ["shuffled", "negated"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_broken_gradient_fails_the_comparison(kind, how, tables, native_losses):
    wrong = {cls: broken(table, how) for cls, table in tables.items()}
    assert not within_noise(native_losses[kind], train(kind, wrong))
