"""One offload step: the pack and unpack hooks, the records, and the scheduling carried out on a target.

A :class:`Session` lives as long as autograd's graph holds its hooks (each saved tensor keeps them), plus the
``with`` block that created it. Its targets are closed (file given back or closed, queued transfers cancelled,
pinned buffers returned) at the first **safe point** after it is freed: the end of the backward pass that freed it,
the start of the next session, or :func:`close_freed` (``offload.empty_cache`` calls it); an exception inside the
block closes them at once. Records never reference the session, and transfer jobs reference neither, so nothing
keeps a dead step alive.

No Python code runs when a session or a record is freed: the weak references that notice it have a C callback
(``deque.append``), and the work is done at the safe points, in ordinary code. A ``KeyboardInterrupt`` that arrives
while Python runs a ``__del__`` or a finalizer is printed as "Exception ignored" and lost (the training loop goes
on), and autograd frees saved tensors all the time; this way Ctrl-C always reaches the loop.

Regions nest: the innermost region's session packs a tensor, and the stats of every enclosing region (of this
thread) count it too (:func:`push_stats`).

Forward (pack): an eligible tensor gets a position, its storage span is handed to the target without a copy, and
the hook keeps only the record. At most ``depth`` writes are in flight; finished writes are **reaped** on the
autograd thread (the thread that runs forward), which drops the last reference to the tensor's storage and checks
that its version counter did not move while it was being copied (autograd itself raises in that case when no
hooks are installed; with hooks it would silently use the modified data, so this raises instead).

Backward (unpack): the tensor comes from memory while its write is in flight, else from a prefetched read, else
from a synchronous read; then the ``depth`` records that the previous step's backward unpacked next are
prefetched (the options keep each step's first-unpack order), or, in a first step or one of another structure,
the ``depth`` records below it (:mod:`.schedule`). A tensor saved
by several nodes (a ReLU output that the next Linear saves too) is one record, read once per backward pass.

Small tensors (``min_bytes <= size < pack_bytes``) are **packed**: instead of a transfer each (whose fixed cost,
a thread hand-off and system calls, or stream and event calls, dominates for small sizes), they join the **pack**
of the current block and stay in memory until it is **flushed**: when the block's region ends (one pack per block
and step) or when the pack reaches ``pack_bytes``. A flush copies the members' bytes into one staging buffer
(each member at a 64-byte aligned offset; on CPU from a pool of reused buffers, see :class:`Staging`), lets the
members' storages go, and writes the buffer as one record (one transfer). In backward the first member unpacked
reads the whole pack back (one transfer, prefetched like any record); every member is a view of that buffer,
which is dropped once every member was served (it comes back for a second backward with ``retain_graph``).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ...errors import FewBitError
from . import schedule
from .layout import _MAX_LAYOUTS, Layout, describe, raw_bytes, restore, with_flags
from .records import Stats, _Member, _Pack, _Record, _RecordRef, _View
from .staging import Staging

__all__ = ["Session", "Stats", "close_freed", "push_stats", "pop_stats", "storage_pointer"]


_LAYOUTS: dict[tuple[int, torch.dtype], Layout] = {}  # layouts of whole storages: (elements, dtype) -> Layout
_NO_TARGET = object()  # (what Session._target_for finds for a device not seen yet; None: left in place)
_ALIGN = 64  # byte alignment of a member inside a pack (any dtype's view of the staging bytes is aligned)


class _SessionRef(weakref.ref):
    """A weak reference to a session that carries its targets (closed once the session is freed)."""

    __slots__ = ("targets",)


_FREED_SESSIONS: deque[_SessionRef] = deque()  # appended to by the weakref callback (C code, no Python frame)
_OPEN_SESSIONS: dict[int, _SessionRef] = {}  # id -> reference: keeps the references (and their callbacks) alive
_FREED_LOCK = threading.Lock()


def _close_targets(targets: dict[Any, Any]) -> None:
    for target in list(targets.values()):  # (each close is idempotent: an interrupted call is simply redone)
        if target is not None:
            target.close()
    targets.clear()


def close_freed() -> None:
    """Close the targets of the sessions freed since the last call (see the module docstring: a safe point)."""
    if not _FREED_SESSIONS:
        return
    with _FREED_LOCK:
        while _FREED_SESSIONS:
            ref = _FREED_SESSIONS[0]
            _close_targets(ref.targets)
            _OPEN_SESSIONS.pop(id(ref), None)
            _FREED_SESSIONS.popleft()


@atexit.register
def _close_all() -> None:  # (files that could not be unlinked at creation are removed at close)
    for ref in list(_OPEN_SESSIONS.values()):
        _close_targets(ref.targets)
    _OPEN_SESSIONS.clear()
    _FREED_SESSIONS.clear()


def _graph_task() -> int:
    """An identifier of the backward pass running in this thread (-1 outside one)."""
    return torch._C._current_graph_task_id()


def _queue_safe_point() -> None:
    """Run :func:`close_freed` when the current backward pass ends (no-op outside a backward pass)."""
    try:
        torch.autograd.Variable._execution_engine.queue_callback(close_freed)
    except RuntimeError:  # unpacked outside a backward pass (grad_fn._saved_...): no pass to end
        pass


_ACTIVE = threading.local()  # .stats: the Stats of the regions entered in this thread, outermost first


def push_stats(stats: Stats) -> None:
    """A region was entered in this thread: what sessions inside it pack is counted in ``stats`` too."""
    if not hasattr(_ACTIVE, "stats"):
        _ACTIVE.stats = []
    _ACTIVE.stats.append(stats)


def pop_stats(stats: Stats) -> None:
    """The region of ``stats`` was left (the innermost occurrence is removed)."""
    active = getattr(_ACTIVE, "stats", [])
    for index in range(len(active) - 1, -1, -1):
        if active[index] is stats:
            del active[index]
            return


def _is_parameter_like(tensor: torch.Tensor) -> bool:
    if tensor.is_leaf and tensor.requires_grad:
        return True
    if type(tensor) is torch.Tensor:  # (``isinstance(t, Parameter)`` is then its ``_is_param`` mark, without the
        return bool(tensor.__dict__.get("_is_param", False))  # Python ``__instancecheck__`` of Parameter's type)
    return isinstance(tensor, torch.nn.Parameter)


def storage_pointer(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage, or None for a tensor without one (functorch wrappers, fakes).

    A ``DTensor`` (FSDP2's sharded parameters) answers with its local shard's storage: its own wrapper storage is
    invalid, and reading its address raises."""
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        tensor = local
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class Session:
    """Pack/unpack hooks of one step. ``make_target(device)`` gives the target of a ``torch.device`` or ``None``
    to leave that device's tensors in place; targets are made on first use, or at once for the ``probe`` devices
    (so that a bad folder fails at entry)."""

    def __init__(
        self,
        make_target: Callable[[torch.device], Any],
        *,
        min_bytes: int,
        depth: int,
        probe: tuple[torch.device, ...] = (),
        exclude: frozenset[int] = frozenset(),
        pack_bytes: int = 0,
        staging: Staging | None = None,
        order_hint: list[int] | None = None,
        blockwise: bool = False,
    ) -> None:
        close_freed()  # a safe point: the previous step's file goes back to the pool before this one takes one
        self._make_target = make_target
        self._targets: dict[torch.device, Any] = {}
        ref = _SessionRef(self, _FREED_SESSIONS.append)
        ref.targets = self._targets
        _OPEN_SESSIONS[id(ref)] = ref
        self.min_bytes = min_bytes
        self.pack_bytes = pack_bytes
        self._staging = staging if staging is not None else Staging()
        self._pending: _Pack | None = None  # the pack being filled (flushed at the end of the block's region)
        self.depth = depth
        self.blockwise = blockwise  # see :meth:`end_block`
        self.block = 0
        self.exclude = exclude
        self.stats = Stats()
        self.sealed = False  # backward has started: a new forward should start a new session
        self._closed: str | None = None
        self._records: dict[int, _RecordRef] = {}  # position -> reference of the records alive
        self._freed_records: deque[_RecordRef] = deque()  # appended to by the references' callback (C code)
        self._safe_point_task: int | None = None  # the backward pass whose end is queued as a safe point
        self.packed = 0  # tensors handed to pack (offloaded or not)
        self._count = 0
        self._seen: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}
        # whole storages written by the synchronous path: (address, bytes, dtype, version) -> (storage, record)
        self._stored: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}
        self._inflight: deque[_Record] = deque()
        # prefetch order: the previous step's first-unpack order of positions (see schedule.upcoming_in_order)
        self.unpack_order: list[int] = []  # this step's, the next step's hint
        self._unpacked: set[int] = set()
        self._hint = list(order_hint or ())
        self._hint_index = {position: place for place, position in enumerate(self._hint)}
        # upcoming records whose write was still in flight when prefetch wanted them: read once the write is done
        self._wanted: set[int] = set()
        for device in probe:
            self._target_for(device)

    # -- life cycle ---------------------------------------------------------------------------------------------
    def close(self, reason: str) -> None:
        """Close the targets now (file removed, transfers cancelled); later unpacks raise ``reason``."""
        if self._closed is None:
            self._closed = reason
        self._pending = None
        inflight = list(self._inflight)
        for record in inflight:
            record.write = record.alias = None
        self._inflight.clear()
        for record in self._alive_records().values():
            record.fetch = record.kept = None
        _close_targets(self._targets)  # (waits for the transfer running: staging buffers are idle after it)
        for record in inflight:
            if isinstance(record, _Pack):
                self._staging.release(record.lease)
                record.lease = None

    def _alive_records(self) -> dict[int, _Record]:
        """The records still alive by position (after releasing what the freed ones held in their target)."""
        self._release_freed_records()
        records = {}
        for position, ref in self._records.items():
            record = ref()
            if record is not None:
                records[position] = record
        return records

    def _release_freed_records(self) -> None:
        """Give back to the target what the records freed since the last call held (pinned buffers on CUDA)."""
        while self._freed_records:
            ref = self._freed_records.popleft()
            if self._records.get(ref.position) is ref:
                del self._records[ref.position]
            if ref.location is not None:
                ref.target.release(ref.location)

    def _check_open(self) -> None:
        if self._closed is not None:
            raise FewBitError(self._closed)

    def _target_for(self, device: torch.device) -> Any:
        target = self._targets.get(device, _NO_TARGET)  # (keyed by the device itself: ``str(device)`` is slow)
        if target is _NO_TARGET:
            target = self._targets[device] = self._make_target(device)
        return target

    # -- blocks ---------------------------------------------------------------------------------------------------
    def enter_block(self) -> None:
        """A region of this session was entered: a new block (its records prefetch among themselves)."""
        self.block += 1

    def end_block(self) -> None:
        """A region of this session ends: its pack is written; in a **blockwise** session its writes are also
        finished now (their tensors' storages released), so no transfer of a block holds memory outside it, and
        backward prefetches only the block's own records (the first unpack of each block reads synchronously).
        Then a block's peak exceeds the synchronous one (``prefetch=0``) by at most ``depth`` of its transfers, in
        forward and in backward, and the bytes it keeps are exactly the synchronous ones: what the planner's
        prediction needs (see :mod:`fewbit_design.runtime.offload.technique`)."""
        self.flush()
        if self.blockwise and self._inflight:
            self._wait_writes(len(self._inflight))

    # -- forward --------------------------------------------------------------------------------------------------
    def _eligible(self, tensor: torch.Tensor) -> bool:
        # (a ``Parameter`` is parameter-like, and every other subclass is refused: only exact tensors go on)
        if type(tensor) is not torch.Tensor or _is_parameter_like(tensor):
            return False
        base = tensor._base
        if base is not None and _is_parameter_like(base):
            return False
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested or tensor.is_meta:
            return False
        if not (tensor.is_cpu or tensor.is_cuda) or tensor.is_inference():
            return False
        return True

    def pack(self, tensor: torch.Tensor) -> Any:
        # runs for every saved tensor, hundreds a step: each step below is guarded so that the common case,
        # nothing freed and nothing in flight, costs no call
        if self._closed is not None:
            raise FewBitError(self._closed)
        self.packed += 1
        if self._freed_records:
            self._release_freed_records()
        if self._inflight:
            self._reap()
        if type(tensor) is not torch.Tensor:  # (see _eligible: only exact tensors go on)
            return tensor
        try:  # (an exact tensor here: no DTensor wrapper, see storage_pointer)
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # (functorch wrappers, fakes: no storage)
            return tensor
        if storage.nbytes() < self.min_bytes:  # (its span is no larger: left in place, as most saved tensors are,
            return tensor  # before the checks below, which cost a few us each: hundreds of calls a step)
        if not self._eligible(tensor):
            return tensor
        pointer = storage.data_ptr()
        if pointer in self.exclude:
            return tensor
        layout = describe(tensor)
        if layout.nbytes == 0 or layout.nbytes < self.min_bytes:
            return tensor
        key = (pointer, tensor.storage_offset(), layout.size, layout.stride, layout.dtype, tensor._version)
        hit = self._seen.get(key)
        if hit is not None:
            same, record = hit[0](), hit[1]()
            if same is not None and record is not None and record.poisoned is None:
                record.uses += 1
                if isinstance(record, _Member):
                    record.pack.uses += 1
                    record.pack.remaining += 1 if record.pack.kept is not None else 0
                return record
        target = self._target_for(tensor.device)
        if target is None:
            return tensor
        if layout.nbytes < self.pack_bytes:
            return self._pack_small(tensor, layout, key, target)
        if self.depth == 0 and hasattr(target, "write_now"):
            return self._pack_now(tensor, layout, key, target)
        if target.bounded_writes:
            self._wait_writes(schedule.write_backlog(len(self._inflight), self.depth))
        record = _Record(self._count, target, layout)
        raw = raw_bytes(tensor, layout)
        location, job = target.write(raw, sync=self.depth == 0)
        if location is None:  # the target is full (max_host_bytes): the tensor stays where it is
            self._count_in_stats("kept_tensors", "kept_bytes", layout.nbytes)
            return tensor
        record.location, record.write = location, job
        record.alias, record.version = tensor.detach(), tensor._version
        ref = self._register(record)
        self._remember(key, tensor, ref)
        self._count_transfer(layout.nbytes, layout.nbytes, 1)
        self._reap()
        return record

    def _pack_now(self, tensor: torch.Tensor, layout: Layout, key: tuple, target: Any) -> Any:
        """:meth:`pack` of a tensor that goes alone to a target that writes synchronously (the disk target with
        ``prefetch=0``, the planner's setting): written here from the tensor's own bytes (no view, no job), so the
        record is finished when the hook returns, and nothing of the tensor is kept (the bytes on disk are the
        value it had when it was saved, as a write job reaped at once leaves them).

        A tensor whose span is at least half of its storage is written as that **whole storage**, once for every
        saved view of it with the same version (its version counter is the storage's): a model saves several
        views of one storage (the query, key and value of an attention are views of one projection's output in
        GPT-2, each spanning almost all of it; a linear's input saved as (batch, sequence, width) and as
        (batch * sequence, width); one input saved by three projections), and each was written, and read back,
        on its own. Each is restored as a view of the storage read back, at its own offset, as autograd saved it
        (written view by view, GPT-2 wrote 69 MiB a step for 48 MiB of distinct bytes, LLaMA 73.5 for 61.5)."""
        storage = tensor.untyped_storage()
        whole = storage.nbytes()
        if whole <= 2 * layout.nbytes and whole % layout.itemsize == 0:
            return self._pack_storage(tensor, storage, whole, layout, key, target)
        written = self._write_now(target, tensor.data_ptr(), layout, layout.nbytes)
        if written is None:  # the target is full (max_host_bytes): the tensor stays where it is
            return tensor
        self._remember(key, tensor, written[1])
        return written[0]

    def _write_now(
        self, target: Any, address: int, layout: Layout, saved_bytes: int
    ) -> tuple[_Record, _RecordRef] | None:
        """Write ``layout.nbytes`` bytes at ``address`` to ``target`` now, as a new record of ``layout`` (its
        position taken, the transfer counted); None when the target is full (``saved_bytes`` counted as kept). A
        failed write closes the session and raises."""
        location, error = target.write_now(address, layout.nbytes)
        if location is None:
            self._count_in_stats("kept_tensors", "kept_bytes", saved_bytes)
            return None
        record = _Record(self._count, target, layout)
        record.location = location
        ref = self._register(record, inflight=False)
        self._count_transfer(layout.nbytes, layout.nbytes, 1)
        if error is not None:  # (what _reap does with a failed write job)
            record.poisoned = target.describe_error(error, f"writing {layout.nbytes} bytes")
            self.close(record.poisoned + "; the step's saved tensors are lost")
            raise FewBitError(record.poisoned + "; the step's saved tensors are lost")
        return record, ref

    def _pack_storage(
        self, tensor: torch.Tensor, storage: torch.UntypedStorage, whole: int, layout: Layout, key: tuple, target: Any
    ) -> Any:
        """The whole-storage case of :meth:`_pack_now`: a :class:`_View` of the storage's record (written now, or
        already by another view of it: same address, size, dtype and version, and the same storage, still alive)."""
        stored_key = (key[0], whole, layout.dtype, key[5])
        hit = self._stored.get(stored_key)
        if hit is not None:
            same, record = hit[0](), hit[1]()
            if same is storage and record is not None and record.poisoned is None:
                record.uses += 1
                return _View(record, tensor.storage_offset(), layout)
        count = whole // layout.itemsize
        base = _LAYOUTS.get((count, layout.dtype))
        if base is None:
            if len(_LAYOUTS) >= _MAX_LAYOUTS:  # (sizes that change every step never grow it without bound)
                _LAYOUTS.clear()
            base = _LAYOUTS.setdefault(
                (count, layout.dtype), Layout((count,), (1,), layout.dtype, count, layout.itemsize)
            )
        written = self._write_now(target, key[0], base, layout.nbytes)
        if written is None:  # the target is full (max_host_bytes): the tensor stays where it is
            return tensor
        record, ref = written
        if len(self._stored) > 2 * len(self._records) + 64:
            self._stored = {k: v for k, v in self._stored.items() if v[0]() is not None and v[1]() is not None}
        self._stored[stored_key] = (weakref.ref(storage), ref)
        return _View(record, tensor.storage_offset(), layout)

    def _register(self, record: _Record, *, inflight: bool = True) -> _RecordRef:
        """Give a written record the next position and watch it (its target range is released when it dies);
        ``inflight``: its write is still to be reaped."""
        record.position = self._count
        record.block = self.block
        if inflight:
            self._inflight.append(record)
        self._count += 1
        ref = _RecordRef(record, self._freed_records.append)
        ref.position, ref.target, ref.location = record.position, record.target, record.location
        self._records[record.position] = ref
        return ref

    def _remember(self, key: tuple, tensor: torch.Tensor, ref: weakref.ref) -> None:
        """Note that ``tensor`` (its storage span and version, ``key``) was packed as the object of ``ref``."""
        if len(self._seen) > 2 * len(self._records) + 64:
            self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None and v[1]() is not None}
        self._seen[key] = (weakref.ref(tensor), ref)

    def _pack_small(self, tensor: torch.Tensor, layout: Layout, key: tuple, target: Any) -> _Member:
        pack = self._pending
        if pack is not None and pack.target is not target:  # (another device: each pack is one transfer)
            self.flush()
            pack = None
        if pack is None:
            pack = self._pending = _Pack(target)
        member = _Member(pack, pack.nbytes, layout, tensor)
        pack.members.append(weakref.ref(member))
        pack.nbytes += -(-layout.nbytes // _ALIGN) * _ALIGN
        pack.uses += 1
        self._remember(key, tensor, weakref.ref(member))
        if pack.nbytes >= self.pack_bytes:  # as large as a tensor that goes alone: no reason to wait longer
            self.flush()
        return member

    def flush(self) -> None:
        """Write the pack being filled as one transfer (the end of a block's region calls this)."""
        pack, self._pending = self._pending, None
        if pack is None or self._closed is not None:
            return
        members = [m for m in (ref() for ref in pack.members) if m is not None and m.alias is not None]
        pack.members = []
        if not members:  # every member already died (backward ran inside the block)
            return
        for member in members:
            if member.alias._version != member.version:  # modified in place since it was saved
                member.poisoned = _modified(member.layout)
        size = max(m.offset + m.layout.nbytes for m in members)
        pack.uses = sum(m.uses for m in members)  # (the dead members will never be served)
        target = pack.target
        if target.bounded_writes:
            self._wait_writes(schedule.write_backlog(len(self._inflight), self.depth))
        staging, lease = self._staging.acquire(size, members[0].alias.device)
        with torch.no_grad():
            for member in members:
                if member.layout.nbytes:
                    end = member.offset + member.layout.nbytes
                    staging[member.offset : end].copy_(raw_bytes(member.alias, member.layout))
        location, job = target.write(staging, sync=self.depth == 0)
        count = len(members)
        if location is None:  # the target is full (max_host_bytes): the members stay where they are
            self._staging.release(lease)
            self._count_in_stats("kept_tensors", "kept_bytes", sum(m.layout.nbytes for m in members), count)
            return
        pack.layout = Layout((size,), (1,), torch.uint8, size, 1)
        pack.location, pack.write, pack.lease = location, job, lease
        pack.alias, pack.version = staging, staging._version
        for member in members:
            member.alias = None  # the staging copy holds the bytes now: the members' storages can go
        self._register(pack)
        self._count_transfer(size, sum(m.layout.nbytes for m in members), count)
        self._reap()

    def _all_stats(self) -> list[Stats]:
        """This session's stats and those of the regions around it, each once."""
        active = getattr(_ACTIVE, "stats", ())
        if len(active) == 1 and active[0] is self.stats:  # (the common case: the session's own region)
            return [self.stats]
        counted: list[Stats] = []
        for stats in [self.stats, *active]:
            if not any(stats is seen for seen in counted):
                counted.append(stats)
        return counted

    def _count_in_stats(self, tensors: str, nbytes: str, size: int, count: int = 1) -> None:
        """Count ``count`` tensors of ``size`` bytes in all in this session's stats and those of the regions around
        it."""
        for stats in self._all_stats():
            setattr(stats, tensors, getattr(stats, tensors) + count)
            setattr(stats, nbytes, getattr(stats, nbytes) + size)

    def _count_transfer(self, transfer: int, size: int, count: int) -> None:
        """Count one transfer of ``transfer`` bytes carrying ``count`` tensors of ``size`` bytes in all (the stats
        of this session and of the regions around it)."""
        for stats in self._all_stats():
            stats.tensors += count
            stats.bytes += size
            stats.transfers += 1
            stats.largest_transfer = max(stats.largest_transfer, transfer)

    def _wait_writes(self, count: int) -> None:
        for record in list(self._inflight)[:count]:
            record.write.wait()
        self._reap()

    def _reap(self) -> None:
        """Finish the writes that are done, oldest first: check versions, drop the storage references."""
        while self._inflight:
            record = self._inflight[0]
            behind = self._count - record.position > max(self.depth, 1)  # (unbounded targets: the allocator waits)
            if not (record.write.done or (behind and not record.target.bounded_writes)):
                break
            self._inflight.popleft()
            job, alias = record.write, record.alias
            record.write = record.alias = None
            if isinstance(record, _Pack) and record.lease is not None:
                if not job.done:  # (not reachable: CPU staging goes to the disk target, whose writes are bounded)
                    job.wait()
                self._staging.release(record.lease)
                record.lease = None
            if job.error is not None:
                record.poisoned = record.target.describe_error(job.error, f"writing {record.layout.nbytes} bytes")
                self.close(record.poisoned + "; the step's saved tensors are lost")
                raise FewBitError(record.poisoned + "; the step's saved tensors are lost")
            if alias._version != record.version:
                record.poisoned = _modified(record.layout)
            elif job.done and record.position in self._wanted and record.fetch is None and record.kept is None:
                self._wanted.discard(record.position)  # prefetch asked for it while it was being written
                record.fetch = record.target.read(record.location, record.layout.nbytes, sync=False)

    # -- backward -------------------------------------------------------------------------------------------------
    def unpack(self, packed: Any) -> torch.Tensor:
        task = _graph_task()
        if task != self._safe_point_task:  # the end of this backward pass is a safe point (see the module docstring)
            self._safe_point_task = task
            _queue_safe_point()
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _View):
            return self._unpack_view(packed)
        if isinstance(packed, _Member):
            return self._unpack_member(packed)
        record: _Record = packed
        if self._closed is not None:
            raise FewBitError(self._closed)
        self.sealed = True
        if self._freed_records:
            self._release_freed_records()
        if self._inflight:
            self._reap()
        if record.kept is not None:
            tensor = record.kept
        elif (
            record.write is None
            and record.fetch is None
            and record.poisoned is None
            and hasattr(record.target, "read_now")
        ):  # (nothing in memory or on its way: read synchronously, straight into the restored tensor)
            tensor, error = record.target.read_now(record.location, record.layout)
            if error is not None:  # (what _materialize does with a failed read job)
                raise FewBitError(record.target.describe_error(error, f"reading {record.layout.nbytes} bytes back"))
        else:
            tensor = restore(self._materialize(record), record.layout)
        record.served += 1
        record.kept = tensor if record.served % record.uses else None
        self._prefetch(record.position)
        return tensor

    def _unpack_view(self, view: _View) -> torch.Tensor:
        """The tensor of a :class:`_View`: its storage's record read back (once per backward pass for all the views
        of it: kept until each was served), viewed as the tensor autograd saved."""
        if self._closed is not None:
            raise FewBitError(self._closed)
        self.sealed = True
        if self._freed_records:
            self._release_freed_records()
        record = view.record
        if record.poisoned is not None:
            raise FewBitError(record.poisoned)
        base = record.kept
        if base is None:
            base, error = record.target.read_now(record.location, record.layout)
            if error is not None:
                raise FewBitError(record.target.describe_error(error, f"reading {record.layout.nbytes} bytes back"))
        record.served += 1
        record.kept = base if record.served % record.uses else None
        self._prefetch(record.position)
        layout = view.layout
        return with_flags(base.as_strided(layout.size, layout.stride, view.offset), layout)

    def _unpack_member(self, member: _Member) -> torch.Tensor:
        self._check_open()
        self.sealed = True
        self._release_freed_records()
        self._reap()
        if member.poisoned is not None:
            raise FewBitError(member.poisoned)
        if member.alias is not None:  # not flushed yet (backward inside the block), or kept in memory by the cap
            if member.alias._version != member.version:
                raise FewBitError(_modified(member.layout))
            return member.alias
        pack = member.pack
        if pack.kept is None:
            if pack.write is not None:  # still being written: a copy (the staging buffer goes back to its pool)
                pack.kept = _raw_of(pack).clone()
            else:
                pack.kept = self._materialize(pack)
            pack.remaining = pack.uses
        tensor = restore(pack.kept[member.offset : member.offset + member.layout.nbytes], member.layout)
        pack.remaining -= 1
        if pack.remaining <= 0:  # every member served: the views hold the bytes as long as autograd needs them
            pack.kept = None
        self._prefetch(pack.position)
        return tensor

    def _materialize(self, record: _Record) -> torch.Tensor:
        if record.write is not None:  # still being written: the storage is still here
            if record.alias._version != record.version:
                raise FewBitError(_modified(record.layout))
            return _raw_of(record)
        if record.poisoned is not None:
            raise FewBitError(record.poisoned)
        job, record.fetch = record.fetch, None
        if job is None:
            job = record.target.read(record.location, record.layout.nbytes, sync=True)
        job.wait()
        if job.error is not None:
            message = record.target.describe_error(job.error, f"reading {record.layout.nbytes} bytes back")
            raise FewBitError(message)
        return job.result

    def _prefetch(self, current: int) -> None:
        if current not in self._unpacked:
            self._unpacked.add(current)
            self.unpack_order.append(current)
        if self.depth <= 0:
            return
        records = self._alive_records()
        upcoming = schedule.upcoming_in_order(current, self._hint, self._hint_index, records, self.depth)
        fetching = [p for p, r in records.items() if r.fetch is not None]
        if upcoming is None:
            stale = schedule.stale_positions(current, fetching, self.depth)
        else:  # (unpacked before ``current`` in the previous step: passed; those still to come are kept)
            place = self._hint_index[current]
            stale = [p for p in fetching if self._hint_index.get(p, -1) < place and p not in upcoming]
        for position in stale:
            records[position].fetch = None
        resident = {p for p, r in records.items() if r.fetch is not None or r.kept is not None or r.write is not None}
        if upcoming is not None:
            candidates = [p for p in upcoming if p not in resident]
        else:
            candidates = schedule.prefetch_candidates(current, records.keys(), resident, self.depth)
        if self.blockwise:  # (see end_block: nothing is read ahead into another block's backward)
            block = records[current].block if current in records else None
            candidates = [p for p in candidates if records[p].block == block]
            upcoming = [p for p in upcoming if p in records and records[p].block == block] if upcoming else upcoming
        self._wanted = {p for p in (upcoming or ()) if p in records and records[p].write is not None}
        for position in candidates:
            record = records[position]
            if record.poisoned is None:
                record.fetch = record.target.read(record.location, record.layout.nbytes, sync=False)


def _raw_of(record: _Record) -> torch.Tensor:
    return raw_bytes(record.alias, record.layout) if record.layout.nbytes else torch.empty(0, dtype=torch.uint8)


def _modified(layout: Layout) -> str:
    return (
        f"a tensor of shape {list(layout.size)} saved for backward was modified in place while it was offloaded; "
        "autograd needs the saved value (without hooks it raises the same error)"
    )
