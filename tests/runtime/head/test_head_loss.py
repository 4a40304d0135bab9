"""The chunked LM head + cross-entropy (fewbit_design.runtime.head.lm_loss) against F.cross_entropy on the whole
logits: loss, gradients, what it saves for backward and its peak, under torch.compile and opcheck."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory
from fewbit_design.runtime.head import default_chunk_rows, lm_loss, lm_loss_reference

# Tolerances. float32: the chunked loop sums the loss and grad_weight chunk by chunk, the native op row-block by
# row-block inside one reduction / GEMM: the same terms in another order, a few float32 ulps of the largest partial
# sum apart (1e-5 relative, 1e-6 absolute on gradients of order 1e-2..1). bfloat16: both compute the logits with the
# same bfloat16 matmul and upcast them, so the loss agrees to float32 rounding; the native gradients are rounded
# to bfloat16 once more than the chunked grad_weight (summed in float32), so they agree to one bfloat16 ulp (2^-8
# relative) of the gradient's scale.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}


def _inputs(rows, hidden_size, vocab, dtype, *, bias=True, ignored=(0, 5), seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5).to(dtype).requires_grad_()
    bias_tensor = torch.randn(vocab, generator=generator).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[list(ignored)] = -100
    return hidden, weight, bias_tensor, labels


def _grads(loss, tensors):
    tensors = [t for t in tensors if t is not None]
    return torch.autograd.grad(loss, tensors)


def _assert_close(actual, expected, dtype):
    tolerance = TOLERANCE[dtype]
    scale = expected.detach().float().abs().max().clamp_min(1e-30)
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=tolerance["rtol"], atol=tolerance["atol"] * float(scale)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64, None])  # 7 does not divide 37 rows; 64 is more than all rows
def test_loss_and_gradients_equal_cross_entropy(dtype, reduction, chunk_rows):
    hidden, weight, bias, labels = _inputs(37, 16, 101, dtype)
    loss = lm_loss(hidden, weight, labels, bias=bias, chunk_rows=chunk_rows, reduction=reduction)
    expected = F.cross_entropy(
        (hidden @ weight.T + bias).float(), labels, ignore_index=-100, reduction=reduction
    )  # independent of lm_loss_reference: the loss written out
    assert loss.dtype == torch.float32
    _assert_close(loss, expected, dtype)
    for got, want in zip(_grads(loss, (hidden, weight, bias)), _grads(expected, (hidden, weight, bias)), strict=True):
        assert got.dtype == dtype
        _assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_leading_dimensions_and_no_bias(dtype):
    hidden, weight, _, labels = _inputs(3 * 11, 8, 29, dtype, bias=False)
    hidden3 = hidden.detach().reshape(3, 11, 8).requires_grad_()
    labels3 = labels.reshape(3, 11)
    loss = lm_loss(hidden3, weight, labels3, chunk_rows=5)
    expected = lm_loss_reference(hidden3, weight, labels3)
    _assert_close(loss, expected, dtype)
    for got, want in zip(_grads(loss, (hidden3, weight)), _grads(expected, (hidden3, weight)), strict=True):
        assert got.shape == want.shape
        _assert_close(got, want, dtype)


def test_ignore_index_rows_take_no_part():
    hidden, weight, bias, labels = _inputs(20, 8, 31, torch.float32, ignored=(1, 2, 3, 19))
    labels[4] = 7
    custom = labels.masked_fill(labels == -100, 5000)  # a custom ignore_index
    loss = lm_loss(hidden, weight, custom, bias=bias, ignore_index=5000, chunk_rows=3)
    expected = F.cross_entropy(hidden @ weight.T + bias, labels)
    _assert_close(loss, expected, torch.float32)
    grad_hidden = _grads(loss, (hidden,))[0]
    assert torch.count_nonzero(grad_hidden[[1, 2, 3, 19]]) == 0  # an ignored row's hidden state gets no gradient
    _assert_close(grad_hidden, _grads(expected, (hidden,))[0], torch.float32)


def test_all_rows_ignored_gives_nan_mean_and_zero_gradients_like_cross_entropy():
    hidden, weight, bias, labels = _inputs(6, 4, 9, torch.float32, ignored=range(6))
    loss = lm_loss(hidden, weight, labels, bias=bias, chunk_rows=4)
    expected = F.cross_entropy(hidden @ weight.T + bias, labels)
    assert torch.isnan(loss) and torch.isnan(expected)
    for got, want in zip(_grads(loss, (hidden, weight, bias)), _grads(expected, (hidden, weight, bias)), strict=True):
        assert torch.equal(got, want) and torch.count_nonzero(got) == 0
    assert lm_loss(hidden, weight, labels, reduction="sum").item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_scale_and_softcap(dtype):
    hidden, weight, bias, labels = _inputs(23, 8, 41, dtype)
    hidden = (hidden.detach() * 4).requires_grad_()  # logits large enough that the cap bends them
    loss = lm_loss(hidden, weight, labels, bias=bias, chunk_rows=6, logit_scale=0.5, softcap=3.0)
    logits = torch.tanh((hidden @ weight.T + bias).float() * 0.5 / 3.0) * 3.0
    expected = F.cross_entropy(logits, labels)
    _assert_close(loss, expected, dtype)
    for got, want in zip(_grads(loss, (hidden, weight, bias)), _grads(expected, (hidden, weight, bias)), strict=True):
        _assert_close(got, want, dtype)


def test_frozen_head_gives_only_the_hidden_gradient():
    hidden, weight, _, labels = _inputs(10, 8, 17, torch.float32, bias=False)
    frozen = weight.detach()
    loss = lm_loss(hidden, frozen, labels, chunk_rows=3)
    loss.backward()
    assert frozen.grad is None
    want = _grads(F.cross_entropy(hidden @ frozen.T, labels), (hidden,))[0]
    _assert_close(hidden.grad, want, torch.float32)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(labels=torch.tensor([0, 1, 17, 2])), "label 17 at row 2 is not a class of the vocabulary: "
                                                   "labels must be in 0..16 or ignore_index (-100)"),
        (dict(labels=torch.tensor([0, -3, 1, 2])), "label -3 at row 1"),
        (dict(labels=torch.tensor([0, 1, 2])), "labels (3,) must have the shape of hidden without its "
                                               "last dimension, (4,)"),
        (dict(labels=torch.zeros(4)), "labels must be an integer tensor, got torch.float32"),
        (dict(weight=torch.randn(17, 5)), "weight must be (V, H) with H = hidden.shape[-1]; "
                                          "got hidden (4, 8) and weight (17, 5)"),
        (dict(weight=torch.randn(17, 8, dtype=torch.float64)), "hidden, weight and bias must share a dtype"),
        (dict(bias=torch.randn(16)), "bias must be (V,) = (17,), got (16,)"),
        (dict(hidden=torch.zeros(4, 8, dtype=torch.int64)), "float32, float16, bfloat16 or float64 hidden states"),
        (dict(reduction="none"), "lm_loss reduction must be 'mean' or 'sum', got 'none'"),
        (dict(chunk_rows=0), "lm_loss chunk_rows must be an integer >= 1, got 0"),
        (dict(softcap=-1.0), "lm_loss softcap must be > 0, got -1.0"),
    ],
)  # fmt: skip
def test_bad_input_is_one_clear_error(change, message):
    arguments = dict(hidden=torch.randn(4, 8), weight=torch.randn(17, 8), labels=torch.tensor([0, 1, 2, 3]))
    arguments.update(change)
    hidden, weight, labels = arguments.pop("hidden"), arguments.pop("weight"), arguments.pop("labels")
    with pytest.raises(FewBitError) as error:
        lm_loss(hidden, weight, labels, **arguments)
    assert message in str(error.value)


def test_saves_hidden_labels_and_logsumexp_only():
    """Saved bytes counted by hand from the shapes: the native loss keeps its N x V float32 log-softmax output."""
    rows, hidden_size, vocab = 37, 16, 3000
    x, weight, bias, labels = _inputs(rows, hidden_size, vocab, torch.float32)
    with memory.saved_bytes() as chunked:
        hidden = x * 2  # not a leaf: what is saved of it counts
        lm_loss(hidden, weight, labels, bias=bias, chunk_rows=8)
    with memory.saved_bytes() as native:
        hidden = x * 2
        lm_loss_reference(hidden, weight, labels, bias=bias)
    logits_bytes = rows * vocab * 4
    # hidden (float32), labels (int64), one float32 logsumexp per row; weight and bias are parameters
    assert chunked.total == rows * hidden_size * 4 + rows * 8 + rows * 4
    assert native.total >= rows * hidden_size * 4 + rows * 8 + logits_bytes
    assert native.total - chunked.total >= logits_bytes - rows * 4


def test_peak_stays_below_one_logits_tensor():
    """Peak of live bytes over forward + backward, bounded by hand: the chunked head holds grad_weight, grad_hidden,
    the logsumexp and a few chunks of logits; native holds the logits and their log-softmax at once."""
    rows, hidden_size, vocab, chunk = 64, 16, 3000, 8
    x, weight, _, labels = _inputs(rows, hidden_size, vocab, torch.float32, bias=False)
    hidden = (x * 2).detach().requires_grad_()
    with memory.peak(hidden, weight, labels) as chunked:
        lm_loss(hidden, weight, labels, chunk_rows=chunk).backward()
    hidden.grad = weight.grad = None
    with memory.peak(hidden, weight, labels) as native:
        lm_loss_reference(hidden, weight, labels).backward()
    logits_bytes = rows * vocab * 4
    bound = vocab * hidden_size * 4 + rows * hidden_size * 4 + rows * 4 + 3 * chunk * vocab * 4 + 1024
    assert chunked.peak_bytes <= bound < logits_bytes
    assert native.peak_bytes >= 2 * logits_bytes


def test_default_chunk_rows_follows_the_input_size_with_a_floor():
    assert default_chunk_rows(100_000, 4096, 32_000) == -(-100_000 * 4096 // 32_000)  # logits ~ hidden's bytes
    rows = default_chunk_rows(512, 64, 32_000)  # the floor: the fewest rows whose float32 logits take 4 MiB
    assert rows * 32_000 * 4 >= 4 << 20 > (rows - 1) * 32_000 * 4
    assert default_chunk_rows(3, 64, 32_000) == 3  # never more than the rows
    assert default_chunk_rows(0, 64, 32_000) == 1


def test_compiled_aot_eager_equals_eager_and_keeps_no_logits():
    rows, hidden_size, vocab = 24, 8, 500
    x, weight, bias, labels = _inputs(rows, hidden_size, vocab, torch.float32)

    def step(x, weight, bias, labels):
        return lm_loss(torch.tanh(x), weight, labels, bias=bias, chunk_rows=5)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with memory.saved_bytes() as saved:
        loss = compiled(x, weight, bias, labels)
    expected = lm_loss_reference(torch.tanh(x), weight, labels, bias=bias)
    _assert_close(loss, expected, torch.float32)
    for got, want in zip(_grads(loss, (x, weight, bias)), _grads(expected, (x, weight, bias)), strict=True):
        _assert_close(got, want, torch.float32)
    assert saved.total < rows * vocab * 4  # what the compiled graph saves holds no logits


@pytest.mark.parametrize("dtype, with_bias, softcap", [(torch.float32, True, None), (torch.bfloat16, False, 2.0)])
def test_opcheck(dtype, with_bias, softcap):
    hidden, weight, bias, labels = _inputs(13, 8, 19, dtype, bias=with_bias)
    torch.library.opcheck(
        torch.ops.fewbit.lm_loss.default, (hidden, weight, bias, labels, 4, -100, "mean", 1.0, softcap)
    )


def test_autocast_runs_the_head_in_the_autocast_dtype_like_native():
    """Under CPU autocast F.linear multiplies in bfloat16: the chunked head does too (the same bfloat16 matmul on a
    chunk of rows and upcast logits: float32 tolerance of the chunked sums), and does not leave a cast of the weight
    made without autograd in autocast's cache, from which the later F.linear of the same weight (the oracle here,
    a tied embedding in a model) would get no weight gradient (regression: 'differentiated Tensor ... not used')."""
    hidden, weight, bias, labels = _inputs(21, 16, 53, torch.float32)
    hidden = (hidden.detach() * 3).requires_grad_()  # logits of order 1-10: their bfloat16 rounding shows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(hidden, weight, labels, bias=bias, chunk_rows=4)
        expected = F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)
    _assert_close(loss, expected, torch.float32)
    for got, want in zip(_grads(loss, (hidden, weight, bias)), _grads(expected, (hidden, weight, bias)), strict=True):
        assert got.dtype == torch.float32  # autocast's casts are differentiable: gradients in the parameters' dtype
        _assert_close(got, want, torch.bfloat16)
