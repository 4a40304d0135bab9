"""What a synchronous disk offload costs per byte, by how tensors come back: the offload file written with
``pwrite`` and read back with ``preadv`` into new tensors (the path before mapped reads), or read back as views of the
mapped file (``torch.frombuffer``: mapped reads, the disk target's synchronous path), against copying the same bytes
to and from memory (``Tensor.copy_`` into a buffer, ``clone`` back): the floor of any path that copies twice; and
written through the mapping too (``memmove`` into the mapped pages: the synchronous path where ``posix_fallocate``
exists), read back as views.

Each round writes ``--tensors`` tensors of ``--mib`` MiB at page-aligned offsets of one reused file (as a step reuses
its pooled file) and reads them all back; the file's pages are in the page cache, as in training. Prints the median
of ``--repeats`` rounds per path, the ratio to the pread path measured in the same run, and GB/s of bytes offloaded.

    python benchmarks/offload_io.py                  # 64 tensors of 1 MiB, 15 rounds (a few seconds)
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # fewbit_design from this checkout

from fewbit_design.runtime.offload.disk import _open_unnamed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=64, help="tensors per round (default 64)")
    parser.add_argument("--mib", type=float, default=1.0, help="MiB per tensor (default 1)")
    parser.add_argument("--repeats", type=int, default=15, help="rounds per path (default 15)")
    parser.add_argument("--directory", default=tempfile.gettempdir(), help="folder of the offload file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    count, size = args.tensors, int(args.mib * (1 << 20)) // 4096 * 4096
    sources = [torch.randn(size // 4) for _ in range(count)]
    fd, path = _open_unnamed(args.directory)
    try:
        os.ftruncate(fd, count * size)
        mapping = mmap.mmap(fd, count * size)
        view = memoryview(mapping)
        memory = torch.empty(count * size // 4)

        def pread_path() -> list[torch.Tensor]:
            for i, source in enumerate(sources):
                os.pwrite(fd, memoryview(source.numpy()).cast("B"), i * size)
            out = []
            for i in range(count):
                tensor = torch.empty(size // 4)
                os.preadv(fd, [memoryview(tensor.numpy()).cast("B")], i * size)
                out.append(tensor)
            return out

        def mapped_path() -> list[torch.Tensor]:
            for i, source in enumerate(sources):
                os.pwrite(fd, memoryview(source.numpy()).cast("B"), i * size)
            return [torch.frombuffer(view, dtype=torch.float32, count=size // 4, offset=i * size) for i in range(count)]

        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))

        def mapped_both() -> list[torch.Tensor]:
            for i, source in enumerate(sources):
                ctypes.memmove(base + i * size, source.data_ptr(), size)
            return [torch.frombuffer(view, dtype=torch.float32, count=size // 4, offset=i * size) for i in range(count)]

        def memory_copies() -> list[torch.Tensor]:
            n = size // 4
            for i, source in enumerate(sources):
                memory[i * n : (i + 1) * n].copy_(source)
            return [memory[i * n : (i + 1) * n].clone() for i in range(count)]

        paths = {
            "pwrite + preadv": pread_path,
            "pwrite + mapped read": mapped_path,
            "mapped write and read": mapped_both,
            "memory copies": memory_copies,
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        for name, run in paths.items():  # warm: the file's pages and the allocator's
            for tensor, source in zip(run(), sources, strict=True):
                assert torch.equal(tensor, source), name
        for _ in range(args.repeats):  # interleaved: a slow spell of the machine hits every path alike
            for name, run in paths.items():
                start = time.perf_counter()
                out = run()
                times[name].append(time.perf_counter() - start)
                del out
        view.release()  # (no tensor of it is left: each round's were dropped)
        mapping.close()
    finally:
        os.close(fd)
        if path is not None:
            os.unlink(path)
    base = statistics.median(times["pwrite + preadv"])
    total = count * size
    print(f"{count} tensors of {size / (1 << 20):.2f} MiB written and read back, {args.repeats} rounds, 1 thread")
    for name, values in times.items():
        median = statistics.median(values)
        ratio = median / base
        print(
            f"  {name:22s} {median * 1e3:7.2f} ms  {ratio:5.2f}x of pwrite + preadv  {total / median / 1e9:5.1f} GB/s"
        )


if __name__ == "__main__":
    main()
