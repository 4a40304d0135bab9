"""A model converted by ``runtime.convert`` in its exact modes, compiled with ``torch.compile`` (``aot_eager`` and
the default inductor backend), trains with native's loss and gradients: every family, and the decoder families with
their KV cache on (the stock ``use_cache=True``) and off, with and without grouped-query attention.

The exact attention core rebuilds v in backward from the value projection's output layout; under compile it must
still recognise a v that is not that output's view (the KV cache's ``torch.cat`` copy, which it once rebuilt with
the copy's strides: q/k gradients off by 84-234%). Compiled graphs decompose and fuse differently from eager native,
so gradients are compared within tests/tolerances.py's float32 bound; a wrong v is off by a large fraction of the
largest element."""

from __future__ import annotations

import copy

import pytest
import torch
from families import BATCH, DECODERS, FAMILIES, TOKENS, WIDTH, build, output
from tolerances import gradient_tolerance

from fewbit_design import runtime

pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")

#: float32, reductions over at most the intermediate width or the batch's tokens; the norms' reconstruction of their
#: input from the rounded output adds a few eps (tests/tolerances.py)
TOLERANCE = gradient_tolerance(torch.float32, max(WIDTH, BATCH * TOKENS), reconstruction=8.0)


def _step(model: torch.nn.Module, forward, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = output(forward, inputs).float()
    # a fixed random projection: a mean square of a normalised output would have almost no gradient at all
    direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    loss = (out * direction).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _compiled_matches_native(family: str, backend: str, **options) -> None:
    use_cache = options.pop("use_cache", None)
    native, inputs = build(family, **options)
    native.train()
    if use_cache is not None:
        native.config.use_cache = use_cache
    converted = runtime.convert(copy.deepcopy(native), activations=False)
    assert not converted.convert_report.approximate, str(converted.convert_report)
    loss, grads = _step(native, native, inputs)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(converted, backend=backend)
        got_loss, got_grads = _step(converted, compiled, inputs)
    finally:
        torch._dynamo.reset()
    # a compiled graph is one autograd node: parameters it used without a path to the loss (BERT's pooler) get
    # zero gradients where eager leaves None, as native compiled does
    assert grads.keys() <= got_grads.keys()
    assert all(not got_grads[name].any() for name in got_grads.keys() - grads.keys())
    torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
    # gradients that cancel to almost nothing (a key bias, to which softmax is invariant; CLIP's first text layer's
    # q and k weights at 1e-8, 1e-7 of the others) keep rounding errors of the size of the terms that cancel, as
    # native compiled does (measured: it differs from native eager by 100% of them): each parameter is held to the
    # tolerance at the scale of the median parameter's largest gradient element at least. A wrong gradient shows in
    # every parameter before it, most of them at or above that scale (a wrong v: 84-234% of the norm of q's)
    floor = float(torch.tensor([float(grad.abs().max()) for grad in grads.values()]).median())
    for name, grad in grads.items():
        error = float((got_grads[name] - grad).abs().max())
        scale = max(float(grad.abs().max()), floor)
        assert error <= TOLERANCE * scale, f"{family} {backend} {name}: {error:.3g} > {TOLERANCE:.3g} * {scale:.3g}"


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("family", DECODERS)
def test_compiled_converted_decoder_gradients_equal_native(family, backend, use_cache):
    # 4 query heads on 2 key/value heads: grouped, and v's view and a contiguous copy of it differ in layout (with
    # one key/value head they coincide)
    _compiled_matches_native(family, backend, use_cache=use_cache, heads=4, kv_heads=2)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in DECODERS])
def test_compiled_converted_model_gradients_equal_native_with_inductor(family):
    _compiled_matches_native(family, "inductor")
