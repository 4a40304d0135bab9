"""Activation offloading: saved tensors leave memory in forward and come back, prefetched, in backward.

Owns: the ``saved_tensors`` context manager, the module form ``apply``, the cost model ``cost``. May import torch,
the project's errors, and its own modules; never scipy, matplotlib, numba or the CLI. Layout of the package:

* ``schedule``: the ordering logic as pure functions (what to prefetch when, when a buffer may be reused, size
  classes); ``cost``: the planner's cost model; ``layout``: the bytes of a saved tensor and how to restore it.
* ``session``: the pack/unpack hooks of one step, driving a target; ``worker``: the background I/O thread.
* ``disk``: CPU tensors to a file (one per step); ``cuda``: CUDA tensors to pinned host buffers on side streams.

>>> import torch
>>> from fewbit_design.runtime import offload
>>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
>>> x = torch.randn(512, 256)
>>> with offload.saved_tensors(min_bytes=0) as stats:     # CPU tensors go to a file in the temp folder
...     loss = model(x).sum()
>>> loss.backward()                                        # read back (prefetched) during backward
>>> stats.tensors, stats.bytes      # x, and the ReLU output (saved by ReLU and the last Linear: one record)
(2, 1048576)

Targets: ``"disk"`` (CPU tensors), ``"cuda-host"`` (CUDA tensors, pinned host memory), ``"auto"`` (each tensor
to the target of its device). Tensors smaller than ``min_bytes``, parameters, leaf tensors that require grad and
views of them stay where they are; so do tensors past the ``max_host_bytes`` cap.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ...errors import FewBitError, check_choice, close_matches
from .cost import Cost, cost
from .session import Session, Stats, close_freed, pop_stats, push_stats

__all__ = ["saved_tensors", "apply", "cost", "Cost", "Stats", "OffloadHandle", "empty_cache", "TARGETS"]

TARGETS = ("auto", "disk", "cuda-host")
DEFAULT_MIN_BYTES = 1 << 20


def _check_count(name: str, value: object, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        extra = " or None" if allow_none else ""
        raise FewBitError(f"offload {name} must be an integer >= 0{extra}, got {value!r}")
    return value


class _Options:
    def __init__(
        self,
        target: str,
        min_bytes: int,
        prefetch: int,
        max_host_bytes: int | None,
        directory: str | os.PathLike | None,
    ) -> None:
        self.target = check_choice("offload target", target, TARGETS)
        self.min_bytes = _check_count("min_bytes", min_bytes)
        self.prefetch = _check_count("prefetch", prefetch)
        self.max_host_bytes = _check_count("max_host_bytes", max_host_bytes, allow_none=True)
        if directory is not None and not isinstance(directory, str | os.PathLike):
            raise FewBitError(f"offload directory must be a path or None, got {directory!r}")
        self.directory = directory
        if target == "cuda-host" and not torch.cuda.is_available():
            raise FewBitError("offload target 'cuda-host' needs CUDA, but torch.cuda.is_available() is False")

    def make_target(self, device: torch.device) -> Any:
        if device.type == "cpu" and self.target in ("auto", "disk"):
            from .disk import DiskTarget

            return DiskTarget(self.directory, capacity=self.max_host_bytes)
        if device.type == "cuda" and self.target in ("auto", "cuda-host"):
            from .cuda import CudaHostTarget, pinned_pool

            return CudaHostTarget(pinned_pool(self.max_host_bytes), device)
        return None

    def _probe_devices(self) -> tuple[torch.device, ...]:
        if self.target == "disk" or (self.target == "auto" and not torch.cuda.is_available()):
            return (torch.device("cpu"),)
        if self.target == "cuda-host":
            return (torch.device("cuda", torch.cuda.current_device()),)
        return ()

    def probe(self) -> None:
        """Make the targets a step will use and close them again: a bad folder fails here, and the file goes to
        the pool of idle files, where the first step takes it."""
        close_freed()  # a safe point (see .session)
        for device in self._probe_devices():
            target = self.make_target(device)
            if target is not None:
                target.close()

    def session(self, exclude: frozenset[int] = frozenset()) -> Session:
        return Session(
            self.make_target,
            min_bytes=self.min_bytes,
            depth=self.prefetch,
            probe=self._probe_devices(),
            exclude=exclude,
        )


def _top_hooks() -> tuple[Any, Any] | None:
    """The saved-tensor hooks on top of this thread's stack (pack, unpack), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(True) if top is not None else None


