"""Faults and bad input of few-bit conversion and modules: every place of a shared activation is
replaced, hyper-parameters keep the table in step, convert is all or nothing, table names must match, the model
itself may be the activation, arguments are checked up front, inference mode, torch.func, shape-changing FewBit
functions, and the memory of the half-precision backward.

Oracles: the torch.nn module (forward, bitwise), grad * levels[code] computed in numpy from the table (backward),
the eager few-bit gradient (for torch.func), and the model's modules before the call (all-or-nothing).
"""

from __future__ import annotations

import importlib
import json
import tracemalloc
from collections import OrderedDict

import pytest
import torch
from test_runtime_modules import oracle_grad

from fewbit_design import runtime
from fewbit_design.design import activations
from fewbit_design.errors import FewBitError
from fewbit_design.runtime import functional as FF
from fewbit_design.runtime import memory
from fewbit_design.runtime import nn as fnn
from fewbit_design.runtime._packing import packed_nbytes
from fewbit_design.runtime.fewbit import backends

matching_module = importlib.import_module("fewbit_design.runtime.fewbit.matching")


def input_grad(module, x, grad):
    leaf = x.detach().requires_grad_()
    module(leaf).backward(grad)
    return leaf.grad


def write_tables(folder, tables):
    """A shipped-table folder holding ``tables`` (3-bit, uniform weight), for FEWBIT_TABLES_DIR."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for number, table in enumerate(tables):
        file = f"{table.activation}-{number}.json"
        table.save(folder / file)
        entries.append(
            {"file": file, "activation": table.activation, "params": table.params, "bits": table.bits,
             "mode": "levelsets", "symmetric": False, "weight": "uniform", "error": 0.0}
        )  # fmt: skip
    (folder / "index.json").write_text(json.dumps({"format": "fewbit-index/1", "tables": entries}))
    return folder


def modules_of(model):
    return [(name, module) for name, module in model.named_modules(remove_duplicate=False)]


# ------------------------------------------------------------------------------------------- 20.3: shared places


def test_an_activation_used_twice_in_one_parent_is_replaced_at_both_places(tables_dir):
    shared = torch.nn.GELU()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), shared, torch.nn.Linear(4, 4), shared)
    report = runtime.convert(model).fewbit_report
    assert isinstance(model[1], fnn.GELU) and model[3] is model[1]  # one shared replacement, at both places
    assert len(report.replaced) == 1 and report.replaced[0].names == ("1", "3") and report.places == 2
    assert "replaced 1 module(s) at 2 place(s)" in str(report) and "'1', '3'" in str(report)
    # the second place saves codes, not its float input: only the Linear inputs and the codes are saved
    x = torch.randn(5, 4, requires_grad=True)
    with memory.saved_bytes(model) as saved:
        model(x)
    codes = packed_nbytes(5 * 4, 3)
    assert saved.by_module == {"1": 2 * codes, "2": 5 * 4 * 4}  # both calls save codes; a native GELU saves 80 bytes


def test_the_same_activation_in_a_module_list_and_before_convolutions(tables_dir):
    act = torch.nn.SiLU()
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([act, torch.nn.Linear(2, 2), act, act])})
    runtime.convert(model)
    layers = model["layers"]
    assert isinstance(layers[0], fnn.SiLU) and layers[2] is layers[0] and layers[3] is layers[0]
    # the neighbour rule looks at every place: a ReLU used twice right before convolutions stays
    relu = torch.nn.ReLU()
    convs = [torch.nn.Conv2d(2, 2, 1) for _ in range(3)]
    model = torch.nn.Sequential(convs[0], relu, convs[1], relu, convs[2])
    with pytest.warns(UserWarning, match="nothing replaced"):
        report = runtime.convert(model).fewbit_report
    assert model[1] is relu and model[3] is relu and report.skipped[0].names == ("1", "3")


# -------------------------------------------------------------------------- 20.4: hyper-parameters follow the table


def other_value(name, key, default):
    if key == "approximate":
        return "tanh"
    return {("hardtanh", "max_val"): 2.0, ("hardtanh", "min_val"): -2.0}.get((name, key), float(default) + 0.75)


PARAMETRISED = [
    name for name in activations.names() if activations.get(name).torch_name and activations.get(name).defaults
]


@pytest.mark.parametrize("name", PARAMETRISED)
def test_changing_a_hyper_parameter_changes_the_table_or_raises(name, make_table, tmp_path, monkeypatch):
    entry = activations.get(name)
    cls = getattr(fnn, entry.torch_name)
    native_cls = getattr(torch.nn, entry.torch_name)
    build = (lambda c, **kw: c(0.0, 0.0, **kw)) if name == "threshold" else (lambda c, **kw: c(**kw))
    default_table = make_table(name, 3, dict(entry.defaults))
    monkeypatch.setenv("FEWBIT_TABLES_DIR", str(write_tables(tmp_path / "defaults", [default_table])))
    x = torch.linspace(-4.0, 4.0, 161)
    grad = torch.randn(161, generator=torch.Generator().manual_seed(0))
    for key, default in entry.defaults.items():
        new = other_value(name, key, default)
        changed = dict(entry.defaults, **{key: new})
        native = build(native_cls)
        setattr(native, key, new)
        # no table for the new value: the assignment raises and nothing changes
        module = build(cls)
        with pytest.raises(FewBitError, match=rf"cannot set {entry.torch_name}\.{key} = .*it stays.*no shipped table"):
            setattr(module, key, new)
        assert getattr(module, key) == default and module.table.params == default_table.params
        torch.testing.assert_close(input_grad(module, x, grad), oracle_grad(default_table, x, grad), rtol=0, atol=0)
        # a module built on an explicit table: that table is for the old value, so the assignment raises
        explicit = build(cls, table=default_table)
        with pytest.raises(FewBitError, match=rf"cannot set {entry.torch_name}\.{key}"):
            setattr(explicit, key, new)
        assert getattr(explicit, key) == default
        # with the new value's table shipped, the table follows: forward and backward are the new function's
        new_table = make_table(name, 3, changed)
        folder = write_tables(tmp_path / f"{key}-both", [default_table, new_table])
        monkeypatch.setenv("FEWBIT_TABLES_DIR", str(folder))
        setattr(module, key, new)
        assert getattr(module, key) == new and module.table.params == new_table.params
        leaf = x.detach().requires_grad_()
        output = module(leaf)
        torch.testing.assert_close(output, native(x), rtol=0, atol=0)
        output.backward(grad)
        torch.testing.assert_close(leaf.grad, oracle_grad(new_table, x, grad), rtol=0, atol=0)
        monkeypatch.setenv("FEWBIT_TABLES_DIR", str(tmp_path / "defaults"))


def test_assigning_a_table_checks_it_and_replaces_the_buffers(tables_dir, make_table):
    module = fnn.GELU(bits=3)
    other = make_table("gelu", 2)
    module.table = other
    assert module.table is other and module.bits == 2 and "table=" in repr(module)
    x = torch.linspace(-3.0, 3.0, 50)
    grad = torch.ones(50)
    torch.testing.assert_close(input_grad(module, x, grad), oracle_grad(other, x, grad), rtol=0, atol=0)
    with pytest.raises(FewBitError, match="is for activation 'silu'"):
        module.table = make_table("silu", 2)
    assert module.table is other
    relu6 = fnn.ReLU6(table=make_table("relu6", 1))
    with pytest.raises(FewBitError, match="max_val is fixed at 6.0"):
        relu6.max_val = 3.0


# ------------------------------------------------------------------------------------- 20.8: all or nothing


def test_a_failure_on_the_third_activation_leaves_the_model_unchanged(tables_dir):
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4), torch.nn.SiLU(),
        torch.nn.Linear(4, 4), torch.nn.ELU(alpha=0.3),
    )  # fmt: skip
    before = modules_of(model)
    with pytest.raises(FewBitError, match=r"cannot convert module '5' \(ELU\(alpha=0.3\)\)"):
        runtime.convert(model)
    assert modules_of(model) == before  # the same objects at the same names: GELU and SiLU not replaced


class Shrinks(torch.nn.Module):
    """Not elementwise (it saves its input, so the measurement keeps it): its few-bit wrapper fails on the example
    only after every module was swapped."""

    def forward(self, x):
        return torch.sin(x)[..., :2]


def test_a_failure_after_the_swap_puts_the_modules_back(tables_dir, make_table):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4), Shrinks())
    before = modules_of(model)
    with pytest.raises(FewBitError, match=r"FewBit\(Shrinks\): fn\(x\) must return a tensor of x's shape"):
        runtime.convert(model, filter={Shrinks: make_table("silu", 2)}, example_inputs=torch.randn(3, 4))
    assert modules_of(model) == before


# ------------------------------------------------------------------------------------------ 20.9: table names


def test_table_names_that_match_no_module_raise_with_the_candidates(tables_dir, make_table):
    model = torch.nn.Sequential(
        OrderedDict(fc=torch.nn.Linear(4, 4), act=torch.nn.GELU(), out=torch.nn.Linear(4, 4), act2=torch.nn.SiLU())
    )
    before = modules_of(model)
    with pytest.raises(FewBitError, match=r"'akt'.*did you mean 'act'.*activation modules are 'act', 'act2'"):
        runtime.convert(model, tables={"akt": make_table("gelu", 2)})
    assert modules_of(model) == before
    with pytest.raises(FewBitError, match=r"tables must be a dict"):
        runtime.convert(model, tables=[make_table("gelu", 2)])
    with pytest.raises(FewBitError, match=r"tables\['act'\]: table must be a Table"):
        runtime.convert(model, tables={"act": 3})
    with pytest.raises(FewBitError, match=r"names 'act' and '_orig_mod.act' name the same module"):
        runtime.convert(model, tables={"act": make_table("gelu", 2), "_orig_mod.act": make_table("gelu", 1)})


def test_tables_calibrated_on_a_compiled_model_apply_to_the_plain_one_and_back(tables_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    tables = runtime.calibrate(torch.compile(model, backend="eager"), [torch.randn(64, 4)], bits=1, samples=2000)
    assert list(tables) == ["1"]
    runtime.convert(model, tables=tables)
    assert model[1].table is tables["1"]
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    runtime.convert(plain, tables={"_orig_mod.1": tables["1"]})  # names of a compiled model, on the plain one
    assert plain[1].table is tables["1"]
    inner = torch.nn.Sequential(torch.nn.GELU())
    compiled = torch.compile(inner, backend="aot_eager")
    x = torch.linspace(-3.0, 3.0, 40, requires_grad=True)
    compiled(x).sum().backward()  # compiled with the native GELU first
    x.grad = None
    runtime.convert(compiled, tables={"0": tables["1"]})
    assert inner[0].table is tables["1"]
    compiled(x).sum().backward()  # the compiled model runs the replacement
    torch.testing.assert_close(x.grad, oracle_grad(tables["1"], x, torch.ones(40)), rtol=0, atol=0)


# --------------------------------------------------------------------------- 20.20: the root, arguments up front


def test_an_activation_given_alone_is_converted_and_returned(tables_dir):
    native = torch.nn.GELU()
    converted = runtime.convert(native)
    report = converted.fewbit_report
    assert isinstance(converted, fnn.GELU) and report.replaced[0].names == ("",)
    x = torch.randn(7)
    torch.testing.assert_close(converted(x), native(x), rtol=0, atol=0)
    assert runtime.convert(converted) is converted
    with pytest.warns(UserWarning, match="PReLU has a trainable slope"):
        assert isinstance(runtime.convert(torch.nn.PReLU()), torch.nn.PReLU)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bits": 9}, "bits must be an integer from 1 to 8, got 9"),
        ({"weight": "bogus"}, "weight must be 'uniform' or 'normal', got 'bogus'"),
        ({"mode": "bogus"}, "mode must be 'levelsets' or 'intervals', got 'bogus'"),
        ({"filter": 3}, "filter must be None"),
        ({"filter": {"GELU": None}}, "filter: keys must be module classes, got 'GELU'"),
        ({"tables": {"x": None}}, r"tables\['x'\]"),
    ],
)
def test_arguments_are_checked_even_when_nothing_is_converted(kwargs, message):
    with pytest.raises(FewBitError, match=message):
        runtime.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)), **kwargs)


# ------------------------------------------------------------------- 20.17: inference mode, torch.func, FewBit fn


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_convert_under_inference_mode_decides_as_in_training_and_trains_after(mode, tables_dir, monkeypatch):
    monkeypatch.setattr(matching_module, "_OUTPUT_ONLY", {})  # the probe cache must not hide the caller's mode

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(2, 2, 1), torch.nn.ReLU(), torch.nn.Conv2d(2, 2, 1), torch.nn.GELU())

    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    x = torch.randn(1, 2, 3, 3)
    model, other = build(), build()
    with context():
        model = runtime.convert(model)
        report = model.fewbit_report
        measured = runtime.convert(other, example_inputs=x).fewbit_report
    assert isinstance(model[1], torch.nn.ReLU) and isinstance(model[3], fnn.GELU)  # the ReLU before a conv stays
    assert [item.names for item in report.replaced] == [("3",)] and measured.measured["native"] > 0
    model(x).sum().backward()  # trains after conversion in inference mode
    with context():
        FF.silu(torch.randn(3), bits=2)  # the functional form caches the table's tensors
    leaf = torch.randn(3, requires_grad=True)
    FF.silu(leaf, bits=2).sum().backward()


def test_a_model_that_fails_on_the_example_gives_one_error(tables_dir):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    with pytest.raises(FewBitError, match=r"convert\(example_inputs=...\).*RuntimeError"):
        runtime.convert(model, example_inputs=torch.randn(3, 5))
    assert isinstance(model[1], torch.nn.GELU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_torch_func_gives_the_eager_few_bit_gradient(dtype, tables_dir):
    act = fnn.GELU(bits=3)
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 7, generator=generator) * 3).to(dtype)  # 7: examples do not fill whole groups of 8
    grad = torch.randn(4, 7, generator=generator).to(dtype)
    eager = input_grad(act, x, grad)
    assert torch.equal(eager, oracle_grad(act.table, x, grad))

    def loss(t, g):
        return (act(t) * g).sum()

    assert torch.equal(torch.func.grad(loss)(x, grad), eager)
    assert torch.equal(torch.func.vjp(act, x)[1](grad)[0], eager)
    assert torch.equal(torch.func.vmap(torch.func.grad(loss))(x, grad), eager)  # per-example gradients
    assert torch.equal(torch.func.grad(lambda t: (torch.func.vmap(act)(t) * grad).sum())(x), eager)
    jacobian = torch.func.jacrev(act)(x[1])
    assert torch.equal(torch.diagonal(jacobian), input_grad(act, x[1], torch.ones(7, dtype=dtype)))
    assert torch.count_nonzero(jacobian - torch.diag(torch.diagonal(jacobian))) == 0
    leaf = x.detach().requires_grad_()
    torch.func.vmap(act, in_dims=1, out_dims=1)(leaf).backward(grad)  # autograd through vmap
    assert torch.equal(leaf.grad, eager)


def test_torch_func_non_finite_and_unsupported_transforms(tables_dir):
    act = fnn.SiLU(bits=2)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    x[1, 2], x[2, 0] = float("nan"), float("inf")
    per_example = torch.func.vmap(torch.func.grad(lambda t: act(t).sum()))(x)
    assert per_example.isnan().all(dim=1).tolist() == [False, True, True, False]  # the example's flag, as compiled
    assert torch.equal(per_example[0], input_grad(act, x[0], torch.ones(5)))
    with pytest.raises(FewBitError, match="higher-order gradients"):
        torch.func.grad(lambda t: torch.func.grad(lambda u: act(u).sum())(t).sum())(x[0])
    with pytest.raises(FewBitError, match="forward-mode AD"):
        torch.func.hessian(lambda t: act(t).sum())(x[0])
    # forward mode alone never reaches the backward: jvp is the native function's, exactly
    _, tangent = torch.func.jvp(act, (x[0],), (torch.ones(5),))
    _, expected = torch.func.jvp(torch.nn.functional.silu, (x[0],), (torch.ones(5),))
    assert torch.equal(tangent, expected)
    with pytest.raises(FewBitError, match="higher-order gradients"):  # eager double backward, as before
        leaf = x[0].clone().requires_grad_()
        torch.autograd.grad(act(leaf).sum(), leaf, create_graph=True)


@pytest.mark.parametrize(
    "fn, got",
    [(lambda x: x.sum(-1), r"shape \(4,\)"), (lambda x: x.reshape(-1), r"shape \(8,\)"), (lambda x: (x, x), "a tuple")],
    ids=["reduces", "reshapes", "tuple"],
)
@pytest.mark.parametrize("grad", [True, False])
def test_a_fewbit_fn_that_changes_the_shape_raises(fn, got, grad, make_table):
    wrapped = runtime.FewBit(fn, make_table("silu", 2))
    x = torch.randn(4, 2, requires_grad=grad)
    with pytest.raises(
        FewBitError, match=rf"FewBit\(<lambda>\): fn\(x\) must return a tensor of x's shape \(4, 2\).*got {got}"
    ):
        wrapped(x)


# ------------------------------------------------------------------- 20.14: half-precision backward memory


def backward_peak(module, x, grad):
    """Peak bytes of the backward alone: torch tensors (memory.peak) plus numpy buffers (tracemalloc)."""
    leaf = x.detach().requires_grad_()
    output = module(leaf)
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        with memory.peak(leaf, grad) as measured:
            output.backward(grad)
        numpy_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return measured.peak_bytes + numpy_peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_backward_peaks_near_torchs(dtype, make_table):
    numel = 1 << 21
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(numel, generator=generator) * 3).to(dtype)
    grad = torch.randn(numel, generator=generator).to(dtype)
    table = make_table("gelu", 3)
    with backends.use_backend("numba"):
        backward_peak(fnn.GELU(table=table), x[:4096], grad[:4096])  # first call: numba compiles (numpy buffers)
        fewbit = backward_peak(fnn.GELU(table=table), x, grad)
    native = backward_peak(torch.nn.GELU(), x, grad)
    assert native >= numel * 2  # the instrument sees the gradient
    # no float32 copy beside the gradient (such a copy took 5x the gradient's bytes; the kernel reads and writes
    # 16 bits, in float32 only per chunk of CHUNK elements). The slack, 1 MiB (an eighth of a float32 copy), covers
    # Python objects of a call (numba's argument boxing, the pool's futures: 45-85 KB traced by tracemalloc)
    assert fewbit <= native + (1 << 20), (fewbit, native)


# --------------------------------------------------------------------- 20.8 for BLPA's convert: all or nothing


def test_blpa_convert_strict_failure_on_a_later_run_leaves_the_model_unchanged():
    from fewbit_design.runtime import blpa

    model = torch.nn.Sequential(
        torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4, affine=False), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3),
    )  # fmt: skip
    before = modules_of(model)
    with pytest.raises(FewBitError, match=r"blpa.convert\(strict=True\): run at '3': .*affine=True"):
        blpa.convert(model, strict=True)
    assert modules_of(model) == before  # the first run was not fused either
    report = blpa.convert(model).blpa_report  # without strict: the first run fused, the second reported
    assert report.fused == [("0", "1", "2")] and report.skipped[0][0] == "3"
