"""runtime.memory: bytes saved for backward, de-duplicated by storage, parameters and buffers excluded.

Expected numbers come from what each torch op is documented to save: Linear saves its input (the weight is a
parameter), ReLU/Sigmoid/Tanh save their output, BatchNorm in training saves its input plus per-channel statistics.
"""

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
