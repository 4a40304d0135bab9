"""The memory planner: the optimiser against brute force, predictions against memory.peak(), apply, JSON, errors."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
import torch
from torch import nn

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime.planner import MemoryPlan, load_plan
from fewbit_design.runtime.planner.model import BlockCosts, ChainCosts, OptionCost, minimum_budget, optimise, replay


# --- the optimiser, on random instances -----------------------------------------------------------------------
def _random_chain(rng: random.Random, n: int, pools: bool = False, arguments: bool = False) -> ChainCosts:
    sizes = [rng.choice([64, 128, 256, 512]) for _ in range(n + 1)]
    blocks = []
    for i in range(n):
        options = []
        for k in range(rng.randint(1, 4)):
            options.append(
                OptionCost(
                    option="plain" if k == 0 else f"o{k}",
                    forward_peak=rng.randint(0, 2000),
                    kept=rng.randint(0, 3000),
                    backward_peak=rng.randint(0, 4000),
                    saves_input=rng.random() < 0.5,
                    saves_output=rng.random() < 0.5,
                    seconds=rng.choice([0.5, 1.0, 1.5, 2.0, 3.25]) * (1 + rng.random()),
                    pool_bytes=rng.choice([0, 0, 300, 700]) if pools and k else 0,
                    holds_arguments=arguments and k > 0 and rng.random() < 0.5,
                )
            )
        blocks.append(BlockCosts(f"b{i}", sizes[i], sizes[i + 1], rng.randint(0, 500), tuple(options)))
    return ChainCosts(
        tuple(blocks),
        entry_bytes=rng.randint(0, 1000),
        pre_forward_peak=rng.randint(0, 1500),
        post_forward_peak=rng.randint(0, 800),
        post_bytes=rng.randint(-100, 800),
        pre_backward_peak=rng.randint(0, 3000),
        argument_bytes=rng.choice([0, 200, 1500]) if arguments else 0,
    )


def _brute_force(chain: ChainCosts, budget: int):
    best = None
    for choice in itertools.product(*(block.options for block in chain.blocks)):
        result = replay(chain, choice)
        if result.peak <= budget and (best is None or result.seconds < best[0] - 1e-12):
            best = (result.seconds, [o.option for o in choice])
    return best


@pytest.mark.parametrize("seed", range(60))
def test_optimiser_matches_brute_force(seed):
    rng = random.Random(seed)
    chain = _random_chain(rng, rng.randint(1, 5))
    peaks = sorted(replay(chain, c).peak for c in itertools.product(*(b.options for b in chain.blocks)))
    for budget in {peaks[0] - 1, peaks[0], rng.choice(peaks), peaks[len(peaks) // 2], peaks[-1]}:
        expected = _brute_force(chain, budget)
        got = optimise(chain, budget)
        if expected is None:
            assert got is None, (budget, got)
            continue
        assert got is not None, budget
        choice = [block.option(name) for block, name in zip(chain.blocks, got, strict=True)]
        result = replay(chain, choice)
        assert result.peak <= budget
        assert math.isclose(result.seconds, expected[0], rel_tol=1e-12), (got, expected)


@pytest.mark.parametrize("seed", range(40))
def test_optimiser_matches_brute_force_with_shared_pools(seed):
    """Options whose region keeps a buffer for reuse (offload's staging pool for packed tensors): the step holds
    one buffer per distinct size among the chosen options, whichever blocks chose them, so the peak is not a sum of
    per-block terms; the optimiser enumerates the sets of sizes and stays exact against replay."""
    rng = random.Random(3000 + seed)
    chain = _random_chain(rng, rng.randint(1, 5), pools=True)
    combos = list(itertools.product(*(b.options for b in chain.blocks)))
    peaks = sorted(replay(chain, c).peak for c in combos)
    for budget in {peaks[0] - 1, peaks[0], rng.choice(peaks), peaks[len(peaks) // 2], peaks[-1]}:
        expected = _brute_force(chain, budget)
        got = optimise(chain, budget)
        assert (got is None) == (expected is None), (budget, got, expected)
        if got is not None:
            result = replay(chain, [block.option(name) for block, name in zip(chain.blocks, got, strict=True)])
            assert result.peak <= budget
            assert math.isclose(result.seconds, expected[0], rel_tol=1e-12), (got, expected)
    assert minimum_budget(chain) == peaks[0]


@pytest.mark.parametrize("seed", range(40))
def test_optimiser_matches_brute_force_with_held_arguments(seed):
    """Options that hold the blocks' other arguments (a checkpoint keeps position ids and masks for its
    recomputation) keep ``argument_bytes`` alive from the chain's exit to the backward of the lowest-index block
    that holds them: a term of the whole choice, not of one block; the optimiser stays exact against replay."""
    rng = random.Random(4000 + seed)
    chain = _random_chain(rng, rng.randint(1, 5), pools=rng.random() < 0.3, arguments=True)
    combos = list(itertools.product(*(b.options for b in chain.blocks)))
    peaks = sorted(replay(chain, c).peak for c in combos)
    for budget in {peaks[0] - 1, peaks[0], rng.choice(peaks), peaks[len(peaks) // 2], peaks[-1]}:
        expected = _brute_force(chain, budget)
        got = optimise(chain, budget)
        assert (got is None) == (expected is None), (budget, got, expected)
        if got is not None:
            result = replay(chain, [block.option(name) for block, name in zip(chain.blocks, got, strict=True)])
            assert result.peak <= budget
            assert math.isclose(result.seconds, expected[0], rel_tol=1e-12), (got, expected)
    assert minimum_budget(chain) == peaks[0]


def test_held_arguments_stay_alive_until_the_lowest_holder_is_done():
    """Hand-computed: two blocks; 50 bytes of arguments that the plain step frees after the chain. An option that
    holds them keeps them alive from the chain's exit to the end of the backward of the lowest-index block holding
    them, and nowhere else (the forward events already count them: they are alive from before the chain)."""
    plain = OptionCost("plain", 100, 0, 100, saves_input=False, saves_output=False, seconds=1.0)
    hold = OptionCost("checkpoint", 100, 0, 100, saves_input=True, saves_output=False, seconds=1.0,
                      holds_arguments=True)  # fmt: skip
    chain = ChainCosts(tuple(BlockCosts(f"b{i}", 100, 100, 0, (plain, hold)) for i in range(2)), argument_bytes=50)
    after = {"loss and modules after the chain", "backward b1", "backward b0"}
    for choice, alive in [((plain, plain), set()), ((plain, hold), after - {"backward b0"}), ((hold, plain), after),
                          ((hold, hold), after)]:  # fmt: skip
        without = replay(replace(chain, argument_bytes=0), choice).timeline
        with_arguments = replay(chain, choice).timeline
        added = {label for (label, a), (_, b) in zip(with_arguments, without, strict=True) if a - b == 50}
        unchanged = {label for (label, a), (_, b) in zip(with_arguments, without, strict=True) if a == b}
        assert added == alive and len(added) + len(unchanged) == len(without), [o.option for o in choice]


@pytest.mark.parametrize("seed", range(20))
def test_minimum_budget_is_the_smallest_peak(seed):
    rng = random.Random(1000 + seed)
    chain = _random_chain(rng, rng.randint(1, 4))
    smallest = min(replay(chain, c).peak for c in itertools.product(*(b.options for b in chain.blocks)))
    assert minimum_budget(chain) == smallest
    assert optimise(chain, smallest) is not None and optimise(chain, smallest - 1) is None


def test_checkpoint_trades_forward_bytes_for_backward_bytes():
    """A hand-computed chain: two blocks with 100-byte hidden states; plain keeps 1000 bytes and saves neither its
    input nor its output; checkpoint keeps nothing (its input: held) but re-materialises 1000 bytes in backward."""
    plain = OptionCost("plain", 1100, 1000, 200, saves_input=False, saves_output=False, seconds=1.0)
    ckpt = OptionCost("checkpoint", 1100, 0, 1200, saves_input=True, saves_output=False, seconds=2.0)
    block = BlockCosts("b", 100, 100, 0, (plain, ckpt))
    chain = ChainCosts((block, block))
    # (a backward peak includes the block's incoming gradient)
    # plain, plain: block 1's forward peaks at 1000 (block 0) + x1 + 1100; its backward at 1000 + 1000 + 200
    assert replay(chain, [plain, plain]).peak == 2200
    # checkpoint, plain: block 1's forward peaks at x1 + 1100; block 0's backward at 1200
    assert replay(chain, [ckpt, plain]).peak == 1200
    # plain, checkpoint: block 1 holds x1; its backward re-materialises 1200 on top of block 0's 1000 + x1
    assert replay(chain, [plain, ckpt]).peak == 2300
    assert replay(chain, [ckpt, ckpt]).peak == 1300
    assert optimise(chain, 2200) == ["plain", "plain"]
    assert optimise(chain, 2199) == ["checkpoint", "plain"]
    assert optimise(chain, 1200) == ["checkpoint", "plain"]
    assert optimise(chain, 1199) is None
    assert minimum_budget(chain) == 1200


# --- on real models ---------------------------------------------------------------------------------------------
def _mlp(seed: int = 0, width: int = 64) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(4)]
    )


def _cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [nn.Conv2d(3, 16, 3, padding=1)]
    blocks += [nn.Sequential(nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)) for _ in range(3)]
    blocks.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)))
    return nn.Sequential(*blocks)


@pytest.fixture(scope="module")
def mlp_plan():
    x = torch.randn(256, 64)
    plan = runtime.plan_memory(_mlp(), x, budget=0.7, offload_min_bytes=1 << 14, repeats=1)
    return plan, x


def test_plan_fits_and_predicts_the_measured_peak(mlp_plan):
    plan, x = mlp_plan
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert plan.techniques_used() - {"plain"}, "a budget of 70% needs some technique"
    plan = MemoryPlan.from_dict(plan.to_dict())
    model = plan.apply(_mlp())
    measured = plan.measure(model, x, steps=1)
    assert measured["peak_bytes"] <= 1.1 * plan.budget_bytes
    assert abs(measured["peak_bytes"] - plan.predicted_peak_bytes) <= 0.1 * measured["peak_bytes"]
    report = plan.report()
    assert "measured peak" in report and "reversible" in report


def test_unconverted_prediction_matches_measurement(mlp_plan):
    plan, x = mlp_plan
    assert abs(plan.facts["measured_peak_bytes"] + plan.baseline_bytes - plan.unconverted_peak_bytes) <= (
        0.05 * plan.unconverted_peak_bytes
    )


def test_json_round_trip_is_identical(mlp_plan, tmp_path):
    plan, x = mlp_plan
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = load_plan(path)
    assert loaded == plan
    assert loaded.report() == plan.report()


def test_exact_gradients_when_approximations_are_not_allowed():
    x = torch.randn(128, 64)
    plan = runtime.plan_memory(
        _mlp(), x, budget=0.85, allow=("checkpoint", "offload"), offload_min_bytes=1 << 14, repeats=1
    )
    assert plan.approximate_blocks() == []
    assert plan.techniques_used() <= {"checkpoint", "offload"} and plan.techniques_used()
    reference, planned = _mlp(), plan.apply(_mlp())
    reference(x).mean().backward()
    planned(x).mean().backward()
    for (name, a), b in zip(reference.named_parameters(), planned.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_blpa_and_fewbit_are_offered_where_they_fit():
    x = torch.randn(8, 3, 16, 16)
    plan = runtime.plan_memory(_cnn(), x, budget="min", allow=("blpa", "fewbit"), repeats=1)
    options = {block.name: {o.option for o in block.options} for block in plan.costs.blocks}
    assert options["0"] == {"plain"}  # a lone convolution: nothing applies
    # few-bit leaves a ReLU whose output the next convolution saves anyway (it would free nothing)
    assert options["1"] == {"plain", "blpa"}
    assert options["4"] == {"plain"}
    assert set(plan.approximate_blocks()) <= {"1", "2", "3"} and plan.approximate_blocks()
    model = plan.apply(_cnn())
    assert any(type(m).__name__ == "BNReLUConv2d" for m in model.modules())
    model(x).mean().backward()


def test_fewbit_is_offered_for_gelu(mlp_plan):
    plan, _ = mlp_plan
    assert {"fewbit", "fewbit+checkpoint", "fewbit+offload"} <= {o.option for o in plan.costs.blocks[0].options}


def test_memory_objective_reaches_the_minimum(mlp_plan):
    plan, x = mlp_plan
    smallest = runtime.plan_memory(_mlp(), x, objective="memory", offload_min_bytes=1 << 14, repeats=1)
    assert smallest.predicted_peak_bytes == smallest.facts["minimum_budget_bytes"]
    assert smallest.predicted_peak_bytes < plan.predicted_peak_bytes


def test_model_is_left_as_it_was():
    model = _cnn()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    runtime.plan_memory(model, torch.randn(4, 3, 8, 8), budget="min", repeats=1)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert [type(m) for m in model.modules()] == [type(m) for m in _cnn().modules()]


def test_errors():
    x = torch.randn(16, 64)
    with pytest.raises(FewBitError, match="smallest feasible peak"):
        runtime.plan_memory(_mlp(), x, budget=1000, repeats=1)
    with pytest.raises(FewBitError, match="allowed technique"):
        runtime.plan_memory(_mlp(), x, allow=("fewbit", "quantum"))
    with pytest.raises(FewBitError, match="objective"):
        runtime.plan_memory(_mlp(), x, objective="speed")
    with pytest.raises(FewBitError, match="fraction"):
        runtime.plan_memory(_mlp(), x, budget=1.5, repeats=1)
    with pytest.raises(FewBitError, match="no nn.Sequential"):
        runtime.plan_memory(nn.Linear(64, 64), x)


def test_apply_checks_the_architecture(mlp_plan):
    plan, _ = mlp_plan
    with pytest.raises(FewBitError, match="chain of blocks"):
        plan.apply(nn.Sequential(nn.Linear(64, 64)))


def test_load_plan_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(FewBitError, match="not JSON"):
        load_plan(bad)
    bad.write_text('{"format": "other"}')
    with pytest.raises(FewBitError, match="format"):
        load_plan(bad)
    with pytest.raises(FewBitError, match="missing.json' does not exist"):
        load_plan(tmp_path / "missing.json")


def test_replan_uses_the_profile_only(mlp_plan):
    plan, _ = mlp_plan
    only = plan.replan("min", allow=("checkpoint",))
    assert set(only.choices) <= {"plain", "checkpoint"}
    assert only.costs is plan.costs
    assert only.predicted_peak_bytes == only.facts["minimum_budget_bytes"] >= plan.facts["minimum_budget_bytes"]
    assert (
        plan.replan(1.0).choices == tuple("plain" for _ in plan.choices) or plan.replan(1.0).predicted_extra_seconds < 0
    )
    with pytest.raises(FewBitError, match="smallest feasible"):
        plan.replan(0.01)


# --- stock Hugging Face models -----------------------------------------------------------------------------------
def _stock_model(kind: str) -> nn.Module:
    """A Hugging Face causal LM from its default config except tiny sizes; ``use_cache`` stays at its default
    (True), which returns the key/value cache from every training step."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
            vocab_size=64, max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    assert model.config.use_cache is True
    return model.train()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_stock_causal_lm_with_its_cache_on_plans_and_trains(kind):
    """Regression: ``use_cache=True`` (the default) made profiling fail with "Trying to backward through the graph
    a second time"; the planner turns caches off while it runs the model and puts the setting back."""
    tokens = torch.randint(0, 64, (4, 32))
    model = _stock_model(kind)
    plans = [
        runtime.plan_memory(model, tokens, budget=budget, example_kwargs={"labels": tokens}, repeats=1)
        for budget in (0.75, "min")  # LLaMA at this size: the smallest feasible peak is 64% of unconverted
    ]
    assert model.config.use_cache is True
    for plan in plans:
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        applied = plan.apply(_stock_model(kind))
        plan.measure(applied, tokens, labels=tokens, steps=1)
        assert applied.config.use_cache is False  # apply runs the model as it was planned: without the cache
        optimizer = torch.optim.SGD(applied.parameters(), lr=0.1)
        loss = applied(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        assert math.isfinite(loss.item())
    # at a budget the unconverted model fits: every block plain, and applying the plan changes nothing
    for budget in (1.0, None, plans[0].unconverted_peak_bytes):
        full = plans[0].replan(budget)
        assert full.choices == ("plain",) * len(full.choices) and full.techniques_used() == set(), budget
    applied, unchanged = full.apply(_stock_model(kind)), _stock_model(kind)
    assert _structure(applied) == _structure(unchanged)
    losses = []
    for model in (applied, unchanged):
        torch.manual_seed(1)  # the same dropout masks
        losses.append(model(tokens, labels=tokens).loss)
        losses[-1].backward()
    assert torch.equal(losses[0], losses[1])
    for (name, a), (_, b) in zip(applied.named_parameters(), unchanged.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def _structure(model: nn.Module) -> list[tuple[str, str, str]]:
    """(name, module class, class of an instance-level forward: a wrapper) of every module."""
    return [(n, type(m).__name__, type(m.__dict__.get("forward")).__name__) for n, m in model.named_modules()]


# --- exact unless needed ---------------------------------------------------------------------------------------
_NAMED = ("plain", "fewbit", "checkpoint", "fewbit+checkpoint")


def _approximate_count(names) -> int:
    return sum("fewbit" in name for name in names)


@pytest.mark.parametrize("seed", range(30))
def test_if_needed_uses_the_fewest_approximate_blocks_that_fit(seed):
    """Brute force over every combination: "if-needed" has the fewest few-bit blocks of all plans that fit (none
    when an exact plan fits), and is the fastest of those (the unconverted chain where it fits); "allowed" is the
    fastest plan that fits."""
    from fewbit_design.runtime.planner.plan import choose

    rng = random.Random(2000 + seed)
    chain = _random_chain(rng, rng.randint(1, 4))
    chain = ChainCosts(
        tuple(
            BlockCosts(b.name, b.input_bytes, b.output_bytes, b.gradient_bytes,
                       tuple(OptionCost(_NAMED[k], *list(vars(o).values())[1:]) for k, o in enumerate(b.options)))
            for b in chain.blocks
        ),
        chain.entry_bytes, chain.pre_forward_peak, chain.post_forward_peak, chain.post_bytes, chain.pre_backward_peak,
    )  # fmt: skip
    combos = [(replay(chain, c), [o.option for o in c]) for c in itertools.product(*(b.options for b in chain.blocks))]
    settings = {"objective": "time", "bits": 3, "blpa_bits": 4, "offload": {}}
    for budget in sorted({r.peak for r, _ in combos})[:: max(1, len(combos) // 5)]:
        fitting = [(r, names) for r, names in combos if r.peak <= budget]
        fewest = min(_approximate_count(names) for _, names in fitting)
        fastest = min(r.seconds for r, names in fitting if _approximate_count(names) == fewest)
        plain = [(r, names) for r, names in fitting if set(names) == {"plain"}]
        if plain:  # the unconverted chain fits: it is the plan, even where a technique profiled faster
            fastest = plain[0][0].seconds
        for rule, expected_count, expected_seconds in [
            ("if-needed", fewest, fastest),
            ("allowed", None, min(r.seconds for r, _ in fitting)),
        ]:
            plan = choose("", chain, {}, baseline=0, step_seconds=1.0, settings={**settings, "approximate": rule},
                          budget=budget, allow=("fewbit", "checkpoint"))  # fmt: skip
            result = replay(chain, [b.option(n) for b, n in zip(chain.blocks, plan.choices, strict=True)])
            assert result.peak <= budget
            if expected_count is not None:
                assert _approximate_count(plan.choices) == expected_count, (rule, budget, plan.choices)
            assert math.isclose(result.seconds, expected_seconds, rel_tol=1e-9), (rule, budget, plan.choices)


def _with_fast_fewbit(plan: MemoryPlan, approximate: str | None) -> MemoryPlan:
    """``plan`` with its option "fewbit" profiled as the fastest of all (seconds 0), as happens on a noisy machine;
    ``approximate=None``: a plan saved before the setting existed (no ``settings.approximate``)."""
    import dataclasses

    blocks = tuple(
        dataclasses.replace(b, options=tuple(
            dataclasses.replace(o, seconds=0.0) if o.option == "fewbit" else o for o in b.options
        ))
        for b in plan.costs.blocks
    )  # fmt: skip
    settings = {k: v for k, v in plan.settings.items() if k != "approximate"}
    if approximate is not None:
        settings["approximate"] = approximate
    return dataclasses.replace(plan, costs=dataclasses.replace(plan.costs, blocks=blocks), settings=settings)


def test_a_budget_the_unconverted_model_fits_changes_nothing(mlp_plan):
    """Regression: at a 100% budget the plan turned few-bit on (approximate gradients) because it profiled
    faster; by default a plan uses an approximate technique only where no exact plan fits."""
    plan, x = mlp_plan
    assert plan.settings["approximate"] == "if-needed"
    fast = _with_fast_fewbit(plan, "if-needed")
    for budget in (None, 1.0, fast.unconverted_peak_bytes):
        same = fast.replan(budget)
        assert same.choices == ("plain",) * len(plan.choices), budget
        assert same.approximate_blocks() == [] and "no block (exact)" in same.report()
    # the opt-in keeps the fastest plan whatever the gradients
    assert set(fast.replan(1.0, approximate="allowed").choices) == {"fewbit"}
    # at a budget below what exact techniques reach, few-bit comes in, and the report says why
    exact_minimum = fast.replan("min", allow=("checkpoint", "offload")).predicted_peak_bytes
    overall_minimum = fast.replan("min").predicted_peak_bytes
    assert overall_minimum < exact_minimum
    tight = fast.replan(overall_minimum)
    assert tight.approximate_blocks() and "(no exact plan fits the budget)" in tight.report()
    assert tight.settings["approximate"] == "if-needed"


def test_plan_memory_at_full_budget_is_plain():
    x = torch.randn(128, 64)
    plan = runtime.plan_memory(_mlp(), x, budget=1.0, offload_min_bytes=1 << 14, repeats=1)
    assert plan.choices == ("plain",) * 4
    assert plan.approximate_blocks() == []


def test_approximate_setting_is_saved_and_old_plans_read_as_allowed(mlp_plan, tmp_path):
    plan, _ = mlp_plan
    allowed = _with_fast_fewbit(plan, "allowed")
    allowed.save(tmp_path / "allowed.json")
    loaded = load_plan(tmp_path / "allowed.json")
    assert loaded.settings["approximate"] == "allowed" and loaded == allowed
    assert set(loaded.replan(1.0).choices) == {"fewbit"}
    # a plan saved before the setting existed loads; its rule is the one its choices were made by: "allowed"
    old = _with_fast_fewbit(plan, None)
    data = old.to_dict()
    assert "approximate" not in data["settings"]
    old = MemoryPlan.from_dict(data)
    assert set(old.replan(1.0).choices) == {"fewbit"}
    assert old.replan(1.0, approximate="if-needed").choices == ("plain",) * len(plan.choices)
    data["settings"]["approximate"] = "sometimes"
    with pytest.raises(FewBitError, match="settings.approximate must be 'if-needed' or 'allowed', got 'sometimes'"):
        MemoryPlan.from_dict(data)
    with pytest.raises(FewBitError, match="approximate must be 'if-needed' or 'allowed', got 'always'"):
        runtime.plan_memory(_mlp(), torch.randn(4, 64), approximate="always")
