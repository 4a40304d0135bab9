"""The compressed linear op: an exact forward, and a backward whose weight gradient reads K-bit codes of the input.

For ``y = x W^T + b`` (``nn.Linear``; Hugging Face's ``Conv1D`` is the same with the weight stored transposed,
``y = x W + b``) the backward needs the input only for the weight gradient ``dW = g^T x``. The op keeps the input as
K-bit group codes (:mod:`.quant`) instead of x, so:

* forward: ``F.linear(x, W, b)`` (``torch.addmm(b, x, W)`` for Conv1D), the very call the native module makes: bitwise
  equal to it;
* ``dX = g W`` (exact: W is a parameter, kept anyway), ``db = sum of g`` over rows (exact);
* ``dW = g^T x~`` with ``x~`` the decoded input: unbiased under stochastic rounding, and
  ``|dW - g^T x| <= |g|^T step`` element-wise (half that with nearest rounding), ``step`` the per-group grid step.

Saved for backward: the packed codes and the scales (:func:`.quant.saved_nbytes`), plus the weight (a parameter,
which autograd's accounting does not count). When the weight does not require grad, nothing about x is needed and
the op is not used (the native call saves only the weight).

Shared inputs: a tensor computed in the forward (it has a ``grad_fn``) that several layers take, such as the
normalised hidden state feeding the q, k and v projections or a gated MLP's gate and up projections, is quantized
once per (bits, group size, rounding): the layers save one set of codes, as native saves one x. An input the caller
created (no ``grad_fn``) is quantized afresh at every call. Under ``torch.compile`` the codes a module hands over
with :func:`share_codes` (a compressed norm's output) are shared the same way; layers that share an input no module
handed codes of quantize it each. In eager the op runs as its autograd.Function twin
(:mod:`fewbit_design.runtime._eager`).

Custom ops (``torch.library``, fake kernels, ``register_autograd``): ``fewbit::compressed_linear`` (this op),
``fewbit::group_quantize`` and ``fewbit::group_dequantize`` (:mod:`.quant`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from .._eager import eager_twin, tracing
from ..flops import register_flops, rows
from .quant import GROUP_SIZE, check_options, dequantize_codes, quantize_codes

__all__ = ["compressed_linear", "native_linear", "share_codes"]


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """What the native module computes: ``F.linear`` (nn.Linear) or Conv1D's ``addmm`` on the flattened rows."""
    if not transposed:
        return torch.nn.functional.linear(x, weight, bias)
    size_out = x.shape[:-1] + (weight.shape[1],)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.addmm(bias, rows, weight) if bias is not None else torch.mm(rows, weight)
    return out.view(size_out)


def _compressed_linear_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group_size: int,
    transposed: bool,
) -> torch.Tensor:
    return native_linear(x, weight, bias, transposed)


_compressed_linear = torch.library.custom_op("fewbit::compressed_linear", mutates_args=())(_compressed_linear_impl)


@_compressed_linear.register_fake
def _(x, weight, bias, packed, scales, bits, group_size, transposed):
    out_features = weight.shape[1] if transposed else weight.shape[0]
    return x.new_empty(x.shape[:-1] + (out_features,))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, packed, scales, bits, group_size, transposed = inputs
    ctx.save_for_backward(weight, packed, scales)
    ctx.x_shape = x.shape
    ctx.options = (bits, group_size, transposed)
    ctx.has_bias = bias is not None


def _backward(ctx, grad: torch.Tensor):
    weight, packed, scales = ctx.saved_tensors
    bits, group_size, transposed = ctx.options
    features = ctx.x_shape[-1]
    rows = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        # dX = g W (Linear, W: out x in) or g W^T (Conv1D, W: in x out): exact
        grad_x = rows.mm(weight.t() if transposed else weight).reshape(ctx.x_shape)
    if ctx.needs_input_grad[1]:
        decoded = dequantize_codes(packed, scales, features, bits, group_size, grad.dtype)
        # dW = g^T x~ (Linear) or x~^T g (Conv1D): the only place the codes are read
        grad_weight = decoded.t().mm(rows) if transposed else rows.t().mm(decoded)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = rows.sum(0)
    return grad_x, grad_weight, grad_bias, None, None, None, None, None


_compressed_linear.register_autograd(_backward, setup_context=_setup_context)
register_flops("compressed_linear")(lambda arguments: 2.0 * rows(arguments["x"]) * arguments["weight"].numel())
_CompressedLinearEager = eager_twin(_compressed_linear_impl, _setup_context, _backward)


# ----------------------------------------------------------------------------------------------------------------------
# One set of codes per input tensor (eager)


