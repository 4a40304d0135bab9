"""Memory-sharing norms (runtime.norms): forward bitwise the native module's, gradients (input, weight, bias) equal
to the native ones for every class the converter covers, in float32 and bfloat16; weights at or near zero; the op
under opcheck and torch.compile; convert's report and its bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import norms
from fewbit_design.runtime.norms import MemorySharingNorm
from fewbit_design.runtime.norms.technique import TECHNIQUE, NormsOptions

transformers = pytest.importorskip("transformers")

WIDTH = 48

# Gradient tolerance, relative to the largest native gradient (normwise), per dtype.
# float32: the backward reconstructs xhat = (y - b) / w from the float32 output (error <= u * (|xhat| + 1 /
# threshold), u = 6e-8, threshold 0.25) and reduces in another order than torch's kernels: a few roundings times
# log2(width); 1e-5 is ~100 u, far below any real error (a wrong formula or a wrong channel is O(1)).
# bfloat16: both backwards end in a bfloat16 rounding (1/2 ulp each, ulp = 2^-8 relative at the top) and the
# reconstruction starts from a bfloat16 output (LLaMA: also a bfloat16 xhat before the scale), so 2-3 ulps apart
# is rounding; 2^-6 (4 ulps) bounds it, while a wrong gradient is off by O(1).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}


def _hf(module: str, name: str):
    return getattr(__import__(f"transformers.models.{module}.modeling_{module}", fromlist=[name]), name)


NORMS = {
    "LayerNorm": lambda: torch.nn.LayerNorm(WIDTH),
    "LayerNorm-no-bias": lambda: torch.nn.LayerNorm(WIDTH, bias=False),
    "LayerNorm-no-affine": lambda: torch.nn.LayerNorm(WIDTH, elementwise_affine=False),
    "LayerNorm-2d": lambda: torch.nn.LayerNorm((4, WIDTH // 4)),
    "RMSNorm": lambda: torch.nn.RMSNorm(WIDTH, eps=1e-6),
    "RMSNorm-default-eps": lambda: torch.nn.RMSNorm(WIDTH),
    "LlamaRMSNorm": lambda: _hf("llama", "LlamaRMSNorm")(WIDTH),
    "MistralRMSNorm": lambda: _hf("mistral", "MistralRMSNorm")(WIDTH),
    "Qwen2RMSNorm": lambda: _hf("qwen2", "Qwen2RMSNorm")(WIDTH),
    "Phi3RMSNorm": lambda: _hf("phi3", "Phi3RMSNorm")(WIDTH),
    "T5LayerNorm": lambda: _hf("t5", "T5LayerNorm")(WIDTH),
    "GemmaRMSNorm": lambda: _hf("gemma", "GemmaRMSNorm")(WIDTH),
}
KINDS = {"LayerNorm": "layer_norm", "RMSNorm": "rms_norm", "T5LayerNorm": "t5", "GemmaRMSNorm": "gemma"}


def _randomised(module: torch.nn.Module, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
            if parameter.dim() and parameter is getattr(module, "bias", None):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return module.to(dtype)


def _converted(module: torch.nn.Module) -> torch.nn.Module:
    holder = norms.convert(torch.nn.Sequential(copy.deepcopy(module)))
    assert isinstance(holder[0], MemorySharingNorm), holder.norms_report
    return holder[0]


def _gradients(module: torch.nn.Module, x: torch.Tensor, upstream: torch.Tensor):
    leaf = x.detach().clone().requires_grad_()
    y = module(leaf)
    parameters = [p for p in (getattr(module, "weight", None), getattr(module, "bias", None)) if p is not None]
    return y, torch.autograd.grad(y, [leaf, *parameters], upstream.to(y.dtype))


def _assert_close(native: torch.Tensor, ours: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert ours.dtype == native.dtype and ours.shape == native.shape, what
    assert torch.isfinite(ours).all(), what
    scale = float(native.abs().max().float())
    error = float((native.float() - ours.float()).abs().max())
    assert error <= TOLERANCE[dtype] * scale, f"{what}: {error:.3g} > {TOLERANCE[dtype]:g} * {scale:.3g}"


def _input(shape, dtype, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 2 + 0.3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(NORMS))
def test_gradients_equal_native(name, dtype):
    native = _randomised(NORMS[name](), dtype)
    ours = _converted(native)
    assert ours.kind == KINDS.get(name.split("-")[0], "llama")
    shape = (3, 5, *getattr(native, "normalized_shape", (WIDTH,)))
    x, upstream = _input(shape, dtype), _input(shape, torch.float32, seed=2)
    y_native, grads_native = _gradients(native, x, upstream)
    y_ours, grads_ours = _gradients(ours, x, upstream)
    assert torch.equal(y_native, y_ours)  # the forward is the original's, op for op
    for what, a, b in zip(("input", "weight", "bias")[: len(grads_native)], grads_native, grads_ours, strict=True):
        _assert_close(a, b, dtype, f"{name} {dtype} {what} gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["LayerNorm", "LayerNorm-no-bias", "RMSNorm", "LlamaRMSNorm", "GemmaRMSNorm"])
def test_weights_at_or_near_zero_keep_their_channels_and_give_native_gradients(name, dtype):
    native = _randomised(NORMS[name](), dtype)
    offset = -1.0 if name == "GemmaRMSNorm" else 0.0  # Gemma scales by 1 + weight: zero at weight -1
    with torch.no_grad():
        native.weight[:3] = offset  # exact zeros
        native.weight[3] = offset + 1e-30  # tiny: underflows y with a bias or in bfloat16 precision
        native.weight[4] = offset - 1e-12
        native.weight[5] = offset + 2.0**-20
        if getattr(native, "bias", None) is not None:
            native.bias[6] = 2.0
            native.weight[6] = 0.1  # small next to its bias: y's rounding (of ~2) over 0.1 is not rounding of xhat
    ours = _converted(native)
    x, upstream = _input((4, 7, WIDTH), dtype), _input((4, 7, WIDTH), torch.float32, seed=2)
    y_native, grads_native = _gradients(native, x, upstream)
    y_ours, grads_ours = _gradients(ours, x, upstream)
    assert torch.equal(y_native, y_ours)
    for what, a, b in zip(("input", "weight", "bias")[: len(grads_native)], grads_native, grads_ours, strict=True):
        _assert_close(a, b, dtype, f"{name} {dtype} {what} gradient")


def test_kept_channels_are_exactly_the_uninvertible_ones():
    # kept where |w| < threshold * (|b| + tiny / eps), threshold 0.25, tiny / eps = 1e-31 for float32
    norm = MemorySharingNorm(
        (8,),
        kind="layer_norm",
        eps=1e-5,
        weight=torch.nn.Parameter(torch.tensor([0.0, 1e-30, 0.1, 0.1, -0.9, 1.0, 1e-35, 1e-30])),
        bias=torch.nn.Parameter(torch.tensor([0.0, 1e-3, 1.0, 0.2, 4.0, 0.0, 0.0, 0.0])),
    )
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(torch.randn(5, 8, requires_grad=True))
    channels = next(t for t in saved if t.dtype == torch.int64)
    # kept: a zero; 1e-30 next to a bias of 1e-3; 0.1 next to 1; 0.9 next to 4; 1e-35 (y underflows).
    # inverted: 0.1 next to 0.2 (0.1 >= 0.05), 1 without bias, 1e-30 without bias (y = 1e-30 * xhat is normal)
    assert channels.tolist() == [0, 1, 2, 4, 6]
    kept = next(t for t in saved if t.dim() == 2 and t.shape[1] == 5)
    assert kept.shape == (5, 5) and kept.dtype == torch.float32


def test_opcheck_on_the_custom_ops():
    x = torch.randn(3, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.rand(8) + 0.5)
    with torch.no_grad():
        weight[1] = 0.0  # a kept channel: the data-dependent [rows, k] output
    bias = torch.nn.Parameter(torch.randn(8))
    cases = [
        (x, weight, bias, "layer_norm", 1, 1e-5, 0.25, -1),
        (x, weight, bias, "layer_norm", 1, 1e-5, 0.25, 3),  # the static count compile uses: one extra channel kept
        (x, None, None, "layer_norm", 1, 1e-5, 0.25, -1),
        (x, weight, None, "rms_norm", 1, 1e-6, 0.25, -1),
        (x.detach().bfloat16().requires_grad_(), weight, None, "llama", 1, 1e-6, 0.25, -1),
        (x, weight, None, "gemma", 1, 1e-6, 0.25, 2),
    ]
    for args in cases:
        torch.library.opcheck(torch.ops.fewbit.norm_forward.default, args)


@pytest.mark.parametrize("name", ["LayerNorm", "LlamaRMSNorm"])
def test_compiled_gradients_equal_eager_and_native(name):
    torch._dynamo.reset()
    native = _randomised(NORMS[name](), torch.float32)
    with torch.no_grad():
        native.weight[0] = 0.0  # a kept channel under compile too
    model = torch.nn.Sequential(native, torch.nn.Linear(WIDTH, 8))
    converted = norms.convert(copy.deepcopy(model))
    compiled = torch.compile(converted, backend="aot_eager")
    x = _input((2, 5, WIDTH), torch.float32)
    results = []
    for module in (model, converted, compiled):
        leaf = x.clone().requires_grad_()
        module(leaf).square().sum().backward()
        results.append([leaf.grad, *(p.grad for p in module.parameters())])
        module.zero_grad()
    for native_grad, eager_grad, compiled_grad in zip(*results, strict=True):
        _assert_close(native_grad, eager_grad, torch.float32, f"{name} eager")
        _assert_close(eager_grad, compiled_grad, torch.float32, f"{name} compiled")


def test_convert_reports_replaced_and_left_modules_and_is_idempotent():
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.GroupNorm(1, 8),
        _hf("llama", "LlamaRMSNorm")(8),
    )  # fmt: skip
    weight = model[0].weight
    converted = norms.convert(model)
    assert converted is model and converted[0].weight is weight  # in place, parameters shared
    report = model.norms_report
    assert report.replaced == {"0": "LayerNorm as layer_norm", "4": "LlamaRMSNorm as llama"}
    assert set(report.left) == {"2", "3"} and all("probe" in reason for reason in report.left.values())
    before = [type(m) for m in model.modules()]
    assert norms.convert(model).norms_report.replaced == {}
    assert [type(m) for m in model.modules()] == before
    assert TECHNIQUE.name == "norms" and TECHNIQUE.exact and TECHNIQUE.seam == "module"
    lone = torch.nn.LayerNorm(8)
    assert isinstance(TECHNIQUE.apply(lone, TECHNIQUE.config({})), MemorySharingNorm)
    assert TECHNIQUE.changes_block(torch.nn.Sequential(torch.nn.RMSNorm(8)), NormsOptions(0.25))
    assert not TECHNIQUE.changes_block(model, NormsOptions(0.25))


class _ScaledNorm(torch.nn.Module):
    """Looks like an RMSNorm (1-D weight, eps) but computes another function: must be left alone."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + self.eps)


def test_a_norm_lookalike_with_another_formula_is_left_with_the_reason():
    model = torch.nn.Sequential(_ScaledNorm(8))
    norms.convert(model)
    assert isinstance(model[0], _ScaledNorm)
    assert "no known norm form agrees on the probe" in model.norms_report.left["0"]


def test_convert_leaves_the_callers_random_stream_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    norms.convert(torch.nn.Sequential(torch.nn.LayerNorm(8), _hf("gemma", "GemmaRMSNorm")(8)))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: norms.convert("model.pt"), "norms.convert takes a torch.nn.Module, got str"),
        (lambda: norms.convert(torch.nn.LayerNorm(4), threshold=0), "norms threshold must be > 0, got 0"),
        (
            lambda: norms.convert(torch.nn.LayerNorm(4))(torch.randn(2, 5)),
            "layer_norm norm over the last dimensions (4,) got an input of shape (2, 5)",
        ),
        (lambda: MemorySharingNorm((4,), kind="batch", eps=1e-5), "norm kind must be"),
    ],
)
def test_bad_input_gives_one_fewbit_error_line(call, message):
    with pytest.raises(FewBitError) as raised:
        call()
    assert message in str(raised.value) and "\n" not in str(raised.value)
