"""Profile a model once for the planner: the chain, one measured training step, and every option of every block.

1. The chain is the ``nn.Sequential`` or ``nn.ModuleList`` given by name, else the model itself when it is one,
   else its Sequential/ModuleList (two blocks or more) holding the most parameters.
2. One plain training step of the whole model under :func:`memory.peak` (with a timeline), with hooks at the
   chain's entry and exit and on the gradients of x_0 and x_n, gives the fixed parts of the step (what runs before
   and after the chain) and the inputs each block receives; a few more plain steps give the step time.
3. Each block runs alone on its recorded inputs, in a copy, under every applicable option: forward under
   :func:`memory.peak` and :func:`memory.saved_bytes`, backward with a gradient of ones; then its options'
   forward + backward runs are timed interleaved, round by round (:func:`timed_options`), each option's time
   taken relative to plain's in the same round. Blocks that are alike (same module text, parameter shapes and
   input shapes) are measured once.

Parameters' gradients, buffers (batch-norm statistics) and the random number generator are restored afterwards.
Caches are off while profiling (:func:`caches_disabled`): a Hugging Face model's ``use_cache=True`` default makes
every step return its key/value cache, which the blocks' recorded inputs would then carry from one run into the next.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...errors import FewBitError
from .. import memory
from ..blockrun import block_input, first_tensor, run_block, synchronize, training_state_kept
from ..fake import deepcopy_module
from ..probe import cache_configs, caches_disabled, outside_inference, training_grad_mode
from .model import BlockCosts, ChainCosts, OptionCost
from .techniques import apply_option, candidate_options, charge, option_region

__all__ = [
    "find_chain",
    "profile_model",
    "default_loss",
    "caches_disabled",
    "cache_configs",
    "training_grad_mode",
    "outside_inference",
    "StepMarks",
    "timed_options",
]


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when the output has one (Hugging Face models given labels), else the mean of the first
    floating-point tensor of the output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensor = _first_tensor(output)
    if tensor is None:
        raise FewBitError(f"cannot take a loss of the model's output ({type(output).__name__}); pass loss_fn=")
    return tensor.float().mean()


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, tuple | list):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def find_chain(model: torch.nn.Module, chain: str | None = None) -> str:
    """The qualified name of the chain ("" for the model itself)."""
    named = dict(model.named_modules())
    if chain is not None:
        if chain not in named:
            raise FewBitError(f"chain {chain!r} is not a submodule of the model")
        if not isinstance(named[chain], torch.nn.Sequential | torch.nn.ModuleList):
            kind = type(named[chain]).__name__
            raise FewBitError(f"chain {chain!r} must be an nn.Sequential or nn.ModuleList, got {kind}")
        return chain
    if isinstance(model, torch.nn.Sequential | torch.nn.ModuleList):
        return ""
    best, best_size = None, -1
    for name, module in named.items():
        if isinstance(module, torch.nn.Sequential | torch.nn.ModuleList) and len(module) >= 2:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = name, size
    if best is None:
        raise FewBitError(
            f"{type(model).__name__} has no nn.Sequential or nn.ModuleList of blocks to plan over; pass chain="
        )
    return best


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    raise FewBitError("a block of the chain must take its hidden state as its first argument (a tensor)")


class StepMarks:
    """Where each event of the predicted timeline (:func:`.model.replay`: ``before the chain``, ``forward <block>``,
    ``loss and modules after the chain``, ``backward <block>``, ``modules before the chain (backward)``) ends in a
    measured step: ``marks[label]`` is the number of operators run by then (an index into ``result.timeline`` of
    :func:`memory.peak`). So the predicted and the measured live bytes share one x axis, the operators of the step.

    A block's forward ends with its forward hook (the first call: a checkpointed block runs forward again in
    backward), its backward when the gradient of its input arrives (not marked where the input needs no gradient);
    :meth:`finish` marks the end of the step."""

    def __init__(self, blocks: list[torch.nn.Module], names: list[str], result: memory.Peak) -> None:
        self.result, self.names, self.last = result, names, len(blocks) - 1
        self.marks: dict[str, int] = {}
        self.handles = []
        for index, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._pre(index), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post(index)))

    def mark(self, label: str) -> None:
        self.marks.setdefault(label, len(self.result.timeline or ()))

    def _on_grad(self, label: str) -> Any:
        return lambda grad: self.mark(label)

    def _pre(self, index: int):
        def hook(module, args, kwargs):
            if index == 0:
                self.mark("before the chain")
            hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if hidden is not None and hidden.requires_grad and f"forward {self.names[index]}" not in self.marks:
                hidden.register_hook(self._on_grad(f"backward {self.names[index]}"))

        return hook

    def _post(self, index: int):
        def hook(module, args, output):
            label = f"forward {self.names[index]}"
            hidden = output[0] if isinstance(output, tuple | list) and output else output
            if (
                index == self.last
                and label not in self.marks
                and isinstance(hidden, torch.Tensor)
                and hidden.requires_grad
            ):
                hidden.register_hook(self._on_grad("loss and modules after the chain"))
            self.mark(label)

        return hook

    def finish(self) -> dict[str, int]:
        """Remove the hooks, mark the end of the step and return the marks."""
        for handle in self.handles:
            handle.remove()
        self.mark("modules before the chain (backward)")
        return self.marks


class _Recorder:
    """Hooks of the profiling step: the blocks' inputs and the live bytes at the chain's boundaries.

    The inputs are kept as copies made out of the instrument's sight, and the outputs only by weak reference: a
    reference to a hidden state would keep it alive through the whole measured step, which the plain step does not
    (the last block's output, freed at the loss, was counted into ``post_bytes``; every hidden state into the peak
    after the chain's backward), so predictions came out above the measured peaks."""

    def __init__(self, blocks: list[torch.nn.Module], result: memory.Peak) -> None:
        self.blocks, self.result = blocks, result
        self.inputs: list[tuple[tuple, dict] | None] = [None] * len(blocks)
        self.needs_grad: list[bool] = [False] * len(blocks)
        self.outputs: list[weakref.ref | None] = [None] * len(blocks)
        self.unchained: int | None = None  # the first block whose input is not the previous block's output
        self.copies: dict[tuple[str, int], torch.Tensor] = {}
        # the storages of the blocks' other arguments (besides the hidden state), by weak reference: which of them
        # the step frees after the chain's forward (``argument_bytes``)
        self.arguments: dict[int, tuple[weakref.ref, int]] = {}
        self.arguments_at_exit: list[tuple[weakref.ref, int]] = []
        self.argument_bytes = 0
        self.calls: list[int] = []
        self.marks: dict[str, tuple[int, int]] = {}
        self.handles = []
        for index, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._pre(index), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._post(index)))

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, (len(self.result.timeline or ()), self.result.live_bytes))

    def _pre(self, index: int):
        def hook(module, args, kwargs):
            self.calls.append(index)
            hidden = _hidden(args, kwargs)
            if index == 0:
                self.mark("entry")
                if hidden.requires_grad:
                    hidden.register_hook(lambda grad: self.mark("chain backward end"))
            else:
                previous = self.outputs[index - 1]() if self.outputs[index - 1] is not None else None
                same = previous is not None and memory.storage_key(previous) == memory.storage_key(hidden)
                if not same and self.unchained is None:
                    self.unchained = index
            self.needs_grad[index] = bool(hidden.requires_grad)
            self.inputs[index] = _copy_unseen((args, kwargs), self.copies)
            for tensor in _tensors((args[1:], kwargs)):
                storage = tensor.untyped_storage()
                self.arguments.setdefault(id(storage), (weakref.ref(storage), int(storage.nbytes())))

        return hook

    def _post(self, index: int):
        def hook(module, args, output):
            hidden = first_tensor(output)
            self.outputs[index] = weakref.ref(hidden)
            if index == len(self.blocks) - 1:
                self.mark("exit")
                self.arguments_at_exit = [(ref, nbytes) for ref, nbytes in self.arguments.values() if ref() is not None]
                if hidden.requires_grad:
                    hidden.register_hook(self._backward_start)

        return hook

    def _backward_start(self, grad: torch.Tensor) -> None:
        self.mark("chain backward start")
        self.argument_bytes = sum(nbytes for ref, nbytes in self.arguments_at_exit if ref() is None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value`` (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _copy_unseen(value: Any, copies: dict[tuple[str, int], torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by a detached copy made outside the dispatch modes (so
    :func:`memory.peak` neither counts the copy nor sees the original kept alive); one copy per storage (the
    keyword inputs the blocks share are copied once)."""
    if isinstance(value, torch.Tensor):
        key = (*memory.storage_key(value), value.storage_offset(), tuple(value.shape), tuple(value.stride()))
        if key not in copies:
            with _disable_current_modes(), torch.no_grad():
                copies[key] = value.detach().clone()
        return copies[key]
    if isinstance(value, tuple | list):
        return type(value)(_copy_unseen(v, copies) for v in value)
    if isinstance(value, dict):
        return {k: _copy_unseen(v, copies) for k, v in value.items()}
    return value


def _signature(block: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    def shape(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), str(value.dtype), value.requires_grad)
        if isinstance(value, tuple | list):
            return tuple(shape(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, shape(v)) for k, v in value.items()))
        return repr(value)

    parameters = tuple((n, tuple(p.shape), p.requires_grad) for n, p in block.named_parameters())
    return (repr(block), parameters, shape(args), shape(kwargs), block.training)


#: the planner's clock (a test replaces it with a fake one to inject timing noise)
clock = time.perf_counter
#: a median is stable when one more run moves it by at most this fraction
STABLE = 0.02


def timed(run: Callable[[], None], repeats: int, device: torch.device) -> tuple[float, float]:
    """Time ``run``: at least ``repeats`` runs, then (with ``repeats`` >= 2) more until one more run moves the
    median by at most :data:`STABLE` of it, at most ``3 * repeats`` runs in all (the whole step's time; a block's
    options are compared by :func:`timed_options`). Returns (median, spread): the spread is half the range of the
    runs. The median, not the minimum: on a shared machine the minimum of a few runs is the luckiest one."""
    times: list[float] = []
    while True:
        synchronize(device)
        start = clock()
        run()
        synchronize(device)
        times.append(clock() - start)
        if len(times) < repeats:
            continue
        if repeats < 2 or len(times) >= 3 * repeats:
            break
        if abs(statistics.median(times) - statistics.median(times[:-1])) <= STABLE * statistics.median(times):
            break
    return statistics.median(times), (max(times) - min(times)) / 2


def timed_options(runs: dict[str, Callable[[], None]], repeats: int, device: torch.device) -> dict[str, tuple]:
    """Time a block's options against each other within one run: round by round, each round running ``plain``
    (the first key) then every other option once, at least ``repeats`` rounds, then (with ``repeats`` >= 2) more
    until one more round moves no median by more than :data:`STABLE` (of plain's time), at most ``3 * repeats``.

    Returns {option: (seconds, spread)}: plain's median, and for every other option plain's median times the median
    over rounds of its time divided by plain's time *in the same round*. The spread (plain's own: 0, it is the
    reference) is half the range of those per-round ratios times plain's median, the noise within which
    :func:`.model.settle_ties` takes two options' times as a tie; a round at least 4 times as far from the median
    as any other (a change of load cut through it) is left out of the range, so that one round does not make every
    option a tie. Options timed one after another, each over its own runs, were compared across seconds of a shared
    machine's changing load: those timed while it was busier came out slower than they are; within a round the
    load is nearly the same for all, and the median over rounds outvotes a round that a change of load cut."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}

    def medians(last: int | None = None) -> list[float]:  # plain's median time, the others' median ratios
        return [statistics.median(times[names[0]][:last])] + [statistics.median(ratios[n][:last]) for n in names[1:]]

    while True:
        for name in names:
            synchronize(device)
            start = clock()
            runs[name]()
            synchronize(device)
            times[name].append(clock() - start)
        plain = times[names[0]][-1]
        for name in names:
            ratios[name].append(times[name][-1] / plain if plain > 0 else 1.0)
        rounds = len(times[names[0]])
        if rounds < repeats:
            continue
        if repeats < 2 or rounds >= 3 * repeats:
            break
        now, before = medians(), medians(last=-1)
        scale = now[0] if now[0] > 0 else 1.0
        moved = [abs(now[0] - before[0]) / scale] + [abs(a - b) for a, b in zip(now[1:], before[1:], strict=True)]
        if max(moved) <= STABLE:
            break
    plain = statistics.median(times[names[0]])
    result = {names[0]: (plain, 0.0)}
    for name in names[1:]:
        ratio = statistics.median(ratios[name])
        kept = sorted(ratios[name], key=lambda r: abs(r - ratio))
        if len(kept) >= 4 and abs(kept[-1] - ratio) > 4 * abs(kept[-2] - ratio):
            kept.pop()  # an outlier: 4 times as far from the median as any other round (a change of load cut it)
        result[name] = (plain * ratio, plain * (max(kept) - min(kept)) / 2)
    return result


def _module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's distinct parameter and buffer storages."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum({memory.storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


class _Measure:
    def __init__(self, settings: dict[str, Any], repeats: int) -> None:
        self.settings, self.repeats = settings, repeats

    def prepare(self, block: torch.nn.Module, option: str) -> torch.nn.Module:
        holder = torch.nn.ModuleDict({"block": deepcopy_module(block)})
        return apply_option(holder, "block", option, self.settings)

    def step(self, module: torch.nn.Module, option: str, args: tuple, kwargs: dict, needs_grad: bool) -> None:
        _, inp = block_input(args[0], needs_grad=needs_grad)
        with option_region(option, self.settings):
            output = module(inp, *args[1:], **kwargs)
        hidden = first_tensor(output)
        if hidden.requires_grad:  # not when the block is frozen and its input needs no gradient: no backward to time
            hidden.backward(torch.ones_like(hidden))

    def cost(
        self, block: torch.nn.Module, option: str, args: tuple, kwargs: dict, needs_grad: bool
    ) -> tuple[OptionCost | None, dict, Callable[[], None]]:
        """The option's bytes (its time is 0 until :func:`timed_options` sets it), the facts measured and a run of
        the option (forward + backward) to time."""
        module = self.prepare(block, option)
        for parameter in module.parameters():
            parameter.grad = None
        run, _ = run_block(
            module,
            args[0],
            args[1:],
            kwargs,
            needs_grad=needs_grad,
            seed="owned",
            region=option_region(option, self.settings),
        )
        extra = {
            "input_bytes": run.input_bytes,
            "output_bytes": run.output_bytes,
            "gradient_bytes": run.gradient_bytes,
            "saved_bytes": run.saved_bytes,
            "offloaded_bytes": run.region.bytes,
            "pool_bytes": run.region.pool_bytes,
            **run.region.facts,
        }

        def timed_step() -> None:
            for parameter in module.parameters():
                parameter.grad = None
            self.step(module, option, args, kwargs, needs_grad)

        added = _module_bytes(module) - _module_bytes(block)
        cost = OptionCost(
            option=option,
            forward_peak=run.forward_peak,
            kept=run.kept,
            backward_peak=run.backward_peak,
            saves_input=run.saves_input,
            saves_output=run.saves_output,
            seconds=0.0,
            resident_bytes=max(added, 0),
        )
        return charge(cost, option, extra), extra, timed_step


def profile_model(
    model: torch.nn.Module,
    example_inputs: tuple,
    example_kwargs: dict,
    *,
    chain: str | None,
    allow: tuple[str, ...],
    settings: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    repeats: int,
) -> tuple[str, ChainCosts, dict]:
    """Profile ``model`` (see the module docstring); return (chain name, costs, facts about the step)."""
    chain_name = find_chain(model, chain)
    container = model.get_submodule(chain_name) if chain_name else model
    blocks = list(container)
    if not blocks:
        where = f"the chain {chain_name!r}" if chain_name else f"the model (an empty {type(model).__name__})"
        raise FewBitError(f"{where} has no blocks: nothing to plan over")
    names = [f"{chain_name}.{key}" if chain_name else key for key in container._modules]
    loss_fn = loss_fn or default_loss
    with training_state_kept(model), torch.random.fork_rng(), caches_disabled(model):
        facts, recorded = _profile_step(model, blocks, example_inputs, example_kwargs, loss_fn, repeats)
        measure = _Measure(settings, repeats)
        costs = []
        cache: dict[tuple, tuple[list[OptionCost], dict]] = {}
        for index, (block, name) in enumerate(zip(blocks, names, strict=True)):
            args, kwargs, needs_grad = recorded[index]
            signature = (_signature(block, args, kwargs), needs_grad)
            if signature not in cache:
                options = []
                plain_extra: dict = {}
                runs: dict[str, Callable[[], None]] = {}
                for option in candidate_options(block, allow, settings):  # plain first
                    cost, extra, run = measure.cost(block, option, args, kwargs, needs_grad)
                    if option == "plain":
                        plain_extra = extra
                    if cost is not None:  # a technique's cost model drops an option that gains nothing
                        options.append(cost)
                        runs[option] = run
                times = timed_options(runs, repeats, args[0].device)
                options = [replace(o, seconds=times[o.option][0], spread=times[o.option][1]) for o in options]
                cache[signature] = (options, plain_extra)
            options, extra = cache[signature]
            costs.append(
                BlockCosts(
                    name=name,
                    input_bytes=extra["input_bytes"],
                    output_bytes=extra["output_bytes"],
                    gradient_bytes=extra["gradient_bytes"],
                    options=tuple(options),
                )
            )
            facts.setdefault("saved_bytes", {})[name] = extra["saved_bytes"]
    # the hidden state x_{i+1} is block i's output: one size for both, so the model's sums telescope
    for i in range(1, len(costs)):
        b = costs[i]
        costs[i] = BlockCosts(b.name, costs[i - 1].output_bytes, b.output_bytes, b.gradient_bytes, b.options)
    chain_costs = ChainCosts(
        blocks=tuple(costs),
        entry_bytes=facts.pop("entry_bytes"),
        pre_forward_peak=facts.pop("pre_forward_peak"),
        post_forward_peak=facts.pop("post_forward_peak"),
        post_bytes=facts.pop("post_bytes"),
        pre_backward_peak=facts.pop("pre_backward_peak"),
        argument_bytes=facts.pop("argument_bytes"),
    )
    return chain_name, chain_costs, facts


CHAIN_FACTS = (
    "entry_bytes",
    "pre_forward_peak",
    "post_forward_peak",
    "post_bytes",
    "pre_backward_peak",
    "argument_bytes",
)


def profile_step_facts(
    model: torch.nn.Module,
    example_inputs: tuple,
    example_kwargs: dict,
    *,
    chain: str,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    repeats: int,
) -> tuple[dict[str, int], dict]:
    """The step's facts around the chain, its blocks as they are: ``({ChainCosts field: bytes}, facts)`` (the plan's
    other facts: baseline, measured peak, step seconds). The blocks' own costs do not change with what is outside the
    chain (the LM head), so :func:`~.plan.plan_memory` profiles the blocks once and this again per ``"model"``-scope
    option."""
    container = model.get_submodule(chain) if chain else model
    with training_state_kept(model), torch.random.fork_rng(), caches_disabled(model):
        facts, _ = _profile_step(
            model, list(container), example_inputs, example_kwargs, loss_fn or default_loss, repeats
        )
    return {name: facts.pop(name) for name in CHAIN_FACTS}, facts


def _first_step(model, example_inputs, example_kwargs, loss_fn) -> torch.Tensor:
    """One training step on the example inputs; what the model (or the loss) raises becomes one FewBitError that
    names it, and a loss without a gradient (no parameter and no input requires one) is refused."""
    try:
        loss = loss_fn(model(*example_inputs, **example_kwargs))
    except FewBitError:
        raise
    except Exception as error:  # the user's model: one line naming what failed, the cause kept for debugging
        raise FewBitError(
            f"the model's training step on the example inputs raised {type(error).__name__}: {error}"
        ) from error
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise FewBitError(f"the loss must be a tensor of one element, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise FewBitError(
            "the loss of the training step does not require a gradient (no parameter of the model and no example "
            "input requires one): nothing is saved for backward, so there is nothing to plan"
        )
    try:
        loss.backward()
    except Exception as error:
        raise FewBitError(f"the model's backward pass raised {type(error).__name__}: {error}") from error
    return loss


def _profile_step(model, blocks, example_inputs, example_kwargs, loss_fn, repeats):
    for parameter in model.parameters():
        parameter.grad = None
    alive = [t for t in (*example_inputs, *example_kwargs.values()) if isinstance(t, torch.Tensor)]
    with memory.peak(model, *alive, timeline=True) as result:
        recorder = _Recorder(blocks, result)
        try:
            loss = _first_step(model, example_inputs, example_kwargs, loss_fn)
        finally:
            recorder.remove()
        del loss
    if recorder.calls != list(range(len(blocks))):
        raise FewBitError(
            f"the chain's blocks must each run once, in order, in one step; they ran in the order {recorder.calls}"
        )
    if recorder.unchained is not None:
        i = recorder.unchained
        raise FewBitError(f"block {i} of the chain does not take block {i - 1}'s output as its first input")
    timeline = [value for _, value in result.timeline]
    marks = recorder.marks
    entry_index, entry = marks["entry"]
    exit_index, exit_bytes = marks["exit"]
    start_index, start_bytes = marks.get("chain backward start", (len(timeline), result.live_bytes))
    end_index, _ = marks.get("chain backward end", (len(timeline), 0))
    facts = {
        "baseline_bytes": result.baseline_bytes,
        "measured_peak_bytes": result.peak_bytes,
        "entry_bytes": entry,
        "pre_forward_peak": max(timeline[:entry_index], default=0),
        "post_forward_peak": max(timeline[exit_index:start_index], default=exit_bytes) - exit_bytes,
        "post_bytes": start_bytes - exit_bytes,
        "pre_backward_peak": max(timeline[end_index:], default=0),
        "argument_bytes": recorder.argument_bytes,
    }
    inputs, needs_grad = recorder.inputs, recorder.needs_grad
    recorded = [(args, kwargs, needs) for (args, kwargs), needs in zip(inputs, needs_grad, strict=True)]
    device = _hidden(*recorded[0][:2]).device

    def step() -> None:
        for parameter in model.parameters():
            parameter.grad = None
        loss_fn(model(*example_inputs, **example_kwargs)).backward()

    facts["step_seconds"], _ = timed(step, repeats, device)
    for parameter in model.parameters():
        parameter.grad = None
    return facts, recorded
