"""The few-bit activation op: forward f(x) with the native torch op, backward grad * q(x) from b-bit codes.

Terms (see :mod:`fewbit_design`): sorted ``boundaries`` cut the real line into intervals, interval m (the number of
boundaries <= x) has code ``interval_codes[m]`` in [0, 2**bits), and code c has level ``levels[c]``; the
derivative is approximated by q(x) = levels[code(x)].

Contract (DESIGN.md "Runtime contract"):

* forward returns exactly what the native op returns (it *is* the native op, run without recording autograd; on
  CUDA the activations of :mod:`.one_pass` compute torch's formula in the pass that writes the codes), and
  saves only the packed codes of x (``ceil(n / 8) * bits`` bytes, layout in :mod:`.._packing`) plus the constant-size
  level tensors;
* backward returns ``grad * levels[code]`` computed in float32 (float64 for float64 gradients), in grad's dtype;
* the code of x is found by comparing x with the boundaries in the compute dtype (float64 for float64 x, else
  float32: float16 and bfloat16 upcast exactly). Boundaries are rounded *up* to float32, so ``x >= float32(b)`` holds
  exactly when ``x >= b`` does: the float32 path follows the table to the last bit.

Layers: ``quantize_reference`` / ``scale_reference`` (pure torch, any device: the oracle), numba CPU kernels
(:mod:`._numba_kernels`), Triton kernels (:mod:`._triton_kernels`); the launchers ``quantize`` / ``scale`` pick one
by device (CUDA -> Triton, CPU -> numba, else reference; ``FEWBIT_BACKEND`` or :func:`~.backends.use_backend`
force one): these live in :mod:`.backends` (reaching them through this module is deprecated). This module holds the
custom ops ``torch.ops.fewbit.quantize`` / ``torch.ops.fewbit.scale`` (with fake kernels, for ``torch.compile``) and
:func:`fewbit_activation`, the autograd entry point used by :mod:`fewbit_design.runtime.nn`.

>>> import torch, torch.nn.functional as F
>>> from fewbit_design.table import Table
>>> from fewbit_design.runtime.fewbit.backends import table_tensors
>>> table = Table(activation="relu", params={}, bits=1, mode="levelsets", symmetric=False,
...               weight={"kind": "uniform", "low": -10.0, "high": 10.0},
...               boundaries=[0.0], codes=[0, 1], levels=[0.0, 1.0], error=0.0, snr_db=None)
>>> x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
>>> y = fewbit_activation(x, F.relu, table_tensors(table))
>>> y.sum().backward()
>>> x.grad.tolist()
[0.0, 1.0, 1.0]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from ...errors import FewBitError
from . import backends
from .backends import (
    SUPPORTED_DTYPES,
    TableTensors,
    backend_for,
    forward_numba,
    forward_triton,
    quantize,
    scale,
    scale_reference,
)

__all__ = ["fewbit_activation", "nonfinite_record"]


def __getattr__(name: str):
    """The launchers and table tensors of :mod:`.backends`, reached here before they moved (deprecated)."""
    if name in backends.__all__:
        warnings.warn(
            f"fewbit_design.runtime.fewbit.ops.{name} is deprecated: import it from "
            f"fewbit_design.runtime.fewbit.backends",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(backends, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------------------------------
# Custom ops (one namespace, fake kernels for torch.compile / FakeTensor)


@torch.library.custom_op("fewbit::quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int) -> torch.Tensor:
    return quantize(x, boundaries, interval_codes, bits)


@_quantize_op.register_fake
def _(x: torch.Tensor, boundaries: torch.Tensor, interval_codes: torch.Tensor, bits: int) -> torch.Tensor:
    return x.new_empty(((x.numel() + 7) // 8) * bits, dtype=torch.uint8)


@torch.library.custom_op("fewbit::scale", mutates_args=())
def _scale_op(grad: torch.Tensor, packed: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    return scale(grad, packed, levels, bits)


@_scale_op.register_fake
def _(grad: torch.Tensor, packed: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------------------------------
# Autograd


SECOND_ORDER_MESSAGE = (
    "few-bit activations do not support higher-order gradients (backward with create_graph=True): "
    "they store only {bits}-bit codes of the input, not the input; use the native torch activation for "
    "double backward"
)


def _maybe_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: False proves every element of x finite (True: some may not be; scan to know).

    One reduction, no temporary: ``sum`` (its result is non-finite when an element is NaN or +-inf, and also when
    finite values overflow the sum, which the exact scan then clears); for float16, whose sums overflow at 65504,
    ``aminmax`` (NaN propagates, +-inf shows in the min or max). Measured on 2^22 elements, one thread: 1.2-1.5 ms,
    about a tenth of the few-bit forward (``sum(dtype=float32)`` on 16-bit input costs 4 ms: it converts first).
    """
    if x.dtype == torch.float16:
        low, high = torch.aminmax(x)
        return ~(torch.isfinite(low) & torch.isfinite(high))
    return ~torch.isfinite(torch.sum(x))


