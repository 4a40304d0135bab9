"""Offload regions: the ``saved_tensors`` block, its options, and ``empty_cache``.

A region pushes one step's :class:`~.session.Session` hooks (pack/unpack) for the saved tensors of a ``with`` block;
:mod:`.modules` enters the same regions around chosen modules' forward. See :mod:`fewbit_design.runtime.offload` for
the targets and what stays in place.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ...errors import FewBitError, check_boolean, check_choice
from .session import Session, Staging, Stats, close_freed, pop_stats, push_stats

__all__ = ["saved_tensors", "empty_cache", "TARGETS", "DEFAULT_MIN_BYTES"]

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
        pack_bytes: int = 0,
        blockwise: bool = False,
    ) -> None:
        self.target = check_choice("offload target", target, TARGETS)
        self.min_bytes = _check_count("min_bytes", min_bytes)
        self.pack_bytes = _check_count("pack_bytes", pack_bytes)
        self.blockwise = check_boolean("offload blockwise", blockwise)
        self.staging = Staging()  # reused across the steps of these options (an apply(), a saved_tensors() block)
        self.prefetch = _check_count("prefetch", prefetch)
        self.max_host_bytes = _check_count("max_host_bytes", max_host_bytes, allow_none=True)
        if directory is not None and not isinstance(directory, str | os.PathLike):
            raise FewBitError(f"offload directory must be a path or None, got {directory!r}")
        self.directory = directory
        if target == "cuda-host" and not torch.cuda.is_available():
            raise FewBitError("offload target 'cuda-host' needs CUDA, but torch.cuda.is_available() is False")

    def __getstate__(self) -> dict[str, Any]:  # (pickled with an offloaded model: the buffers are not kept)
        return {k: v for k, v in self.__dict__.items() if k not in ("staging", "unpack_order")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.pack_bytes = state.get("pack_bytes", 0)
        self.blockwise = state.get("blockwise", False)
        self.staging = Staging()

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
        """The next step's session; it prefetches in the order the previous step's backward unpacked."""
        session = Session(
            self.make_target,
            min_bytes=self.min_bytes,
            depth=self.prefetch,
            probe=self._probe_devices(),
            exclude=exclude,
            pack_bytes=self.pack_bytes,
            staging=self.staging,
            order_hint=self.__dict__.get("unpack_order"),
            blockwise=self.blockwise,
        )
        self.unpack_order = session.unpack_order  # (the list it fills in backward)
        return session


def _never_compiled(hook: Any) -> Any:
    """``hook`` as a function that ``torch.compile`` never traces.

    Autograd calls the pack hook from whatever frame saves a tensor. Where ``torch.compile`` runs a model's code
    eagerly after a graph break (an offloaded block's forward always breaks: the region's ``with`` is Python
    state), its frame callback also catches the hook's own frame and dynamo compiles ``Session.pack`` as a
    graph: I/O, weak references and storage addresses guarded and re-traced per shape, and for some saved tensors
    (the memory-sharing norm's outputs) a graph that fails to compile (``tensor._base`` traced as a tensor, None
    when run: ``BackendCompilerFailed``). The hooks are plain Python by design; dynamo is only imported where
    something already compiles (so ``import fewbit_design.runtime`` stays lean).

    Not ``torch._dynamo.disable(hook)``: it builds a ``DisableContext`` (about 0.1 ms) per region entry,
    and each of its calls sets the frame callback three times and asks whether an export runs. Here the wrapper's
    own frame is skipped by dynamo (``skip_code``, as dynamo does for its non-recursive wrapper) and clears the
    callback for the hook's frames only where one is set (the check costs one C call)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return hook
    if not _skip_guard_frames():  # (a torch without skip_code: dynamo's own wrapper)
        return dynamo.disable(hook)
    return _guarded(hook)


def _guarded(hook: Any) -> Any:
    from torch._C._dynamo.eval_frame import set_eval_frame

    def guarded(argument: Any) -> Any:
        prior = set_eval_frame(None)  # (the callback that was set: None outside torch.compile)
        if prior is None:
            return hook(argument)
        try:
            return hook(argument)
        finally:
            set_eval_frame(prior)

    return guarded


_GUARD_SKIPPED: list[bool] = []  # [whether dynamo skips the frames of ``_guarded``'s wrapper], once known


def _skip_guard_frames() -> bool:
    if not _GUARD_SKIPPED:
        try:
            from torch._dynamo.eval_frame import skip_code

            skip_code(_guarded(None).__code__)  # (one code object for every wrapper)
            _GUARD_SKIPPED.append(True)
        except (ImportError, AttributeError):
            _GUARD_SKIPPED.append(False)
    return _GUARD_SKIPPED[0]


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
        hooks = torch.autograd.graph.saved_tensors_hooks(_never_compiled(session.pack), _never_compiled(session.unpack))
        push_stats(session.stats)
        session.enter_block()
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
        if exc_type is None:
            try:
                session.end_block()  # the block's pack of small tensors: one transfer (blockwise: writes done)
            except BaseException as error:
                session.close(f"the offload region failed to write its small tensors ({type(error).__name__})")
                raise
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
    pack_bytes: int = 0,
    blockwise: bool = False,
) -> _Region:
    """Offload the tensors that autograd saves inside the block; the ``with`` value is the step's :class:`Stats`.

    Args:
        target: ``"auto"`` (CUDA tensors to pinned host memory, CPU tensors to disk), ``"disk"`` or ``"cuda-host"``.
        min_bytes: tensors whose storage span is smaller stay where they are (default 1 MiB).
        pack_bytes: tensors from ``min_bytes`` up to (not including) ``pack_bytes`` are **packed**: the small tensors
            saved in one block go out together in one transfer, through one staging buffer, when the block ends
            (or when the pack reaches ``pack_bytes``), and come back together when backward first needs one of
            them; so the fixed cost of a transfer is paid once per block, and size is no floor (``min_bytes=0,
            pack_bytes=1 << 20`` offloads everything). Default 0: no packing, each tensor is its own transfer.
        prefetch: transfers in flight in each direction: writes behind forward, reads ahead of backward. 0 makes
            every transfer synchronous (``save_on_cpu``-style).
        max_host_bytes: cap on the bytes one step holds in pinned memory (CUDA: a process-wide pool per cap) or in
            its file (disk); tensors past it stay where they are. ``None``: no cap.
        directory: folder of the disk target's file (default: the system temporary folder). It is probed at entry:
            an unwritable or full folder raises :class:`FewBitError` before anything runs.
        blockwise: finish the block's writes when it ends and prefetch only within a block, so no transfer holds
            memory outside its block and the peak is at most ``prefetch`` transfers above the synchronous one
            (what the planner uses to predict peaks with ``prefetch > 0``). Default False.

    The step's file or pinned buffers are released once autograd frees the graph: at the end of the backward pass
    that frees it, or, for a graph dropped without backward (or after an error in backward), when the next step
    starts or :func:`empty_cache` runs; at once when the block raises (its graph can then not run backward). No
    Python code runs while autograd frees the graph, so a Ctrl-C is never lost there. Released files and pinned
    buffers are kept for the next step (unlinked files: at most two per folder and four in all, none for a folder
    that was removed); :func:`empty_cache` gives them back.

    Blocks nest: the innermost block offloads what is saved inside it; the stats of the blocks around it count it
    too. A block (the object) is entered once.
    """
    options = _Options(target, min_bytes, prefetch, max_host_bytes, directory, pack_bytes, blockwise)
    options.probe()
    return _Region(options=options)


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
