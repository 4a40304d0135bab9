"""runtime.memory.peak: the peak of live tensor bytes, checked against hand-computed cases.

Every expected number below is counted by hand from the tensors torch creates (float32: 4 bytes per element). The
values are exact integers from storage sizes, not timings or floats, so they are compared with ``==``.
"""

import pytest
import torch

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import memory


def test_one_matmul():
    a, b = torch.randn(30, 20), torch.randn(20, 10)
    with memory.peak(a, b) as p:
        c = a @ b
    assert p.baseline_bytes == (30 * 20 + 20 * 10) * 4
    assert p.peak_bytes == 30 * 10 * 4
    assert p.live_bytes == 30 * 10 * 4  # c outlives the region
    del c


@pytest.mark.parametrize("widths", [(16, 8, 4), (5, 7, 3, 9, 2), (12,) * 6])
def test_chain_of_linear_layers_forward_and_backward(widths):
    batch = 512
    pairs = list(zip(widths[:-1], widths[1:], strict=True))
    layers = torch.nn.Sequential(*[torch.nn.Linear(i, o, bias=False) for i, o in pairs])
    x = torch.randn(batch, widths[0])  # the input does not require grad: no gradient for it
    with memory.peak(layers, x) as p:
        layers(x).sum().backward()
    hidden = [4 * batch * width for width in widths]  # hidden[0] is x, hidden[k] the output of layer k
    weights = [4 * i * o for i, o in pairs]
    n = len(weights)
    # forward: all outputs h_1..h_n are alive when the loss (4 bytes) is created (h_1..h_{n-1} are saved for
    # backward; h_n is freed after the sum)
    forward = sum(hidden[1:]) + 4
    # backward of layer k (n down to 1): the saved h_1..h_{k-1}, the incoming gradient (for layer n an expanded
    # view of the 4-byte ones), the new input gradient (none for layer 1), the weight gradients of layers k..n,
    # the loss and its ones gradient
    backward = [
        sum(hidden[1:k]) + (hidden[k] if k < n else 0) + (hidden[k - 1] if k > 1 else 0) + sum(weights[k - 1 :]) + 8
        for k in range(n, 0, -1)
    ]
    assert p.peak_bytes == max([forward] + backward)
    assert p.baseline_bytes == hidden[0] + sum(weights)
    assert p.live_bytes == sum(weights)  # only the weight gradients outlive the step (the loss was a temporary)


def test_backward_peak_of_a_wide_linear_layer():
    layer = torch.nn.Linear(1000, 10, bias=False)
    x = torch.randn(4, 1000)
    with memory.peak(layer, x, timeline=True) as p:
        layer(x).sum().backward()
    # forward: output 4x10 + loss; the output is freed after the sum (nothing saves it);
    # backward: loss + its ones gradient + the 10x1000 weight gradient
    assert p.peak_bytes == 4 + 4 + 10 * 1000 * 4
    assert max(live for _, live in p.timeline) == p.peak_bytes
    assert p.timeline[0][0].startswith("aten.")


def test_freed_tensors_leave_the_count():
    with memory.peak() as p:
        for _ in range(10):
            t = torch.empty(1000)  # the new tensor exists before the old one is released: two alive at once
        del t
    assert p.peak_bytes == 2 * 4000
    assert p.live_bytes == 0
    assert p.allocated_bytes == 10 * 4000


def test_views_and_in_place_results_are_not_new_memory():
    x = torch.randn(100)
    with memory.peak(x) as p:
        x.add_(1)
        x.view(10, 10).t()
        x[:50].mul_(2)
        y = x.clone()
        y.view(-1)[3:].relu_()
    assert p.peak_bytes == 400
    del y


def test_reset_peak_and_max_bytes():
    x = torch.randn(100)
    with memory.peak(x) as p:
        big = torch.empty(1000)
        del big
        p.reset_peak()
        small = torch.empty(10)
    assert p.peak_bytes == 40
    assert p.max_bytes == 400 + 40
    del small


def test_saved_tensors_count_until_backward_frees_them():
    x = torch.randn(1000, requires_grad=True)
    with memory.peak(x) as p:
        y = torch.sigmoid(x)  # saved for backward: alive after the python name is dropped
        loss = y.sum()
        del y
        alive_before_backward = p.live_bytes
        loss.backward()
    assert alive_before_backward == 4000 + 4
    # backward: ones (4), expanded view, sigmoid backward result 4000 = x.grad, while y (4000) is still saved
    assert p.peak_bytes == 4000 + 4 + 4 + 4000
    assert p.live_bytes == 4 + 4000  # the loss and x.grad (the ones gradient was freed)


def test_bad_argument_is_one_error():
    with pytest.raises(FewBitError, match="tensors and modules"):
        with memory.peak("x"):
            pass


@pytest.mark.cuda
def test_cuda_peak_matches_the_allocator():
    layers = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).cuda()
    x = torch.randn(4096, 256, device="cuda")
    layers(x).sum().backward()  # warm up (cuBLAS workspace), then measure a step with gradients present
    with memory.peak(layers, x) as p:
        layers(x).sum().backward()
    assert p.cuda_peak_bytes is not None
    assert abs(p.peak_bytes - p.cuda_peak_bytes) <= 0.05 * p.cuda_peak_bytes


def test_a_peak_object_measures_one_block():
    x = torch.randn(100)
    p = memory.peak(x)
    with p as first:
        y = x * 2
    assert first.peak_bytes == 400
    with pytest.raises(FewBitError, match=r"memory.peak\(\) object .* already entered; call memory.peak\(\) again"):
        with p:
            pass
    p = memory.peak(x)
    with pytest.raises(FewBitError, match="already entered"), p, p:
        pass
    with memory.peak(x) as outer, memory.peak(x) as inner:  # two objects nest: each sees every operator
        y = x * 2
        z = x * 3
    assert outer.peak_bytes == inner.peak_bytes == 800
    del y, z


def test_live_bytes_read_inside_the_block_counts_the_storages_freed_since_the_last_operator():
    with memory.peak() as p:
        t = torch.empty(1000)
        assert p.live_bytes == 4000
        del t
        assert p.live_bytes == 0  # freed between operators: no operator ran since
        p.reset_peak()
        assert p.peak_bytes == 0


def test_no_python_code_runs_when_a_storage_is_freed():
    """A KeyboardInterrupt raised while Python runs a finalizer is printed and lost (Ctrl-C would not stop a
    measured step): freeing a counted storage only queues it (a C callback)."""
    import sys

    calls = []
    with memory.peak() as p:
        t = torch.empty(1000)
        sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
        try:
            del t
        finally:
            sys.setprofile(None)
        assert p.live_bytes == 0
    assert calls == []
