"""Exact accounting of memory: the bytes saved for the backward pass, and the peak of live tensor bytes.

Every tensor that autograd saves for backward goes through ``torch.autograd.graph.saved_tensors_hooks``;
this module counts those tensors' storages once each (told apart by identity, not by address), leaving out
parameters and, when a model is given, its buffers. Leaf tensors that require grad (parameters, or inputs the
caller created with ``requires_grad=True``) are left out too: the caller keeps them alive whether or not autograd
saves them, so they are not memory that backward costs. It is how memory claims are measured on a machine without
a GPU.

>>> import torch
>>> from fewbit_design.runtime import memory
>>> x = torch.randn(1000, requires_grad=True)
>>> with memory.saved_bytes() as m:
...     y = torch.sigmoid(x * 2)       # mul saves nothing of x's storage (x is a leaf), sigmoid saves its output
>>> m.total
4000

:func:`peak` is the other instrument: the peak of live tensor bytes over a region (forward and backward). On CPU
there is no allocator counter, so it watches every operator through a ``TorchDispatchMode``: an output whose
storage is new (not a storage of the operator's inputs, so views and in-place results do not count) is counted
once, with ``untyped_storage().nbytes()``, and uncounted when its storage is freed (a weak reference on the
storage, whose callback only queues it: no Python code runs while a storage is freed, so a Ctrl-C there is never
lost; the queue is read at the next operator and whenever ``live_bytes`` is read). ``peak_bytes`` is the largest
total of such storages alive at once, measured after each operator: the bytes allocated inside the region above
what was alive at entry. Memory an operator uses only while it runs (scratch space of a kernel) is not seen.
A tensor made outside the dispatcher over memory that is not the allocator's (offload's mapped reads: a view of the
offload file's pages, ``torch.frombuffer``) is counted when its maker calls :func:`count_storage`, as if an operator
had returned it.

Beside it, :func:`peak` reports the process's view on Linux: ``rss_peak_bytes``, the peak resident set size
(RSS) during the block above the RSS at entry. The kernel's high-water mark ``VmHWM`` (``/proc/self/status``) is
reset to the current RSS at entry by writing ``5`` to ``/proc/self/clear_refs`` (Linux 4.0 and later; nested
blocks fold the mark into the blocks around them before resetting it). It is larger than ``peak_bytes``: the
allocator keeps freed memory for reuse instead of returning it to the system (glibc's heap and arenas below its
mmap threshold; PyTorch's CUDA caching allocator on GPUs), pages touched once stay resident until unmapped, and
it counts what is not a tensor (Python objects, code, thread stacks, I/O buffers). It is ``None`` where the
system has no resettable mark (not Linux, or ``clear_refs`` not writable).

>>> with memory.peak() as p:
...     y = (x * 2).sum()
>>> p.peak_bytes                       # x * 2 (4000 bytes) and the sum (4 bytes) are alive together
4004
"""

from __future__ import annotations

import sys
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import FewBitError

__all__ = ["Peak", "SavedBytes", "count_storage", "peak", "saved_bytes", "storage_key"]


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """An identifier of the storage behind ``tensor`` while it is alive (device and base address; for a fake tensor,
    which has no address, the storage object's identity)."""
    storage = tensor.untyped_storage()
    if is_fake(tensor):
        return (f"fake {tensor.device}", id(storage))
    return (str(tensor.device), storage.data_ptr())


def _storage_nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().nbytes())


_Result = TypeVar("_Result")


class _OneRegion(AbstractContextManager, Generic[_Result]):
    """The object :func:`saved_bytes` and :func:`peak` return: it measures one ``with`` block. Entering it a second
    time (again after the block, or nested in its own block) raises :class:`FewBitError` instead of measuring
    something else; call the function again for a new block."""

    def __init__(self, name: str, region: AbstractContextManager[_Result]) -> None:
        self._name = name
        self._region: AbstractContextManager[_Result] | None = region
        self._entered: AbstractContextManager[_Result] | None = None

    def __enter__(self) -> _Result:
        region, self._region = self._region, None
        if region is None:
            raise FewBitError(
                f"a memory.{self._name}() object measures one with-block and was already entered; "
                f"call memory.{self._name}() again for another block"
            )
        self._entered = region
        return region.__enter__()

    def __exit__(self, *exc_info: Any) -> bool | None:
        assert self._entered is not None, "exit without enter"
        return self._entered.__exit__(*exc_info)


