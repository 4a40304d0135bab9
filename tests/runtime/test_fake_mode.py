"""Fake mode measures what real tensors would: ``runtime.fake.fake_mode`` (FakeTensorMode; nothing allocated) gives
the same bytes saved for backward (``memory.saved_bytes``), the same peak of live bytes (``memory.peak``) and the same
``runtime.convert`` decisions as real tensors, for every family of tests/families.py, native and converted; and the
planner's profile the same bytes. Every comparison is exact: both sides count whole storages of the same shapes and
dtypes (no floating point in a byte count), so any difference is a difference in what was allocated or kept."""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch
from families import FAMILIES, build
from torch._subclasses.fake_tensor import FakeTensorMode

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime.fake import deepcopy_module, fake_mode, is_fake
from fewbit_design.runtime.probe import caches_disabled, step_loss


def _measure(family: str, fake: bool, convert: dict | None = None) -> dict:
    """Bytes of one forward (saved for backward) and of one training step (peak, baseline) of a tiny ``family``
    model, converted with ``runtime.convert(**convert)`` (None: native), built and run under fake mode or with real
    tensors."""
    with fake_mode() if fake else contextlib.nullcontext(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inputs = build(family)
        if convert is not None:
            model = runtime.convert(model, **convert)
        assert all(is_fake(p) for p in model.parameters()) == fake
        with caches_disabled(model):
            with memory.saved_bytes(model) as saved:
                output = model(**inputs)
            del output
            with memory.peak(model, *inputs.values()) as peak:
                step_loss(model(**inputs)).backward()
        report = getattr(model, "convert_report", None)
        statuses = {item.name: item.status for item in report.techniques} if report is not None else {}
    return {
        "saved": saved.total,
        "by_module": saved.by_module,
        "peak": peak.peak_bytes,
        "baseline": peak.baseline_bytes,
        "convert": statuses,
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_fake_mode_native_bytes_equal_real(family):
    real, fake = _measure(family, False), _measure(family, True)
    assert fake == real


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fake_mode_convert_decides_and_measures_as_real(family):
    # runtime.convert under fake mode failed first in the norms converter's probe ("_apply(): Couldn't swap
    # LlamaRMSNorm.weight"), then wherever a technique read values; now it applies the same techniques
    real, fake = _measure(family, False, {}), _measure(family, True, {})
    assert fake["convert"] == real["convert"]
    assert any(status == "applied" for status in real["convert"].values())
    assert fake == real


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fake_mode_compressed_linears_save_what_real_ones_save(family):
    # compressed linear layers share one set of codes per input tensor, found by its address: fake tensors have
    # none (every address 0), so every layer took the first layer's codes. The attention core is left exact here:
    # its compressed form shares its output's codes with o_proj on real CPU tensors only (see docs/memory.md).
    real = _measure(family, False, {"compress": 4, "attention": False})
    fake = _measure(family, True, {"compress": 4, "attention": False})
    assert fake["convert"] == real["convert"]
    assert (fake["saved"], fake["by_module"]) == (real["saved"], real["by_module"])


def test_norm_probe_on_fake_weights_decides_as_on_real_ones():
    # the probe of a norm's formula runs real arithmetic on random weights: on fake parameters it runs on a real
    # stand-in of the same shape and dtype, and picks the same formula
    from fewbit_design.runtime.norms.convert import convert as norms_convert

    decisions = []
    default = torch.get_default_dtype()
    for fake in (False, True):
        torch.set_default_dtype(torch.bfloat16)  # (Module.to cannot convert fake parameters: built in bfloat16)
        try:
            with fake_mode() if fake else contextlib.nullcontext():
                model, _ = build("gemma")
                assert model.model.norm.weight.dtype == torch.bfloat16
                decisions.append(norms_convert(model).norms_report)
        finally:
            torch.set_default_dtype(default)
    assert decisions[0].replaced == decisions[1].replaced
    assert decisions[0].left == decisions[1].left
    assert len(decisions[0].replaced) == 3


def test_fake_storages_are_told_apart():
    # memory.storage_key named a storage by its address; every fake storage has address 0, so the baseline of
    # memory.peak counted one fake storage for all of a model's parameters
    with fake_mode():
        layer = torch.nn.Linear(16, 16)
        with memory.peak(layer) as peak:
            pass
    assert peak.baseline_bytes == (16 * 16 + 16) * 4
    assert memory.storage_key(layer.weight) != memory.storage_key(layer.bias)


def test_deepcopy_module_keeps_fake_tensors_in_their_mode():
    with fake_mode() as mode:
        layer = torch.nn.Linear(4, 4)
        copied = deepcopy_module(layer)
        assert copied.weight is not layer.weight
        assert copied.weight.fake_mode is mode
        copied(torch.randn(2, 4)).sum().backward()  # a second mode would raise "Mixing fake modes"


def test_huggingface_masks_under_fake_mode_are_those_of_a_full_batch():
    # on fake position ids Hugging Face cannot tell one sequence per row from packed ones and builds the 4-D mask
    # (batch x 1 x sequence x sequence) that a real run leaves to SDPA; it is kept for backward
    totals = {}
    for name, mode in (("real", contextlib.nullcontext), ("fake", fake_mode), ("bare", FakeTensorMode)):
        with mode():
            model, inputs = build("llama")
            model.config.use_cache = False
            with memory.saved_bytes(model) as saved:
                model(**inputs)
        totals[name] = saved.total
    assert totals["fake"] == totals["real"]
    assert totals["bare"] > totals["real"]


@pytest.mark.slow
def test_planner_profile_under_fake_mode_has_the_real_bytes():
    import dataclasses

    def costs(fake: bool):
        with fake_mode() if fake else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, inputs = build("llama", layers=2)
            plan = runtime.plan_memory(model, example_kwargs=inputs, allow=("checkpoint", "norms"), repeats=1)
        blocks = [
            [{k: v for k, v in dataclasses.asdict(o).items() if k not in ("seconds", "spread")} for o in b.options]
            for b in plan.costs.blocks
        ]
        return blocks, plan.costs.entry_bytes, plan.costs.post_bytes, plan.baseline_bytes

    assert costs(True) == costs(False)


def test_step_loss_frees_its_partial_sums():
    # step_loss summed the outputs in a closure that called itself: a reference cycle that kept every partial sum
    # alive until Python's garbage collector ran (at a moment that differed between runs, moving measured peaks)
    x = torch.randn(10, requires_grad=True)
    enabled = gc.isenabled()
    gc.disable()
    try:
        with memory.peak(x) as peak:
            first, second = x * 1, x * 2
            loss = step_loss({"a": first, "b": (second,)})
            live = peak.live_bytes
    finally:
        if enabled:
            gc.enable()
    assert loss.shape == ()
    assert live == 40 + 40 + 4  # the two outputs and the loss: the partial sums and their stack are freed


def test_fewbit_codes_of_a_small_input_are_counted_in_the_peak():
    # the numba forward of a small input writes its codes into numpy memory (torch.from_numpy): no operator
    # returns them, so memory.peak did not count them unless told (memory.count_storage)
    from fewbit_design.runtime.fewbit.backends import use_backend

    pytest.importorskip("numba")
    activation = runtime.nn.GELU(bits=3)
    x = torch.randn(1000, requires_grad=True)
    with use_backend("numba"), memory.peak(x) as peak:
        y = activation(x)
        live = peak.live_bytes
    assert y.shape == x.shape
    assert live == 1000 * 4 + (1000 // 8) * 3  # y and the 3-bit codes


def test_transformers_imported_inside_the_block_gets_the_full_batch_masks_too():
    """A script that enters ``fake_mode()`` before it imports transformers (a fresh process) measures as real."""
    import subprocess
    import sys

    script = """
import torch
from fewbit_design.runtime import memory
from fewbit_design.runtime.fake import fake_mode

def measure():
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_hidden_layers=1, vocab_size=64, use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 32))
    with memory.saved_bytes(model) as saved:
        model(input_ids=ids)
    return saved.total

with fake_mode():
    fake = measure()
print(fake, measure())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    fake, real = map(int, result.stdout.split())
    assert fake == real


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_a_compressed_norm_step_peak_under_fake_mode_is_the_real_one(kind):
    # the compressed norm's backward allocates float32 temporaries (the gradient, xhat, the fused kernel's output)
    # that its custom op's fake kernel does not: under fake mode it runs its eager body, whose allocations the peak
    # counts (fake mode's peak of a Llama-3-8B-width compress=8 step was 3.2% below the real one before)
    def measure(fake: bool) -> tuple[int, int]:
        with fake_mode() if fake else contextlib.nullcontext():
            torch.manual_seed(0)
            norm = torch.nn.LayerNorm if kind == "layer_norm" else torch.nn.RMSNorm
            model = runtime.norms.convert(torch.nn.Sequential(norm(256, dtype=torch.bfloat16)), bits=8)
            x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
            with memory.peak(model, x) as peak:
                model(x * 1).float().sum().backward()
        return peak.peak_bytes, peak.baseline_bytes

    assert measure(True) == measure(False)


def test_cuda_kernels_keep_what_a_gpus_kernels_keep():
    """fake_mode(kernels="cuda"): native SDPA with dropout keeps what a fused kernel keeps (q, k, v, the output and
    the float32 log-sum-exp: no S x S probabilities or mask, as CUDA's flash kernel), native dropout a bool mask (one
    byte per element, CUDA's native_dropout) where the CPU keeps bfloat16 noise (two); the default follows the CPU's
    kernels, and the functions are torch's again after the block."""
    batch, heads, rows, dim = 2, 4, 128, 16
    fused = 4 * batch * heads * rows * dim * 2 + batch * heads * rows * 4  # q, k, v, output (bfloat16), lse
    kept = {}
    for kernels in ("cpu", "cuda"):
        with fake_mode(kernels=kernels):
            q, k, v = (torch.randn(batch, heads, rows, dim, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
            q, k, v = q * 1.0, k * 1.0, v * 1.0  # not leaves: counted where kept
            with memory.saved_bytes() as attention:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
            x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True) * 1.0
            with memory.saved_bytes() as dropout:
                torch.nn.functional.dropout(x, 0.1, training=True)
        kept[kernels] = attention.total, dropout.total
    assert kept["cuda"] == (fused, 64 * 32)
    assert kept["cpu"][0] > fused + batch * heads * rows * rows and kept["cpu"][1] == 2 * 64 * 32
    assert torch.nn.functional.dropout.__module__ == "torch.nn.functional"
    with pytest.raises(FewBitError, match="kernels must be 'cpu' or 'cuda', got 'tpu'"):
        with fake_mode(kernels="tpu"):
            pass
