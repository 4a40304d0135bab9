"""What few-bit conversion cannot reach: activation functions called in a module's forward code (``F.gelu`` in
Whisper's convolutional stem) rather than as modules. Found by running the probe under a ``TorchFunctionMode`` that
attributes every call of an activation of the design registry to the innermost running module; ``runtime.convert``
lists them in its report."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...design import activations
from ..probe import no_side_effects, run_example
from .matching import _recognise

__all__ = ["functional_calls", "FUNCTIONAL_NAMES"]

#: the functions looked for in forward code (every activation of the design registry, and the in-place forms)
FUNCTIONAL_NAMES = frozenset(activations.names()) | {f"{name}_" for name in activations.names()}


def _activation_call(name: str, args: tuple, kwargs: dict) -> bool:
    return name in FUNCTIONAL_NAMES


class _FunctionalCalls(TorchFunctionMode):
    """Counts the calls ``wanted`` picks per innermost running module (a stack kept by forward hooks), except inside
    a module that ``sees_itself`` says its technique reached."""

    def __init__(self, stack: list[tuple[str, torch.nn.Module]], wanted: Callable, sees_itself: Callable) -> None:
        super().__init__()
        self.stack = stack
        self.wanted, self.sees_itself = wanted, sees_itself
        self.calls: Counter[tuple[str, str, str]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.wanted(name, args, kwargs or {}) and not any(self.sees_itself(module) for _, module in self.stack):
            where, module = self.stack[-1] if self.stack else ("", None)
            owner = type(module).__qualname__ if module is not None else "?"
            self.calls[where, owner, _function_name(func, name)] += 1
        return func(*args, **(kwargs or {}))


def _function_name(func: Any, name: str) -> str:
    """``torch.nn.functional.gelu`` for the builtin ``torch._C._nn.gelu``, ``torch.Tensor.relu`` for the method."""
    owner = getattr(func, "__module__", None) or ""
    if owner in ("torch._C._nn", "torch.nn.functional", ""):
        owner = "torch.nn.functional" if owner else "torch.Tensor"
    elif owner.startswith("torch._C"):
        owner = "torch"
    return f"{owner}.{name}"


def _sees_itself(module: torch.nn.Module) -> bool:
    """Calls inside this module are its own business: an activation module (replaced or not, convert saw it) or a
    module of this runtime (few-bit, gated, norms, linear)."""
    return type(module).__module__.startswith("fewbit_design.") or _recognise(module) is not None


def functional_calls(
    model: torch.nn.Module,
    probe: Any,
    options: Any = None,
    *,
    wanted: Callable[[str, tuple, dict], bool] = _activation_call,
    sees_itself: Callable[[torch.nn.Module], bool] = _sees_itself,
) -> list[tuple[str, str, str, int]]:
    """``(module name, module class, function, calls)`` of every call ``wanted`` picks (by default: of an activation
    function) in forward code on one run of ``probe`` (no gradients; no side effects).

    Args:
        model: the model
        probe: example inputs of one step
        options: the technique's options (unused: every activation is looked for)
        wanted: ``wanted(function name, args, kwargs)``, which calls to count (another technique's functions:
            dropout's)
        sees_itself: ``sees_itself(module)``, whether calls inside a running module are its technique's business
    """
    stack: list[tuple[str, torch.nn.Module]] = []
    handles = []
    for name, module in model.named_modules():

        def push(module, _inputs, _name=name):
            stack.append((_name, module))

        def pop(module, _inputs, _outputs, _name=name):
            if stack and stack[-1][0] == _name:
                stack.pop()

        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop, always_call=True))
    mode = _FunctionalCalls(stack, wanted, sees_itself)
    try:
        with no_side_effects(model), torch.no_grad(), mode:
            run_example(model, probe)
    finally:
        for handle in handles:
            handle.remove()
    return [(where, owner, function, count) for (where, owner, function), count in mode.calls.items()]
