"""One training step of converted models under DistributedDataParallel and FSDP2, checked against one process.

Run by ``tests/runtime/test_distributed.py`` as
``torchrun --nproc-per-node 2 tests/runtime/distributed/train_step.py OUT.json [CASES]`` (CPU, gloo). Every rank
builds the same model (same seed), converts it with one technique, wraps it (``ddp``: ``DistributedDataParallel``;
``fsdp2``: ``fully_shard`` on every block of the planner's chain that has parameters, then the root), runs forward
and backward on its half of a batch of 8 and gathers the full gradients. Every rank also runs the same converted
model unwrapped in one process and compares; rank 0 writes one JSON record per case.

Cases: ``plain``, ``fewbit``, ``blpa``, ``checkpoint``, ``offload`` convert an MLP (BLPA: an MLP of batch norms)
directly; ``plan`` is a ``plan_memory`` plan (few-bit and checkpoint) of the MLP; ``plan-<technique>`` is a
``plan_memory`` plan that may use that technique alone (``budget="min"``, ``approximate="allowed"``), made on the
first of the test models where the planner can choose it (a tiny Hugging Face LLaMA, whose decoder layers hold
the norms, gated MLPs and linear layers; a chain of BatchNorm -> ReLU -> Linear blocks; the MLPs; an MLP with
dropout), for every registered technique the planner can choose there; ``head`` converts the LLaMA with
``runtime.head.convert``, since the planner cannot choose the head (it is not inside any block of the chain), and
``attention`` converts its attention cores with ``runtime.attention.convert`` (``convert(compress=K)`` applies it;
not a plan option).
Rank 0 plans, and the plan is sent to every rank like a saved plan.json (timings differ between processes). The
record ``choosable`` lists, per registered technique, the first test model where the planner can choose it (None:
on none of them).

The reference is the single-process model on the concatenated batch, with the loss a mean over the batch: DDP
and FSDP2 average the two ranks' gradients of their local means, which is the gradient of the global mean. The
BLPA models hold batch norms, whose statistics are per replica under DDP and FSDP (torch's documented behaviour;
SyncBatchNorm is a different module that BLPA does not fuse): their reference is the mean of the single-process
gradients of the two halves, run one after the other. The dropout MLP draws its masks on each rank from the same
random state (every rank seeds alike) for its half of the batch: its reference runs each half from that state.

Everything runs in float64, so for the exact techniques the only differences are the order of floating-point sums
(the all-reduce adds two partial sums; one process sums all 8 rows at once): at most a few ulp of the gradients'
magnitude. The test checks ``|g - g_ref| <= 1e-10 * max|g_ref| + 1e-12`` per tensor; few-bit and BLPA codes are
per-element decisions on identical inputs, so they are identical on both sides too. Compressed linear inputs round
stochastically (random draws differ between the processes and the reference), so their weight gradients are close,
not equal: the record has ``approximate`` set and the test uses the tolerance it states for them. Each approximate
case also records whether its gradients differ from the unconverted model's (``differs_from_exact``), so the
check cannot pass on a technique that did nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

BATCH = 8
FEATURES = 12
SEQUENCE, VOCABULARY = 16, 64
_PLANS: dict[str, dict] = {}  # each plan case's plan, made once
#: the cases whose gradients are approximate (plans: set by build)
_APPROXIMATE = {"fewbit": True, "blpa": True, "attention": True}
CASES = ("plain", "fewbit", "blpa", "checkpoint", "offload", "plan", "head", "attention")
WRAPPERS = ("ddp", "fsdp2")
#: the planner's options for the plan-<technique> cases (offload: every saved tensor, to the disk target)
PLAN_OPTIONS = dict(budget="min", approximate="allowed", repeats=1, offload_min_bytes=0, offload_target="disk")


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


def bn_blocks() -> nn.Sequential:
    """:func:`bn_mlp` as a chain of blocks, each holding one BatchNorm1d -> ReLU -> Linear unit (so the planner can
    choose BLPA per block)."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(FEATURES, 32)]
    blocks += [nn.Sequential(nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32)) for _ in range(2)]
    blocks.append(nn.Sequential(nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)))
    return nn.Sequential(*blocks).double()