def _hooks_below() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The saved-tensor hooks active now (those a new pair of hooks hides), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(True) if top is not None else None


class _Storages:
    """Storages by identity, each with a number. A storage's Python object lives as long as the storage, and torch
    returns that same object for every tensor over it, so ``id`` tells storages apart while they are alive; a weak
    reference checks that a storage found under an ``id`` is still the one recorded, as a storage freed inside a
    block and a new one given its ``id`` (or its address, by the allocator) are two storages. Nothing is kept
    alive."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}

    def number(self, storage: torch.UntypedStorage | None) -> int | None:
        """The number ``storage`` was added with, or None (not added, or None)."""
        entry = self._by_id.get(id(storage)) if storage is not None else None
        return entry[1] if entry is not None and entry[0]() is storage else None

    def add(self, storage: torch.UntypedStorage, number: int) -> None:
        self._by_id[id(storage)] = (weakref.ref(storage), number)


@dataclass
class SavedBytes:
    """What :func:`saved_bytes` measured.

    Attributes:
        total: bytes of the distinct storages saved for backward (parameters and buffers excluded).
        by_module: bytes per module qualified name ("" is the model itself), attributed to the innermost module
            running when the tensor was saved; only filled when a model was given.
        tensors: number of distinct storages counted.
        exclusive_by_module: bytes per module name of the storages that module saved and no other module did: what
            replacing the module by one that saves nothing would free (a ReLU output that the next convolution also
            saves is not exclusive). Only filled when a model was given.
    """

    total: int = 0
    by_module: dict[str, int] = field(default_factory=dict)
    tensors: int = 0
    exclusive_by_module: dict[str, int] = field(default_factory=dict)
    # the counted storages are numbered 0, 1, ... in the order they were first saved
    _storages: _Storages = field(default_factory=_Storages, repr=False, compare=False)
    _seen: dict[int, int] = field(default_factory=dict, repr=False)  # number -> bytes
    _in_memory: set[int] = field(default_factory=set, repr=False)
    _savers: dict[int, set[str]] = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        return f"{self.total} bytes saved for backward in {self.tensors} storages"

    def _number(self, tensor: torch.Tensor) -> int | None:
        return self._storages.number(_storage_or_none(tensor))

    def _attribute(self, by_module: Mapping[str, int]) -> None:
        """Fill :attr:`by_module` and :attr:`exclusive_by_module` at the end of the block."""
        self.by_module = dict(by_module)
        exclusive: defaultdict[str, int] = defaultdict(int)
        for number, savers in self._savers.items():
            if len(savers) == 1:
                exclusive[next(iter(savers))] += self._seen[number]
        self.exclusive_by_module = dict(exclusive)

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether the storage behind ``tensor`` was counted as saved for backward."""
        return self._number(tensor) is not None

    def savers(self, tensor: torch.Tensor) -> frozenset[str]:
        """Qualified names of the modules that saved the storage behind ``tensor`` (the innermost module running at
        each save, "" outside every module); empty when it was not saved or no model was given.

        Args:
            tensor: any tensor of the storage
        """
        number = self._number(tensor)
        return frozenset(self._savers.get(number, ())) if number is not None else frozenset()

    def keeps(self, tensor: torch.Tensor) -> bool:
        """Whether the storage behind ``tensor`` was saved for backward and stays in memory: saved at least once
        without the hooks active below this block (those that were active when it was entered: an offload region,
        a checkpoint) packing it away. An offload region keeps a tensor under its ``min_bytes`` as it is, so
        ``keeps`` is true for it and false for what it offloaded; without hooks below, ``keeps`` is ``contains``."""
        return self._number(tensor) in self._in_memory


