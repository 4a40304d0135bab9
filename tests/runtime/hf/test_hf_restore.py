"""The record of a conversion in a Hugging Face model's config (written by runtime.convert and plan.apply, or
runtime.hf.record) and restore() after from_pretrained; runtime.unconvert back to native modules."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from hf_tiny import loss_and_gradients, structure, tiny_gpt2, tokens
from test_lean_imports import loaded_after

from fewbit_design import runtime
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import hf
from fewbit_design.runtime.fewbit.nn import FewBitModule

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'models' extra)")


def _converted(batch):
    """A tiny GPT-2 converted by hand (few-bit activations, then a checkpoint plan at the smallest budget)."""
    model = runtime.convert(tiny_gpt2(transformers), bits=2)
    plan = runtime.plan_memory(
        model, batch, example_kwargs={"labels": batch}, budget="min", allow=("checkpoint",), repeats=1
    )
    assert "checkpoint" in plan.choices  # the round trip has a checkpointed block to restore
    return plan.apply(model), plan


def _few_bit_count(model) -> int:
    return sum(isinstance(module, FewBitModule) for module in model.modules())


def test_save_pretrained_from_pretrained_restore_gives_the_converted_model(tmp_path):
    batch = tokens()
    model, plan = _converted(batch)
    hf.record(model, convert={"bits": 2}, plan=plan)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["fewbit"]["format"] == hf.FORMAT

    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert _few_bit_count(loaded) == 0  # from_pretrained alone builds the unconverted model
    restored = hf.restore(loaded)
    assert restored is loaded
    assert structure(restored) == structure(model)
    assert _few_bit_count(restored) == _few_bit_count(model) == 2
    assert restored.fewbit_memory_plan.choices == plan.choices
    loss, gradients = loss_and_gradients(model, batch)
    restored_loss, restored_gradients = loss_and_gradients(restored, batch)
    assert torch.equal(restored_loss, loss)
    assert gradients.keys() == restored_gradients.keys()
    assert all(torch.equal(restored_gradients[name], gradients[name]) for name in gradients)
    # the approximate gradients are the converted model's, not the unconverted one's
    _, native = loss_and_gradients(transformers.GPT2LMHeadModel.from_pretrained(tmp_path), batch)
    assert not all(torch.equal(native[name], gradients[name]) for name in gradients)


def test_a_model_saved_unconverted_warns_once_at_restore(tmp_path):
    tiny_gpt2(transformers).save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"no 'fewbit' record.*fewbit_design\.runtime\.hf\.record\(model"):
        assert hf.restore(loaded) is loaded
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.restore(loaded)  # once per model
    assert _few_bit_count(loaded) == 0


def test_a_model_converted_and_planned_by_hand_is_recorded_and_reloads_converted(tmp_path):
    """convert and plan.apply record themselves in the config (no record() call): save_pretrained, then
    from_pretrained and restore give the same modules, loss and gradients; restore twice changes nothing."""
    batch = tokens()
    model, plan = _converted(batch)
    model.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["fewbit"]
    assert record["convert"] == {"bits": 2} and record["plan"]["choices"] == list(plan.choices)
    restored = hf.restore(transformers.GPT2LMHeadModel.from_pretrained(tmp_path))
    assert structure(restored) == structure(model)
    assert hf.restore(restored) is restored and structure(restored) == structure(model)  # idempotent
    loss, gradients = loss_and_gradients(model, batch)
    restored_loss, restored_gradients = loss_and_gradients(restored, batch)
    assert torch.equal(restored_loss, loss)
    assert all(torch.equal(restored_gradients[name], gradients[name]) for name in gradients)


def test_two_convert_calls_are_both_recorded_and_replayed(tmp_path):
    model = runtime.convert(tiny_gpt2(transformers), activations=False)
    model = runtime.convert(model, bits=2, norms=False)
    assert model.config.fewbit["convert"] == [{"activations": False}, {"bits": 2, "norms": False}]
    model.save_pretrained(tmp_path)
    restored = hf.restore(transformers.GPT2LMHeadModel.from_pretrained(tmp_path))
    assert structure(restored) == structure(model)


def test_unconvert_gives_the_native_modules_and_native_gradients():
    batch = tokens()
    native = tiny_gpt2(transformers)
    native_structure = structure(native)
    native_loss, native_gradients = loss_and_gradients(native, batch)
    model, _ = _converted(batch)
    assert structure(model) != native_structure
    model.config.use_cache = True  # as a stock config has it before the plan turned it off
    model.fewbit_use_cache = {"": True}
    plain = runtime.unconvert(model)
    assert plain is model and structure(plain) == native_structure
    assert not hasattr(plain.config, "fewbit") and plain.config.use_cache is True
    assert not hasattr(plain, "fewbit_memory_plan") and not hasattr(plain, "convert_report")
    loss, gradients = loss_and_gradients(plain, batch)
    assert torch.equal(loss, native_loss)
    assert all(torch.equal(gradients[name], native_gradients[name]) for name in native_gradients)
    assert runtime.unconvert(plain) is plain  # nothing left to undo


def _record(**fields):
    data = {"format": hf.FORMAT, "version": "0.1.0", "convert": {"bits": 3}, "plan": None}
    data.update(fields)
    return data


BAD_RECORDS = [
    (
        _record(format="fewbit-hf/9", version="9.0"),
        r"format 'fewbit-hf/9' \(written by fewbit-design 9\.0\).*'fewbit-hf/1'",
    ),
    (
        _record(convert={"bitz": 3}),
        r"fewbit\.convert: runtime\.convert has no argument 'bitz' \(did you mean 'bits'\?\)",
    ),
    (_record(convert={"filter": None}), r"convert\['filter'\]: .*cannot be recorded"),
    (_record(convert=[3]), r"convert\[0\] must be a dict"),
    ({k: v for k, v in _record().items() if k != "plan"}, r"fewbit lacks 'plan'"),
    (_record(extra=1), r"unknown field 'extra'"),
    ("fewbit-hf/1", r"fewbit must be an object"),
]


@pytest.mark.parametrize("data, message", BAD_RECORDS)
def test_a_bad_record_is_one_clear_error_and_the_model_stays_as_it_was(data, message):
    model = tiny_gpt2(transformers)
    model.config.fewbit = data
    with pytest.raises(FewBitError, match=message):
        hf.restore(model)
    assert _few_bit_count(model) == 0


def test_a_plan_naming_an_unknown_technique_or_another_architecture_fails_before_the_model_changes():
    batch = tokens()
    model, plan = _converted(batch)
    hf.record(model, convert={"bits": 2}, plan=plan)
    record = json.loads(json.dumps(model.config.fewbit))

    bad = json.loads(json.dumps(record))
    bad["plan"]["choices"][0] = "warp"
    other = tiny_gpt2(transformers)
    other.config.fewbit = bad
    with pytest.raises(FewBitError, match=r"fewbit\.plan.*choices\[0\] is 'warp'"):
        hf.restore(other)

    deeper = tiny_gpt2(transformers, layers=3)
    deeper.config.fewbit = record
    with pytest.raises(FewBitError, match=r"chain of blocks \['0', '1'\].*\['0', '1', '2'\]"):
        hf.restore(deeper)
    assert _few_bit_count(deeper) == 0  # checked before convert ran


def test_record_keeps_json_only_and_names_what_cannot_be_recorded():
    model = tiny_gpt2(transformers)
    with pytest.raises(
        FewBitError, match=r"record\(convert=\.\.\.\)\['filter'\]: convert's 'filter' cannot be recorded"
    ):
        hf.record(model, convert={"filter": {torch.nn.GELU: None}})
    with pytest.raises(FewBitError, match=r"\['tables'\]\['h\.0\.mlp\.act'\] is .*JSON values only"):
        hf.record(model, convert={"tables": {"h.0.mlp.act": object()}})
    with pytest.raises(FewBitError, match=r"record takes a torch\.nn\.Module"):
        hf.record("model")
    with pytest.raises(FewBitError, match=r"Linear has no config object"):
        hf.restore(torch.nn.Linear(2, 2))
    table = runtime.load_table("gelu", bits=2, params={"approximate": "tanh"})
    data = hf.record(model, convert={"tables": {"transformer.h.0.mlp.act": table}})
    assert json.loads(json.dumps(data))["convert"]["tables"]["transformer.h.0.mlp.act"] == table.to_dict()
    assert model.config.fewbit == data


def test_importing_the_hf_package_and_restore_loads_no_transformers():
    code = """
from fewbit_design import runtime
from fewbit_design.runtime.hf import record, restore
names = dir(runtime.hf)
result = {'transformers': 'transformers' in sys.modules, 'names': names}
"""
    assert loaded_after(code) == {"transformers": False, "names": sorted(hf.__all__)}
