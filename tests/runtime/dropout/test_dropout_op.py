"""The dropout op against torch's own dropout, for the same random state: the forward, the random stream after it and
the gradients are bitwise native's in both modes, every float dtype, odd sizes, 1-D to 4-D and non-contiguous views;
the mask backward applies is bitwise the one forward drew; the fused (CUDA) formula is native_dropout's, run on CPU;
the packed layout is the shared one; eval mode, no grad, p of 0 or 1 and empty inputs are native; bad input is one
FewBitError line."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import _packing, memory
from fewbit_design.runtime.dropout import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
#: (shape, view): odd sizes, 1-D to 4-D; "t": a transposed view, "slice": a strided slice (not dense)
SHAPES = [
    ((1,), None),
    ((7,), None),
    ((1023,), None),
    ((5, 8 * 9 + 3), None),
    ((3, 4, 11), "t"),
    ((2, 3, 5, 12), "slice"),
]
P = 0.3


def _input(shape, view, dtype, seed=0):
    """A leaf of ``shape`` (as the view: transposed, or every other element of the last dimension) with no zeros, so
    that ``y != 0`` is the mask."""
    generator = torch.Generator().manual_seed(seed)
    if view == "slice":
        base = torch.rand(*shape[:-1], 2 * shape[-1], generator=generator) + 0.5
        return base.to(dtype)[..., ::2].detach().requires_grad_()
    x = torch.rand(*shape, generator=generator) + 0.5
    if view == "t":
        x = x.transpose(0, -1).contiguous().transpose(0, -1)  # the same shape, column-major strides
    return x.to(dtype).detach().requires_grad_()


def _step(function, x, seed=7):
    """(y, x's gradient, the next random number) of one forward from ``torch.manual_seed(seed)`` and one backward."""
    torch.manual_seed(seed)
    y = function(x)
    after = torch.rand(4)
    grad = (torch.randn(y.shape, generator=torch.Generator().manual_seed(3)) + 2.0).to(y.dtype)
    (x_grad,) = torch.autograd.grad(y, x, grad)
    return y.detach(), x_grad, after


@pytest.mark.parametrize("mode", ops.MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "view"), SHAPES)
def test_forward_gradients_and_random_stream_are_native(mode, dtype, shape, view):
    x = _input(shape, view, dtype)
    ours = _step(lambda t: ops.dropout(t, P, mode=mode), x)
    native = _step(lambda t: F.dropout(t, P), x)
    assert torch.equal(ours[0], native[0]), "forward"
    assert torch.equal(ours[1], native[1]), "gradient"
    assert torch.equal(ours[2], native[2]), "the random stream after the call"
    assert ours[1].dtype == dtype and ours[1].shape == x.shape


@pytest.mark.parametrize("mode", ops.MODES)
@pytest.mark.parametrize(("shape", "view"), SHAPES)
def test_the_mask_backward_applies_is_bitwise_the_forward_mask(mode, shape, view):
    """The gradient of ones is the noise backward multiplies by: nonzero exactly where forward kept the element (x has
    no zeros, so ``y != 0`` is the forward's mask); a backward drawing a mask of its own fails this."""
    x = _input(shape, view, torch.float32)
    torch.manual_seed(11)
    y = ops.dropout(x, 0.5, mode=mode)
    torch.rand(100)  # the generator moves on before backward, as it does in training
    (noise,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(noise != 0, y.detach() != 0)
    assert 0 < int((y != 0).sum()) < y.numel() or y.numel() < 8  # a mask with both values (p = 0.5)
    assert torch.equal(noise[noise != 0], torch.full_like(noise[noise != 0], 2.0))


def test_the_packed_mask_saved_is_the_forward_mask():
    x = _input((37, 5), None, torch.float32)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = ops.dropout(x, P)
    (kept,) = packed
    assert kept.dtype == torch.uint8 and kept.numel() == math.ceil(x.numel() / 8)
    assert torch.equal(ops.unpack_mask(kept, x.numel()).reshape(x.shape), y.detach() != 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_formula_is_native_dropouts(dtype):
    """The path of CUDA (and XPU, lazy) devices, run on CPU: native_dropout's output for the same random state, and
    native_dropout_backward's gradient from the unpacked mask."""
    x = _input((6, 21), None, dtype)
    for operator in (ops._BitsEager.apply, torch.ops.fewbit.dropout_bits):
        torch.manual_seed(3)
        y, packed = operator(x, P, True)
        torch.manual_seed(3)
        native, mask = torch.native_dropout(x.detach(), P, True)
        assert torch.equal(y.detach(), native) and torch.equal(ops.unpack_mask(packed, x.numel()), mask.reshape(-1))
        grad = torch.randn(y.shape).to(dtype)
        (got,) = torch.autograd.grad(y, x, grad)
        assert torch.equal(got, torch.ops.aten.native_dropout_backward(grad, mask, 1.0 / (1.0 - P)))


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 1023, 8 * 125 + 3, 70_001])
def test_packed_mask_has_the_shared_layout(numel):
    mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.6
    shared = _packing.pack_reference(mask.to(torch.int64), 1)
    assert torch.equal(ops.pack_mask(mask), shared) and torch.equal(ops.pack_mask_reference(mask), shared)
    assert torch.equal(ops.unpack_mask(shared, numel), mask)
    assert torch.equal(ops.unpack_mask_reference(shared, numel), mask)


