"""Run a plan: checkpoint the chosen segments with ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

* An ``nn.Sequential`` (or a list of modules) becomes a :class:`CheckpointedSequential`: an ``nn.Sequential`` of
  the same modules (same parameters, same state-dict keys) whose forward runs the plan's segments.
* An ``nn.ModuleList`` that a model loops over (Hugging Face decoder layers) is changed in place: each block in a
  checkpointed segment gets an instance ``forward`` that checkpoints its class's forward, so the model's own loop,
  hooks, ``isinstance`` checks and state-dict keys stay as they were. :func:`remove` undoes it.

Recomputation replays the random number generator (dropout masks match) and leaves batch-norm running statistics
as the first forward pass left them (restored after recomputing), so a step updates them once. Under
``torch.no_grad()`` or in eval mode the blocks run plainly, with no checkpoint overhead. ``selective=True`` is
Chen's §4.2: recompute only cheap operations and keep the outputs of matrix products and convolutions, through
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (the plan's peak prediction assumes full
recomputation, so it overestimates a selective run).

``torch.compile`` works on the result (the default backend and ``"aot_eager"``; tested): there the compiled graph
recomputes, and batch-norm statistics are updated once by the functional graph. With ``backend="eager"`` (Dynamo
alone) a batch norm inside a checkpointed segment fails in torch's own checkpoint ("modified by an inplace
operation"), as it does for ``torch.utils.checkpoint`` without this module.

:func:`wrap` profiles, plans and applies in one call.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ...errors import FewBitError
from ..fingerprint import check_fingerprint
from .cost import Segment
from .plan import Plan
from .plan import plan as plan_segments
from .profile import profile as profile_blocks

__all__ = ["CheckpointedSequential", "CheckpointedForward", "apply", "remove", "wrap", "KEEP_OPS"]

_aten = torch.ops.aten
#: operations whose outputs ``selective=True`` keeps instead of recomputing (Chen §4.2)
KEEP_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.convolution.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
    }
)


def _keep_costly(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEEP_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _batch_norms(modules: Sequence[torch.nn.Module]) -> list[torch.nn.modules.batchnorm._BatchNorm]:
    return [
        m
        for module in modules
        for m in module.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]


@contextlib.contextmanager
def _keep_running_stats(norms: Sequence[torch.nn.Module]) -> Iterator[None]:
    """During recomputation: leave batch-norm running statistics as the first forward pass set them."""
    saved = [
        [b.detach().clone() for b in (n.running_mean, n.running_var, n.num_batches_tracked) if b is not None]
        for n in norms
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, values in zip(norms, saved, strict=True):
                buffers = [b for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked) if b is not None]
                for buffer, value in zip(buffers, values, strict=True):
                    buffer.copy_(value)


def _context_fn(modules: Sequence[torch.nn.Module], selective: bool) -> Callable[[], tuple[Any, Any]]:
    norms = _batch_norms(modules)

    def context_fn():
        if selective:
            forward, recompute = create_selective_checkpoint_contexts(_keep_costly)
        else:
            forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
        if not norms:
            return forward, recompute

        @contextlib.contextmanager
        def recompute_keeping_stats():
            with recompute, _keep_running_stats(norms):
                yield

        return forward, recompute_keeping_stats()

    return context_fn


def _checkpoint_options(modules: Sequence[torch.nn.Module], selective: bool) -> dict[str, Any]:
    """``torch.utils.checkpoint`` keyword arguments for a segment of ``modules``.

    Eager: a ``context_fn`` that keeps batch-norm statistics through recomputation (and selects what to keep when
    ``selective``). Under ``torch.compile`` Dynamo accepts only a plain function or a ``functools.partial`` as
    ``context_fn`` and only selective-checkpoint contexts, and its graph updates batch-norm statistics once anyway
    (the recomputed graph is functional), so the compiled form passes none (plain recomputation) or the selective
    policy alone."""
    if torch.compiler.is_compiling():
        if selective:
            return {"context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_costly)}
        return {}
    return {"context_fn": _context_fn(modules, selective)}


def _checkpointing(module: torch.nn.Module) -> bool:
    return torch.is_grad_enabled() and module.training


class CheckpointedSequential(torch.nn.Sequential):
    """An ``nn.Sequential`` of the original modules that runs a :class:`Plan`'s segments (checkpointed ones
    through ``torch.utils.checkpoint``). Parameters and state-dict keys are the original's.

    Args:
        modules: the original modules (or an ``nn.Sequential`` of them)
        plan: the :class:`Plan` whose segments it runs
        selective: keep matmul and convolution outputs in checkpointed segments and recompute the rest (section 4.2)
    """

    def __init__(self, modules: Sequence[torch.nn.Module] | torch.nn.Sequential, plan: Plan, *, selective: bool):
        if isinstance(modules, torch.nn.Sequential):
            super().__init__(OrderedDict(modules._modules))
        else:
            super().__init__(*modules)
        self.plan = plan
        self.selective = selective

    @property
    def plan(self) -> Plan:
        """The plan it runs. Setting it checks the new plan (:meth:`Plan.validate`) and keeps a frozen copy of its
        segments, so changing the plan object afterwards changes nothing until it is set again."""
        return self._plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        if not isinstance(plan, Plan):
            raise FewBitError(f"a CheckpointedSequential runs a checkpoint Plan, got {type(plan).__name__}")
        segments = plan.validate()
        if segments[-1].stop != len(self):
            raise FewBitError(f"the plan is for {segments[-1].stop} blocks, but {len(self)} were given")
        self._segments = segments
        self._plan = plan

    def __getitem__(self, index):
        if isinstance(index, slice):  # a part of the chain: the plan does not apply to it
            return torch.nn.Sequential(OrderedDict(list(self._modules.items())[index]))
        return super().__getitem__(index)

    def forward(self, x: Any) -> Any:  # noqa: D102 (nn.Module.forward)
        if not _checkpointing(self):
            return super().forward(x)
        return self._run(self._segments, x)

    def _run(self, segments: Sequence[Segment], x: Any) -> Any:
        blocks = list(self)
        for segment in segments:
            if segment.checkpoint:
                children = segment.children or (Segment(segment.start, segment.stop, False),)
                x = checkpoint(
                    functools.partial(self._run, children),
                    x,
                    use_reentrant=False,
                    **_checkpoint_options(blocks[segment.start : segment.stop], self.selective),
                )
            else:
                for block in blocks[segment.start : segment.stop]:
                    x = block(x)
        return x

    def extra_repr(self) -> str:
        return f"plan={self.plan.strategy!r}, checkpointed={self.plan.checkpointed}"


class CheckpointedForward:
    """A block's instance ``forward`` that checkpoints its class's forward. It holds the module itself (not a bound
    method), so ``copy.deepcopy`` of the model gives the copy a forward of its own block."""

    def __init__(self, module: torch.nn.Module, selective: bool) -> None:
        self.module = module
        self.selective = selective

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        original = functools.partial(type(module).forward, module)
        if not _checkpointing(module):
            return original(*args, **kwargs)
        run = functools.partial(checkpoint, use_reentrant=False, **_checkpoint_options([module], self.selective))
        if _is_hf_checkpointing_layer(module):
            with _hf_checkpointing(module, run):  # HF's wrapper (the class's forward) calls ``run``
                return original(*args, **kwargs)
        return run(original, *args, **kwargs)


def _is_hf_checkpointing_layer(module: torch.nn.Module) -> bool:
    """A Hugging Face ``GradientCheckpointingLayer`` (without importing transformers): its class forward checkpoints
    through ``self._gradient_checkpointing_func`` when ``self.gradient_checkpointing`` is set."""
    return hasattr(type(module), "_can_checkpoint_with_cache") and hasattr(type(module), "gradient_checkpointing")


@contextlib.contextmanager
def _hf_checkpointing(module: torch.nn.Module, run: Callable[..., Any]) -> Iterator[None]:
    """Checkpoint a Hugging Face layer through its own mechanism for the duration of one call.

    A layer that writes a cache in forward (T5's and Whisper's decoder blocks with ``use_cache``: the key/value
    cache, and cross-attention's ``is_updated`` flag) must not write it when recomputed: the recomputation would
    read the keys the first pass stored instead of computing them (T5's decoder block 0 saved 57 tensors in forward
    and 53 when recomputed: ``CheckpointError``). HF's ``GradientCheckpointingLayer`` knows which arguments those
    are for each layer (``use_cache``, ``cache``, ``layer_past``, unless the layer only reads its cache): with its
    flag set for the call, its forward drops them and checkpoints through ``run``, as ``gradient_checkpointing_enable``
    would."""
    had = {name: module.__dict__[name] for name in ("gradient_checkpointing", "_gradient_checkpointing_func")
           if name in module.__dict__}  # fmt: skip
    module.gradient_checkpointing = True
    module._gradient_checkpointing_func = run
    try:
        yield
    finally:
        for name in ("gradient_checkpointing", "_gradient_checkpointing_func"):
            if name in had:
                module.__dict__[name] = had[name]
            else:
                module.__dict__.pop(name, None)


def remove(blocks: torch.nn.ModuleList | CheckpointedSequential) -> torch.nn.Module:
    """Undo :func:`apply`: a ModuleList's blocks get their class's forward back; a CheckpointedSequential becomes a
    plain ``nn.Sequential`` of the same modules."""
    if isinstance(blocks, CheckpointedSequential):
        return torch.nn.Sequential(OrderedDict(blocks._modules))
    if isinstance(blocks, torch.nn.ModuleList):
        for block in blocks:
            if isinstance(block.__dict__.get("forward"), CheckpointedForward):
                del block.forward
        return blocks
    raise FewBitError(f"remove takes what apply returned, got {type(blocks).__name__}")


def apply(blocks: Any, plan: Plan, *, selective: bool = False) -> torch.nn.Module:
    """Checkpoint ``blocks`` as ``plan`` says (see the module docstring).

    Args:
        blocks: the container that was profiled (an ``nn.Sequential``, a list of modules, or an ``nn.ModuleList``).
        plan: from :func:`.plan.plan`, for as many blocks.
        selective: Chen §4.2: inside checkpointed segments keep matrix-product and convolution outputs, recompute
            the rest.

    Returns a :class:`CheckpointedSequential` for a Sequential or a list, and the same ModuleList (changed in
    place) for a ModuleList.
    """
    if not isinstance(plan, Plan):
        raise FewBitError(f"apply needs a Plan from plan(), got {type(plan).__name__}")
    segments = plan.validate()  # a plan built or edited by hand is checked here too
    n = segments[-1].stop
    if isinstance(blocks, torch.nn.ModuleList):
        if len(blocks) != n:
            raise FewBitError(f"the plan is for {n} blocks, but the ModuleList has {len(blocks)}")
        long = [(s.start, s.stop) for s in segments if s.checkpoint and (s.stop - s.start > 1 or s.children)]
        if long:
            raise FewBitError(
                f"an nn.ModuleList is checkpointed block by block, but the plan has multi-block segments {long}; "
                "plan it from a profile of the ModuleList"
            )
        check_fingerprint(plan.fingerprint, list(blocks), [str(i) for i in range(len(blocks))], "the checkpoint plan")
        remove(blocks)
        for segment in segments:
            if segment.checkpoint:
                block = blocks[segment.start]
                block.forward = CheckpointedForward(block, selective)
        return blocks
    if isinstance(blocks, CheckpointedSequential):
        blocks = torch.nn.Sequential(OrderedDict(blocks._modules))
    if isinstance(blocks, torch.nn.Sequential) or (
        isinstance(blocks, Sequence) and all(isinstance(b, torch.nn.Module) for b in blocks)
    ):
        if len(blocks) != n:
            raise FewBitError(f"the plan is for {n} blocks, but {len(blocks)} were given")
        names = list(blocks._modules) if isinstance(blocks, torch.nn.Sequential) else [str(i) for i in range(n)]
        check_fingerprint(plan.fingerprint, list(blocks), names, "the checkpoint plan")
        return CheckpointedSequential(blocks, plan, selective=selective)
    raise FewBitError(
        f"blocks must be an nn.Sequential, an nn.ModuleList or a list of modules, got {type(blocks).__name__}"
    )


def wrap(
    blocks: Any,
    *example_inputs: Any,
    budget: int | float | str | None = None,
    strategy: str = "optimal",
    selective: bool = False,
    grads_allocated: bool = False,
    **example_kwargs: Any,
) -> torch.nn.Module:
    """Profile, plan and apply in one call: ``apply(blocks, plan(profile(blocks, *example), budget=...))``.

    ``grads_allocated``: plan for steps whose parameters' gradients exist before the backward pass (see
    :func:`.profile.profile`).

    The plan is kept on the result (``.plan`` of a CheckpointedSequential; for a ModuleList, ``blocks.fewbit_plan``).

    Args:
        blocks: an ``nn.Sequential``, a list or an ``nn.ModuleList`` of blocks
        example_inputs: the first block's positional inputs
        budget: bytes, ``"2GiB"``, a fraction of the unplanned peak, or ``"min"`` (None: the smallest feasible peak)
        strategy: ``"optimal"``, ``"greedy"``, ``"sqrt"``, ``"recursive"`` or ``"none"``
        selective: as in :func:`apply`
        grads_allocated: as in :func:`.profile.profile`
        example_kwargs: keyword inputs of every block
    """
    measured = profile_blocks(blocks, *example_inputs, grads_allocated=grads_allocated, **example_kwargs)
    chosen = plan_segments(measured, budget=budget, strategy=strategy)
    result = apply(blocks, chosen, selective=selective)
    if isinstance(result, torch.nn.ModuleList):
        result.fewbit_plan = chosen
    return result