def saved_bytes(model: torch.nn.Module | None = None) -> AbstractContextManager[SavedBytes]:
    """Count the bytes saved for backward by everything run inside the block.

    Args:
        model: optional module; its parameters and buffers are excluded, and bytes are attributed to its
            submodules in ``by_module``.

    Each storage saved inside the block counts once, however many tensors over it are saved and by how many
    operators; storages are told apart by identity, not by address, so one freed inside the block (its graph
    dropped) and a new one the allocator puts at its address both count. Modules are found on the Python stack
    when a tensor is saved: the block adds no hook to the model or to torch's global module hooks, which would
    make a compiled model recompile (dynamo guards on them) and slow every later module call.

    The count is transparent: each saved tensor, once counted, goes on to the saved-tensor hooks that were active
    when the block was entered (an enclosing ``saved_bytes`` block, which counts it too, an offload region, a
    checkpoint), exactly as if this block were not there. So nested blocks each count everything saved inside them,
    and measuring inside an offloaded region does not stop the offloading. A block entered inside it that installs
    its own hooks (an offload region, a checkpointed segment) takes the tensors it packs out of sight: they are
    counted as what those hooks keep (nothing for an offload region, the inputs for a checkpoint).
    """
    return _OneRegion("saved_bytes", _saved_bytes(model))


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _running_module(names: dict[int, str]) -> str:
    """The name in ``names`` (``id(module)`` -> qualified name) of the innermost of those modules running now, ""
    when none: the innermost frame of ``Module._call_impl`` whose module is one of them. Code that dynamo compiled
    runs no such frame, so what a compiled region saves (when its graph returns) goes to the module that was
    running eagerly around it."""
    if torch.compiler.is_compiling():
        return ""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            name = names.get(id(frame.f_locals.get("self")))
            if name is not None:
                return name
        frame = frame.f_back
    return ""


@contextmanager
def _saved_bytes(model: torch.nn.Module | None) -> Iterator[SavedBytes]:
    result = SavedBytes()
    excluded = _Storages()
    names: dict[int, str] = {}
    by_module: defaultdict[str, int] = defaultdict(int)
    if model is not None:
        for tensor in list(model.parameters()) + list(model.buffers()):
            storage = _storage_or_none(tensor)
            if storage is not None:
                excluded.add(storage, 0)
        names = {id(module): name for name, module in model.named_modules()}

    def count(tensor: torch.Tensor, packed: Any = None) -> None:
        """Count ``tensor``; ``packed`` is what the hooks below made of it (it stays in memory when that is a
        tensor of the same storage)."""
        if isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
            return
        storage = _storage_or_none(tensor)  # None: a tensor without storage (functional wrappers)
        if storage is None or excluded.number(storage) is not None:
            return
        name = _running_module(names) if model is not None else ""
        number = result._storages.number(storage)
        if number is None:
            number = len(result._seen)
            result._storages.add(storage, number)
            result._seen[number] = nbytes = int(storage.nbytes())
            result.total += nbytes
            result.tensors += 1
            by_module[name] += nbytes
        if packed is tensor or (isinstance(packed, torch.Tensor) and _storage_or_none(packed) is storage):
            result._in_memory.add(number)
        if model is not None:
            result._savers.setdefault(number, set()).add(name)

    below = _hooks_below()
    if below is None:

        def pack(tensor: torch.Tensor) -> Any:
            count(tensor, tensor)
            return tensor

        def unpack(packed: Any) -> torch.Tensor:
            return packed

    else:
        pack_below, unpack = below

        def pack(tensor: torch.Tensor) -> Any:
            packed = pack_below(tensor)
            count(tensor, packed)
            return packed

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield result
    finally:
        if model is not None:
            result._attribute(by_module)


