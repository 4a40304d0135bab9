"""Measuring models without allocating them: :func:`fake_mode`, ``FakeTensorMode`` with what a measurement needs.

Under ``torch._subclasses.fake_tensor.FakeTensorMode`` a model is built and run with shapes, dtypes and storages but
no data: :mod:`.memory` (``saved_bytes``, ``peak``), ``runtime.convert`` with every technique, and the planner's
profile give the bytes real tensors would have, for a model of any size, in seconds (the custom ops have fake
kernels; checks that need values, such as the norm converter's probe, run on real copies of the same shapes and
dtypes: :func:`.probe.real_stand_in`).

Two libraries decide differently on fake tensors than on real ones, and :func:`fake_mode` makes them decide as on
real inputs for as long as it is active:

* Hugging Face's attention masks: on a fake ``position_ids`` or padding mask it cannot read the values, so it builds
  the full ``batch x 1 x sequence x sequence`` mask that a real run of a full batch (no padding, one sequence per
  row) leaves to SDPA's ``is_causal``: that mask is kept for backward and changes the attention kernel. Under
  :func:`fake_mode` fake inputs are taken as such a full batch, the case every estimate of this project is for.
* ``torch._fused_sdp_choice`` (which kernel SDPA picks; the exact attention core asks it) answers from the meta
  kernel on fake tensors (the math path) while SDPA itself runs the CPU flash kernel's fake: under :func:`fake_mode`
  it answers for fake CPU tensors what it answers for real ones of the same shapes, strides and dtypes (asked on
  uninitialised real tensors, whose pages are never touched).
* ``torch.nn.init.trunc_normal_`` reads values (``.item()``) and fails on fake parameters (ViT's initialisation):
  under :func:`fake_mode` it leaves a fake tensor as it is (it has no values to draw).

Neither change applies to real tensors, nor while ``torch.compile`` traces (its fake tensors are not ours to
reinterpret). What fake mode cannot see, real or not: the allocator's rounding of each block (512 bytes on CUDA) and
its cache (reserved above allocated), fragmentation, and the workspace of vendor kernels (cuBLAS, cuDNN, flash
attention), none of which is a tensor.

>>> import torch
>>> from fewbit_design.runtime import memory
>>> with fake_mode():
...     layer = torch.nn.Linear(4096, 4096, dtype=torch.bfloat16)
...     x = torch.randn(8192, 4096, dtype=torch.bfloat16, requires_grad=True)
...     with memory.saved_bytes(layer) as saved:
...         y = torch.nn.functional.gelu(layer(x))
>>> saved.total  # gelu's input, 8192 x 4096 bfloat16 (the linear's input x is a leaf: not counted)
67108864
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily

from ..errors import check_choice

__all__ = ["fake_mode", "is_fake", "deepcopy_module", "kernel_device", "KERNELS"]

#: the devices whose kernel choices a measurement can follow (:func:`fake_mode`'s ``kernels``)
KERNELS = ("cpu", "cuda")
_target = {"kernels": "cpu"}  # the innermost active fake_mode's


def deepcopy_module(module: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(module)``, with its fake parameters and buffers copied in their own fake mode (``deepcopy`` of
    a fake tensor makes a new mode, whose tensors cannot meet the old mode's in one operator).

    Args:
        module: the module to copy (real, fake or mixed)
    """
    memo: dict[int, Any] = {}
    for parameter in module.parameters():
        if is_fake(parameter) and id(parameter) not in memo:
            memo[id(parameter)] = torch.nn.Parameter(parameter.detach().clone(), parameter.requires_grad)
    for buffer in module.buffers():
        if is_fake(buffer) and id(buffer) not in memo:
            memo[id(buffer)] = buffer.detach().clone()
    return copy.deepcopy(module, memo)