@pytest.mark.parametrize("mode", ops.MODES)
@pytest.mark.parametrize("case", ["eval", "no_grad", "no_requires_grad", "p0", "p1", "empty"], ids=lambda case: case)
def test_native_where_nothing_is_worth_keeping(mode, case):
    x = torch.rand(0, 4) if case == "empty" else torch.rand(6, 5) + 0.5
    x.requires_grad_(case != "no_requires_grad")
    p = {"p0": 0.0, "p1": 1.0}.get(case, P)
    training = case != "eval"
    results = []
    for function in (lambda t: ops.dropout(t, p, training, mode=mode), lambda t: F.dropout(t, p, training)):
        torch.manual_seed(2)
        with memory.saved_bytes() as saved, torch.set_grad_enabled(case != "no_grad"):
            y = function(x)
        results.append((y.detach(), saved.total, torch.rand(2)))
    (y, saved, after), (native, native_saved, native_after) = results
    assert torch.equal(y, native) and torch.equal(after, native_after) and saved == native_saved


@pytest.mark.parametrize("mode", ops.MODES)
def test_inplace_writes_into_the_input_as_native(mode):
    results = []
    for function in (lambda t: ops.dropout(t, P, inplace=True, mode=mode), lambda t: F.dropout(t, P, inplace=True)):
        leaf = (torch.rand(5, 9, generator=torch.Generator().manual_seed(1)) + 0.5).requires_grad_()
        hidden = leaf * 3.0
        torch.manual_seed(4)
        y = function(hidden)
        assert y is hidden
        y.backward(torch.arange(45.0).reshape(5, 9))
        results.append((y.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("mode", ops.MODES)
def test_double_backward_is_native(mode):
    results = []
    for function in (lambda t: ops.dropout(t, P, mode=mode), lambda t: F.dropout(t, P)):
        x = (torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) + 0.5).requires_grad_()
        torch.manual_seed(9)
        y = function(x)
        (grad,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad(grad.pow(2).sum(), x)
        results.append(second)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize(
    ("p", "mode", "message"),
    [
        (-0.1, "bits", r"dropout probability p must be a number >= 0, got -0\.1"),
        (1.5, "bits", r"dropout probability p must be in \[0, 1\], got 1\.5"),
        (float("nan"), "bits", "dropout probability p must be a finite number, got nan"),
        ("0.1", "bits", "dropout probability p must be a number"),
        (0.1, "bytes", "dropout mode must be 'bits' or 'seed', got 'bytes'"),
    ],
)
def test_bad_input_is_one_error_line(p, mode, message):
    with pytest.raises(FewBitError, match=message):
        ops.dropout(torch.rand(3, requires_grad=True), p, mode=mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_packing_of_other_devices_gives_the_same_op(monkeypatch, dtype):
    """The byte operations CUDA runs instead of the numba kernels (numba made unavailable): still native's forward,
    gradients and random stream."""
    monkeypatch.setattr(_packing, "_numba_available", lambda: False)
    x = _input((5, 8 * 9 + 3), None, dtype)
    ours, native = _step(lambda t: ops.dropout(t, P), x), _step(lambda t: F.dropout(t, P), x)
    assert all(torch.equal(a, b) for a, b in zip(ours, native, strict=True))


@pytest.mark.parametrize("mode", ops.MODES)
def test_checkpointed_and_autocast_blocks_are_native(mode):
    """torch.utils.checkpoint recomputes the block in backward with the random state restored, so the recomputed
    mask is the forward's; under CPU autocast the dropout runs in the linear's bfloat16 output."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 12)
    x = torch.randn(3, 12, requires_grad=True)
    results = []
    for function in (lambda t: ops.dropout(linear(t), P, mode=mode), lambda t: F.dropout(linear(t), P)):
        torch.manual_seed(6)
        y = torch.utils.checkpoint.checkpoint(function, x, use_reentrant=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = function(y)
        assert z.dtype == torch.bfloat16
        results.append((z.detach(), *torch.autograd.grad(z.float().sum(), (x, linear.weight))))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("mode", ops.MODES)
def test_torch_func_transforms_give_natives_gradient(mode):
    x = torch.rand(4, 9, generator=torch.Generator().manual_seed(1)) + 0.5
    grads = []
    for function in (lambda t: ops.dropout(t, P, mode=mode), lambda t: F.dropout(t, P)):
        torch.manual_seed(12)
        grads.append(torch.func.grad(lambda t, f=function: f(t).pow(2).sum())(x))
    assert torch.equal(grads[0], grads[1]) and bool((grads[1] == 0).any())
