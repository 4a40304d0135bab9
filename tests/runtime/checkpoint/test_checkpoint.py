"""runtime.checkpoint: the peak model against memory.peak(), the strategies against brute force, and checkpointed
training against the unchanged model (gradients compared bitwise: with one torch thread, recomputing a forward
pass repeats the same float operations in the same order, so the results are the same bits)."""

import copy
import itertools
import json
import random

import pytest
import torch

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import checkpoint, memory
from fewbit_design.runtime.checkpoint import BlockProfile, Profile, Segment, parse_budget, predict
from fewbit_design.runtime.checkpoint.apply import CheckpointedForward

WIDTH, BATCH = 32, 256


class Residual(torch.nn.Module):
    """x + MLP(LayerNorm(x)), optionally with dropout and batch norm."""

    def __init__(self, width=WIDTH, dropout=0.0, batch_norm=False, activation=None):
        super().__init__()
        layers = [torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), activation or torch.nn.GELU()]
        if batch_norm:
            layers.append(torch.nn.BatchNorm1d(4 * width))
        layers += [torch.nn.Dropout(dropout), torch.nn.Linear(4 * width, width)]
        self.mlp = torch.nn.Sequential(*layers)

    def forward(self, x):
        return x + self.mlp(x)


class Attention(torch.nn.Module):
    """A small pre-norm transformer block taking extra arguments: a mask, a keyword scale and a string."""

    def __init__(self, width=WIDTH, heads=2):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attention = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, width)
        )

    def forward(self, x, mask, *, scale=1.0, note="unused"):
        assert isinstance(note, str)
        h = self.norm1(x)
        x = x + scale * self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return (x + self.mlp(self.norm2(x)), None)


def chain(n, **options):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Residual(**options) for _ in range(n)])


def measured_peak(model, x):
    for parameter in model.parameters():
        parameter.grad = None
    with memory.peak() as p:
        model(x).sum().backward()
    return p.peak_bytes


@pytest.fixture(scope="module")
def mlp_chain():
    blocks = chain(12)
    x = torch.randn(BATCH, WIDTH)
    return blocks, x, checkpoint.profile(blocks, x)


@pytest.mark.parametrize("strategy", checkpoint.STRATEGIES)
def test_predicted_peak_within_10_percent_of_measured(mlp_chain, strategy):
    blocks, x, profile = mlp_chain
    plan = checkpoint.plan(profile, strategy=strategy)
    measured = measured_peak(checkpoint.apply(blocks, plan), x)
    assert abs(plan.peak_bytes - measured) <= 0.10 * measured, (plan.peak_bytes, measured)


@pytest.mark.parametrize("strategy", checkpoint.STRATEGIES)
def test_predicted_peak_with_gradients_allocated_before_the_step(strategy):
    # zero_grad(set_to_none=False) / gradient accumulation: the backward pass adds into existing gradients, so the
    # step's peak leaves them out; a profile taken the default way would overestimate it by the gradients' bytes
    blocks, x = chain(8), torch.randn(BATCH, WIDTH)
    profile = checkpoint.profile(blocks, x, grads_allocated=True)
    assert profile.grads_allocated and all(p.grad is None for p in blocks.parameters())  # left as it was
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    plan = checkpoint.plan(profile, strategy=strategy)
    model = checkpoint.apply(blocks, plan)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    with memory.peak() as p:
        model(x).sum().backward()
    assert abs(plan.peak_bytes - p.peak_bytes) <= 0.10 * p.peak_bytes, (plan.peak_bytes, p.peak_bytes)
    fresh = checkpoint.plan(checkpoint.profile(blocks, x), strategy=strategy)
    if strategy != "optimal":  # same segments: with fresh gradients the peak also holds the gradients made so far
        assert fresh.segments == plan.segments
        assert fresh.peak_bytes >= plan.peak_bytes, (fresh.peak_bytes, plan.peak_bytes)


