"""Memory-sharing norms under torch.compile: one graph per model (no graph break at each norm), so a compiled
converted LLaMA block saves no more than the eager one and less than compiled native; the static count of kept
channels that makes that possible is exact, and exceeding it is one FewBitError line."""

from __future__ import annotations

import warnings

import pytest
import torch

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory, norms
from fewbit_design.runtime.norms import MemorySharingNorm

transformers = pytest.importorskip("transformers")

VOCAB, TOKENS, BATCH, WIDTH = 64, 8, 2, 32


def _llama(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=88, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=TOKENS, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()  # sdpa attention: its float mask is shared by the blocks


def _saved(model: torch.nn.Module, forward, ids: torch.Tensor) -> int:
    # one step per model: saved_bytes(model) installs new module hooks at each entry, which a compiled model's guards
    # would see as a change (a recompile), and the first step saves what every later one does
    with memory.saved_bytes(model) as saved:
        loss = forward(input_ids=ids, labels=ids).loss
    loss.backward()
    return saved.total


def _measure(layers: int, convert: bool, compiled: bool, compress: int | None = None) -> tuple[int, int]:
    """(bytes one training step saves for backward, graphs dynamo made)."""
    model = _llama(layers)
    if convert:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model = runtime.convert(model, compress=compress)
    graphs = []

    def backend(graph, inputs):
        graphs.append(graph)
        return torch._dynamo.lookup_backend("aot_eager_decomp_partition")(graph, inputs)

    torch._dynamo.reset()
    forward = torch.compile(model, backend=backend) if compiled else model
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(1))
    return _saved(model, forward, ids), len(graphs)


def test_compiled_converted_llama_is_one_graph_and_its_block_saves_less_than_compiled_native():
    """Regression: the norm op's data-dependent count of kept channels made dynamo break the graph at every norm;
    each piece then saved its own copy of the attention mask (+256 KiB per block at the benchmark's sizes) and the
    partitioner could not see across the norms. With a static count the model is one graph."""
    two, graphs = _measure(2, convert=True, compiled=True)
    one, _ = _measure(1, convert=True, compiled=True)
    assert graphs == 1
    eager_block = _measure(2, convert=True, compiled=False)[0] - _measure(1, convert=True, compiled=False)[0]
    assert two - one <= eager_block
    assert two < _measure(2, convert=False, compiled=True)[0]
    # one block: exact modes keep the MLP's x, gate and up (2 intermediate-size tensors beside x) and 5 hidden-size
    # ones (the two norm outputs, q, k, the attention output; the exact attention core rebuilds v from the first
    # norm's output), plus per-row statistics (2 norms' rstd, the attention's logsumexp); compiled native keeps 3
    # intermediate-size and 8 hidden-size tensors
    rows, hidden, intermediate, heads = BATCH * TOKENS, WIDTH, 88, 4
    activations = rows * (2 * intermediate + 5 * hidden) * 4
    assert activations <= two - one <= activations + (2 + heads) * rows * 4


def test_compiled_compressed_norms_keep_one_graph():
    """Regression: under compress=K the compressed norm op kept a data-dependent count of channels, so dynamo
    broke the graph at every norm of a compiled compress=8 model (10 graphs for a 2-block LLaMA, 1 now)."""
    _, graphs = _measure(2, convert=True, compiled=True, compress=8)
    assert graphs == 1


def test_static_count_keeps_extra_channels_exactly():
    torch.manual_seed(0)
    x = torch.randn(6, 16, dtype=torch.float64)
    weight = torch.nn.Parameter(torch.rand(16, dtype=torch.float64) + 0.5)
    bias = torch.nn.Parameter(torch.randn(16, dtype=torch.float64))
    results = []
    for capacity in (None, 0, 5):  # none needed: 5 kept from x anyway, the same gradients to rounding
        leaf = x.clone().requires_grad_()
        y = norms.memory_sharing_norm(
            leaf, weight, bias, kind="layer_norm", normalized_ndim=1, eps=1e-5, capacity=capacity
        )
        y.square().sum().backward()
        results.append([leaf.grad, weight.grad.clone(), bias.grad.clone()])
        weight.grad = bias.grad = None
    for other in results[1:]:
        for mine, theirs in zip(other, results[0], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_more_channels_to_keep_than_the_compiled_count_is_one_error_line():
    torch._dynamo.reset()
    norm = MemorySharingNorm((8,), kind="layer_norm", eps=1e-5, weight=torch.nn.Parameter(torch.ones(8)),
                             bias=torch.nn.Parameter(torch.ones(8)))  # fmt: skip
    assert norm.compiled_capacity == 0
    compiled = torch.compile(norm, backend="aot_eager")
    compiled(torch.randn(3, 8, requires_grad=True)).sum().backward()
    with torch.no_grad():
        norm.weight[[2, 5]] = 0.0  # training drove two weights to zero after compilation
    with pytest.raises(FewBitError, match="2 channels have weights too small to invert .* keeps 0"):
        compiled(torch.randn(3, 8, requires_grad=True))
    norm(torch.randn(3, 8, requires_grad=True))  # an eager run counts them; the guard on the count recompiles
    assert norm.compiled_capacity == 2
    x = torch.randn(3, 8)
    reference = torch.nn.LayerNorm(8)
    with torch.no_grad():
        reference.weight.copy_(norm.weight)
        reference.bias.copy_(norm.bias)
    grads = []
    for module in (reference, compiled):
        leaf = x.clone().requires_grad_()
        module(leaf).square().sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