def llama() -> nn.Module:
    """A tiny Hugging Face LLaMA (RMSNorm, gated MLP, linear layers, LM head) in training mode, caches off."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQUENCE,
        use_cache=False,
    )
    return LlamaForCausalLM(config).double().train()


def dropout_mlp() -> nn.Sequential:
    """:func:`mlp` with dropout (p = 0.1) after each activation."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Dropout(0.1))]
    blocks += [nn.Sequential(nn.Linear(32, 32), nn.SiLU(), nn.Dropout(0.1)) for _ in range(3)]
    blocks.append(nn.Sequential(nn.Linear(32, 4)))
    return nn.Sequential(*blocks).double()


#: the test models: how to build one, and its example batch from (features, token ids)
MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": llama, "bn_blocks": bn_blocks, "mlp": mlp, "bn_mlp": bn_mlp, "dropout_mlp": dropout_mlp,
}  # fmt: skip
#: the models with batch norms, whose statistics are per replica
PER_REPLICA = ("bn_mlp", "bn_blocks")
#: the models with dropout, whose masks each rank draws from the same random state
RANDOM = ("dropout_mlp",)


def batch_of(kind: str, batches: dict[str, torch.Tensor]) -> torch.Tensor:
    return batches["ids"] if kind == "llama" else batches["features"]