class _SharedCodes:
    """Codes of the forward's intermediate tensors, keyed by the data they read: a tensor's address, strides, shape
    and dtype, so a view of the same elements (Hugging Face reshapes the attention output before the output
    projection) finds the codes made for another view. An entry lives while the tensor it was made for (or the base
    it is a view of, which holds the storage) lives, so the address names those elements; it is dropped when that
    tensor is freed and ignored once the elements change in place (views share one version counter)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[Any, int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(x: torch.Tensor, options: tuple) -> tuple:
        if is_fake(x):  # no address: the storage object (alive while the entry's owner is) and the offset in it
            return (id(x.untyped_storage()), x.storage_offset(), x.stride(), options)
        return (x.data_ptr(), x.stride(), options)

    def get(self, x: torch.Tensor, options: tuple, make) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            return _traced_get(x, options, make)
        if x.grad_fn is None:
            return make()
        with self._lock:
            entry = self._entries.get(self._key(x, options))
        if entry is not None:
            owner = entry[0]()
            if owner is not None and entry[1] == x._version == owner._version:
                return entry[2]
        codes = make()
        self.put(x, options, codes)
        return codes

    def put(self, x: torch.Tensor, options: tuple, codes: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Record ``codes`` as x's for these options (eager tensors computed in the forward only; under
        ``torch.compile``, on the traced tensor itself: :func:`_traced_get`)."""
        if torch.compiler.is_compiling():
            setattr(x, _TRACED_CODES, {**getattr(x, _TRACED_CODES, {}), options: codes})
            return
        if x.grad_fn is None:
            return
        key = self._key(x, options)
        owner = x if x._base is None else x._base  # a view's base holds the storage (and lives as long as the view)
        entries, lock = self._entries, self._lock

        def forget(ref, key=key, entries=entries, lock=lock):
            with lock:
                if key in entries and entries[key][0] is ref:  # not a later entry for the same data
                    del entries[key]

        with lock:
            entries[key] = (weakref.ref(owner, forget), x._version, codes)


_SHARED = _SharedCodes()

#: the attribute of a traced tensor holding the codes its producer handed over under ``torch.compile``
_TRACED_CODES = "_fewbit_codes"


def _traced_get(x: torch.Tensor, options: tuple, make) -> tuple[torch.Tensor, torch.Tensor]:
    """Under ``torch.compile``: the codes the module that computed x handed over (:func:`share_codes`), else new
    ones. Dynamo traces the attribute as a side effect on the traced tensor, so the layers reading the norm's output
    (q, k and v) read one node of the graph and the graph keeps one set of codes, as eager does. Only producers
    record codes, on a tensor they made in this step (an intermediate, whose attribute ends with the trace, or the
    output of an earlier graph of the same step, which carries them to the next); codes a layer makes are not
    recorded, since its input may be a graph input, which would carry them past the call."""
    found = getattr(x, _TRACED_CODES, None)
    if found is not None and options in found:
        return found[options]
    return make()


def _codes(x: torch.Tensor, bits: int, group_size: int, stochastic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    def make():
        # the seed comes from torch's default CPU generator: torch.manual_seed makes the codes reproducible
        seed = torch.randint(0, 2**62, (), dtype=torch.int64)
        return quantize_codes(x, bits, group_size, stochastic, seed)

    return _SHARED.get(x, (bits, group_size, stochastic, x.shape, x.dtype), make)


def share_codes(
    x: torch.Tensor, codes: tuple[torch.Tensor, torch.Tensor], *, bits: int, group_size: int, rounding: str
) -> None:
    """Make ``codes`` (``(packed, scales)`` of x from ``fewbit::group_quantize`` with these options) the codes every
    compressed linear layer reading x with the same options saves, instead of quantizing x again: a module that
    computes x and keeps its codes itself (a memory-sharing norm in compressed mode) and the layers after it then
    keep one set. A layer fed a view of the same elements (same address, shape, strides, dtype) finds them too: the
    attention core hands its output's codes to the output projection, which reads a reshaped view of it. Under
    ``torch.compile`` the codes ride on the traced tensor itself (:func:`_traced_get`: give a tensor the producer made
    with a single-output op, such as ``y.view(y.shape)``, which dynamo tracks); in eager they are found by address,
    and ignored for a tensor without ``grad_fn``.

    Args:
        x: the tensor the codes are of
        codes: its packed codes and scales
        bits: bits per code
        group_size: values per group
        rounding: ``'stochastic'`` or ``'nearest'``, how the codes were rounded
    """
    _SHARED.put(x, (bits, group_size, rounding == "stochastic", x.shape, x.dtype), codes)


def compressed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    bits: int = 8,
    group_size: int = GROUP_SIZE,
    rounding: str = "stochastic",
    transposed: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``transposed``: Conv1D's ``x W + b``, weight in x out) that keeps x for the
    weight gradient as ``bits``-bit group codes (module docstring). Without a weight gradient to compute (grad mode
    off, or the weight does not require grad) it is the native call.

    >>> layer = torch.nn.Linear(64, 8)
    >>> x = torch.randn(4, 64)
    >>> torch.equal(compressed_linear(x, layer.weight, layer.bias, bits=4), layer(x))
    True

    Args:
        x: the input, features last
        weight: (out, in), or (in, out) with ``transposed``
        bias: the bias or None
        bits: bits per element of the saved codes
        group_size: elements per quantization group
        rounding: ``'stochastic'`` or ``'nearest'``
        transposed: Conv1D's layout
    """
    bits, group_size, rounding = check_options(bits, group_size, rounding)
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return native_linear(x, weight, bias, transposed)
    packed, scales = _codes(x, bits, group_size, rounding == "stochastic")
    arguments = (x, weight, bias, packed, scales, bits, group_size, transposed)
    if tracing(x, weight):
        return torch.ops.fewbit.compressed_linear(*arguments)
    return _CompressedLinearEager.apply(*arguments)  # the same op without the custom-op dispatch (runtime._eager)
