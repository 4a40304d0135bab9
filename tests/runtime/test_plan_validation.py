"""Plan files and plan objects are checked completely, when read and when applied.

A checkpoint plan whose segments do not tile the blocks would run a different function; a memory plan whose choices
use a technique its ``settings.allow`` leaves out would change gradients it promised exact. Every test here failed
before the checks existed. The last part fuzzes both file formats with hypothesis: every input either loads and
applies to a model that computes what the unconverted model computes, or raises one FewBitError.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from fewbit_design import runtime
from fewbit_design.errors import FewBitError, parse_budget
from fewbit_design.runtime import checkpoint
from fewbit_design.runtime.checkpoint import Plan, Segment
from fewbit_design.runtime.planner import MemoryPlan, load_plan

WIDTH = 8


def chain(n: int = 4, width: int = WIDTH, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width)) for _ in range(n)]
    )


def mlp(width: int = WIDTH, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(3)]
    return nn.Sequential(*blocks)


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for parameter in model.parameters():
        parameter.grad = None
    output = model(x)
    output.pow(2).sum().backward()
    return output.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def checkpoint_plan() -> Plan:
    blocks = chain()
    return checkpoint.plan(checkpoint.profile(blocks, torch.randn(4, WIDTH)), strategy="sqrt")


@pytest.fixture(scope="module")
def memory_plan() -> MemoryPlan:
    """A plan over every technique (few-bit, offload and checkpoint options profiled for every block). A batch of
    64, where what the blocks save outweighs the few-bit tables, so that the smallest peak offloads (at a batch of
    4 the blocks keep less than the step's fixed parts, and every plan has nearly the same peak)."""
    return runtime.plan_memory(mlp(), torch.randn(64, WIDTH), budget="min", offload_min_bytes=0, repeats=1)


def edited(plan, **changes) -> dict:
    data = json.loads(json.dumps(plan.to_dict()))
    data.update(changes)
    return data


# --- checkpoint plans --------------------------------------------------------------------------------------------
SEGMENT_EDITS = [
    ([{"start": 0, "stop": 2, "checkpoint": True}, {"start": 3, "stop": 4, "checkpoint": False}], "starts at 3"),
    ([{"start": 0, "stop": 3, "checkpoint": True}, {"start": 2, "stop": 4, "checkpoint": False}], "starts at 2"),
    ([{"start": -1, "stop": 4, "checkpoint": True}], r"segments\[0\].start must be an integer >= 0, got -1"),
    ([{"start": 0, "stop": 2, "checkpoint": True}], "end at block 1"),
    ([{"start": 0, "stop": 5, "checkpoint": True}], "beyond block 3"),
    ([{"start": 0, "stop": 0, "checkpoint": True}, {"start": 0, "stop": 4, "checkpoint": False}], "is empty"),
    ([{"start": 0, "stop": 4, "checkpoint": "no"}], r"segments\[0\].checkpoint must be true or false, got 'no'"),
    ([{"start": 0, "stop": 4, "checkpoint": 1}], "must be true or false"),
    ([{"start": "0", "stop": 4, "checkpoint": True}], "must be an integer"),
    ([{"start": 0.0, "stop": 4, "checkpoint": True}], "must be an integer"),
    ([{"start": 0, "stop": 4, "checkpoint": True, "children": [{"start": 0, "stop": 3, "checkpoint": False}]}], "3"),
    ([{"start": 0, "stop": 4, "checkpoint": False, "children": [{"start": 0, "stop": 4, "checkpoint": True}]}], "not"),
    ([{"start": 0, "stop": 4, "checkpoint": True, "chekpoint": True}], "unknown field 'chekpoint'"),
    ([{"start": 0, "stop": 4}], "lacks 'checkpoint'"),
    ([], "segments must be a non-empty list"),
    ("0-4", "segments must be a list"),
]


@pytest.mark.parametrize(("segments", "message"), SEGMENT_EDITS)
def test_checkpoint_plan_segments_that_do_not_tile_the_blocks_are_refused(checkpoint_plan, segments, message):
    # before: a gap, an overlap or a negative start was applied and computed a different function
    with pytest.raises(FewBitError, match=message):
        Plan.from_dict(edited(checkpoint_plan, segments=segments))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("peak_bytes", -5, "peak_bytes must be an integer >= 0, got -5"),
        ("peak_bytes", 1.5, "peak_bytes must be an integer"),
        ("baseline_peak_bytes", "12", "baseline_peak_bytes must be an integer"),
        ("extra_seconds", -1.0, "extra_seconds must be a number >= 0"),
        ("forward_seconds", "fast", "forward_seconds must be a number"),
        ("budget_bytes", 0, "budget_bytes must be an integer >= 1"),
        ("budget_bytes", True, "budget_bytes must be an integer"),
        ("names", ["0", "1", 2, "3"], r"names\[2\] must be a string"),
        ("names", ["0", "1"], "must cover blocks 0..1"),
        ("strategy", 3, "strategy must be a string"),
        ("format", "fewbit-checkpoint-plan/2", "format must be 'fewbit-checkpoint-plan/1'"),
        ("extra", 1, "unknown field 'extra'"),
    ],
)
def test_checkpoint_plan_fields_have_strict_types(checkpoint_plan, field, value, message):
    with pytest.raises(FewBitError, match=message):
        Plan.from_dict(edited(checkpoint_plan, **{field: value}))