def loss_of(kind: str, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The step's loss, a mean over the batch (LLaMA: its causal-LM loss, a mean over the tokens)."""
    if kind == "llama":
        return model(input_ids=batch, labels=batch).loss
    return model(batch).pow(2).mean()


def planner_settings() -> dict:
    from fewbit_design.runtime import registry

    offload = {"min_bytes": 0, "target": "disk", "prefetch": 0, "max_host_bytes": None, "directory": None}
    return {"bits": 3, "blpa_bits": 4, "offload": offload, **registry.setting_defaults()}


def choosable() -> dict[str, str | None]:
    """Per registered technique, the first test model where the planner can choose it (one of the options it
    would measure on some block of the chain), or None."""
    from fewbit_design.runtime import registry
    from fewbit_design.runtime.planner.profile import find_chain
    from fewbit_design.runtime.planner.techniques import candidate_options, parse_option

    settings, found = planner_settings(), {}
    for kind, build in MODELS.items():
        model = build()
        chain = model.get_submodule(find_chain(model))
        for block in chain:
            for option in candidate_options(block, registry.names(), settings):
                for name in parse_option(option):
                    found.setdefault(name, kind)
    return {name: found.get(name) for name in registry.names()}


def _planned(case: str, make: Callable[[], dict]) -> dict:
    """``make()`` on rank 0, sent to every rank (once per case)."""
    if case not in _PLANS:
        message = [make() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(message, src=0)
        _PLANS[case] = message[0]
    return _PLANS[case]


def build(case: str, batches: dict[str, torch.Tensor]) -> tuple[nn.Module, str, str]:
    """The model of ``case``, converted; what converted it; and its kind (a key of :data:`MODELS`)."""
    from fewbit_design import runtime
    from fewbit_design.runtime.planner import MemoryPlan

    if case == "plain":
        return mlp(), "none", "mlp"
    if case == "fewbit":
        return runtime.convert(mlp(), bits=3), "runtime.convert(bits=3)", "mlp"
    if case == "blpa":
        return runtime.blpa.convert(bn_mlp(), bits=4), "runtime.blpa.convert(bits=4)", "bn_mlp"
    if case == "checkpoint":
        model = mlp()
        for index in range(len(model) - 1):
            model[index] = Checkpointed(model[index])
        return model, "torch.utils.checkpoint per block", "mlp"
    if case == "offload":
        model = mlp()
        from fewbit_design.runtime import offload

        offload.apply(model, min_bytes=0, target="disk")
        return model, "runtime.offload.apply(min_bytes=0, target='disk')", "mlp"
    if case == "head":
        return runtime.head.convert(llama()), "runtime.head.convert", "llama"
    if case == "attention":  # q, k, v kept as 8-bit codes, rounded to nearest: the same codes on every rank
        return runtime.attention.convert(llama(), bits=8), "runtime.attention.convert(bits=8)", "llama"
    if case == "plan":

        def make() -> dict:  # planned for a larger batch, where activations dominate the peak
            example = torch.randn(1024, FEATURES, dtype=torch.float64)
            allow = ("fewbit", "checkpoint")
            return runtime.plan_memory(mlp(), example, budget="min", allow=allow, repeats=1).to_dict()

        plan = MemoryPlan.from_dict(_planned(case, make))
        _APPROXIMATE[case] = bool(plan.approximate_blocks())
        return plan.apply(mlp()), "plan_memory: " + ", ".join(sorted(plan.techniques_used())), "mlp"
    if case.startswith("plan-"):
        technique = case.removeprefix("plan-")
        kind = choosable()[technique]
        if kind is None:
            raise ValueError(f"the planner cannot choose {technique!r} on any test model")
        example = batch_of(kind, batches)[: BATCH // 2]
        if kind != "llama":  # planned for a larger batch, where activations dominate the peak (as ``plan``): at
            # 4 rows the parameters do, every option has the same peak and "min" picks by (noisy) time
            example = torch.randn(1024, FEATURES, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        extra = {"example_kwargs": {"labels": example}} if kind == "llama" else {}

        def make() -> dict:
            plan = runtime.plan_memory(MODELS[kind](), example, allow=(technique,), **PLAN_OPTIONS, **extra)
            return plan.to_dict()

        plan = MemoryPlan.from_dict(_planned(case, make))
        _APPROXIMATE[case] = bool(plan.approximate_blocks())
        return plan.apply(MODELS[kind]()), f"plan_memory(allow=({technique!r},)): {', '.join(plan.choices)}", kind
    raise ValueError(case)


def wrap(model: nn.Module, wrapper: str) -> nn.Module:
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fewbit_design.runtime.planner.profile import find_chain

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.get_submodule(find_chain(model)).children():
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
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


def reference(case: str, batches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model, _, kind = build(case, batches)
    batch = batch_of(kind, batches)
    if kind in PER_REPLICA or kind in RANDOM:  # per-replica statistics or masks: the mean of the halves' gradients
        state = torch.get_rng_state()
        for half in batch.chunk(dist.get_world_size()):
            torch.set_rng_state(state)  # each rank's masks, drawn from the state every rank has after build
            (loss_of(kind, model, half) / dist.get_world_size()).backward()
    else:
        loss_of(kind, model, batch).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def exact_reference(kind: str, batches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The unconverted model's gradients (the same reference as :func:`reference`)."""
    model = MODELS[kind]()
    batch = batch_of(kind, batches)
    halves = batch.chunk(dist.get_world_size()) if kind in PER_REPLICA else [batch]
    for half in halves:
        (loss_of(kind, model, half) / len(halves)).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def run_case(case: str, wrapper: str, batches: dict[str, torch.Tensor]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, how, kind = build(case, batches)
    local = batch_of(kind, batches).chunk(world)[rank]
    model = wrap(model, wrapper)
    loss_of(kind, model, local).backward()
    got = full_gradients(model)
    want = reference(case, batches)
    errors = {}
    for name, expected in want.items():
        if name not in got:
            return {"status": "error", "message": f"no gradient for {name} under {wrapper}", "how": how}
        scale = float(expected.abs().max())
        errors[name] = {"max_abs": float((got[name] - expected).abs().max()), "scale": scale}
    approximate = _APPROXIMATE.get(case, False)
    differs = None
    if approximate:
        exact = exact_reference(kind, batches)
        differs = any(not torch.equal(want[name], exact[name]) for name in want if name in exact)
    record = {"status": "ok", "how": how, "kind": kind, "errors": errors, "names": sorted(got)}
    record.update(approximate=approximate, differs_from_exact=differs)
    return record


def main() -> None:
    out = sys.argv[1]
    cases = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a desynchronised case fails fast
    rank = dist.get_rank()
    torch.manual_seed(1234)
    batches = {
        "features": torch.randn(BATCH, FEATURES, dtype=torch.float64),
        "ids": torch.randint(0, VOCABULARY, (BATCH, SEQUENCE)),
    }
    results = {"world_size": dist.get_world_size(), "torch": torch.__version__, "cases": {}}
    results["choosable"] = choosable()
    for case in cases:
        for wrapper in WRAPPERS:
            try:
                record = run_case(case, wrapper, batches)
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
