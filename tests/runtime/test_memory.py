"""runtime.memory: bytes saved for backward, de-duplicated by storage, parameters and buffers excluded.

Expected numbers come from what each torch op is documented to save: Linear saves its input (the weight is a
parameter), ReLU/Sigmoid/Tanh save their output, BatchNorm in training saves its input plus per-channel statistics.
"""

import pytest
import torch

from fewbit_design.runtime import memory


def test_sequential_counts_each_storage_once_and_by_module():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))
    x = torch.randn(8, 10)
    with memory.saved_bytes(model) as m:
        model(x).sum()
    # Linear 0 saves x (8*10 floats); ReLU saves its output (8*20), which Linear 2 saves again (same storage)
    assert m.total == 8 * 10 * 4 + 8 * 20 * 4
    assert m.tensors == 2
    assert m.by_module == {"0": 320, "1": 640}
    # the ReLU output is also saved by Linear 2: replacing the ReLU would free nothing of it
    assert m.exclusive_by_module == {"0": 320}


def test_exclusive_bytes_of_an_activation_whose_output_nobody_else_keeps():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.GELU(), torch.nn.Linear(20, 5))
    x = torch.randn(8, 10)
    with memory.saved_bytes(model) as m:
        model(x).sum()
    # GELU saves its input (Linear 0's output, 8*20 floats); Linear 2 saves GELU's output: three storages, one each
    assert m.exclusive_by_module == {"0": 320, "1": 640, "2": 640}


def test_views_of_one_storage_count_once():
    x = torch.randn(100, requires_grad=True)
    with memory.saved_bytes() as m:
        y = torch.sigmoid(x)
        torch.tanh(y.view(10, 10))
        torch.tanh(y[:50])  # a view of y's storage: tanh saves its own (new) output
    # sigmoid saves y (100 floats), the first tanh its 100-float output, the second its 50-float output
    assert m.total == 2 * 400 + 50 * 4


def test_parameters_and_buffers_are_excluded():
    model = torch.nn.BatchNorm1d(6)
    x = torch.randn(4, 6, requires_grad=True)
    with memory.saved_bytes(model) as m:
        model(x).sum()
    # the leaf input x is a user tensor requiring grad: excluded like a parameter (it is alive anyway);
    # what remains is the per-channel mean and inverse std that native batch norm saves
    assert m.total == 2 * 6 * 4


def test_nothing_saved_under_no_grad():
    model = torch.nn.Linear(4, 4)
    with torch.no_grad(), memory.saved_bytes(model) as m:
        model(torch.randn(3, 4))
    assert m.total == 0 and m.tensors == 0


def test_grows_linearly_with_batch():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
    totals = []
    for batch in (4, 8, 16):
        with memory.saved_bytes(model) as m:
            model(torch.randn(batch, 16)).sum()
        totals.append(m.total)
    # Linear saves its input, GELU saves its input (the Linear output): 2 * batch * 16 floats
    assert totals == [2 * b * 16 * 4 for b in (4, 8, 16)]


def test_hooks_are_removed_afterwards():
    model = torch.nn.Linear(3, 3)
    with memory.saved_bytes(model):
        pass
    assert not model._forward_hooks and not model._forward_pre_hooks


def _chain_of_three():
    x = torch.randn(100, requires_grad=True)
    y = torch.sigmoid(x * 2)  # saves its output (400 bytes)
    return torch.tanh(y).sum()  # saves its output (400 bytes)


def test_nested_blocks_each_count_everything_saved_inside_them():
    torch.manual_seed(0)
    with memory.saved_bytes() as alone:
        _chain_of_three()
    with memory.saved_bytes() as outer:
        with memory.saved_bytes() as inner:
            _chain_of_three()
        with memory.saved_bytes() as second:
            with memory.saved_bytes() as innermost:
                torch.exp(torch.randn(10, requires_grad=True) * 1)  # exp saves its output: 40 bytes
    assert alone.total == 800
    assert inner.total == 800 and second.total == innermost.total == 40
    assert outer.total == alone.total + 40 and outer.tensors == alone.tensors + 1


def test_nested_blocks_with_a_model_attribute_per_module():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))
    x = torch.randn(8, 10)
    with memory.saved_bytes(model) as alone:
        model(x)
    with memory.saved_bytes(model) as outer, memory.saved_bytes(model[2]) as inner:
        model(x)
    assert outer.total == alone.total and outer.by_module == alone.by_module == {"0": 320, "1": 640}
    assert inner.total == alone.total  # everything saved inside the block (model[2] only names the modules)


def test_measuring_inside_an_offload_region_does_not_stop_the_offloading(tmp_path):
    """The count goes on to the hooks active at entry (an offload region here), as if the block were not there."""
    from fewbit_design.runtime import offload

    x = torch.randn(4096, requires_grad=True)
    expected = torch.autograd.grad(torch.tanh(torch.tanh(x * 1)).sum(), x)[0]
    with offload.saved_tensors(target="disk", min_bytes=0, directory=tmp_path) as stats:
        with memory.saved_bytes() as m:
            loss = torch.tanh(torch.tanh(x * 1)).sum()
    assert m.total == 2 * 4096 * 4  # both tanh outputs, counted on their way to the offload region
    assert stats.tensors == 2  # and offloaded
    assert torch.equal(torch.autograd.grad(loss, x)[0], expected)
    offload.empty_cache()


def test_keeps_tells_what_stays_in_memory_from_what_a_region_below_moved_out(tmp_path):
    """Regression: the planner asked ``contains`` whether a block under offload keeps its input, with the region's
    hooks hiding everything it packed, kept or not; a hidden state under ``min_bytes`` stays in memory, and the
    planner predicted it freed (plans measured over budget). ``keeps`` is true only for what stays."""
    from fewbit_design.runtime import offload

    small, large = torch.randn(64, requires_grad=True), torch.randn(4096, requires_grad=True)
    with offload.saved_tensors(target="disk", min_bytes=1024, directory=tmp_path) as stats:
        with memory.saved_bytes() as m:
            kept, moved = torch.tanh(small), torch.tanh(large)  # each saves its output
    assert stats.tensors == 1 and stats.bytes == 4096 * 4  # the large output left memory
    assert m.contains(kept) and m.contains(moved) and m.total == (64 + 4096) * 4
    assert m.keeps(kept) and not m.keeps(moved)
    (kept.sum() + moved.sum()).backward()
    offload.empty_cache()
    with memory.saved_bytes() as plain:  # no hooks below: keeps is contains
        out = torch.tanh(small)
    assert plain.keeps(out) and plain.contains(out) and not plain.keeps(small)


def test_a_block_object_measures_one_block():
    from fewbit_design.errors import FewBitError

    m = memory.saved_bytes()
    with m:
        pass
    with pytest.raises(FewBitError, match=r"memory.saved_bytes\(\) object .* already entered"):
        with m:
            pass
    m = memory.saved_bytes()
    with pytest.raises(FewBitError, match="already entered"), m, m:
        pass
