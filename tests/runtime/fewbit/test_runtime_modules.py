"""runtime.nn, runtime.functional, FewBit, convert, load_table: drop-in behaviour, errors, torch integration, memory.

Oracles: the torch.nn module / torch.nn.functional op (forward, compared bitwise), and
grad_output * levels[codes[searchsorted(boundaries, x, side='right')]] computed here in numpy (backward).
"""

import copy
import dataclasses
import inspect
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fewbit_design import runtime
from fewbit_design.design import activations
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import functional as FF
from fewbit_design.runtime import memory
from fewbit_design.runtime import nn as fnn
from fewbit_design.runtime.fewbit import backends

NAMES = [name for name in activations.names() if activations.get(name).torch_name]  # entries with a torch.nn class
EXTRA = ("bits", "weight", "mode", "table")


def oracle_grad(table, x, grad):
    values = x.detach().reshape(-1).to(torch.float64).numpy()
    codes = table.codes[np.searchsorted(table.boundaries, values, side="right")]
    compute = torch.float64 if grad.dtype == torch.float64 else torch.float32
    levels = table.levels.astype(np.float64 if compute == torch.float64 else np.float32)[codes]
    product = grad.detach().reshape(-1).to(compute).numpy() * levels
    return torch.from_numpy(product).to(grad.dtype).reshape(grad.shape)


def native_module(name):
    entry = activations.get(name)
    cls = getattr(torch.nn, entry.torch_name)
    return cls(0.0, 0.0) if name == "threshold" else cls()


def fewbit_module(name, table):
    cls = getattr(fnn, activations.get(name).torch_name)
    return cls(0.0, 0.0, table=table) if name == "threshold" else cls(table=table)