@dataclass
class Peak:
    """What :func:`peak` measured (read the attributes after the block, or inside it for the values so far).

    Attributes:
        peak_bytes: the largest number of bytes of tensor storages allocated inside the region and alive at once,
            measured after each operator (forward and backward alike). It is the peak above entry: storages alive
            at entry are not in it.
        baseline_bytes: bytes of the distinct storages of the tensors and modules (parameters, buffers, gradients)
            passed to :func:`peak`, i.e. what is known to be alive at entry; ``max_bytes = baseline_bytes +
            peak_bytes``.
        live_bytes: bytes allocated inside the region that are alive now (at exit: those that outlived it).
        allocated_bytes: bytes of all storages allocated inside the region, alive or not.
        timeline: ``(operator name, live bytes after it)`` for each operator, when asked for (for plots).
        cuda_peak_bytes: on CUDA, ``torch.cuda.max_memory_allocated()`` minus the allocated bytes at entry (the
            allocator's view, with caching and scratch space); ``None`` where CUDA is not in use.
        rss_peak_bytes: the process's peak resident set size during the block minus its RSS at entry (Linux; see
            the module docstring for why it exceeds ``peak_bytes``); ``None`` where it cannot be measured.
    """

    peak_bytes: int = 0
    baseline_bytes: int = 0
    allocated_bytes: int = 0
    timeline: list[tuple[str, int]] | None = None
    cuda_peak_bytes: int | None = None
    rss_peak_bytes: int | None = None
    _live_bytes: int = field(default=0, repr=False)
    _collect: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    @property
    def live_bytes(self) -> int:
        """Bytes allocated inside the region that are alive now (at exit: those that outlived it)."""
        if self._collect is not None:
            self._collect()
        return self._live_bytes

    @property
    def max_bytes(self) -> int:
        """``baseline_bytes + peak_bytes``: the known bytes alive at the peak."""
        return self.baseline_bytes + self.peak_bytes

    def reset_peak(self) -> None:
        """Restart the peak from the bytes alive now (like ``torch.cuda.reset_peak_memory_stats``)."""
        self.peak_bytes = self.live_bytes

    def __str__(self) -> str:
        return f"peak {self.peak_bytes} bytes above a baseline of {self.baseline_bytes} bytes"


class _StorageRef(weakref.ref):
    """A weak reference to a counted storage, with what to uncount when it is freed."""

    __slots__ = ("key", "nbytes")