class _Region:
    """The ``with`` block of :func:`saved_tensors` (or one module call under :func:`apply`).

    Regions nest: the innermost one offloads what is saved inside it, and the stats of every region around it
    count those tensors too (so an outer block reports everything offloaded inside it)."""

    def __init__(self, session: Session | None = None, options: _Options | None = None) -> None:
        self._session = session  # (None: made at entry from ``options``, so a block never entered holds nothing)
        self._options = options
        self._entered = False
        self._hooks: Any = None

    def __enter__(self) -> Stats:
        if self._entered:
            raise FewBitError(
                "an offload.saved_tensors() block is entered once (it is one step's session); "
                "call offload.saved_tensors() again for another block"
            )
        self._entered = True
        if self._session is None:
            assert self._options is not None, "a region has a session or the options to make one"
            self._session = self._options.session()
        session = self._session
        hooks = torch.autograd.graph.saved_tensors_hooks(session.pack, session.unpack)
        push_stats(session.stats)
        try:
            hooks.__enter__()
        except BaseException:  # (a Ctrl-C right after the push): leave no hooks behind that nobody pops
            if _top_hooks() == (hooks.pack_hook, hooks.unpack_hook):
                hooks.__exit__(None, None, None)
            pop_stats(session.stats)
            self._session = None
            raise
        self._hooks = hooks
        return session.stats

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        pop_stats(session.stats)
        if self._hooks is not None:
            self._hooks.__exit__(exc_type, exc, traceback)
            self._hooks = None
        if exc_type is not None:
            session.close(f"the offload region exited with {exc_type.__name__}: its saved tensors were discarded")
        elif not session.packed:  # nothing was saved inside: no backward will ever use the session
            session.close("the offload region saved nothing")
        del session
        close_freed()  # a safe point: the session is freed now if its backward already ran inside the block


def saved_tensors(
    *,
    target: str = "auto",
    min_bytes: int = DEFAULT_MIN_BYTES,
    prefetch: int = 2,
    max_host_bytes: int | None = None,
    directory: str | os.PathLike | None = None,
) -> _Region:
    """Offload the tensors that autograd saves inside the block; the ``with`` value is the step's :class:`Stats`.

    Args:
        target: ``"auto"`` (CUDA tensors to pinned host memory, CPU tensors to disk), ``"disk"`` or ``"cuda-host"``.
        min_bytes: tensors whose storage span is smaller stay where they are (default 1 MiB).
        prefetch: transfers in flight in each direction: writes behind forward, reads ahead of backward. 0 makes
            every transfer synchronous (``save_on_cpu``-style).
        max_host_bytes: cap on the bytes one step holds in pinned memory (CUDA: a process-wide pool per cap) or in
            its file (disk); tensors past it stay where they are. ``None``: no cap.
        directory: folder of the disk target's file (default: the system temporary folder). It is probed at entry:
            an unwritable or full folder raises :class:`FewBitError` before anything runs.

    The step's file or pinned buffers are released once autograd frees the graph: at the end of the backward pass
    that frees it, or, for a graph dropped without backward (or after an error in backward), when the next step
    starts or :func:`empty_cache` runs; at once when the block raises (its graph can then not run backward). No
    Python code runs while autograd frees the graph, so a Ctrl-C is never lost there. Released files and pinned
    buffers are kept for the next step (unlinked files: at most two per folder and four in all, none for a folder
    that was removed); :func:`empty_cache` gives them back.

    Blocks nest: the innermost block offloads what is saved inside it; the stats of the blocks around it count it
    too. A block (the object) is entered once.
    """
    options = _Options(target, min_bytes, prefetch, max_host_bytes, directory)
    options.probe()
    return _Region(options=options)