def nonfinite_record(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sparse record of x's non-finite elements: (positions, values), or None when every element is finite.

    ``positions`` are int64 indices into x flattened in logical (row-major) order, ``values`` x's NaN / +-inf there
    (x's dtype). The common, all-finite case costs one reduction over x (:func:`_maybe_nonfinite`) and saves
    nothing. (The numba and Triton forwards, :func:`~.backends.forward_numba` and
    :func:`~.triton_launch.forward_triton`, find non-finite elements in their kernels instead.)
    """
    detached = x.detach()
    if detached.numel() == 0 or not bool(_maybe_nonfinite(detached)):
        return None
    mask = ~torch.isfinite(detached)
    positions = torch.nonzero(mask.reshape(-1)).reshape(-1)
    if positions.numel() == 0:  # the sum overflowed, the elements are finite
        return None
    return positions, detached[mask]


def _nonfinite_gradient(
    native: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """The gradient at the (few) non-finite ``values`` for the incoming ``grad`` there: NaN at NaN, and torch's own
    gradient of ``native`` at +-inf.

    torch's gradient at NaN is not a function of the input: its vectorised and scalar loops disagree (relu6, hardtanh,
    hardshrink, softshrink give 0 or grad, elu, celu, selu, hardswish NaN or grad, depending on the element's position
    in the tensor), so NaN always gives NaN: never less visible than torch. At +-inf both loops agree.
    """
    nan = torch.full_like(values, float("nan"))
    try:
        with torch.enable_grad():
            inputs = values.detach().requires_grad_()
            outputs = native(inputs)
            (result,) = torch.autograd.grad(outputs, inputs, grad.to(outputs.dtype))
    except RuntimeError:  # a function torch cannot differentiate: mark the positions as NaN
        return nan
    return torch.where(torch.isnan(values), nan, result.to(values.dtype))


_compiling = torch.compiler.is_compiling


def _capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream (for a CUDA tensor ``x``): then the forward saves
    the compiled form's non-finite flag, since no host synchronisation is allowed."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


class _FewBitFunction(torch.autograd.Function):
    # Non-finite inputs: codes have no spare value, so NaN and +-inf elements are kept in a sparse
    # record beside the packed codes (nonfinite_record: positions + values, None when all finite, i.e. zero extra
    # bytes in the common case); backward puts NaN at NaN and torch's own gradient at +-inf (NaN for silu / gelu, 0
    # for tanh / sigmoid, ...), see _nonfinite_gradient. Under torch.compile (no data-dependent
    # shapes) a 0-dim flag "x had a non-finite element" is saved instead and makes the whole gradient NaN, which
    # keeps overflow detection (GradScaler) working.
    #
    # forward / setup_context are separate (torch.func needs it): forward returns what backward needs beside y
    # (packed codes, the record) as extra outputs that fewbit_activation drops, and setup_context saves them.
    @classmethod
    def apply(cls, *args):
        # torch's Function.apply binds the arguments to forward's signature with inspect.signature on every call
        # (about 20 us, as much as a native GELU of 2^14 elements); every caller here passes all seven positionally,
        # so that binding is the identity: eager calls outside torch.func go straight to the C++ apply, as torch's
        # own apply does after binding. torch.compile and torch.func keep torch's path.
        # Dead functorch wrappers (tensors that escaped a finished transform, x or a table tensor read through
        # torch.func.functional_call) are unwrapped: the five tensor arguments, one C call each.
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        x, boundaries, interval_codes, levels32, levels64, bits, native = args
        return super(torch.autograd.Function, cls).apply(
            _unwrap_if_dead(x),
            _unwrap_if_dead(boundaries),
            _unwrap_if_dead(interval_codes),
            _unwrap_if_dead(levels32),
            _unwrap_if_dead(levels64),
            bits,
            native,
        )

    @staticmethod
    def forward(x, boundaries, interval_codes, levels32, levels64, bits, native):
        # codes first (a user fn might work in place), then the native op, not recorded by autograd: y is bitwise
        # the native module's output and x is not saved. Eager calls the launcher directly (the custom op's Python
        # wrapper costs ~0.1 ms a call); torch.compile traces the custom op. A CUDA graph capture takes the compiled
        # form too: the sparse record's bool() and nonzero() synchronise with the host, which a capture forbids.
        if _compiling() or _capturing(x):
            packed = torch.ops.fewbit.quantize(x, boundaries, interval_codes, bits)
            flag = _maybe_nonfinite(x.detach()) if x.numel() else torch.zeros((), dtype=torch.bool, device=x.device)
            positions, values = flag, None
            y = native(x)
        elif is_fake(x):  # FakeTensorMode: the codes' shape from the op's fake kernel; no values, so no non-finite
            # record (what an eager run saves for a finite input: nothing beside the codes)
            packed = torch.ops.fewbit.quantize(x, boundaries, interval_codes, bits)
            positions, values = None, None
            y = native(x)
        elif (backend := backend_for(x.device)) == "numba":
            # codes and y in one pass over x (blocks in cache), the non-finite count from the same loads
            y, packed, record = forward_numba(x, native, boundaries, interval_codes, bits)
            positions, values = record or (None, None)
        elif backend == "triton":
            # one kernel pass over x for the activations of one_pass.py (y, codes and the non-finite flag), else the
            # codes kernel (with the flag), then the native op
            y, packed, record = forward_triton(x, native, boundaries, interval_codes, bits)
            positions, values = record or (None, None)
        else:
            packed = quantize(x, boundaries, interval_codes, bits)
            positions, values = nonfinite_record(x) or (None, None)
            y = native(x)
        return y, packed, positions, values

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, _, levels32, levels64, bits, native = inputs
        _, packed, positions, values = output
        if values is not None:
            ctx.mark_non_differentiable(values)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(packed, levels32, levels64, positions, values)
        ctx.bits = bits
        ctx.native = native if values is not None else None
        # set up by a torch.func transform, whose backward always builds a graph (higher orders are refused in
        # forward there, by _check_transforms)
        ctx.functorch = not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None

    @staticmethod
    def backward(ctx, grad, *_):
        if torch.is_grad_enabled() and not ctx.functorch:
            raise FewBitError(SECOND_ORDER_MESSAGE.format(bits=ctx.bits))
        if grad is None:
            return None, None, None, None, None, None, None
        packed, levels32, levels64, positions, values = ctx.saved_tensors
        levels = levels64 if grad.dtype == torch.float64 else levels32
        if torch.compiler.is_compiling() or is_fake(grad):
            grad_input = torch.ops.fewbit.scale(grad, packed, levels, ctx.bits)
        elif _functorch_wrapped(grad):  # batched or wrapped by torch.func: pure torch ops, bitwise the kernels'
            grad_input = scale_reference(grad, packed, levels, ctx.bits)
        else:
            grad_input = scale(grad, packed, levels, ctx.bits)
        if positions is not None and values is None:  # the compiled (or vmapped) form's flag
            grad_input = torch.where(positions, torch.full_like(grad_input, float("nan")), grad_input)
        elif positions is not None:
            exact = _nonfinite_gradient(ctx.native, values, grad.reshape(-1)[positions])
            grad_input.view(-1)[positions] = exact.to(grad_input.dtype)
        return grad_input, None, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, x, boundaries, interval_codes, levels32, levels64, bits, native):
        # torch.func.vmap: the op is elementwise, so it runs once on the whole batch; each example's codes start on a
        # group of 8 (the batch is padded per example) so that a per-example backward (vmap of grad) reads its own
        # codes, and the non-finite record is the per-example flag (as under torch.compile).
        if any(dim is not None for dim in in_dims[1:5]):
            raise FewBitError("few-bit activations under torch.func.vmap take a batched input, not a batched table")
        if in_dims[0] is None:
            return _FewBitFunction.apply(x, boundaries, interval_codes, levels32, levels64, bits, native), (None,) * 4
        batch = x.movedim(in_dims[0], 0)
        size = info.batch_size
        example = batch.shape[1:]
        numel = math.prod(example)
        padded = -(-numel // 8) * 8
        flat = batch.reshape(size, numel)
        if padded != numel:
            flat = torch.nn.functional.pad(flat, (0, padded - numel))
        y, packed, _, _ = _FewBitFunction.apply(flat, boundaries, interval_codes, levels32, levels64, bits, native)
        y = y[:, :numel].reshape(batch.shape)
        packed = packed.reshape(size, (padded // 8) * bits)
        flag = ~torch.isfinite(batch.detach().reshape(size, numel)).all(dim=1)
        return (y, packed, flag, None), (0, 0, 0, None)


def _functorch_wrapped(tensor: torch.Tensor) -> bool:
    """A batched or wrapped tensor of torch.func."""
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def _requires_grad(x: torch.Tensor) -> bool:
    """``x.requires_grad``, looking through torch.func.vmap's batching (a batched tensor reports False even when
    the tensor it batches requires grad, as in ``grad(vmap(f))``)."""
    if x.requires_grad:
        return True
    if torch.compiler.is_compiling():
        return False
    while torch._C._functorch.is_batchedtensor(x):
        x = torch._C._functorch.get_unwrapped(x)
        if x.requires_grad:
            return True
    return False


def _check_transforms() -> None:
    """Under torch.func: first-order reverse mode (grad, vjp, jacrev) and vmap work; forward mode and higher orders
    raise (the codes give no derivative of the backward)."""
    stack = torch._C._functorch.get_interpreter_stack()
    if not stack:
        return
    keys = [str(interpreter.key()) for interpreter in stack]
    if any(key.endswith("Jvp") for key in keys):
        raise FewBitError(
            "few-bit activations do not support forward-mode AD (torch.func.jvp, jacfwd, hessian): they have a "
            "backward only; use torch.func.grad / vjp / jacrev, or the native torch activation"
        )
    if sum(key.endswith("Grad") for key in keys) > 1:
        raise FewBitError(SECOND_ORDER_MESSAGE.format(bits="b"))


def fewbit_activation(
    x: torch.Tensor, native: Callable[[torch.Tensor], torch.Tensor], tensors: TableTensors
) -> torch.Tensor:
    """``native(x)``, with a backward that uses the table in ``tensors`` and stores ``tensors.bits`` bits per element.

    Without autograd (x does not require grad, or grad mode is off) this is just ``native(x)``.

    ``torch.func``: ``grad``, ``vjp``, ``jacrev`` and ``vmap`` (in any nesting with one reverse-mode level) give the
    same few-bit gradient as eager autograd, bitwise; under ``vmap`` a non-finite input makes its whole example's
    gradient NaN (the flag of the compiled form). ``jvp`` / ``jacfwd`` alone never reach the backward (the input
    does not require grad there), so they differentiate the native function exactly. A reverse-mode level inside
    another (``grad(grad(f))``) or inside forward mode (``hessian``) raises :class:`FewBitError`: the codes give no
    derivative of the backward.
    """
    if not (torch.is_grad_enabled() and _requires_grad(x)):
        return native(x)
    if x.dtype not in SUPPORTED_DTYPES:
        raise FewBitError(f"few-bit activations take float32, float16, bfloat16 or float64 input, got {x.dtype}")
    if not torch.compiler.is_compiling():
        _check_transforms()
    boundaries, _ = tensors.for_input(x.dtype)
    y, _, _, _ = _FewBitFunction.apply(
        x, boundaries, tensors.interval_codes, tensors.levels32, tensors.levels64, tensors.bits, native
    )
    return y