def test_checkpoint_plan_from_dict_of_a_non_dict_is_one_error():
    for data in ([1], None, "plan", 3):
        with pytest.raises(FewBitError, match="checkpoint plan: the plan must be an object"):
            Plan.from_dict(data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"segments": (Segment(0, 2, True), Segment(3, 4, False))}, "starts at 3 but segments"),
        ({"segments": (Segment(0, 4, "no"),)}, "must be true or false"),
        ({"segments": (Segment(0, 4, True, (Segment(0, 1, False),)),)}, "must cover blocks 0..3"),
        ({"segments": ()}, "non-empty list of Segment"),
        ({"peak_bytes": -5}, "peak_bytes"),
        ({"names": ("a", "b")}, "must cover blocks 0..1"),
    ],
)
def test_a_plan_changed_in_python_is_refused_when_applied(checkpoint_plan, change, message):
    plan = copy.deepcopy(checkpoint_plan)
    for name, value in change.items():
        setattr(plan, name, value)
    with pytest.raises(FewBitError, match=message):
        checkpoint.apply(chain(), plan)
    with pytest.raises(FewBitError, match=message):
        checkpoint.apply(nn.ModuleList(list(chain())), plan)


def test_checkpointed_sequential_runs_the_plan_it_checked(checkpoint_plan):
    blocks, x = chain(), torch.randn(4, WIDTH)
    expected = step(copy.deepcopy(blocks), x)
    plan = copy.deepcopy(checkpoint_plan)
    model = checkpoint.apply(blocks, plan)
    plan.segments = (Segment(0, 1, True), Segment(2, 4, False))  # changed after apply: not used
    got = step(model, x)
    assert torch.equal(got[0], expected[0])
    for a, b in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(FewBitError, match="starts at 2"):
        model.plan = plan  # setting a plan checks it


def test_checkpoint_plan_file_round_trip_and_bad_files(checkpoint_plan, tmp_path):
    path = tmp_path / "plan.json"
    checkpoint_plan.save(path)
    assert checkpoint.load_plan(path) == checkpoint_plan
    for content, message in [
        (b"[" * 100_000 + b"]" * 100_000, "nesting depth 100000 exceeds"),
        (b"\xff\xfe{}", "cannot be read"),
        (b'{"format": "fewbit-checkpoint-plan/1", ', "is not JSON"),
        (b"1" * 5000, "cannot be parsed"),
    ]:
        path.write_bytes(content)
        with pytest.raises(FewBitError, match=message):
            checkpoint.load_plan(path)
    with pytest.raises(FewBitError, match="does not exist"):
        checkpoint.load_plan(tmp_path / "missing.json")


# --- memory plans keep to settings.allow; offload settings are offload's own -------------------------------------
def test_memory_plan_choices_must_use_allowed_techniques_only(memory_plan):
    data = edited(memory_plan)
    data["settings"]["allow"] = ["checkpoint"]
    data["choices"] = ["fewbit", "plain", "plain"]  # a profiled option of block 0, but not allowed
    with pytest.raises(FewBitError, match=r"choices\[0\] \('0'\) is 'fewbit', which uses fewbit, but settings.allow"):
        MemoryPlan.from_dict(data)
    # the same plan changed in Python: refused at apply, the model left as it was
    plan = copy.deepcopy(memory_plan)
    plan.settings = {**plan.settings, "allow": ("checkpoint",)}
    plan.choices = ("fewbit", "plain", "plain")
    model = mlp()
    before = [type(m) for m in model.modules()]
    with pytest.raises(FewBitError, match="settings.allow"):
        plan.apply(model)
    assert [type(m) for m in model.modules()] == before