def inputs(dtype, shape=(6, 37)):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator) * 4
    x.view(-1)[:7] = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0, -3.0, 6.0])  # kinks of the registry activations
    return x.to(dtype).requires_grad_(), torch.randn(shape, generator=generator).to(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# drop-in modules and functions


@pytest.mark.parametrize("name", NAMES)
def test_constructor_matches_torch(name):
    torch_name = activations.get(name).torch_name
    ours = inspect.signature(getattr(fnn, torch_name).__init__).parameters
    torch_class = getattr(torch.nn, torch_name)
    # classes without their own __init__ (Sigmoid, Tanh, ...) take no arguments
    theirs = inspect.signature(torch_class.__init__).parameters if "__init__" in vars(torch_class) else {"self": None}
    ours_torch_part = [(p.name, p.default, p.kind) for p in ours.values() if p.name not in EXTRA]
    if "__init__" in vars(torch_class):
        assert ours_torch_part == [(p.name, p.default, p.kind) for p in theirs.values()]
    else:
        assert [name for name, _, _ in ours_torch_part] == ["self"]
    assert [p for p in ours if p in EXTRA] == list(EXTRA)
    assert all(ours[p].kind is inspect.Parameter.KEYWORD_ONLY for p in EXTRA)
    assert (ours["bits"].default, ours["weight"].default, ours["mode"].default, ours["table"].default) == (
        3,
        "uniform",
        "levelsets",
        None,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_module_forward_is_native_and_backward_is_the_table(name, dtype, make_table):
    table = make_table(name, 3)
    ours, native = fewbit_module(name, table), native_module(name)
    x, grad = inputs(dtype)
    y = ours(x)
    expected = native(x.detach())
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    assert y.dtype == expected.dtype
    (x_grad,) = torch.autograd.grad(y, x, grad)
    torch.testing.assert_close(x_grad, oracle_grad(table, x, grad), rtol=0, atol=0)


FUNCTIONAL_CALLS = {
    "leaky_relu": {"negative_slope": 0.01},
    "elu": {"alpha": 1.0},
    "celu": {"alpha": 1.0},
    "gelu": {"approximate": "none"},
    "softplus": {"beta": 1.0, "threshold": 20.0},
    "hardtanh": {"min_val": -1.0, "max_val": 1.0},
    "softshrink": {"lambd": 0.5},
    "hardshrink": {"lambd": 0.5},
    "threshold": {"threshold": 0.0, "value": 0.0},
}


@pytest.mark.parametrize("name", NAMES)
def test_functional_forward_is_native_and_backward_is_the_table(name, make_table):
    table = make_table(name, 2)
    params = FUNCTIONAL_CALLS.get(name, {})
    native = {"sigmoid": torch.sigmoid, "tanh": torch.tanh}.get(name) or getattr(F, name)
    x, grad = inputs(torch.float32, shape=(203,))
    y = getattr(FF, name)(x, **params, table=table)
    torch.testing.assert_close(y, native(x.detach(), **params), rtol=0, atol=0)
    y.backward(grad)
    torch.testing.assert_close(x.grad, oracle_grad(table, x, grad), rtol=0, atol=0)


def test_hyper_parameters_are_kept_and_used(make_table):
    table = make_table("leaky_relu", 2, {"negative_slope": 0.2})
    module = fnn.LeakyReLU(0.2, True, table=table)
    assert (module.negative_slope, module.inplace, module.bits) == (0.2, True, 2)
    x = torch.randn(50)
    torch.testing.assert_close(module(x), F.leaky_relu(x, 0.2), rtol=0, atol=0)
    assert not torch.equal(module(x), F.leaky_relu(x, 0.01))
    assert "negative_slope=0.2" in repr(module) and "bits=2" in repr(module)


def test_inplace_is_ignored_and_the_input_is_kept(make_table):
    module = fnn.ReLU(inplace=True, table=make_table("relu", 1))
    x = torch.randn(20)
    before = x.clone()
    module(x)
    assert torch.equal(x, before)


def test_fewbit_wraps_any_function(make_table):
    table = make_table("silu", 3)

    def swish(x):
        return x * torch.sigmoid(x)

    module = runtime.FewBit(swish, table)
    x, grad = inputs(torch.float32, shape=(99,))
    y = module(x)
    torch.testing.assert_close(y, swish(x.detach()), rtol=0, atol=0)
    y.backward(grad)
    torch.testing.assert_close(x.grad, oracle_grad(table, x, grad), rtol=0, atol=0)
    assert "fn=test_fewbit_wraps_any_function.<locals>.swish" in repr(module)


def test_fewbit_refuses_trainable_parameters_and_missing_tables(make_table):
    with pytest.raises(FewBitError, match="parameter 'weight' is trainable"):
        runtime.FewBit(torch.nn.PReLU(), make_table("relu", 1))
    with pytest.raises(FewBitError, match="needs a table"):
        runtime.FewBit(torch.relu, None)
    with pytest.raises(FewBitError, match="callable"):
        runtime.FewBit(3, make_table("relu", 1))


def test_without_autograd_nothing_is_computed_or_saved(make_table):
    module = fnn.GELU(table=make_table("gelu", 3))
    x = torch.randn(100)
    with memory.saved_bytes() as m:
        y = module(x)
    assert m.total == 0 and y.grad_fn is None
    with torch.no_grad():
        assert module(x.requires_grad_()).grad_fn is None


# ---------------------------------------------------------------------------------------------------------------------
# tables: Table, dict, path; shipped tables; errors


def test_table_as_table_dict_or_path_gives_the_same_module(make_table, tmp_path):
    table = make_table("gelu", 2)
    path = table.save(tmp_path / "gelu.json")
    x = torch.randn(64, requires_grad=True)
    results = []
    for given in (table, table.to_dict(), str(path), path):
        module = fnn.GELU(table=given, bits=5)  # the table's bits win over bits=
        assert module.bits == 2
        (grad,) = torch.autograd.grad(module(x).sum(), x)
        results.append(grad)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_table_for_another_activation_is_refused(make_table, tmp_path):
    path = make_table("silu", 3).save(tmp_path / "silu.json")
    with pytest.raises(FewBitError, match=r"silu.json' is for activation 'silu', but it was given to GELU \(gelu\)"):
        fnn.GELU(table=path)
    with pytest.raises(FewBitError, match="for activation 'silu'"):
        FF.gelu(torch.randn(3), table=make_table("silu", 3))


def test_table_with_other_params_is_refused(make_table):
    table = make_table("leaky_relu", 2, {"negative_slope": 0.2})
    with pytest.raises(FewBitError, match=r"leaky_relu\(negative_slope=0.2\), but the module has leaky_relu\(negative"):
        fnn.LeakyReLU(0.1, table=table)


def test_corrupt_or_missing_table_files_raise_one_clear_error(make_table, tmp_path):
    data = make_table("gelu", 3).to_dict()
    data["boundaries"] = data["boundaries"][::-1]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(FewBitError, match=r"bad.json'.*field 'boundaries' must be strictly increasing"):
        fnn.GELU(table=bad)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(FewBitError, match="broken.json'.*not valid JSON"):
        fnn.GELU(table=tmp_path / "broken.json")
    with pytest.raises(FewBitError, match="missing.json' does not exist"):
        fnn.GELU(table=tmp_path / "missing.json")
    with pytest.raises(FewBitError, match="table must be a Table, a dict or a path"):
        fnn.GELU(table=3)


@pytest.mark.parametrize("bits", [0, 9, 2.5, True])
def test_bits_outside_1_to_8_are_refused(bits, tables_dir):
    with pytest.raises(FewBitError, match="bits must be an integer from 1 to 8"):
        fnn.GELU(bits=bits)
    with pytest.raises(FewBitError, match="bits must be an integer from 1 to 8"):
        runtime.load_table("gelu", bits=bits)


def test_load_table_finds_shipped_tables_and_caches_them(tables_dir):
    table = runtime.load_table("gelu", bits=2)
    assert (table.activation, table.bits, table.mode, table.weight["kind"]) == ("gelu", 2, "levelsets", "uniform")
    assert runtime.load_table("GELU", params={"approximate": "none"}, bits=2) is table
    assert runtime.load_table("gelu", bits=3, weight="normal").weight["kind"] == "normal"
    module = fnn.GELU(bits=2)
    assert module.table is table and repr(module) == "GELU(approximate='none', bits=2)"
    converted = runtime.convert(torch.nn.Sequential(torch.nn.SiLU()), bits=1)
    assert converted[0].table is runtime.load_table("silu", bits=1)


def test_not_shipped_tables_show_the_design_command(tables_dir):
    with pytest.raises(FewBitError) as info:
        fnn.ELU(alpha=0.5)
    message = str(info.value)
    assert "no shipped table for elu(alpha=0.5) at 3 bits" in message
    assert "fewbit-design elu --param alpha=0.5 --bits 3 --weight uniform --out elu.json" in message
    assert "table='elu.json'" in message
    with pytest.raises(FewBitError, match="--mode intervals"):
        runtime.load_table("gelu", mode="intervals")


def test_missing_or_corrupt_index(tmp_path, monkeypatch):
    monkeypatch.setenv("FEWBIT_TABLES_DIR", str(tmp_path))
    with pytest.raises(FewBitError, match=r"index.json' does not exist; design it with `fewbit-design gelu --bits 3"):
        runtime.load_table("gelu")
    (tmp_path / "index.json").write_text(json.dumps({"format": "other", "tables": []}))
    with pytest.raises(FewBitError, match="field 'format' must be 'fewbit-index/1'"):
        runtime.load_table("gelu")


def test_load_table_checks_its_options(tables_dir):
    with pytest.raises(FewBitError, match="weight must be 'uniform' or 'normal', got 'laplace'"):
        runtime.load_table("gelu", weight="laplace")
    with pytest.raises(FewBitError, match="mode must be 'levelsets' or 'intervals'"):
        runtime.load_table("gelu", mode="fast")
    with pytest.raises(FewBitError, match="unknown activation 'gleu'"):
        runtime.load_table("gleu")


def test_index_entry_that_disagrees_with_its_file_is_refused(tables_dir):
    index = json.loads((tables_dir / "index.json").read_text())
    for entry in index["tables"]:
        if entry["activation"] == "gelu" and entry["bits"] == 1:
            entry["file"] = "silu/levelsets-uniform-1bit.json"
    (tables_dir / "index.json").write_text(json.dumps(index))
    with pytest.raises(FewBitError, match="does not match its index entry"):
        runtime.load_table("gelu", bits=1)


# ---------------------------------------------------------------------------------------------------------------------
# convert


class MyActivation(torch.nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


def test_convert_replaces_supported_activations_and_is_idempotent(tables_dir):
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.GELU(),
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LeakyReLU(), torch.nn.Dropout(0.0)),
        torch.nn.SiLU(),
        torch.nn.Softmax(dim=-1),
    )
    x = torch.randn(3, 4)
    before = model(x)
    assert runtime.convert(model, bits=2) is model
    assert isinstance(model[1], fnn.GELU) and isinstance(model[2][1], fnn.LeakyReLU) and isinstance(model[3], fnn.SiLU)
    assert isinstance(model[4], torch.nn.Softmax) and isinstance(model[2][2], torch.nn.Dropout)
    assert model[1].bits == 2 and model[2][1].negative_slope == 0.01
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    modules = list(model.modules())
    runtime.convert(model, bits=3)
    assert list(model.modules()) == modules and model[1].bits == 2


def test_convert_with_a_filter_dict_and_callable(make_table, tables_dir):
    table = make_table("silu", 2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), MyActivation(), torch.nn.GELU(), torch.nn.ReLU())
    runtime.convert(model, filter={MyActivation: table, torch.nn.ReLU: None})
    assert isinstance(model[1], runtime.FewBit) and model[1].fn.__class__ is MyActivation
    assert isinstance(model[2], fnn.GELU) and isinstance(model[3], torch.nn.ReLU)
    x = torch.randn(5, 4, requires_grad=True)
    model(x).sum().backward()
    runtime.convert(model, filter={MyActivation: table})
    assert model[1].fn.__class__ is MyActivation  # not wrapped twice

    model = torch.nn.Sequential(torch.nn.GELU(), torch.nn.GELU(), MyActivation())
    choice = {"0": True, "1": None, "2": table}
    runtime.convert(model, filter=lambda name, module: choice[name])
    assert isinstance(model[0], fnn.GELU) and isinstance(model[1], torch.nn.GELU)
    assert isinstance(model[2], runtime.FewBit)


