"""Offloading chosen modules of a model: ``apply`` wraps their ``forward`` so each call runs inside an offload
region (one session per training step), and :class:`OffloadHandle` gives the stats and ``remove()``.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ...errors import FewBitError, close_matches
from .region import DEFAULT_MIN_BYTES, _Options, _Region
from .session import Session, Stats, storage_pointer

__all__ = ["apply", "OffloadHandle"]


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
            exclude = frozenset(pointer for pointer in map(storage_pointer, tensors) if pointer is not None)
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
    """What :func:`apply` returns: ``stats`` of the latest step, and ``remove()`` to restore the modules (and to
    close the idle file that the disk target keeps for the next step in its folder).

    Args:
        offloader: the object that holds the wrapped forwards (internal)
        modules: the modules whose forwards were wrapped
    """

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
        options = self._offloader.options
        options.staging.trim()  # the staging buffers kept for the next step
        if options.target != "cuda-host":  # the idle file kept for the next step in its folder (none will come)
            from .disk import empty_cache

            empty_cache(options.directory if options.directory is not None else tempfile.gettempdir())


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
    pack_bytes: int = 0,
    blockwise: bool = False,
) -> OffloadHandle:
    """Offload what the chosen modules save for backward, every time they run; the model's parameters and buffers
    stay. Options as in :func:`saved_tensors`; the folder is probed once here and at each step. With ``pack_bytes``
    each call of a chosen module is a block: the small tensors it saves go out in one transfer when it returns.

    Args:
        target: ``"auto"``, ``"disk"`` or ``"cuda-host"``, as in :func:`saved_tensors`
        min_bytes: smaller saved tensors stay where they are
        prefetch: transfers in flight each way (0: synchronous)
        max_host_bytes: a cap on what one step holds in pinned memory or in its file
        directory: the disk target's folder (default: the temporary folder)
        blockwise: each call of a chosen module is a block whose writes finish when it returns and whose backward
            prefetches only its own tensors (see :func:`saved_tensors`; the planner's setting)
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
    options = _Options(target, min_bytes, prefetch, max_host_bytes, directory, pack_bytes, blockwise)
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