@pytest.mark.parametrize(
    ("offload", "message"),
    [
        ({"prefetch": -1}, "settings.offload.prefetch must be an integer >= 0, got -1"),
        ({"target": "nvme"}, "settings.offload.target must be 'auto', 'disk' or 'cuda-host', got 'nvme'"),
        ({"min_bytes": "1MiB"}, "settings.offload.min_bytes must be an integer"),
        ({"max_host_bytes": -1}, "max_host_bytes must be an integer >= 0"),
        ({"directory": 3}, "directory must be a string"),
        ({"speed": "fast"}, "unknown field 'speed'"),
    ],
)
def test_memory_plan_offload_settings_are_checked(memory_plan, offload, message):
    data = edited(memory_plan)
    data["settings"]["offload"].update(offload)
    with pytest.raises(FewBitError, match=message):
        MemoryPlan.from_dict(data)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["settings"].update(bits=9), "settings.bits must be an integer from 1 to 8"),
        (lambda d: d["settings"].update(bits=3.0), "settings.bits must be an integer"),
        (lambda d: d["settings"].update(blpa_bits=1), "settings.blpa_bits"),
        (lambda d: d["settings"].update(allow=["fewbit", "fewbit"]), "twice"),
        (lambda d: d["settings"].update(objective="speed"), "settings.objective"),
        (lambda d: d["choices"].pop(), "choices has 2 entries"),
        (lambda d: d["choices"].__setitem__(0, "blpa"), "not a profiled option"),
        (lambda d: d.update(budget_bytes="abc"), "budget_bytes must be an integer"),
        (lambda d: d.update(step_seconds=float("nan")), "step_seconds must be a finite number"),
        (lambda d: d["costs"]["blocks"][0]["options"][0].update(kept=[1]), r"options\[0\].kept must be an integer"),
        (lambda d: d["costs"]["blocks"][0]["options"][0].update(saves_input="no"), "saves_input must be true"),
        (lambda d: d["costs"]["blocks"][0]["options"][0].update(option="fewbit+blpa"), "in that order"),
        (lambda d: d["costs"]["blocks"][0].update(name="x.0"), "name must be the key"),
        (lambda d: d["costs"]["blocks"][1].update(name="0"), "appears twice"),
        (lambda d: d["costs"]["blocks"][0].update(output_bytes=-1), "output_bytes must be an integer >= 0"),
        (lambda d: d["costs"].update(entry_bytes=None), "costs.entry_bytes must be an integer"),
        (lambda d: d["facts"].update(saved_bytes=[1]), "facts.saved_bytes must be an object"),
        (lambda d: d.update(measured={"peak_bytes": 1}), "measured lacks"),
        (lambda d: d["fingerprint"].pop(), "fingerprint has 2 blocks"),
        (lambda d: d.update(chain=None), "chain must be a string"),
    ],
)
def test_memory_plan_fields_have_strict_types(memory_plan, edit, message):
    data = edited(memory_plan)
    edit(data)
    with pytest.raises(FewBitError, match=message):
        MemoryPlan.from_dict(data)


def test_memory_plan_offload_failure_leaves_the_model_unchanged(memory_plan, tmp_path):
    assert any("offload" in choice for choice in memory_plan.choices) and memory_plan.approximate_blocks()
    for offload, message in [
        ({"target": "cuda-host"}, "needs CUDA"),
        ({"directory": str(tmp_path / "no")}, "must be an existing folder"),
    ]:
        if offload.get("target") == "cuda-host" and torch.cuda.is_available():
            continue
        plan = copy.deepcopy(memory_plan)
        plan.settings["offload"].update(offload)
        model = mlp()
        before = [type(m) for m in model.modules()]
        with pytest.raises(FewBitError, match=message):
            plan.apply(model)
        assert [type(m) for m in model.modules()] == before  # nothing converted before offload failed


