"""BLPA and offload under FSDP2 (``fully_shard``) in one process (gloo, world size 1): the fast twin of the
``torchrun`` test (tests/runtime/test_distributed.py), which runs every technique on two processes.

FSDP2 frees each module's unsharded parameters after its forward and backward by resizing their storages to 0, and
between steps the model's parameters are ``DTensor`` shards. Regressions held here:

* BLPA's CPU kernels read gamma and beta through ``Tensor.numpy()``; a view of the parameter's storage (float64:
  ``.to(float64)`` is no copy) made the storage not resizable, and FSDP2's free raised ``Trying to resize storage
  that is not resizable``.
* offload's module hooks read every parameter's storage address to leave parameters in place; a ``DTensor``'s
  wrapper storage is invalid, and reading it raised ``Attempted to access the data pointer on an invalid python
  storage``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torch.distributed.fsdp")


@pytest.fixture
def one_process_group():
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of this process's own")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    found = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad.full_tensor() if hasattr(parameter.grad, "full_tensor") else parameter.grad
        found[name] = grad.detach().clone()
    return found


def _one_step_each(build, x: torch.Tensor, steps: int = 2) -> None:
    """``steps`` steps of ``build()`` sharded and unsharded from the same weights: equal gradients every step."""
    plain, sharded = build(), _shard(build())
    for _ in range(steps):
        for model in (plain, sharded):
            model.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
        want, got = _gradients(plain), _gradients(sharded)
        assert want.keys() == got.keys()
        for name, expected in want.items():
            assert expected.abs().max() > 0, name
            torch.testing.assert_close(got[name], expected, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_blpa_trains_under_fully_shard(one_process_group, dtype):
    from fewbit_design import runtime

    def build() -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16)]
        layers += [nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)]
        return runtime.blpa.convert(nn.Sequential(*layers).to(dtype), bits=4)

    x = torch.randn(8, 6, dtype=dtype, generator=torch.Generator().manual_seed(1))
    _one_step_each(build, x)


def test_blpa_kernels_leave_parameters_resizable():
    """The storage of every parameter can still be freed (resized) after a forward and backward on the CPU kernels,
    which FSDP2 does after each module's forward and backward."""
    from fewbit_design import runtime

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).double()
    model = runtime.blpa.convert(model, bits=4)
    model(torch.randn(8, 6, dtype=torch.float64)).pow(2).mean().backward()
    for name, parameter in model.named_parameters():
        storage = parameter.untyped_storage()
        storage.resize_(storage.nbytes())  # raises "Trying to resize storage that is not resizable" if viewed
        assert parameter.grad is not None, name


def test_offload_trains_under_fully_shard(one_process_group, tmp_path):
    from fewbit_design.runtime import offload

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3)).double()
        offload.apply(model, min_bytes=0, target="disk", directory=tmp_path)
        return model

    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _one_step_each(build, x)