def test_convert_names_the_module_it_cannot_convert(tables_dir):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ELU(alpha=0.5)))
    with pytest.raises(FewBitError, match=r"cannot convert module '1.0' \(ELU\(alpha=0.5\)\).*--param alpha=0.5"):
        runtime.convert(model)
    with pytest.raises(FewBitError, match="filter must be"):
        runtime.convert(model, filter=3)


def test_converted_model_keeps_tables_exact_after_half_and_state_dict_is_unchanged(make_table):
    table = make_table("gelu", 3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    state = copy.deepcopy(model.state_dict())
    runtime.convert(model, filter={torch.nn.GELU: table})
    assert model.state_dict().keys() == state.keys()
    model.load_state_dict(state)
    model.to(torch.bfloat16)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    hidden = model[0](x).detach().requires_grad_()
    grad = torch.randn_like(hidden)
    (x_grad,) = torch.autograd.grad(model[1](hidden), hidden, grad)
    torch.testing.assert_close(x_grad, oracle_grad(table, hidden, grad), rtol=0, atol=0)
    copy.deepcopy(model)


# ---------------------------------------------------------------------------------------------------------------------
# torch integration


class Block(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.act = fnn.GELU(table=table)

    def forward(self, x):
        return self.act(self.linear(x)).sum(dim=-1)


def test_torch_compile_fullgraph(make_table):
    torch.manual_seed(0)
    model = Block(make_table("gelu", 3))
    x = torch.randn(16, 8)
    expected = model(x)
    expected.sum().backward()
    expected_grad = model.linear.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    result = compiled(x)
    result.sum().backward()
    torch.testing.assert_close(result, expected, rtol=0, atol=0)
    torch.testing.assert_close(model.linear.weight.grad, expected_grad, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_on_cpu(dtype, make_table):
    table = make_table("gelu", 3)
    linear = torch.nn.Linear(8, 8)
    ours, native = fnn.GELU(table=table), torch.nn.GELU()
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=dtype):
        hidden = linear(x)
        y = ours(hidden)
        expected = native(hidden)
    assert hidden.dtype == dtype and y.dtype == expected.dtype
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    grad = torch.randn_like(y)
    (hidden_grad,) = torch.autograd.grad(y, hidden, grad)
    torch.testing.assert_close(hidden_grad, oracle_grad(table, hidden, grad), rtol=0, atol=0)


def test_second_order_gradients_raise_instead_of_a_wrong_answer(make_table):
    module = fnn.GELU(table=make_table("gelu", 3))
    x = torch.randn(10, requires_grad=True)
    with pytest.raises(FewBitError, match="do not support higher-order gradients"):
        (grad,) = torch.autograd.grad(module(x).sum(), x, create_graph=True)
        grad.sum().backward()


# ---------------------------------------------------------------------------------------------------------------------
# memory: exactly ceil(n / 8) * bits bytes plus a constant


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_saved_bytes_are_packed_codes_plus_a_constant(bits, make_table):
    module = fnn.SiLU(table=make_table("silu", bits))
    levels = len(module.table.levels)
    constants = set()
    for n in (1, 7, 8, 1000, 8 * 1001 + 3, 65536 + 5):
        x = torch.randn(n, requires_grad=True)
        with memory.saved_bytes(module) as m:  # module buffers (the levels) excluded: codes only
            y = module(x)
        assert m.total == math.ceil(n / 8) * bits
        with memory.saved_bytes() as m:
            module(x)
        constants.add(m.total - math.ceil(n / 8) * bits)
        y.sum().backward()
    assert constants == {levels * (4 + 8)}  # float32 and float64 levels, whatever n


def test_saved_bytes_against_native():
    native = torch.nn.GELU()
    x = torch.randn(4096, requires_grad=True)
    with memory.saved_bytes() as m:
        native(x * 1.0)
    assert m.total == 4096 * 4
    assert backends.TableTensors._fields[0] == "bits"


# ---------------------------------------------------------------------------------------------------------------------
# exact forward on every view

VIEWS = {
    "transposed": lambda t: t.transpose(1, 3),
    "strided-slice": lambda t: t[:, ::2, 1:, ::3],
    "expanded": lambda t: t[:, :1].expand(-1, 6, -1, -1),
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "offset-2d-transposed": lambda t: t.reshape(-1, 66)[3:, 5:].t(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_forward_on_every_view_is_torchs_on_the_same_view(name, dtype, make_table):
    # the native op runs on the input exactly as given (no contiguous copy): torch's vectorised and scalar loops may
    # differ by an ulp, so a copy would not be bitwise torch's result on the view
    module, native = fewbit_module(name, make_table(name, 2)), native_module(name)
    generator = torch.Generator().manual_seed(0)
    base = (torch.randn(3, 6, 5, 66, generator=generator) * 4).to(dtype)
    table = make_table(name, 2)
    for kind, make_view in VIEWS.items():
        view = make_view(base).detach().requires_grad_()  # detach keeps the view's strides
        out = module(view)
        expected = native(view.detach())
        assert out.dtype == expected.dtype and torch.equal(out, expected), (name, dtype, kind)
        assert out.stride() == expected.stride(), (name, dtype, kind)
        grad = torch.linspace(-2, 2, out.numel()).reshape(out.shape).to(out.dtype)
        out.backward(grad)  # codes packed from the view in logical (row-major) order
        assert torch.equal(view.grad, oracle_grad(table, view, grad)), (name, dtype, kind)


def test_a_shipped_table_is_found_by_one_key_and_the_index_entries_are_bound_once(tables_dir, monkeypatch):
    from fewbit_design.runtime.fewbit import lookup as lookup

    gelu = activations.bind("gelu")
    key = lookup.TableKey.of(gelu, bits=2, mode="levelsets", weight="uniform")
    assert key == lookup.TableKey.of(activations.bind("GELU", {"approximate": "none"}), bits=2, mode="levelsets",
                                     weight="uniform")  # fmt: skip
    assert key.params == (("approximate", "none"),) and hash(key) == hash(dataclasses.replace(key))
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.bits = 3
    bound_params = []
    real_bind = activations.bind

    def counting_bind(name, params=None):
        bound_params.append(dict(params or {}))
        return real_bind(name, params)

    monkeypatch.setattr(lookup.activations, "bind", counting_bind)
    runtime.load_table("leaky_relu", bits=2)  # binds the index entries of (leaky_relu, 2 bits, levelsets, uniform)
    shipped = {"negative_slope": 0.01}
    assert shipped in bound_params
    bound_params.clear()
    with pytest.raises(FewBitError, match="not in the shipped set"):
        runtime.load_table("leaky_relu", params={"negative_slope": 0.25}, bits=2)
    assert bound_params and shipped not in bound_params  # another key of the same group: the entries stay bound