def test_memory_plan_differences_of_live_bytes_may_be_negative(memory_plan):
    # a block may keep less than it allocated and the modules after the chain may free bytes: real plans have these
    data = edited(memory_plan)
    data["costs"].update(post_forward_peak=-64, post_bytes=-64)
    data["costs"]["blocks"][0]["options"][0]["kept"] = -64
    plan = MemoryPlan.from_dict(data)
    assert plan.costs.post_forward_peak == plan.costs.post_bytes == plan.costs.blocks[0].options[0].kept == -64


# --- plan_memory's inputs, apply twice, load_plan of bad files, from_dict of non-dicts ---------------------------
def test_plan_memory_refuses_what_it_cannot_plan():
    x = torch.randn(4, WIDTH)
    with pytest.raises(FewBitError, match="has no blocks"):
        runtime.plan_memory(nn.Sequential(), x, repeats=1)
    with pytest.raises(FewBitError, match="does not require a gradient"):
        runtime.plan_memory(nn.Sequential(nn.GELU(), nn.Tanh()), x, repeats=1)
    with pytest.raises(FewBitError, match="needs example inputs"):
        runtime.plan_memory(mlp())
    with pytest.raises(FewBitError, match="raised RuntimeError"):  # a shape the model cannot take
        runtime.plan_memory(mlp(), torch.randn(4, WIDTH + 1), repeats=1)
    with pytest.raises(FewBitError, match="budget"):  # before profiling
        runtime.plan_memory(mlp(), x, budget="lots")


def test_applying_a_memory_plan_twice_is_one_error(memory_plan):
    model = memory_plan.apply(mlp())
    modules = [type(m) for m in model.modules()]
    with pytest.raises(FewBitError, match="applied to this model already"):
        memory_plan.apply(model)
    assert [type(m) for m in model.modules()] == modules
    x = torch.randn(4, WIDTH)
    assert torch.equal(model(x), mlp()(x))


def test_load_plan_of_bad_files_is_one_error(tmp_path):
    path = tmp_path / "plan.json"
    for content, message in [
        (b"[" * 100_000 + b"]" * 100_000, "nesting depth 100000 exceeds"),
        (b"\xff\xfe{}", "cannot be read"),
        (b"1" * 5000, "cannot be parsed"),
        (b"[1, 2]", "the plan must be an object"),
    ]:
        path.write_bytes(content)
        with pytest.raises(FewBitError, match=message):
            load_plan(path)


def test_memory_plan_from_dict_of_a_non_dict_or_non_numbers_is_one_error(memory_plan):
    for data in ([1], None, "plan"):
        with pytest.raises(FewBitError, match="the plan must be an object"):
            MemoryPlan.from_dict(data)
    with pytest.raises(FewBitError, match="baseline_bytes must be an integer"):
        MemoryPlan.from_dict(edited(memory_plan, baseline_bytes="many"))


# --- one budget syntax; plans check the model they are applied to ------------------------------------------------
def test_checkpoint_plan_takes_the_planner_budget_forms():
    blocks = chain(6)
    profile = checkpoint.profile(blocks, torch.randn(16, WIDTH))
    smallest = checkpoint.minimum_budget(profile)
    unconverted = checkpoint.plan(profile, strategy="none").peak_bytes
    assert checkpoint.plan(profile, budget="min").budget_bytes == smallest
    assert checkpoint.plan(profile, budget="MIN").peak_bytes == smallest
    assert checkpoint.plan(profile, budget=1.0).budget_bytes == unconverted
    assert checkpoint.plan(profile, budget="1.0").budget_bytes == unconverted
    assert checkpoint.plan(profile, budget=smallest).peak_bytes <= smallest


def test_memory_plan_takes_the_checkpoint_budget_forms(memory_plan):
    assert memory_plan.replan("1.0").budget_bytes == memory_plan.replan(1.0).budget_bytes
    assert memory_plan.replan("Min").budget_bytes == memory_plan.replan("min").budget_bytes
    nbytes = memory_plan.unconverted_peak_bytes
    assert memory_plan.replan(f"{nbytes}B").budget_bytes == memory_plan.replan(nbytes).budget_bytes == nbytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("1000", 1000), (7, 7), (0.5, 0.5), ("0.25", 0.25), ("mIn", "min")],
)
def test_one_budget_syntax(text, expected):
    assert parse_budget(text) == expected == checkpoint.parse_budget(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2gib", "did you mean '2GiB'"),
        ("1.5", r"fraction .* \(0, 1\]"),
        (2.0, r"\(0, 1\]"),
        ("0", "> 0"),
        ("9" * 25, "budget must be"),
    ],
)
def test_bad_budgets_name_the_form(text, message):
    with pytest.raises(FewBitError, match=message):
        parse_budget(text)


