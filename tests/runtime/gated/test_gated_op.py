"""The gated-MLP op (fewbit_design.runtime.gated.ops): gradients equal native autograd's for every activation and
layout, what it saves (counted by memory.saved_bytes against a count by hand from the shapes), torch.library.opcheck,
torch.compile (aot_eager) and its errors."""

import pytest
import torch
import torch.nn.functional as F

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime.gated import LAYOUTS, GatedMLP, gated_mlp
from fewbit_design.runtime.gated.ops import ACTIVATIONS

NATIVE = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}

# The op recomputes act(gate) and the product with the same torch kernels, in the same dtype and order, as native
# autograd's forward, and runs torch's own activation backward (silu_backward, gelu_backward, threshold_backward) and
# the same mm calls: gradients come out bitwise equal on one machine. The only freedom left is the order of the two
# terms of dx (commutative for two terms) and the blocking a BLAS picks for a matmul, so the tolerance is a few
# roundings of the dtype: float32 1e-5 relative (about 80 float32 ulps), bfloat16 one ulp (2^-7 relative).
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}


class NativeGated(torch.nn.Module):
    """The pattern written out with torch.nn (the native baseline), in the separate or fused layout."""

    def __init__(self, hidden, width, activation, *, fused=False, bias=False, dtype=torch.float32):
        super().__init__()
        self.fused, self.activation = fused, activation
        if fused:
            self.gate_up_proj = torch.nn.Linear(hidden, 2 * width, bias=bias, dtype=dtype)
        else:
            self.gate_proj = torch.nn.Linear(hidden, width, bias=bias, dtype=dtype)
            self.up_proj = torch.nn.Linear(hidden, width, bias=bias, dtype=dtype)
        self.down_proj = torch.nn.Linear(width, hidden, bias=bias, dtype=dtype)

    def forward(self, x):
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(NATIVE[self.activation](gate) * up)


def replacement(native):
    layout = LAYOUTS[3] if native.fused else LAYOUTS[0]
    return GatedMLP(dict(native.named_children()), layout, native.activation)


