"""memory.peak's process view: ``rss_peak_bytes`` (peak RSS during the block above the RSS at entry, Linux)."""

import os

import pytest
import torch

from fewbit_design.runtime import memory

LINUX_MARK = os.path.exists("/proc/self/clear_refs") and os.access("/proc/self/clear_refs", os.W_OK)
MiB = 1 << 20


def touch(nbytes):
    """A tensor of ``nbytes`` whose pages are all written (so they are resident). Above glibc's largest mmap
    threshold (32 MiB) it is its own mapping, returned to the system when freed."""
    return torch.ones(nbytes // 4)


@pytest.mark.skipif(not LINUX_MARK, reason="the resettable high-water mark is Linux's /proc/self/clear_refs")
def test_rss_peak_is_the_block_s_own_and_survives_nesting():
    with memory.peak() as big:
        tensor = touch(64 * MiB)
        del tensor
    with memory.peak() as small:  # the mark was reset at entry: the block before does not leak into this one
        tensor = touch(1 * MiB)
        del tensor
    with memory.peak() as outer:
        tensor = touch(64 * MiB)
        del tensor
        with memory.peak() as inner:  # resets the mark: the outer block's peak must be kept all the same
            tensor = touch(1 * MiB)
            del tensor
    assert big.rss_peak_bytes >= 60 * MiB and outer.rss_peak_bytes >= 60 * MiB
    assert small.rss_peak_bytes < 16 * MiB and inner.rss_peak_bytes < 16 * MiB
    assert big.peak_bytes == 64 * MiB  # the live tensor bytes beside it


@pytest.mark.skipif(LINUX_MARK, reason="checks the value where the system has no resettable mark")
def test_rss_peak_is_none_without_a_resettable_mark():
    with memory.peak() as measured:
        touch(MiB)
    assert measured.rss_peak_bytes is None