def test_cli_budget_uses_the_same_parser(capsys):
    from fewbit_design.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["memory", "no_such_module:f", "--input-shape", "4,8", "--budget", "2gib"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "did you mean '2GiB'" in err and err.count("\n") == 1


def test_a_checkpoint_plan_for_another_model_is_refused(checkpoint_plan):
    other = chain(width=WIDTH + 4)  # same block names and classes, other widths
    with pytest.raises(
        FewBitError, match=r"block 0 \('0'\) differs: its parameter '0.weight' has shape 24x12, in the plan 16x8"
    ):
        checkpoint.apply(other, checkpoint_plan)
    x = torch.randn(4, WIDTH)
    per_block = checkpoint.plan(checkpoint.profile(nn.ModuleList(list(chain())), x), budget="min")
    with pytest.raises(FewBitError, match=r"block 0 \('0'\) differs"):
        checkpoint.apply(nn.ModuleList(list(other)), per_block)
    swapped = chain()
    swapped[2] = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH, bias=False))
    with pytest.raises(FewBitError, match=r"block 2 \('2'\) differs: it has no parameter '2.bias'"):
        checkpoint.apply(swapped, checkpoint_plan)
    with pytest.raises(
        FewBitError, match=r"block 1 \('1'\) differs: it is a Linear, the plan was made for a Sequential"
    ):
        checkpoint.apply(
            nn.Sequential(*[nn.Linear(WIDTH, WIDTH) if i == 1 else b for i, b in enumerate(chain())]), checkpoint_plan
        )


def test_a_memory_plan_for_another_model_is_refused(memory_plan):
    other = mlp(width=WIDTH * 2)
    before = [type(m) for m in other.modules()]
    with pytest.raises(FewBitError, match=r"another model: block 0 \('0'\) differs: its parameter '0.weight'"):
        memory_plan.apply(other)
    assert [type(m) for m in other.modules()] == before


def test_plans_saved_before_fingerprints_still_load_and_apply(checkpoint_plan, memory_plan):
    data = edited(checkpoint_plan)
    del data["fingerprint"]
    old = Plan.from_dict(data)
    assert old.fingerprint == () and checkpoint.apply(chain(), old).plan is old
    data = edited(memory_plan)
    del data["fingerprint"]
    old_memory = MemoryPlan.from_dict(data)
    assert old_memory.fingerprint == ()
    x = torch.randn(4, WIDTH)
    assert torch.equal(old_memory.apply(mlp())(x), mlp()(x))


