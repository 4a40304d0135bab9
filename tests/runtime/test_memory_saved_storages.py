"""``memory.saved_bytes`` tells saved storages apart by identity, not by address, and leaves no hook behind.

A storage saved inside the block and freed there (its graph dropped, or run backward) gives its address back to the
allocator; the next storage put there is another storage and counts again. Expected counts are by hand from what
each op saves: Linear saves its input (the weight is a parameter, excluded), GELU its input, sigmoid its output, a
product with a leaf that requires grad the other factor.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.modules import module as module_hooks

from fewbit_design.runtime import memory

ROWS, WIDTH = 256, 64
ACTIVATION = ROWS * WIDTH * 4  # bytes of one float32 (256, 64) activation: 65536

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _mlp(device: str = "cpu") -> torch.nn.Sequential:
    torch.manual_seed(0)
    first, second = (torch.nn.Linear(WIDTH, WIDTH, device=device) for _ in range(2))
    return torch.nn.Sequential(first, torch.nn.GELU(), second)


def _per_forward(forwards: int) -> dict[str, int]:
    """What ``forwards`` forwards of :func:`_mlp` on one input save, per module: Linear 0 saves the input (one
    storage, alive throughout), GELU its input and Linear 2 the GELU output (new storages at each forward)."""
    return {"0": ACTIVATION, "1": forwards * ACTIVATION, "2": forwards * ACTIVATION}


@pytest.mark.parametrize("device", DEVICES)
def test_forwards_whose_outputs_are_dropped_each_count(device):
    """Regression: storages were keyed by address; a forward's saved storages, freed when its output was dropped,
    gave their addresses to the next forward's, which were not counted again (two forwards: kept 327680, dropped
    196608 or 262144)."""
    model, x = _mlp(device), torch.randn(ROWS, WIDTH, device=device)
    with memory.saved_bytes(model) as kept:
        outputs = [model(x) for _ in range(4)]
    with memory.saved_bytes(model) as dropped:
        for _ in range(4):
            model(x)
    expected = _per_forward(4)
    assert len(outputs) == 4
    assert kept.total == dropped.total == sum(expected.values()), (kept.total, dropped.total)
    assert kept.by_module == dropped.by_module == expected
    assert dropped.tensors == 1 + 2 * 4


def test_accumulated_steps_count_every_step():
    """Four forward-backward steps in one block save four times what one step saves beyond the shared input."""
    model, x = _mlp(), torch.randn(ROWS, WIDTH)
    with memory.saved_bytes(model) as steps:
        for _ in range(4):
            model(x).sum().backward()
    assert steps.total == sum(_per_forward(4).values()) and steps.by_module == _per_forward(4)


def test_nested_blocks_count_storages_freed_between_inner_blocks():
    model, x = _mlp(), torch.randn(ROWS, WIDTH)
    with memory.saved_bytes(model) as outer:
        with memory.saved_bytes(model) as first:
            model(x).sum().backward()
        with memory.saved_bytes(model) as second:
            model(x).sum().backward()
    assert first.total == second.total == sum(_per_forward(1).values())
    assert outer.total == sum(_per_forward(2).values()) and outer.by_module == _per_forward(2)
    assert outer.exclusive_by_module == _per_forward(2)  # every storage saved by one module only


def test_a_storage_saved_twice_counts_once_while_others_are_freed_and_reused():
    """Each step saves ``y`` three times (sigmoid its output, two products a view of it): one storage per step."""
    x = torch.randn(ROWS, WIDTH)
    scale, left, right = (torch.randn(n, requires_grad=True) for n in (WIDTH, WIDTH // 2, ROWS * WIDTH))
    with memory.saved_bytes() as saved:
        for _ in range(4):
            y = torch.sigmoid(x * scale)  # the product saves x (scale is a leaf), sigmoid saves y
            ((y[:, : WIDTH // 2] * left).sum() + (y.view(-1) * right).sum()).backward()
            assert saved.contains(y) and saved.contains(y[1:])
    assert saved.total == (1 + 4) * ACTIVATION and saved.tensors == 1 + 4


def test_contains_does_not_report_a_new_storage_at_a_freed_address():
    x = torch.randn(ROWS, WIDTH)
    scale = torch.randn(WIDTH, requires_grad=True)
    with memory.saved_bytes() as saved:
        torch.sigmoid(x * scale).sum().backward()  # its saved output is freed here
    later = [torch.empty(ROWS, WIDTH) for _ in range(8)]  # same size: the allocator may hand the address back
    assert not any(saved.contains(tensor) for tensor in later)
    assert saved.contains(x) and not saved.contains(scale)


def test_fake_tensors_are_counted_like_real_ones():
    """Fake tensors all have address 0: keyed by address, every fake storage was the fake parameters' (0 bytes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model, x = _mlp(), torch.randn(ROWS, WIDTH)
        with memory.saved_bytes(model) as saved:
            model(x)
    assert saved.total == sum(_per_forward(1).values()) and saved.by_module == _per_forward(1)


def _global_hooks() -> list[dict]:
    return [
        dict(module_hooks._global_forward_pre_hooks),
        dict(module_hooks._global_forward_hooks),
        dict(module_hooks._global_backward_pre_hooks),
        dict(module_hooks._global_backward_hooks),
    ]


def test_no_global_module_hook_is_left_behind():
    """Regression: a first ``saved_bytes(model)`` registered a global forward pre-hook and hook for the rest of the
    process (a cost on every module call, and torch's warning at every later ``torch.compile(module)``)."""
    before = _global_hooks()
    model, x = _mlp(), torch.randn(ROWS, WIDTH)
    with memory.saved_bytes(model) as saved:
        model(x)
    assert saved.by_module == _per_forward(1)
    assert _global_hooks() == before
    ours = [hook for hooks in _global_hooks() for hook in hooks.values() if hook.__module__ == memory.__name__]
    assert not ours
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(2, 4))
    assert not [w for w in caught if "global hooks" in str(w.message)]
