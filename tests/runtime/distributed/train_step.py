"""One training step of converted models under DistributedDataParallel and FSDP2, checked against one process.

Run by ``tests/runtime/test_distributed.py`` as
``torchrun --nproc-per-node 2 tests/runtime/distributed/train_step.py OUT.json`` (CPU, gloo). Every rank builds the
same model (same seed), converts it with one technique, wraps it
(``ddp``: ``DistributedDataParallel``; ``fsdp2``: ``fully_shard`` on every child with parameters, then the root),
runs forward and backward on its half of a batch of 8 and gathers the full gradients. Every rank also runs the
same converted model unwrapped in one process and compares; rank 0 writes one JSON record per case.

The reference is the single-process model on the concatenated batch, with the loss a mean over the batch: DDP
and FSDP2 average the two ranks' gradients of their local means, which is the gradient of the global mean. The
BLPA model holds batch norms, whose statistics are per replica under DDP and FSDP (torch's documented behaviour;
SyncBatchNorm is a different module that BLPA does not fuse): its reference is the mean of the single-process
gradients of the two halves, run one after the other.

Everything runs in float64, so the only differences are the order of floating-point sums (the all-reduce adds
two partial sums; one process sums all 8 rows at once): at most a few ulp of the gradients' magnitude. The check
is ``|g - g_ref| <= 1e-10 * max|g_ref| + 1e-12`` per tensor; quantization (few-bit codes, BLPA codes) is a
per-element decision on identical inputs, so it is identical on both sides.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

BATCH = 8
FEATURES = 12
_PLAN: list[dict] = []  # the plan case's plan, made once
CASES = ("plain", "fewbit", "blpa", "checkpoint", "offload", "plan")
WRAPPERS = ("ddp", "fsdp2")


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` around one block (non-reentrant), the fallback when the checkpoint package has no
    ``apply`` yet."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def mlp() -> nn.Sequential:
    """Blocks of Linear + activation (GELU, SiLU: few-bit converts them), a chain the checkpoint can cut."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU())]
    blocks += [nn.Sequential(nn.Linear(32, 32), nn.SiLU()) for _ in range(3)]
    blocks.append(nn.Sequential(nn.Linear(32, 4)))
    return nn.Sequential(*blocks).double()


def bn_mlp() -> nn.Sequential:
    """Linear, then BatchNorm1d -> ReLU -> Linear units that BLPA fuses."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(FEATURES, 32)]
    for _ in range(2):
        layers += [nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32)]
    layers += [nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)]
    return nn.Sequential(*layers).double()


def build(case: str, x: torch.Tensor) -> tuple[nn.Module, str]:
    """The model of ``case``, converted; and what converted it."""
    from fewbit_design import runtime

    if case == "plain":
        return mlp(), "none"
    if case == "fewbit":
        return runtime.convert(mlp(), bits=3), "runtime.convert(bits=3)"
    if case == "blpa":
        return runtime.blpa.convert(bn_mlp(), bits=4), "runtime.blpa.convert(bits=4)"
    if case == "checkpoint":
        model = mlp()
        for index in range(len(model) - 1):
            model[index] = Checkpointed(model[index])
        return model, "torch.utils.checkpoint per block"
    if case == "offload":
        model = mlp()
        from fewbit_design.runtime import offload

        offload.apply(model, min_bytes=0, target="disk")
        return model, "runtime.offload.apply(min_bytes=0, target='disk')"
    if case == "plan":
        # planned on rank 0 (timings differ between processes) and sent to every rank, like a saved plan.json
        from fewbit_design.runtime.planner import MemoryPlan

        if not _PLAN:
            message = [None]
            if dist.get_rank() == 0:  # planned for a larger batch, where activations dominate the peak
                example = torch.randn(1024, FEATURES, dtype=torch.float64)
                allow = ("fewbit", "checkpoint")
                message = [runtime.plan_memory(mlp(), example, budget="min", allow=allow, repeats=1).to_dict()]
            dist.broadcast_object_list(message, src=0)
            _PLAN.append(message[0])
        plan = MemoryPlan.from_dict(_PLAN[0])
        return plan.apply(mlp()), "plan_memory: " + ", ".join(sorted(plan.techniques_used()))
    raise ValueError(case)


def wrap(model: nn.Module, wrapper: str) -> nn.Module:
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        if grad is None:
            continue
        if hasattr(grad, "full_tensor"):  # FSDP2: a sharded DTensor
            grad = grad.full_tensor()
        grads[name.replace("module.", "", 1) if name.startswith("module.") else name] = grad.detach().clone()
    return grads


def reference(case: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model, _ = build(case, x[: BATCH // 2])
    if case == "blpa":  # per-replica batch statistics: the mean of the halves' gradients
        for half in x.chunk(dist.get_world_size()):
            (model(half).pow(2).mean() / dist.get_world_size()).backward()
    else:
        model(x).pow(2).mean().backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def run_case(case: str, wrapper: str, x: torch.Tensor) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    local = x.chunk(world)[rank]
    model, how = build(case, x[: BATCH // 2])
    model = wrap(model, wrapper)
    model(local).pow(2).mean().backward()
    got = full_gradients(model)
    want = reference(case, x)
    errors = {}
    for name, expected in want.items():
        if name not in got:
            return {"status": "error", "message": f"no gradient for {name} under {wrapper}", "how": how}
        scale = float(expected.abs().max())
        errors[name] = {"max_abs": float((got[name] - expected).abs().max()), "scale": scale}
    exact = reference("plain", x) if case == "fewbit" else None
    differs = None
    if exact is not None and case == "fewbit":
        differs = any(not torch.equal(want[name], exact[name]) for name in want if name in exact)
    return {"status": "ok", "how": how, "errors": errors, "names": sorted(got), "differs_from_exact": differs}


def main() -> None:
    out = sys.argv[1]
    cases = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a desynchronised case fails fast
    rank = dist.get_rank()
    torch.manual_seed(1234)
    x = torch.randn(BATCH, FEATURES, dtype=torch.float64)
    results = {"world_size": dist.get_world_size(), "torch": torch.__version__, "cases": {}}
    for case in cases:
        for wrapper in WRAPPERS:
            try:
                record = run_case(case, wrapper, x)
            except Exception as error:  # recorded, so the test can name the exact failure
                record = {"status": "error", "message": f"{type(error).__name__}: {error}".splitlines()[0]}
                record["traceback"] = traceback.format_exc()[-2000:]
            results["cases"][f"{case}-{wrapper}"] = record
            dist.barrier()
    if rank == 0:
        tmp = f"{out}.tmp{os.getpid()}"
        with open(tmp, "w") as handle:
            json.dump(results, handle, indent=1)
        os.replace(tmp, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