# --- fuzzing both plan formats -----------------------------------------------------------------------------------
def _paths(value, prefix=()):
    """Every place in a JSON document: (path of keys/indices)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


def _get(document, path):
    for key in path:
        document = document[key]
    return document


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.sampled_from([0, 1, -1, 2, 3, 7, 8, 9, 2**31, 2**63, -(2**63), 10**30])
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["", "plain", "fewbit", "checkpoint", "offload", "blpa", "fewbit+checkpoint", "0", "nvme", "min"])
    | st.text(max_size=6)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)


@st.composite
def tiling(draw, start: int, stop: int, depth: int = 0) -> list[dict]:
    """A valid segmentation of blocks start..stop - 1 (checkpointed segments may nest)."""
    cuts = (
        sorted(draw(st.sets(st.integers(start + 1, stop - 1), max_size=stop - start - 1))) if stop - start > 1 else []
    )
    segments = []
    for first, last in zip([start, *cuts], [*cuts, stop], strict=True):
        segment = {"start": first, "stop": last, "checkpoint": draw(st.booleans())}
        if segment["checkpoint"] and depth < 2 and draw(st.booleans()):
            segment["children"] = draw(tiling(first, last, depth + 1))
        segments.append(segment)
    return segments


@st.composite
def valid_checkpoint_edits(draw, document: dict) -> None:
    document["segments"] = draw(tiling(0, len(document["names"])))
    document["peak_bytes"] = draw(st.integers(0, 2**40))
    document["extra_seconds"] = draw(st.floats(0, 1e3))
    for key in ("fingerprint", "names", "budget_bytes"):
        if draw(st.booleans()):
            del document[key]  # optional: a plan saved before fingerprints, a plan without names or budget


@st.composite
def valid_memory_edits(draw, document: dict) -> None:
    blocks = document["costs"]["blocks"]
    document["choices"] = [draw(st.sampled_from([o["option"] for o in block["options"]])) for block in blocks]
    used = {t for choice in document["choices"] if choice != "plain" for t in choice.split("+")}
    extra = draw(st.sets(st.sampled_from(["blpa", "fewbit", "offload", "checkpoint"])))
    document["settings"]["allow"] = draw(st.permutations(sorted(used | extra)))
    document["settings"]["bits"] = draw(st.integers(1, 8))
    document["settings"]["offload"]["prefetch"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        del document["fingerprint"]


@st.composite
def mutated(draw, document: dict, valid_edits) -> bytes:
    """The JSON text of ``document`` changed: valid edits (another tiling or other choices, other numbers in range,
    optional fields dropped), then zero to three bad ones in random places (a value replaced by another JSON value:
    a wrong type, an out-of-range number; a deeply nested value; a key deleted or added); or random bytes, or the
    text cut short."""
    kind = draw(st.sampled_from(["edit", "edit", "edit", "bytes", "cut"]))
    text = json.dumps(document)
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "cut":
        return text[: draw(st.integers(0, len(text) - 1))].encode()
    document = copy.deepcopy(document)
    draw(valid_edits(document))
    for _ in range(draw(st.integers(0, 3))):
        paths = list(_paths(document))
        path = draw(st.sampled_from(paths[1:]))
        parent, key = _get(document, path[:-1]), path[-1]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add", "nest", "number"]))
        if action == "replace":
            parent[key] = draw(JSON_VALUES)
        elif action == "nest":
            value = parent[key]
            for _ in range(draw(st.integers(1, 40))):
                value = [value]
            parent[key] = value
        elif action == "number" and isinstance(parent[key], int | float) and not isinstance(parent[key], bool):
            parent[key] = parent[key] + draw(st.sampled_from([-1, 1, -(10**6), 0.5]))
        elif action == "delete":
            del parent[key]
        elif action == "add":
            target = parent[key] if isinstance(parent[key], dict | list) else parent
            if isinstance(target, dict):
                target[draw(st.text(max_size=6))] = draw(JSON_VALUES)
            else:
                target.append(draw(JSON_VALUES))
    return json.dumps(document).encode()


def _fuzz_one(tmp_path, content: bytes, load, apply, model_factory):
    path = tmp_path / "fuzzed.json"
    path.write_bytes(content)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(0))
    try:
        plan = load(path)
        model = apply(model_factory(), plan)
    except FewBitError:
        event("refused with FewBitError")
        return None
    event("loaded and applied")
    reference = model_factory()
    got, expected = step(model, x), step(reference, x)
    assert torch.equal(got[0], expected[0]), "a plan that loads and applies must compute the same function"
    return plan, got[1], expected[1]


FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.data())
def test_fuzzed_checkpoint_plans_work_or_raise_one_error(checkpoint_plan, tmp_path, data):
    content = data.draw(mutated(checkpoint_plan.to_dict(), valid_checkpoint_edits))
    result = _fuzz_one(tmp_path, content, checkpoint.load_plan, lambda m, p: checkpoint.apply(m, p), chain)
    if result is not None:  # checkpointing never changes gradients
        for got, expected in zip(result[1], result[2], strict=True):
            torch.testing.assert_close(got, expected)


@FUZZ
@given(data=st.data())
def test_fuzzed_memory_plans_work_or_raise_one_error(memory_plan, tmp_path, data):
    content = data.draw(mutated(json.loads(memory_plan.to_json()), valid_memory_edits))
    result = _fuzz_one(tmp_path, content, load_plan, lambda m, p: p.apply(m), mlp)
    if result is not None and not result[0].approximate_blocks():  # exact techniques only: exact gradients
        for got, expected in zip(result[1], result[2], strict=True):
            torch.testing.assert_close(got, expected)