class _PeakMode(TorchDispatchMode):
    """Counts the new storages that operators return, and forgets them when they are freed."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: torch.compile still compiles (and runs the compiled code) under this mode, which is off while
        compiling and on while the compiled code runs, so the operators it runs are the ones counted. (False, the
        default, makes dynamo skip every frame under the mode: a compiled model would run eagerly, and its peak
        would silently be the eager model's.)"""
        return True

    #: higher-order operators (``run_and_save_rng_state`` of a compiled checkpoint, ...) come here too: run as
    #: any operator, their new outputs counted (the operators inside them are not seen one by one)
    supports_higher_order_operators = True

    def __init__(self, result: Peak) -> None:
        super().__init__()
        self.result = result
        self.alive: dict[int, _StorageRef] = {}  # id(storage) -> its reference
        self.freed: deque[_StorageRef] = deque()  # appended to by the references' callback (C code)
        result._collect = self.collect

    def collect(self) -> None:
        """Uncount the storages freed since the last call (before any new storage can reuse their id)."""
        while self.freed:
            ref = self.freed.popleft()
            if self.alive.get(ref.key) is ref:
                del self.alive[ref.key]
                self.result._live_bytes -= ref.nbytes

    def close(self) -> None:
        self.collect()
        self.result._collect = None
        self.alive.clear()  # (the references die with it: their callbacks never run)
        self.freed.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.collect()
        inputs = None
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested, functional)
                continue
            if id(storage) in self.alive:
                continue
            if inputs is None:
                inputs = {id(_storage_or_none(t)) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if id(storage) in inputs:  # a view or an in-place result of an input: no new memory
                continue
            self.add(storage)
        self.note(str(func))
        return out

    def add(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` (new, not counted yet) until it is freed."""
        key, nbytes = id(storage), int(storage.nbytes())
        ref = _StorageRef(storage, self.freed.append)
        ref.key, ref.nbytes = key, nbytes
        self.alive[key] = ref
        self.result._live_bytes += nbytes
        self.result.allocated_bytes += nbytes

    def note(self, event: str) -> None:
        """Fold the live bytes into the peak (and the timeline) after ``event``."""
        result = self.result
        if result._live_bytes > result.peak_bytes:
            result.peak_bytes = result._live_bytes
        if result.timeline is not None:
            result.timeline.append((event, result._live_bytes))


_ACTIVE_PEAKS: list[_PeakMode] = []  # the peak() blocks open now, outermost first


def count_storage(tensor: torch.Tensor) -> None:
    """Count ``tensor``'s storage in every :func:`peak` block open now, as a new tensor an operator returned.

    For tensors made outside the dispatcher over memory that is not the allocator's, which no operator returns
    (offload's mapped reads: ``torch.frombuffer`` over the offload file's pages); counted once, uncounted when the
    storage is freed. A no-op when no block is open (the common case: one list check)."""
    if not _ACTIVE_PEAKS:
        return
    storage = tensor.untyped_storage()
    for mode in _ACTIVE_PEAKS:
        mode.collect()
        if id(storage) not in mode.alive:
            mode.add(storage)
            mode.note("count_storage")


_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_RSS_OPEN: list[list[int]] = []  # [rss at entry, highest mark seen] of the blocks measuring RSS, outermost first


def _status_bytes(field_name: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or None (not Linux, or no such field)."""
    try:
        with open(_STATUS, encoding="ascii") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _fold_rss_mark() -> None:
    """Fold the kernel's high-water mark into every open block (before a reset, and at each exit)."""
    mark = _status_bytes("VmHWM")
    if mark is not None:
        for entry in _RSS_OPEN:
            entry[1] = max(entry[1], mark)


def _start_rss() -> list[int] | None:
    """Reset the high-water mark to the current RSS and open a block; None where that is not possible."""
    _fold_rss_mark()
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return None
    rss = _status_bytes("VmRSS")
    if rss is None:
        return None
    entry = [rss, rss]
    _RSS_OPEN.append(entry)
    return entry


def _finish_rss(entry: list[int]) -> int:
    _fold_rss_mark()
    for index in range(len(_RSS_OPEN) - 1, -1, -1):
        if _RSS_OPEN[index] is entry:
            del _RSS_OPEN[index]
            break
    return max(entry[1] - entry[0], 0)


def _storage_or_none(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _baseline(objects: tuple[torch.Tensor | torch.nn.Module, ...]) -> int:
    sizes: dict[tuple[str, int], int] = {}
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            tensors = [t for p in obj.parameters() for t in (p, p.grad) if t is not None] + list(obj.buffers())
        elif isinstance(obj, torch.Tensor):
            tensors = [obj] if obj.grad is None else [obj, obj.grad]
        else:
            raise FewBitError(f"peak() takes tensors and modules alive at entry, got {type(obj).__name__}")
        for tensor in tensors:
            sizes[storage_key(tensor)] = _storage_nbytes(tensor)
    return sum(sizes.values())


def peak(*alive: torch.Tensor | torch.nn.Module, timeline: bool = False) -> AbstractContextManager[Peak]:
    """Measure the peak of live tensor bytes allocated inside the block, forward and backward.

    Args:
        alive: tensors and modules alive at entry (inputs, the model); only their bytes are reported, as
            ``baseline_bytes``: the peak is always measured above entry.
        timeline: also record the live bytes after every operator in ``timeline``.

    >>> import torch
    >>> from fewbit_design.runtime import memory
    >>> layer = torch.nn.Linear(100, 10, bias=False)
    >>> x = torch.randn(32, 100)
    >>> with memory.peak(layer, x) as p:
    ...     layer(x).sum().backward()
    >>> p.baseline_bytes, p.peak_bytes  # weight + x; in backward: loss, its ones gradient and the weight's gradient
    (16800, 4008)

    Blocks nest (each sees every operator run inside it); one object measures one block.
    """
    return _OneRegion("peak", _peak(alive, timeline))


@contextmanager
def _peak(alive: tuple[torch.Tensor | torch.nn.Module, ...], timeline: bool) -> Iterator[Peak]:
    result = Peak(baseline_bytes=_baseline(alive), timeline=[] if timeline else None)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_entry = torch.cuda.memory_allocated()
    mode = _PeakMode(result)
    rss = _start_rss()
    _ACTIVE_PEAKS.append(mode)
    try:
        with mode:
            yield result
    finally:
        _ACTIVE_PEAKS.remove(mode)
        mode.close()
        if rss is not None:
            result.rss_peak_bytes = _finish_rss(rss)
        if use_cuda:
            torch.cuda.synchronize()
            result.cuda_peak_bytes = int(torch.cuda.max_memory_allocated() - cuda_entry)
