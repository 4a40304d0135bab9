"""The shared numba packing (runtime/_numba_packing.py) against the torch reference layout, range by range.

1, 2, 4 and 8 bits are written whole bytes at a time, the other widths through the SWAR compress of 8 codes; every
width must give the reference's bytes, and a range's call must touch no byte outside its own groups (threads pack
adjacent ranges at once), in any call order.
"""

import numpy as np
import pytest
import torch

from fewbit_design.runtime._packing import pack_reference

kernels = pytest.importorskip("fewbit_design.runtime._numba_packing")

CANARY = 0xA5


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [1, 7, 8, 9, 43, 4096 + 13])
def test_pack_codes_matches_the_reference_layout(bits, count):
    codes = torch.randint(0, 2**bits, (count,), generator=torch.Generator().manual_seed(bits * 1000 + count))
    out = np.full(-(-count // 8) * bits, CANARY, dtype=np.uint8)
    kernels.pack_codes(codes.numpy(), bits, out, 0, count)
    assert np.array_equal(out, pack_reference(codes, bits).numpy())


@pytest.mark.parametrize("bits", range(1, 9))
def test_a_range_writes_only_its_own_groups_in_any_order(bits):
    # three adjacent ranges (starts at multiples of 8), packed last-first into one buffer, as threads may finish
    count = 3 * 4096 + 40
    edges = [0, 4096 + 8, 2 * 4096 + 24, count]
    codes = torch.randint(0, 2**bits, (count,), generator=torch.Generator().manual_seed(bits))
    expected = pack_reference(codes, bits).numpy()
    out = np.full(expected.size + 16, CANARY, dtype=np.uint8)  # 16 bytes past the end stay untouched
    for start, stop in reversed(list(zip(edges[:-1], edges[1:], strict=True))):
        kernels.pack_codes(codes.numpy(), bits, out, start, stop)
        written = slice(start // 8 * bits, -(-stop // 8) * bits)
        assert np.array_equal(out[written], expected[written])
    assert np.array_equal(out[: expected.size], expected)
    assert np.all(out[expected.size :] == CANARY)


@pytest.mark.parametrize("bits", range(1, 9))
def test_unpack_inverts_pack(bits):
    count = 4096 + 77
    codes = torch.randint(0, 2**bits, (count,), generator=torch.Generator().manual_seed(7 + bits)).to(torch.uint8)
    packed = np.zeros(-(-count // 8) * bits, dtype=np.uint8)
    kernels.pack_codes(codes.numpy(), bits, packed, 0, count)
    back = np.zeros(count, dtype=np.uint8)
    kernels.unpack_codes(packed, bits, back, 0, count)
    assert np.array_equal(back, codes.numpy())
