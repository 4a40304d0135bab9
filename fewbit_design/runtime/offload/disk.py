"""The disk target: saved CPU tensors go to one file per step, written and read back on a background thread.

At entry the target creates its file in ``directory`` (or the system temporary folder) without a name where the
system allows it (Linux ``O_TMPFILE``; elsewhere it is unlinked right after creation, and removed on any error or
interrupt before that), and writes and fsyncs a page there (a full disk or an unwritable folder fails here, before
training starts, with one :class:`FewBitError`): the data stays reachable through the open descriptor and the
space returns to the file system when it is closed, so no file is left behind whatever happens, even if the
process is killed or interrupted. Tensors are written with ``os.pwrite`` at page-aligned offsets and read back with
``os.preadv`` into buffers allocated by the calling thread (so allocations stay visible to memory instruments that
watch that thread).

**Mapped reads** (the synchronous path, ``prefetch=0``, the planner's setting): a tensor read back is not copied out
of the page cache but mapped: the file is mapped into memory (``mmap``, shared, read-write) and the restored tensor
is a view of the file's bytes at its offset (``torch.frombuffer``), so a step copies its offloaded bytes once
instead of twice. **Mapped writes**: where the system has ``posix_fallocate``, that one copy is a ``memmove`` into the
mapped pages (no system call per tensor), the file's blocks allocated ahead (so a full disk is an error of the
allocation, never a SIGBUS at a write) and the file grown geometrically; ``pwrite`` elsewhere. ``python
benchmarks/offload_io.py`` (64 tensors of 1 MiB written and read back, 2-core development machine): 0.52x the time
of ``pwrite`` + ``preadv`` with mapped reads, 0.44x with mapped writes too. Such a tensor
holds the file's pages, not memory of torch's allocator: :func:`..memory.count_storage` makes ``memory.peak`` count
its bytes as it counts any new tensor (so a plan's predicted and measured peaks are unchanged), and the process's RSS
includes the mapped pages (file-backed pages the kernel may write back and drop under memory pressure, as it may the
page cache that ``pwrite`` fills). Safety: a mapped tensor keeps the mapping alive (``torch.frombuffer`` holds a
reference to it), byte ranges are never reused within a step, and a file goes back to the pool for the next step
only when no tensor still maps it (a tensor kept past its step, by a double backward's graph say, makes its file be
closed instead: the next step cannot overwrite it). One difference from a read: a disk error while the kernel reads
a mapped page back (possible only after it dropped the page under memory pressure) stops the process with SIGBUS,
as for any memory-mapped file (``numpy.memmap``, ``torch.load(mmap=True)``), where ``preadv`` (``prefetch`` >= 1)
gives a :class:`FewBitError`.

Free space: the file may grow to the free space seen at entry minus a **reserve** that is never used, so the file
system is never filled to the last byte: ``MIN_FREE_BYTES`` (64 MiB), or ``max_host_bytes`` rounded up to pages when
that is smaller (a capped step never writes more than its cap, so it keeps free at least what it may write). A
folder with less free space than the reserve fails at entry; a step that would eat into it gets a
:class:`FewBitError` in forward, never a torn file.

Files are reused: when a step's file is closed it goes back to a small pool of idle files (still unlinked), and
the next step in that folder overwrites it. Writing into pages the page cache already holds is about ten times
cheaper in CPU than writing fresh ones (measured on the 2-core development machine: 2.0 against 0.23 GB/s), and on
CPU that work competes with the compute. The pool is bounded: at most ``MAX_IDLE_FILES`` per folder and
``MAX_IDLE_TOTAL`` in all (the least recently used goes first), and a file whose folder was removed (or replaced)
is closed at the next use of the pool instead of being kept. :func:`empty_cache` closes the idle files (the space
returns to the file system), and removing an offload (``OffloadHandle.remove``, which undoing a memory plan calls)
closes those of its folder; a file that saw an I/O error is never reused.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable

import torch

from ...errors import FewBitError
from ..memory import count_storage
from .layout import Layout, address_bytes, empty, with_flags
from .worker import Job, Worker

__all__ = ["DiskTarget", "MIN_FREE_BYTES", "MAX_IDLE_FILES", "MAX_IDLE_TOTAL", "empty_cache", "idle_files"]

MIN_FREE_BYTES = 64 << 20  # never fill the file system to the last byte
_PAGE = 4096
_CHUNK = 1 << 30  # largest single read/write call (Linux caps one call near 2 GiB)
#: the synchronous path writes through the mapping (a memmove into the file's mapped pages) where the system can
#: allocate a file's blocks ahead (``posix_fallocate``), and with ``pwrite`` elsewhere
_MAPPED_WRITES = hasattr(os, "posix_fallocate")
MAX_IDLE_FILES = 2  # per folder
MAX_IDLE_TOTAL = 4  # all folders together
_Folder = tuple[str, int, int]  # (real path, device, inode): a folder removed and made again is another folder
#: (folder, descriptor, bytes in the file, its mapping or None), least recently given back first; a mapping here
#: is mapped by no tensor (checked when given back), so closing it is safe
_IDLE: list[tuple[_Folder, int, int, mmap.mmap | None]] = []
_IDLE_LOCK = threading.Lock()


def _identify(path: str) -> _Folder | None:
    """The folder at ``path`` now, or None when there is no folder there."""
    real = os.path.realpath(path)
    try:
        status = os.stat(real)
    except OSError:
        return None
    return (real, status.st_dev, status.st_ino)


def _prune() -> list[tuple]:
    """Take out the idle files whose folder is gone or was replaced (under the lock); return their entries."""
    present: dict[_Folder, bool] = {}
    stale = []
    for entry in _IDLE:
        folder = entry[0]
        if folder not in present:
            present[folder] = _identify(folder[0]) == folder
        if not present[folder]:
            stale.append(entry)
    for entry in stale:
        _IDLE.remove(entry)
    return stale


def _close_all(entries: list[tuple]) -> None:
    """Close idle entries ``(folder, fd, size, mapping)`` (their mappings are mapped by no tensor)."""
    for _folder, fd, _size, mapping in entries:
        if mapping is not None:
            mapping.close()
        try:
            os.close(fd)
        except OSError:
            pass


def _take_idle(folder: _Folder) -> tuple[int, int, mmap.mmap | None] | None:
    with _IDLE_LOCK:
        stale = _prune()
        found = None
        for index in range(len(_IDLE) - 1, -1, -1):
            if _IDLE[index][0] == folder:
                found = _IDLE.pop(index)[1:]
                break
    _close_all(stale)
    return found


def _give_back(folder: _Folder, fd: int, size: int, mapping: mmap.mmap | None) -> bool:
    """Keep ``fd`` (and its ``mapping``, mapped by no tensor) for reuse (True), or refuse it (False: the caller
    closes it): folder gone, or per folder pool full. Past ``MAX_IDLE_TOTAL`` the least recently given back file
    is closed."""
    with _IDLE_LOCK:
        stale = _prune()
        kept = _identify(folder[0]) == folder and sum(entry[0] == folder for entry in _IDLE) < MAX_IDLE_FILES
        if kept:
            _IDLE.append((folder, fd, size, mapping))
            while len(_IDLE) > MAX_IDLE_TOTAL:
                stale.append(_IDLE.pop(0))
    _close_all(stale)
    return kept


def idle_files() -> int:
    """How many closed step files are kept open for reuse (all folders; those of removed folders are closed)."""
    with _IDLE_LOCK:
        stale = _prune()
        count = len(_IDLE)
    _close_all(stale)
    return count


def empty_cache(directory: str | os.PathLike | None = None) -> int:
    """Close the idle step files kept for reuse, all of them or those of ``directory`` only (whether or not the folder
    is still there); return the bytes they held on disk.

    Args:
        directory: the folder whose idle files to close, or None for every folder
    """
    real = os.path.realpath(os.fspath(directory)) if directory is not None else None
    with _IDLE_LOCK:
        files = [entry for entry in _IDLE if real is None or entry[0][0] == real]
        for entry in files:
            _IDLE.remove(entry)
    _close_all(files)
    return sum(entry[2] for entry in files)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        written = os.pwrite(fd, data[done : done + _CHUNK], offset + done)
        if written <= 0:
            raise OSError(f"pwrite wrote {written} bytes")
        done += written


def _pread_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        count = os.preadv(fd, [data[done : done + _CHUNK]], offset + done)
        if count <= 0:
            raise OSError(f"unexpected end of the offload file at byte {offset + done}")
        done += count


class DiskTarget:
    """One file of one step; see the module docstring. ``depth`` 0 makes every transfer synchronous."""

    device_type = "cpu"
    bounded_writes = True  # at most ``depth`` writes in flight: memory is released at the pace of the disk

    def __init__(self, directory: str | os.PathLike | None, capacity: int | None = None) -> None:
        self.capacity = capacity
        folder = os.fspath(directory) if directory is not None else tempfile.gettempdir()
        self.directory = folder
        if not os.path.isdir(folder):
            raise FewBitError(f"offload directory must be an existing folder, got {folder!r}")
        self._folder = _identify(folder)
        self._failed = False
        self._path: str | None = None
        self._fd: int | None = None
        # the reserve (see the module docstring): what a capped step may write, when that is below MIN_FREE_BYTES
        self.reserve = MIN_FREE_BYTES if capacity is None else min(MIN_FREE_BYTES, -(-capacity // _PAGE) * _PAGE)
        # the mapped file (see "Mapped reads"): the mapping, the memoryview the read tensors are made from (each
        # holds a reference to it: a weak reference to it says whether any is alive), the bytes mapped
        self._mapping: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._mapped = 0
        self._base = 0  # the mapping's address (mapped writes)
        self._abandoned: list[weakref.ref] = []  # views of mappings let go of while tensors still held them
        idle = _take_idle(self._folder) if self._folder is not None else None
        if idle is not None:
            self._fd, self.reused, mapping = idle
            if mapping is not None:
                self._mapping, self._view, self._mapped = mapping, memoryview(mapping), len(mapping)
                self._base = _address(mapping)
        else:
            self._fd, self._path = self._create(folder)
            self.reused = 0
        try:
            self.free_bytes: int | None = shutil.disk_usage(folder).free
        except OSError:
            self.free_bytes = None
        if self.free_bytes is not None and self.free_bytes < self.reserve:
            self.close()
            cap = "" if capacity is None else f" (the smaller of {MIN_FREE_BYTES >> 20} MiB and max_host_bytes)"
            raise FewBitError(
                f"offload directory {folder!r} has {_mib(self.free_bytes)} free, needs at least "
                f"{_mib(self.reserve)}{cap}; free some space, lower max_host_bytes or pass directory="
            )
        self.end = 0
        self._worker = Worker("disk")

    @staticmethod
    def _create(folder: str) -> tuple[int, str | None]:
        """A new file in ``folder`` without a name (or unlinked at once), probed: a page written and fsynced.
        Returns the descriptor and, on a platform that cannot unlink open files, the path to remove at close."""
        fd, path = _open_unnamed(folder)
        try:
            os.write(fd, b"\0" * _PAGE)
            os.fsync(fd)
            os.ftruncate(fd, 0)
        except BaseException as error:
            os.close(fd)
            if path is not None:
                _unlink_quietly(path)
            if not isinstance(error, OSError):
                raise
            raise FewBitError(
                f"offload directory {folder!r} cannot take a {_PAGE}-byte probe file: {error.strerror or error}"
            ) from None
        return fd, path

    def _allocate(self, nbytes: int) -> int:
        offset = self.end
        end = offset + -(-nbytes // _PAGE) * _PAGE
        if self.free_bytes is not None and end > self.reused + self.free_bytes - self.reserve:
            raise FewBitError(
                f"offloading needs {_mib(end)} in {self.directory!r}, which had {_mib(self.free_bytes)} free "
                f"at entry (keeping {_mib(self.reserve)} free); free some space, lower max_host_bytes or pass "
                "directory="
            )
        self.end = end
        return offset

    def _fd_or_raise(self) -> int:
        if self._fd is None:
            raise FewBitError("offload file is closed: the step's saved tensors are gone")
        return self._fd

    def write(self, raw: torch.Tensor, *, sync: bool) -> tuple[int, Job]:
        """Start writing the bytes ``raw`` (1-D uint8); return their offset and the job (``raw`` kept in it), or
        ``(None, None)`` when the file would pass ``capacity`` (the tensor then stays in memory)."""
        if self.capacity is not None and self.end + raw.numel() > self.capacity:
            return None, None
        offset = self._allocate(raw.numel())
        fd = self._fd_or_raise()

        def write() -> torch.Tensor:
            if raw.numel():
                try:
                    _pwrite_all(fd, memoryview(raw.numpy()), offset)
                except BaseException:
                    self._failed = True  # never reuse this file
                    raise
            return raw

        return offset, self._start(write, sync=sync)

    def write_now(self, address: int, nbytes: int) -> tuple[int | None, Exception | None]:
        """Write the ``nbytes`` of host memory at ``address`` (a tensor's storage span, or a whole storage) here and
        now (``prefetch=0``: no job, no copy, no torch view); the caller holds the tensor. Return their offset and
        the write's error (None), or ``(None, None)`` when the file would pass ``capacity``. A full disk raises
        :class:`FewBitError` as :meth:`write` does; an error of the write itself is returned, as :meth:`write`'s job
        holds it (and the file is never reused)."""
        if self.capacity is not None and self.end + nbytes > self.capacity:
            return None, None
        offset = self._allocate(nbytes)
        fd = self._fd_or_raise()
        if nbytes:
            try:
                if _MAPPED_WRITES:
                    if offset + nbytes > self._mapped:
                        self._grow(fd, offset + nbytes)
                    ctypes.memmove(self._base + offset, address, nbytes)
                else:
                    _pwrite_all(fd, address_bytes(address, nbytes), offset)
            except BaseException as error:
                self._failed = True  # never reuse this file
                if not isinstance(error, Exception):  # KeyboardInterrupt: never turned into an I/O error
                    raise
                return offset, error
        return offset, None

    def read_now(self, offset: int, layout: Layout) -> tuple[torch.Tensor | None, Exception | None]:
        """The tensor of ``layout`` written at ``offset``, here and now: a view of the mapped file (see "Mapped
        reads"; counted by ``memory.peak`` as a new tensor); return it and None, or None and the error of
        mapping the file."""
        fd = self._fd_or_raise()
        nbytes = layout.nbytes
        if not nbytes:
            return with_flags(empty(layout), layout), None
        if offset + nbytes > self._mapped:
            try:
                self._map(fd, offset + nbytes)
            except (OSError, ValueError) as error:  # (described by the caller, as a read job's error)
                return None, error
        tensor = torch.frombuffer(self._view, dtype=layout.dtype, count=layout.span, offset=offset)
        if layout.size != (layout.span,) or layout.stride != (1,):
            tensor = tensor.as_strided(layout.size, layout.stride)
        count_storage(tensor)
        return with_flags(tensor, layout), None

    def _grow(self, fd: int, end: int) -> None:
        """Make the file hold at least ``end`` bytes, its blocks allocated (``posix_fallocate``: a write through
        the mapping can then never meet a full disk, which would be a SIGBUS), growing it geometrically (at least
        doubling, within the free space seen at entry) so that a step whose file grows maps it a few times, not
        once per tensor; then map it."""
        size = os.fstat(fd).st_size
        if size < end:
            target = max(end, 2 * size)
            if self.free_bytes is not None:
                target = max(end, min(target, self.reused + self.free_bytes - self.reserve))
            target = -(-target // _PAGE) * _PAGE
            os.posix_fallocate(fd, size, target - size)
        self._map(fd, end)

    def _map(self, fd: int, end: int) -> None:
        """Map the whole file (it holds at least ``end`` bytes: they were written), in place of a shorter mapping;
        the old one is unmapped when the last tensor made from it dies (each holds a reference to it)."""
        size = os.fstat(fd).st_size
        if size < end:  # (never: every byte read was written first)
            raise OSError(errno.EIO, f"the offload file holds {size} bytes, {end} expected")
        old = self._mapping
        if self._release_view() and old is not None:
            old.close()
        self._mapping = mmap.mmap(fd, size)  # (shared, read-write: a tensor read back may be written in place)
        self._view, self._mapped, self._base = memoryview(self._mapping), size, _address(self._mapping)

    def _release_view(self) -> bool:
        """Let go of the mapping; return True when no tensor maps it (then it is still open, in ``_mapping``, for the
        pool), False when some tensor still does (then it is left to them: unmapped when the last one dies)."""
        view, self._view, self._mapped = self._view, None, 0
        if view is not None:
            ref = weakref.ref(view)
            del view  # (the last reference but those of tensors made from it)
            if ref() is not None:  # tensors still map it: watched until they die, as a shorter mapping's (_map)
                self._abandoned.append(ref)
                self._mapping = None
        self._abandoned = [ref for ref in self._abandoned if ref() is not None]
        return not self._abandoned

    def read(self, offset: int, nbytes: int, *, sync: bool) -> Job:
        """Start reading ``nbytes`` at ``offset`` into a new uint8 tensor (allocated here, by the caller)."""
        fd = self._fd_or_raise()
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())

        def read() -> torch.Tensor:
            if nbytes:
                _pread_all(fd, view, offset)
            return buffer

        return self._start(read, sync=sync)

    def _start(self, function: Callable[[], torch.Tensor], *, sync: bool) -> Job:
        """A job of ``function``: run here and now (``sync``), or queued on the file's worker thread."""
        job = Job(function)
        if sync:
            job.run()
        else:
            self._worker.submit(job)
        return job

    def release(self, location: int) -> None:
        """A record was freed (its file range is dead; the whole file goes at close)."""

    def describe_error(self, error: BaseException, action: str) -> str:
        detail = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        return f"offload: {action} in {self.directory!r} failed ({detail})"

    def close(self) -> None:
        """Cancel queued transfers, wait for the running one, and give the file back to the pool of idle files
        (or close it: pool full, I/O error, or a file that could not be unlinked). Idempotent."""
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.close(FewBitError("offload file closed before the transfer ran"))
        if self._fd is not None:
            fd, self._fd = self._fd, None
            size = max(self.reused, getattr(self, "end", 0), self._mapped)
            unmapped = self._release_view()  # False: a tensor still maps the file, which must not be overwritten
            mapping, self._mapping = self._mapping, None
            reusable = unmapped and not self._failed and self._path is None and self._folder is not None
            if not reusable or not _give_back(self._folder, fd, size, mapping):
                # (an error closing is not the caller's: close runs at safe points in its code)
                _close_all([(None, fd, size, mapping)])
        if self._path is not None:
            _unlink_quietly(self._path)
            self._path = None


def _address(mapping: mmap.mmap) -> int:
    """The address of ``mapping``'s first byte (the ctypes object that exports it is dropped at once: the address
    stays valid while the mapping is open)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


def _mib(nbytes: int) -> str:
    if nbytes < 1 << 20:
        return f"{nbytes} bytes"
    return f"{nbytes >> 20} MiB" if nbytes % (1 << 20) == 0 else f"{nbytes / (1 << 20):.1f} MiB"


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _open_unnamed(folder: str) -> tuple[int, str | None]:
    """A new empty file in ``folder`` that no name points to (descriptor, None), or, on a platform that cannot
    unlink open files, (descriptor, path to remove at close). An interrupt never leaves a named file behind."""
    flags = os.O_RDWR | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(folder, flags | os.O_TMPFILE, 0o600), None
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise FewBitError(f"offload directory {folder!r} is not writable: {error.strerror or error}") from None
            # (a file system without unnamed files: a named one, unlinked at once)
    for _ in range(100):
        path = os.path.join(folder, f"fewbit-offload-{secrets.token_hex(8)}.bin")
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        except OSError as error:
            raise FewBitError(f"offload directory {folder!r} is not writable: {error.strerror or error}") from None
        except BaseException:  # interrupted: the file may exist; it must not stay
            _unlink_quietly(path)
            raise
        try:
            os.unlink(path)  # the descriptor keeps the data; nothing is left behind, whatever happens
        except OSError:  # (a platform that cannot unlink open files: removed at close)
            return fd, path
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        return fd, None
    raise FewBitError(f"offload directory {folder!r}: could not find a free name for the offload file")
