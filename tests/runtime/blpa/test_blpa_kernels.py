"""BLPA numba kernels against the pure-torch reference: codes and forward outputs bitwise, gradients to rounding."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from fewbit_design.errors import FewBitError
from fewbit_design.runtime import blpa
from fewbit_design.runtime.blpa import quant

pytest.importorskip("numba")


@contextlib.contextmanager
def _backend(name):
    previous = quant.get_backend()
    blpa.set_backend(name)
    try:
        yield
    finally:
        blpa.set_backend(previous)


def run_unit(unit, x, grad_out, backend):
    unit.zero_grad()
    x = x.detach().clone().requires_grad_()
    with _backend(backend):
        out = unit(x)
        stored = out.grad_fn.saved_tensors[0].clone()
        out.backward(grad_out)
    grads = {"input": x.grad, "gamma": unit.bn.weight.grad, "beta": unit.bn.bias.grad, "weight": unit.op.weight.grad}
    return out.detach(), stored, grads


CASES = [  # (kind, input shape): odd spatial sizes so packing groups straddle planes; Linear has inner = 1
    ("conv", (3, 5, 7, 5)),
    ("linear", (13, 5)),
]


BITS_NAIVE = [(None, False), (2, False), (3, False), (4, False), (8, False), (4, True)]


def unit_case(kind, shape, bits, naive, dtype):
    """(unit, x, grad_out) of a case: seeded, with hand-picked gammas and betas and a constant patch."""
    generator = torch.Generator().manual_seed(0)
    if kind == "conv":
        unit = blpa.BNReLUConv2d(5, 4, 3, padding=1, bits=bits, naive=naive).to(dtype)
    else:
        unit = blpa.BNReLULinear(5, 4, bits=bits, naive=naive).to(dtype)
    with torch.no_grad():  # far beta (catch-all codes), negative and zero gamma, an exact zero of A2
        unit.bn.weight.copy_(torch.tensor([1.0, -0.5, 0.0, 2.0, 0.3], dtype=dtype))
        unit.bn.bias.copy_(torch.tensor([0.2, 0.1, 0.5, -7.0, 4.0], dtype=dtype))
    x = torch.randn(shape, dtype=dtype, generator=generator) * 2 + 1
    x[0, 1] = 0.0  # constant patch
    with torch.no_grad():
        grad_out = torch.randn(unit(x).shape, dtype=dtype, generator=generator)
    return unit, x, grad_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bits,naive", BITS_NAIVE)
@pytest.mark.parametrize("kind,shape", CASES)
def test_kernels_match_reference(kind, shape, bits, naive, dtype):
    unit, x, grad_out = unit_case(kind, shape, bits, naive, dtype)
    out_ref, stored_ref, grads_ref = run_unit(unit, x, grad_out, "torch")
    out_k, stored_k, grads_k = run_unit(unit, x, grad_out, "numba")
    assert torch.equal(out_k, out_ref)
    assert torch.equal(stored_k, stored_ref)
    tolerance = {torch.float32: 2e-5, torch.float64: 1e-12}[dtype]
    for name, value in grads_ref.items():
        torch.testing.assert_close(grads_k[name], value, rtol=tolerance, atol=tolerance, msg=name)


def test_backend_choice_is_checked():
    with pytest.raises(FewBitError, match="backend must be 'auto', 'torch' or 'numba', got 'cuda'"):
        blpa.set_backend("cuda")
    with _backend("numba"), pytest.raises(FewBitError, match="backend 'numba' needs"):
        blpa.BNReLULinear(4, 2).to(torch.float16)(torch.randn(3, 4, dtype=torch.float16))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("planes", [(0, 3), (8, 11), (0, 16)])
def test_blpa_packs_with_the_shared_packing_kernels(bits, planes):
    # BLPA had its own bit-stream packing beside runtime._numba_packing (the same layout, slower: 2-5x at
    # 2^22 codes); it now calls the shared kernels, whose stream is the reference packing's
    from fewbit_design.runtime import _numba_packing, _packing
    from fewbit_design.runtime.blpa import _numba_kernels as blpa_kernels

    assert blpa_kernels._pack is _numba_packing.pack_codes and blpa_kernels._unpack is _numba_packing.unpack_codes
    inner = 5
    start, stop = planes[0] * inner, planes[1] * inner
    codes = np.random.default_rng(bits).integers(0, 2**bits, stop).astype(np.uint8)
    packed = np.zeros(_packing.packed_nbytes(stop, bits), dtype=np.uint8)
    blpa_kernels._pack(codes, bits, packed, start, stop)
    expected = _packing.pack_reference(torch.from_numpy(codes.astype(np.int64)), bits).numpy()
    first = start // 8 * bits
    np.testing.assert_array_equal(packed[first:], expected[first:])
    unpacked = np.zeros(stop, dtype=np.uint8)
    blpa_kernels.unpack(packed, bits, inner, unpacked, planes[0], planes[1])
    np.testing.assert_array_equal(unpacked[start:], codes[start:])