def test_predicted_peak_under_budgets_and_with_batch_norm_and_relu():
    # ReLU saves its output (the block after it saves the same storage), batch norm saves statistics
    blocks = torch.nn.Sequential(*[Residual(batch_norm=i % 2 == 0, activation=torch.nn.ReLU()) for i in range(9)])
    x = torch.randn(BATCH, WIDTH)
    profile = checkpoint.profile(blocks, x)
    smallest = checkpoint.minimum_budget(profile)
    baseline = checkpoint.plan(profile, strategy="none").peak_bytes
    for budget in (smallest, (smallest + baseline) // 2, baseline):
        plan = checkpoint.plan(profile, budget=budget)
        assert plan.peak_bytes <= budget
        measured = measured_peak(checkpoint.apply(blocks, plan), x)
        assert abs(plan.peak_bytes - measured) <= 0.10 * measured, (budget, plan.peak_bytes, measured)


def test_sqrt_plan_keeps_less_than_no_checkpointing(mlp_chain):
    blocks, x, profile = mlp_chain
    none = measured_peak(blocks, x)
    sqrt = measured_peak(checkpoint.apply(blocks, checkpoint.plan(profile, strategy="sqrt")), x)
    recursive = checkpoint.plan(profile, strategy="recursive")
    assert sqrt < 0.6 * none
    assert recursive.extra_seconds > checkpoint.plan(profile, strategy="sqrt").extra_seconds  # nested recomputation


# --- the strategies on random profiles ---------------------------------------------------------------------------


def random_profile(n, rng):
    blocks, previous = [], rng.randint(1, 20) * 64
    for i in range(n):
        output, retained = rng.randint(1, 20) * 64, rng.randint(0, 60) * 64
        blocks.append(
            BlockProfile(
                name=str(i),
                input_bytes=previous,
                output_bytes=output,
                saved_bytes=retained,
                saves_input=rng.random() < 0.7,
                saves_output=rng.random() < 0.3,
                retained_bytes=retained,
                forward_peak_bytes=retained + output + rng.randint(0, 10) * 64,
                checkpoint_forward_peak_bytes=output + rng.randint(0, 10) * 64,
                backward_peak_bytes=rng.randint(0, 80) * 64,
                backward_delta_bytes=-retained + rng.randint(0, 8) * 64 + (previous if i else 0),
                input_grad_bytes=previous if i else 0,
                forward_seconds=rng.uniform(0.1, 1.0),
            )
        )
        previous = output
    return Profile(tuple(blocks))


def flat_schedules(n, per_block=False):
    """Every flat schedule: all cuts of the chain into segments, each segment plain or checkpointed."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        for modes in itertools.product((False, True), repeat=len(spans)):
            if per_block and any(m and b - a > 1 for (a, b), m in zip(spans, modes, strict=True)):
                continue
            yield [Segment(a, b, m) for (a, b), m in zip(spans, modes, strict=True)]


@pytest.mark.parametrize("seed", range(12))
def test_optimal_matches_brute_force_and_beats_greedy_and_sqrt(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    profile = random_profile(n, rng)
    schedules = [(predict(profile, s), s) for s in flat_schedules(n)]
    smallest = min(p.peak_bytes for p, _ in schedules)
    assert checkpoint.minimum_budget(profile) == smallest
    peaks = sorted({p.peak_bytes for p, _ in schedules})
    for budget in peaks[:: max(1, len(peaks) // 6)] + [peaks[-1]]:
        best = min(p.extra_seconds for p, _ in schedules if p.peak_bytes <= budget)
        plan = checkpoint.plan(profile, budget=budget)
        assert plan.peak_bytes <= budget
        assert plan.extra_seconds == pytest.approx(best, abs=1e-12)
        assert plan.peak_bytes == predict(profile, plan.segments).peak_bytes
    for strategy in ("greedy", "sqrt"):
        other = checkpoint.plan(profile, strategy=strategy)
        optimal = checkpoint.plan(profile, budget=other.peak_bytes)
        assert optimal.peak_bytes <= other.peak_bytes
        assert optimal.extra_seconds <= other.extra_seconds + 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_per_block_plans_match_brute_force(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(2, 7)
    profile = Profile(random_profile(n, rng).blocks, per_block=True)
    schedules = [(predict(profile, s), s) for s in flat_schedules(n, per_block=True)]
    budget = sorted(p.peak_bytes for p, _ in schedules)[len(schedules) // 3]
    plan = checkpoint.plan(profile, budget=budget)
    assert plan.extra_seconds == pytest.approx(min(p.extra_seconds for p, _ in schedules if p.peak_bytes <= budget))
    assert all(s.stop - s.start == 1 for s in plan.segments if s.checkpoint)
    with pytest.raises(FewBitError, match="block by block"):
        checkpoint.plan(profile, strategy="sqrt")


def test_impossible_budget_names_the_smallest_feasible_one():
    profile = random_profile(6, random.Random(7))
    smallest = checkpoint.minimum_budget(profile)
    for strategy in ("optimal", "greedy", "sqrt", "none"):
        with pytest.raises(FewBitError, match=f"smallest feasible budget is {smallest} bytes"):
            checkpoint.plan(profile, budget=smallest - 1, strategy=strategy)
    assert checkpoint.plan(profile, budget=smallest).peak_bytes == smallest


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1000", 1000), (" 3 KiB ", 3072), (7, 7)],
)
def test_budget_strings(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["2 gigs", "1.5", "-1MiB", "0", "GiB", "1e9", "2GIB", "1,5GB", True, 1.5, None])
def test_bad_budgets_are_one_error(text):
    with pytest.raises(FewBitError, match="budget"):
        parse_budget(text)


def test_plan_prints_as_a_table_and_round_trips_through_json(mlp_chain):
    _, _, profile = mlp_chain
    for strategy in ("optimal", "recursive"):
        plan = checkpoint.plan(profile, strategy=strategy)
        again = checkpoint.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
        assert again == plan
        text = str(plan)
        assert f"'{strategy}' for 12 blocks" in text and "predicted peak" in text and "yes" in text
    again = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile


# --- running plans -----------------------------------------------------------------------------------------------


def gradients(model, x):
    for parameter in model.parameters():
        parameter.grad = None
    torch.manual_seed(1)
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("strategy", checkpoint.STRATEGIES)
def test_gradients_bitwise_equal_with_dropout(strategy, one_torch_thread):
    blocks = chain(7, dropout=0.3)
    x = torch.randn(16, WIDTH, requires_grad=True)
    expected = gradients(blocks, x)
    model = checkpoint.apply(blocks, checkpoint.plan(checkpoint.profile(blocks, x), strategy=strategy))
    assert list(model.parameters()) == list(blocks.parameters())  # the same modules, not copies
    assert model.state_dict().keys() == blocks.state_dict().keys()
    for got, want in zip(gradients(model, x), expected, strict=True):
        assert torch.equal(got, want)


def test_batch_norm_running_statistics_update_once_per_step(one_torch_thread):
    blocks = chain(5, batch_norm=True)
    plain = copy.deepcopy(blocks)
    x = torch.randn(16, WIDTH)
    plan = checkpoint.plan(checkpoint.profile(blocks, x), strategy="sqrt")
    model = checkpoint.apply(blocks, plan)
    assert plan.checkpointed  # something is recomputed
    for _ in range(2):
        for got, want in zip(gradients(model, x), gradients(plain, x), strict=True):
            assert torch.equal(got, want)
    for got, want in zip(blocks.buffers(), plain.buffers(), strict=True):
        assert torch.equal(got, want)
    assert int(blocks[0].mlp[3].num_batches_tracked) == 2


def test_profile_leaves_the_model_unchanged():
    blocks = chain(3, batch_norm=True, dropout=0.5)
    blocks[0].mlp[1].weight.grad = torch.ones_like(blocks[0].mlp[1].weight)
    state = copy.deepcopy(blocks.state_dict())
    x = torch.randn(8, WIDTH)
    torch.manual_seed(5)
    expected_random = torch.rand(3)
    torch.manual_seed(5)
    checkpoint.profile(blocks, x)
    assert all(torch.equal(v, state[k]) for k, v in blocks.state_dict().items())
    assert torch.equal(blocks[0].mlp[1].weight.grad, torch.ones_like(blocks[0].mlp[1].weight))
    assert blocks[1].mlp[1].weight.grad is None
    assert torch.equal(torch.rand(3), expected_random)  # profile's own draws (dropout) were forked away


class CountCalls:
    def __init__(self, module):
        self.calls = 0
        module.register_forward_hook(self)

    def __call__(self, *args):
        self.calls += 1


def test_no_grad_and_eval_run_without_recomputation():
    blocks = chain(4)
    x = torch.randn(8, WIDTH)
    model = checkpoint.apply(blocks, checkpoint.plan(checkpoint.profile(blocks, x), strategy="sqrt"))
    counter = CountCalls(blocks[0].mlp[1])
    model(x).sum().backward()
    assert counter.calls == 2  # training: the forward pass and its recomputation
    counter.calls = 0
    with torch.no_grad():
        model(x)
    assert counter.calls == 1
    model.eval()
    model(x).sum().backward()
    assert counter.calls == 2


def test_module_list_in_place_with_keyword_and_non_tensor_arguments(one_torch_thread):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Attention() for _ in range(4)])
    plain = copy.deepcopy(layers)
    x = torch.randn(4, 10, WIDTH)
    mask = torch.triu(torch.full((10, 10), float("-inf")), diagonal=1)

    def loop(blocks):
        for parameter in blocks.parameters():
            parameter.grad = None
        h = x
        for block in blocks:
            h = block(h, mask, scale=0.5, note="kept")[0]
        h.sum().backward()
        return [p.grad for p in blocks.parameters()]

    smallest = checkpoint.minimum_budget(checkpoint.profile(layers, x, mask, scale=0.5, note="kept"))
    result = checkpoint.wrap(layers, x, mask, scale=0.5, note="kept", budget=smallest)
    assert result is layers and all(type(a) is type(b) for a, b in zip(layers, plain, strict=True))
    assert layers.fewbit_plan.checkpointed
    assert layers.state_dict().keys() == plain.state_dict().keys()
    for got, want in zip(loop(layers), loop(plain), strict=True):
        assert torch.equal(got, want)
    checkpoint.remove(layers)
    assert all("forward" not in block.__dict__ for block in layers)


def test_copies_of_checkpointed_models_use_their_own_parameters():
    # regression: a checkpointed forward that closed over the original block made deep copies train the original
    layers = torch.nn.ModuleList(list(chain(3)))
    x = torch.randn(4, WIDTH)
    checkpoint.wrap(layers, x, budget=checkpoint.minimum_budget(checkpoint.profile(layers, x)))
    clone = copy.deepcopy(layers)
    h = x
    for block in clone:
        h = block(h)
    h.sum().backward()
    assert all(p.grad is not None for p in clone.parameters())
    assert all(p.grad is None for p in layers.parameters())
    sequential = checkpoint.apply(chain(4), checkpoint.plan(checkpoint.profile(chain(4), x), strategy="sqrt"))
    assert type(sequential[1:3]) is torch.nn.Sequential and len(sequential[1:3]) == 2


def test_module_list_rejects_multi_block_segments():
    blocks = chain(4)
    plan = checkpoint.plan(checkpoint.profile(blocks, torch.randn(4, WIDTH)), strategy="sqrt")
    with pytest.raises(FewBitError, match="block by block"):
        checkpoint.apply(torch.nn.ModuleList(list(blocks)), plan)
    with pytest.raises(FewBitError, match="for 4 blocks"):
        checkpoint.apply(chain(5), plan)


def test_few_bit_activations_inside_checkpointed_blocks(one_torch_thread):
    from fewbit_design.runtime import nn as fewbit_nn

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[Residual(activation=fewbit_nn.GELU(bits=3)) for _ in range(6)])
    x = torch.randn(16, WIDTH, requires_grad=True)
    expected = gradients(blocks, x)
    profile = checkpoint.profile(blocks, x)
    plan = checkpoint.plan(profile, strategy="sqrt")
    model = checkpoint.apply(blocks, plan)
    for got, want in zip(gradients(model, x), expected, strict=True):
        assert torch.equal(got, want)
    measured = measured_peak(model, x)
    assert abs(plan.peak_bytes - measured) <= 0.10 * measured


def test_selective_recomputation_keeps_matrix_products(one_torch_thread):
    blocks = chain(6)
    x = torch.randn(64, WIDTH)
    expected = gradients(blocks, x)
    plan = checkpoint.plan(checkpoint.profile(blocks, x), strategy="sqrt")
    full = measured_peak(checkpoint.apply(blocks, plan), x)
    model = checkpoint.apply(blocks, plan, selective=True)
    for got, want in zip(gradients(model, x), expected, strict=True):
        assert torch.equal(got, want)
    selective = measured_peak(model, x)
    plain = measured_peak(blocks, x)
    assert full < selective < plain  # keeps the matmul outputs, drops GELU and LayerNorm results


def test_torch_compile_of_a_checkpointed_model(one_torch_thread):
    # regression: Dynamo refused the context_fn closure that keeps batch-norm statistics ("checkpoint not
    # implemented for NestedUserFunctionVariable context_fn") at the first call of a compiled checkpointed model
    blocks = chain(4, batch_norm=True)
    plain = copy.deepcopy(blocks)
    x = torch.randn(16, WIDTH)
    plan = checkpoint.plan(checkpoint.profile(blocks, x), strategy="sqrt")
    assert plan.checkpointed
    compiled = torch.compile(checkpoint.apply(blocks, plan), backend="aot_eager")
    for got, want in zip(gradients(compiled, x), gradients(plain, x), strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(blocks.buffers(), plain.buffers(), strict=True):  # statistics updated once
        torch.testing.assert_close(got, want)
    # the in-place ModuleList form (per-block checkpointed forwards), with selective recomputation
    layers = torch.nn.ModuleList(list(chain(3)))
    reference = copy.deepcopy(layers)
    by_hand = checkpoint.Plan((Segment(0, 1, True), Segment(1, 2, True), Segment(2, 3, False)), "by hand", 0, 0, 0, 0)
    checkpoint.apply(layers, by_hand, selective=True)

    def run(blocks):
        h = x
        for block in blocks:
            h = block(h)
        return h

    compiled_loop = torch.compile(run, backend="aot_eager")
    compiled_loop(layers).pow(2).sum().backward()
    run(reference).pow(2).sum().backward()
    for got, want in zip(layers.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def test_gpt2_trains_with_wrap_on_its_blocks():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, n_positions=32, vocab_size=128)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    ids = torch.randint(0, 128, (2, 16))
    hidden = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(16))
    checkpoint.wrap(model.transformer.h, hidden.detach())
    assert model.transformer.h.fewbit_plan.checkpointed
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_bad_inputs_are_one_error():
    with pytest.raises(FewBitError, match="nn.Sequential, an nn.ModuleList"):
        checkpoint.profile(torch.nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(FewBitError, match="one input"):
        checkpoint.profile(chain(2), torch.randn(1, WIDTH), torch.randn(1))
    with pytest.raises(FewBitError, match="strategy must be"):
        checkpoint.plan(random_profile(3, random.Random(0)), strategy="sqrtn")
    with pytest.raises(FewBitError, match="cover blocks"):
        predict(random_profile(3, random.Random(0)), [Segment(0, 2, True)])


def test_t5_decoder_blocks_with_their_cache_on_checkpoint_with_exact_gradients(one_torch_thread):
    """Regression: T5's decoder blocks write the key/value cache (``use_cache`` is on by default); recomputed, block 0
    read the keys its first pass had stored (57 tensors saved in forward, 53 in recomputation: ``CheckpointError``).
    Hugging Face layers are checkpointed through their own mechanism, which leaves the cache out of a checkpointed
    call; the flag it reads is set for the call only."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    assert config.use_cache and config.dropout_rate > 0  # the defaults: the cache written, dropout masks replayed
    torch.manual_seed(0)
    plain = transformers.T5ForConditionalGeneration(config).train()
    model = copy.deepcopy(plain)
    blocks = [*model.encoder.block, *model.decoder.block]
    for block in blocks:
        block.forward = CheckpointedForward(block, selective=False)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def gradients(net):
        torch.manual_seed(2)
        net(ids, labels=ids).loss.backward()
        return [p.grad for p in net.parameters()]

    for got, want in zip(gradients(model), gradients(plain), strict=True):
        assert torch.equal(got, want)
    assert not any(
        {"gradient_checkpointing", "_gradient_checkpointing_func"} & block.__dict__.keys() for block in blocks
    )
