"""Eager twins of the runtime's custom ops: the same forward, ``setup_context`` and backward as an op registered
with ``torch.library`` (``register_autograd``), wrapped in a plain :class:`torch.autograd.Function`.

Why: a ``torch.library`` custom op with autograd costs about 35 us per forward call and 40 us per backward call in
Python dispatch on a CPU (measured on a 64-feature linear: 44 us forward against 10 us through an
``autograd.Function``), which the tiny transformer blocks of ``benchmarks/transformer_memory.py`` pay at every
compressed layer. Under ``torch.compile`` (:func:`tracing`) the entry points still call the custom op, which
Dynamo and AOTAutograd see as one node with its fake kernel; in eager they call the twin, which computes the very
same tensors (the same Python functions run) and saves the very same tensors for backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["eager_twin", "tracing", "fake_eager", "traced_body"]


def tracing(*tensors: torch.Tensor | None) -> bool:
    """Whether the caller is being traced (the custom op must be called then): by ``torch.compile``, or by a tracer
    that hands it fake or functional tensors (AOTAutograd tracing a backward, ``make_fx``, ``opcheck``).

    Args:
        tensors: the tensors the caller is about to compute with (None entries are skipped)
    """
    if torch.compiler.is_compiling():
        return True
    return any(tensor is not None and not _real(tensor) for tensor in tensors)


def fake_eager(*tensors: torch.Tensor | None) -> bool:
    """Whether the caller runs eagerly on fake tensors (a model measured under ``runtime.fake.fake_mode()``): every
    tensor given is a ``FakeTensor`` and nothing compiles, traces (``make_fx``, AOTAutograd) or functionalizes. Such
    a caller may run the Python body of an op whose body is plain torch instead of the custom op (which :func:`tracing`
    picks for fake tensors): the body allocates what the eager twin allocates, which ``memory.peak`` then sees, where
    the custom op's fake kernel gives only its outputs.

    Args:
        tensors: the tensors the caller is about to compute with (None entries are skipped)
    """
    from torch._subclasses.fake_tensor import FakeTensor

    present = [tensor for tensor in tensors if tensor is not None]
    if not present or any(type(tensor) is not FakeTensor for tensor in present) or torch.compiler.is_compiling():
        return False
    keys = torch._C._TorchDispatchModeKey
    return all(torch._C._get_dispatch_mode(key) is None for key in (keys.PROXY, keys.FUNCTIONAL))


def traced_body(*tensors: torch.Tensor | None) -> bool:
    """Whether a caller whose op body is plain torch must call the custom op: :func:`tracing`, except eagerly on fake
    tensors (:func:`fake_eager`), where the body runs so that fake mode sees its temporaries.

    Args:
        tensors: the tensors the caller is about to compute with (None entries are skipped)
    """
    return tracing(*tensors) and not fake_eager(*tensors)


def _real(tensor: torch.Tensor) -> bool:
    """A plain tensor or parameter holding data (any other subclass, fake or functional tensors are traced; the
    custom op is always a correct choice, the twin only a faster one)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and not torch._is_functional_tensor(tensor)


def eager_twin(forward: Callable, setup_context: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` whose ``apply(*args)`` is ``forward(*args)`` with ``setup_context(ctx, args,
    output)`` and ``backward(ctx, *grads)`` as registered for the custom op; gradients the backward returns for
    list arguments (the op's ``Tensor[]`` inputs) become None, as autograd expects for a non-tensor argument.

    Args:
        forward: the custom op's implementation (positional arguments)
        setup_context: its ``setup_context``
        backward: its backward
    """

    def forward_(ctx, *args):
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    def backward_(ctx, *grads):
        return tuple(None if isinstance(grad, list | tuple) else grad for grad in backward(ctx, *grads))

    # named at creation, so that its backward node is too (``<op>_eagerBackward``)
    name = f"{getattr(forward, '__name__', 'op').strip('_')}_eager"
    return type(
        name, (torch.autograd.Function,), {"forward": staticmethod(forward_), "backward": staticmethod(backward_)}
    )