class _ModuleOffloader:
    """One :func:`apply`: regions entered around the selected modules' forward, one session per step (a forward
    after the previous step's backward started begins a new one)."""

    def __init__(self, options: _Options, model: torch.nn.Module | None) -> None:
        self.options = options
        self._model = weakref.ref(model) if model is not None else _no_model
        self._session: weakref.ref[Session] | None = None
        self._regions: list[_Region | None] = []
        self.stats = Stats()  # zeros until the first step

    def __reduce__(self) -> tuple:
        """Pickling (``torch.save`` of the model) keeps the options and the model, not the hooks' state: the
        loaded model is offloaded the same way, from a fresh step."""
        return (_ModuleOffloader, (self.options, self._model()))

    def __deepcopy__(self, memo: dict) -> _ModuleOffloader:
        copy = _ModuleOffloader.__new__(_ModuleOffloader)
        model = self._model()
        copied = memo.get(id(model), model) if model is not None else None  # the copy of the model, if made
        copy._model = weakref.ref(copied) if copied is not None else self._model
        copy.options, copy._session, copy._regions, copy.stats = self.options, None, [], Stats()
        return copy

    def enter(self) -> None:
        if not torch.is_grad_enabled():  # nothing will be saved (evaluation): no file, no probe
            self._regions.append(None)
            return
        session = self._session() if self._session is not None else None
        if session is None or session.sealed or session._closed is not None:
            model = self._model()
            tensors = [] if model is None else [*model.parameters(), *model.buffers()]
            exclude = frozenset(t.untyped_storage().data_ptr() for t in tensors)
            session = self.options.session(exclude)
            self._session = weakref.ref(session)
            self.stats = session.stats
        region = _Region(session)
        self._regions.append(region)  # (first: the caller's exit pops it even if entering is interrupted)
        region.__enter__()

    def exit(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        region = self._regions.pop()
        if region is not None:
            region.__exit__(exc_type, exc, traceback)


def _no_model() -> None:
    return None


class _OffloadedForward:
    """The forward of a module under :func:`apply` (a plain object, so ``copy.deepcopy`` and pickling of the model
    work)."""

    def __init__(self, forward: Any, offloader: _ModuleOffloader) -> None:
        self.forward = forward
        self.offloader = offloader

    def __reduce__(self) -> tuple:
        owner = getattr(self.forward, "__self__", None)
        function = getattr(self.forward, "__func__", None)
        if isinstance(owner, torch.nn.Module) and function is getattr(type(owner), "forward", None):
            # the class's own forward: rebuilt from the class, never looked up on the instance (whose ``forward``
            # is this object)
            return (_class_forward, (owner, self.offloader))
        return (_OffloadedForward, (self.forward, self.offloader))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        depth = len(self.offloader._regions)
        try:
            self.offloader.enter()
            result = self.forward(*args, **kwargs)
        except BaseException as error:
            if len(self.offloader._regions) > depth:  # (entered, or interrupted while entering)
                self.offloader.exit(type(error), error, error.__traceback__)
            raise
        self.offloader.exit(None, None, None)
        return result


def _class_forward(module: torch.nn.Module, offloader: _ModuleOffloader) -> _OffloadedForward:
    return _OffloadedForward(type(module).forward.__get__(module), offloader)


class OffloadHandle:
    """What :func:`apply` returns: ``stats`` of the latest step, and ``remove()`` to restore the modules."""

    def __init__(self, offloader: _ModuleOffloader, modules: list[torch.nn.Module]) -> None:
        self._offloader = offloader
        self._modules = modules

    @property
    def stats(self) -> Stats:
        """What the latest step offloaded (zeros before the first step)."""
        return self._offloader.stats

    def remove(self) -> None:
        for module in self._modules:
            wrapper = module.__dict__.get("forward")
            if isinstance(wrapper, _OffloadedForward) and wrapper.offloader is self._offloader:
                if getattr(wrapper.forward, "__self__", None) is module:
                    del module.forward
                else:
                    module.forward = wrapper.forward
        self._modules = []


def _select(model: torch.nn.Module, modules: Any) -> list[torch.nn.Module]:
    if modules is None:
        return [model]
    if isinstance(modules, str | type | torch.nn.Module):
        modules = [modules]
    named = dict(model.named_modules())
    chosen: list[torch.nn.Module] = []
    for item in modules if isinstance(modules, Iterable) else [modules]:
        if isinstance(item, str):
            if item not in named:
                hint = close_matches(item, [n for n in named if n])
                suffix = f"; did you mean {', '.join(map(repr, hint))}?" if hint else ""
                raise FewBitError(f"offload modules: the model has no submodule {item!r}{suffix}")
            found = [named[item]]
        elif isinstance(item, type) and issubclass(item, torch.nn.Module):
            found = [m for m in named.values() if isinstance(m, item)]
            if not found:
                raise FewBitError(f"offload modules: the model has no {item.__name__} submodule")
        elif isinstance(item, torch.nn.Module):
            if not any(m is item for m in named.values()):
                raise FewBitError(f"offload modules: {type(item).__name__} object is not part of the model")
            found = [item]
        else:
            raise FewBitError(f"offload modules must be submodules, qualified names or module classes, got {item!r}")
        chosen.extend(m for m in found if not any(m is c for c in chosen))
    return chosen


def apply(
    model: torch.nn.Module,
    modules: Any = None,
    *,
    target: str = "auto",
    min_bytes: int = DEFAULT_MIN_BYTES,
    prefetch: int = 2,
    max_host_bytes: int | None = None,
    directory: str | os.PathLike | None = None,
) -> OffloadHandle:
    """Offload what the chosen modules save for backward, every time they run; the model's parameters and buffers
    stay. Options as in :func:`saved_tensors`; the folder is probed once here and at each step.

    Args:
        model: the model; changed in place (each chosen module's ``forward`` is wrapped).
        modules: ``None`` (the whole model), or submodules, qualified names (``"encoder.layers.0"``) or module
            classes (every submodule of that class), alone or in a list.

    >>> import torch
    >>> from fewbit_design.runtime import offload
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    >>> handle = offload.apply(model, [torch.nn.Tanh], min_bytes=0)
    >>> model(torch.randn(32, 64)).sum().backward()
    >>> handle.stats.tensors
    1
    >>> handle.remove()
    """
    options = _Options(target, min_bytes, prefetch, max_host_bytes, directory)
    if options.target == "disk" or (options.target == "auto" and not torch.cuda.is_available()):
        options.probe()  # a bad folder fails now, before training starts
    offloader = _ModuleOffloader(options, model)
    chosen = _select(model, modules)
    for module in chosen:
        if isinstance(module.__dict__.get("forward"), _OffloadedForward):
            raise FewBitError(f"offload.apply: {type(module).__name__} module is already offloaded")
    for module in chosen:
        module.forward = _OffloadedForward(module.forward, offloader)
    return OffloadHandle(offloader, chosen)


def empty_cache() -> int:
    """Release what is kept for reuse between steps: the idle step files of the disk target (their space returns
    to the file system) and the idle pinned buffers of the CUDA target. Returns the bytes released."""
    from .disk import empty_cache as _empty_files

    close_freed()  # steps whose graph was freed outside a backward pass give their files back first
    released = _empty_files()
    if torch.cuda.is_available():
        from .cuda import empty_cache as _empty_pinned

        released += _empty_pinned()
    return released