def _ours(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor of a measurement (not one of ``torch.compile``'s tracing)."""
    return isinstance(tensor, torch.Tensor) and is_fake(tensor) and not torch.compiler.is_compiling()


def _full_batch_masks(masking: Any) -> dict[str, Callable]:
    """Replacements of ``transformers.masking_utils``' value-reading decisions that take fake inputs as a full
    batch (the originals for real ones)."""
    find_packed = masking.find_packed_sequence_indices
    replacements: dict[str, Callable] = {}

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if _ours(position_ids) else find_packed(position_ids)  # one sequence per row

    replacements["find_packed_sequence_indices"] = find_packed_sequence_indices
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        original = getattr(masking, name, None)
        if original is None:
            continue

        def ignore(padding_mask: Any, *args: Any, _original: Callable = original, **kwargs: Any) -> bool:
            return _original(None if _ours(padding_mask) else padding_mask, *args, **kwargs)  # no padding

        replacements[name] = ignore
    return replacements


def kernel_device(tensor: torch.Tensor) -> str:
    """The device type whose kernels run on ``tensor``: its own, or ``"cuda"`` for a fake tensor of
    ``fake_mode(kernels="cuda")`` (a CPU tensor measured as CUDA would run it). The runtime's ops ask this where
    they choose by device.

    Args:
        tensor: a tensor the op runs on
    """
    return "cuda" if _target["kernels"] == "cuda" and _ours(tensor) else tensor.device.type


def _cuda_kernels(functional: Any) -> dict[str, Callable]:
    """Replacements of native functions that run, on fake tensors, as CUDA runs them where CUDA's kernel keeps other
    tensors for backward than the CPU's: SDPA with dropout runs a fused kernel on CUDA (flash or memory-efficient,
    which draw the mask again in backward) and its math path on CPU (the probabilities and the mask kept: S x S), so
    it runs here without dropout (the fused kernel's saved tensors; its random state, two 8-byte scalars, is not
    counted); dropout keeps a bool mask on CUDA (``native_dropout``) and a noise tensor of the input's dtype on CPU."""
    sdpa, dropout = functional.scaled_dot_product_attention, functional.dropout

    def scaled_dot_product_attention(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _ours(query):
            if len(args) > 3:
                args = (*args[:3], 0.0, *args[4:])
            else:
                kwargs["dropout_p"] = 0.0
        return sdpa(query, *args, **kwargs)

    def dropout_(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if _ours(input) and training and 0.0 < p < 1.0 and not inplace:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    return {"scaled_dot_product_attention": scaled_dot_product_attention, "dropout": dropout_}


@contextlib.contextmanager
def _kernels(kernels: str) -> Iterator[None]:
    previous = _target["kernels"]
    _target["kernels"] = kernels
    try:
        if kernels == "cuda":
            with _patched(torch.nn.functional, _cuda_kernels(torch.nn.functional)):
                yield
        else:
            yield
    finally:
        _target["kernels"] = previous


def _sdp_choice(original: Callable) -> Callable:
    def _fused_sdp_choice(*args: Any, **kwargs: Any) -> int:
        tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        if not any(_ours(tensor) for tensor in tensors) or any(t.device.type != "cpu" for t in tensors):
            return original(*args, **kwargs)
        with unset_fake_temporarily():

            def real(value: Any) -> Any:
                if not isinstance(value, torch.Tensor):
                    return value
                twin = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
                return twin.requires_grad_(value.requires_grad)

            return original(*map(real, args), **{key: real(value) for key, value in kwargs.items()})

    return _fused_sdp_choice


def _trunc_normal(original: Callable) -> Callable:
    def trunc_normal_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return tensor if _ours(tensor) else original(tensor, *args, **kwargs)

    return trunc_normal_


@contextlib.contextmanager
def _patched(owner: Any, replacements: dict[str, Callable]) -> Iterator[None]:
    previous = {name: getattr(owner, name) for name in replacements}
    try:
        for name, replacement in replacements.items():
            setattr(owner, name, replacement)
        yield
    finally:
        for name, value in previous.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def fake_mode(kernels: str = "cpu") -> Iterator[FakeTensorMode]:
    """A ``FakeTensorMode`` (yielded) in which models are built and measured as real ones would be (see the module
    docstring): tensors made in the block are fake, Hugging Face masks treat fake inputs as a full batch, and
    ``trunc_normal_`` leaves fake tensors alone. Everything is put back on exit.

    Args:
        kernels: whose kernel choices the fake tensors (CPU tensors) follow, where CPU and CUDA keep different
            tensors for backward: ``"cpu"`` (this machine's: the measurement equals a real CPU run) or ``"cuda"``
            (a GPU's: native SDPA with dropout in a fused kernel, native dropout with a bool mask, and the runtime's
            ops as they choose on CUDA, :func:`kernel_device`)
    """
    check_choice("kernels", kernels, KERNELS)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_kernels(kernels))
        masking = sys.modules.get("transformers.masking_utils")
        if masking is None and importlib.util.find_spec("transformers") is not None:
            # imported now if installed: a model built inside the block would import it after the patch was decided
            import transformers.masking_utils as masking
        if masking is not None:
            stack.enter_context(_patched(masking, _full_batch_masks(masking)))
        stack.enter_context(_patched(torch.nn.init, {"trunc_normal_": _trunc_normal(torch.nn.init.trunc_normal_)}))
        stack.enter_context(_patched(torch, {"_fused_sdp_choice": _sdp_choice(torch._fused_sdp_choice)}))
        initialization = sys.modules.get("transformers.initialization")
        functions = getattr(initialization, "TORCH_INIT_FUNCTIONS", None)
        if isinstance(functions, dict) and "trunc_normal_" in functions:
            stack.enter_context(_patched_item(functions, "trunc_normal_"))
        yield stack.enter_context(FakeTensorMode())


@contextlib.contextmanager
def _patched_item(functions: dict[str, Callable], name: str) -> Iterator[None]:
    original = functions[name]
    functions[name] = _trunc_normal(original)
    try:
        yield
    finally:
        functions[name] = original