def gradients(module, x, seed=1):
    """(output, gradients of x and of every parameter) for a fixed random output gradient."""
    x = x.detach().requires_grad_()
    y = module(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype)
    return y, torch.autograd.grad(y, [x, *module.parameters()], g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["separate", "separate+bias", "fused", "fused+bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradients_equal_native(activation, layout, dtype):
    torch.manual_seed(0)
    native = NativeGated(8, 12, activation, fused="fused" in layout, bias="bias" in layout, dtype=dtype)
    x = torch.randn(2, 7, 8, dtype=dtype)
    y_native, g_native = gradients(native, x)
    y_ours, g_ours = gradients(replacement(native), x)
    torch.testing.assert_close(y_ours, y_native, **TOLERANCE[dtype])
    assert len(g_ours) == len(g_native) == 2 + len(list(native.parameters())) - 1
    for ours, theirs in zip(g_ours, g_native, strict=True):
        torch.testing.assert_close(ours, theirs, **TOLERANCE[dtype])


@pytest.mark.parametrize("shape", [(1, 8), (7, 8), (3, 1, 5, 8), (0, 8)])
def test_shapes_and_non_contiguous_input(shape):
    torch.manual_seed(0)
    native = NativeGated(8, 16, "silu", bias=True)
    x = torch.randn(*shape)
    transposed = torch.randn(shape[-1], *shape[:-1]).movedim(0, -1)  # the same shape, not contiguous
    for inputs in (x, transposed):
        y_native, g_native = gradients(native, inputs)
        y_ours, g_ours = gradients(replacement(native), inputs)
        assert y_ours.shape == y_native.shape == shape
        for ours, theirs in zip((y_ours, *g_ours), (y_native, *g_native), strict=True):
            torch.testing.assert_close(ours, theirs, **TOLERANCE[torch.float32])


def saved(module, x):
    with memory.saved_bytes(module) as counted:
        module(x * 1)  # x * 1: a non-leaf input, which the linears (and the op) save and the counter counts
    return counted.total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_saved_bytes_are_x_gate_and_up(activation, fused, dtype):
    tokens, hidden, width = 6, 8, 24
    native = NativeGated(hidden, width, activation, fused=fused, dtype=dtype)
    x = torch.randn(2, tokens // 2, hidden, dtype=dtype, requires_grad=True)
    size = torch.finfo(dtype).bits // 8
    ours = saved(replacement(native), x)
    assert ours == tokens * (hidden + 2 * width) * size  # x, gate, up
    # native keeps x, gate, act(gate), up and the product; ReLU keeps its output instead of gate (unless fused,
    # where gate is a view of the gate_up output, kept whole for the product's up)
    native_elements = hidden + (3 if activation == "relu" and not fused else 4) * width
    assert saved(native, x) == tokens * native_elements * size
    assert ours < saved(native, x)


@pytest.mark.parametrize("fused", [False, True])
def test_opcheck(fused):
    torch.manual_seed(0)
    hidden, width = 8, 6
    x = torch.randn(5, hidden, requires_grad=True)
    w_gate = torch.randn(2 * width if fused else width, hidden, requires_grad=True)
    b_gate = torch.randn(w_gate.shape[0], requires_grad=True)
    w_up = None if fused else torch.randn(width, hidden, requires_grad=True)
    b_up = None if fused else torch.randn(width, requires_grad=True)
    w_down = torch.randn(hidden, width, requires_grad=True)
    arguments = (x, w_gate, b_gate, w_up, b_up, w_down, None, "gelu")
    torch.library.opcheck(torch.ops.fewbit.gated_mlp, arguments)
    _, gate, up = torch.ops.fewbit.gated_mlp(*arguments)
    detached = [None if t is None else t.detach() for t in (x, gate, up, w_gate, w_up, w_down)]
    for input_grad in (True, False):
        torch.library.opcheck(
            torch.ops.fewbit.gated_mlp_backward, (torch.randn(5, hidden), *detached, "gelu", input_grad)
        )


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_aot_eager_gives_native_gradients_and_saves_x_gate_up(fused):
    torch.manual_seed(0)
    tokens, hidden, width = 6, 8, 16
    native = NativeGated(hidden, width, "silu", fused=fused, bias=True)
    ours = replacement(native)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    x = torch.randn(tokens, hidden)
    y_native, g_native = gradients(native, x)
    y_compiled, g_compiled = gradients(compiled, x)
    for mine, theirs in zip((y_compiled, *g_compiled), (y_native, *g_native), strict=True):
        torch.testing.assert_close(mine, theirs, **TOLERANCE[torch.float32])
    assert saved(compiled, x.requires_grad_()) == tokens * (hidden + 2 * width) * 4


def test_autocast_matches_native_autocast():
    torch.manual_seed(0)
    native = NativeGated(8, 16, "silu", bias=True)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_native, g_native = gradients(native, x)
        y_ours, g_ours = gradients(replacement(native), x)
    assert y_ours.dtype == y_native.dtype == torch.bfloat16
    for ours, theirs in zip((y_ours, *g_ours), (y_native, *g_native), strict=True):
        torch.testing.assert_close(ours, theirs, **TOLERANCE[torch.bfloat16])


def test_errors_are_one_line():
    x = torch.randn(3, 4, requires_grad=True)
    w_gate, w_up, w_down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    with pytest.raises(FewBitError, match="gated MLP activation must be .*'silu'.*, got 'tanh'"):
        gated_mlp(x, w_gate, None, w_up, None, w_down, None, "tanh")
    with pytest.raises(FewBitError, match="w_down is torch.float64 but the input is torch.float32"):
        gated_mlp(x, w_gate, None, w_up, None, w_down.double(), None, "silu")
    with pytest.raises(FewBitError, match="the input's last dimension must be the gate projection's 4 features, got"):
        gated_mlp(x.t(), w_gate, None, w_up, None, w_down, None, "silu")
    with pytest.raises(FewBitError, match="fused gate_up weight needs an even number of rows, got 7"):
        gated_mlp(x, torch.randn(7, 4), None, None, None, w_down, None, "silu")
    with pytest.raises(FewBitError, match="w_down takes 6 features but the product has 3"):
        gated_mlp(x, w_gate, None, None, None, w_down, None, "silu")
    y = gated_mlp(x, w_gate, None, w_up, None, w_down, None, "silu")
    with pytest.raises(FewBitError, match="higher-order gradients"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_compiled_inductor_once_tiny():
    # the one inductor run of this folder (slow on 2 cores): the op stays an opaque kernel inside inductor's graph,
    # whose partitioner cannot recompute into it, so the compiled forward keeps x, gate and up as in eager
    torch.manual_seed(0)
    native = NativeGated(8, 16, "silu", bias=True)
    ours = replacement(native)
    compiled = torch.compile(ours, fullgraph=True)
    x = torch.randn(6, 8)
    y_native, g_native = gradients(native, x)
    y_compiled, g_compiled = gradients(compiled, x)
    for mine, theirs in zip((y_compiled, *g_compiled), (y_native, *g_native), strict=True):
        torch.testing.assert_close(mine, theirs, **TOLERANCE[torch.float32])
    assert saved(compiled, x.requires_grad_()) == 6 * (8 + 2 * 16) * 4
