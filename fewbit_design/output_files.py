"""Output files: every file the project writes (tables, figures, CSV, plans) goes through :func:`write_files_atomic`
(:func:`write_bytes_atomic` for one file); a command checks all its outputs up front with :func:`check_outputs`.
:mod:`fewbit_design.table` re-exports these names.

* A symbolic link is written through: the file it points to is replaced (or created, for a dangling link), the
  link stays. The same as a shell's ``>``.
* An existing FIFO or character device (/dev/null, /dev/stdout) is written through in place, never replaced, and
  needs no --force (like a shell's ``set -o noclobber``); with no reader on a FIFO the write fails at once instead of
  blocking. Block devices, sockets and directories are refused.
* A regular file is written to a temporary file beside the target, then renamed over it: a reader sees the old file
  or the new one, never a partial file, and an interrupted write leaves neither the target changed nor a temporary
  file behind. Without force, the rename is a hard link of the temporary file, which fails if the target exists: of
  two concurrent writers exactly one succeeds, the other gets the "exists" error.
* The outputs of one command are written together, all or nothing: every temporary file is complete before the
  first rename, and Ctrl-C is held off during the renames.

This module needs only the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .errors import FewBitError

__all__ = ["check_writable", "check_outputs", "write_bytes_atomic", "write_files_atomic", "write_text_atomic"]


def _fail_output(path: str | os.PathLike, message: str) -> FewBitError:
    return FewBitError(f"output file {os.fspath(path)!r} {message}")


def _exists(path: str | os.PathLike) -> FewBitError:
    return _fail_output(path, "exists; pass --force (force=True) to overwrite it")


def _target(path: str | os.PathLike) -> Path:
    """The file a write to ``path`` changes: every symbolic link followed (a dangling link: the file it names)."""
    return Path(os.path.realpath(os.fspath(path)))


def _kind(mode: int) -> str | None:
    """What a non-regular file is, for messages (None for a regular file)."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def _name_max(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):  # pragma: no cover - platforms without pathconf
        return 255


def check_writable(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Check, before any work, that ``path`` can be written (and is new unless ``force``); returns ``Path(path)``.

    The rules are in this module's docstring: links are followed, FIFOs and character devices are
    written in place, directories, block devices and sockets are refused.
    """
    if not os.fspath(path):
        raise FewBitError("output file name is empty")
    if "\0" in os.fsdecode(path):
        raise _fail_output(path, "has a NUL character in its name")
    given = Path(path)
    target = _target(path)
    name_bytes = len(os.fsencode(target.name))
    if target.parent.is_dir() and name_bytes > _name_max(target.parent):
        raise _fail_output(path, f"has a name of {name_bytes} bytes; the file system allows {_name_max(target.parent)}")
    try:
        info = os.stat(target)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise _fail_output(path, f"cannot be checked: {exc.strerror or exc}") from None
    if info is not None:
        kind = _kind(info.st_mode)
        if kind == "a directory":
            raise FewBitError(f"output path {os.fspath(path)!r} is a directory; give a file name")
        if kind in ("a FIFO", "a character device"):
            if not os.access(target, os.W_OK):
                raise _fail_output(path, f"is {kind} that is not writable")
            return given  # written in place (write_bytes_atomic), never replaced
        if kind is not None:
            raise _fail_output(path, f"is {kind}; refusing to write a file onto it")
        if not force:
            raise _exists(path)
    parent = target.parent
    if not parent.is_dir():
        raise FewBitError(f"output directory {str(given.parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise FewBitError(f"output directory {str(parent)!r} is not writable")
    try:  # os.access says yes to root everywhere; a real probe also catches read-only and special filesystems
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise FewBitError(f"output directory {str(parent)!r} is not writable ({exc.strerror})") from None
    return given


def check_outputs(outputs: dict[str, str | os.PathLike | None], *, force: bool = False) -> dict[str, Path | None]:
    """Check every output of one command (option name -> path or None) with :func:`check_writable`, and that no two
    name the same file: compared after following links (and by inode for existing files, so hard links count).
    Character devices (``/dev/null``) may repeat. Returns option name -> ``Path`` (None where not given).

    >>> check_outputs({"--out": "a.png", "--csv": "./a.png"})
    Traceback (most recent call last):
    ...
    fewbit_design.errors.FewBitError: --out and --csv name the same file './a.png'; give different files

    Args:
        outputs: option name -> path (or None when not given)
        force: allow replacing existing files
    """
    checked: dict[str, Path | None] = {}
    seen: dict[Any, str] = {}
    for option, path in outputs.items():
        if path is None:
            checked[option] = None
            continue
        checked[option] = check_writable(path, force=force)
        target = _target(path)
        try:
            info = os.stat(target)
        except OSError:
            info = None
        if info is not None and stat.S_ISCHR(info.st_mode):
            continue
        keys = [("path", str(target))] + ([("inode", info.st_dev, info.st_ino)] if info is not None else [])
        for key in keys:
            if key in seen:
                raise FewBitError(
                    f"{seen[key]} and {option} name the same file {os.fspath(path)!r}; give different files"
                )
        for key in keys:
            seen[key] = option
    return checked


def _write_in_place(target: Path, path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` into an existing FIFO or character device without replacing it (no temporary file)."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise _fail_output(path, "is a FIFO with no reader") from None
        raise _fail_output(path, f"cannot be opened: {exc.strerror or exc}") from None
    try:
        os.set_blocking(fd, True)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        raise _fail_output(path, f"cannot be written: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, force: bool = False) -> Path:
    """Write ``data`` to ``path``: never a partial file, never an existing file replaced without ``force``.

    The rules are in this module's docstring. Returns ``Path(path)``.
    """
    return write_files_atomic({path: data}, force=force)[0]


def write_files_atomic(files: Mapping[str | os.PathLike, bytes], *, force: bool = False) -> list[Path]:
    """Write every file of ``files`` (path -> content) or none: the outputs of one command, all or nothing.

    Each file is written and synced to a temporary file beside it (FIFOs and character devices are then written in
    place); only when every one is complete are they given their names, with Ctrl-C held off meanwhile. A failure
    before that (a full disk, Ctrl-C, an unwritable FIFO) changes no file and leaves no temporary file; a name taken
    by another process in between removes the files this call had already created. The rules for each file are in
    this module's docstring.

    Args:
        files: path -> content; the paths must name different files (:func:`check_outputs` checks that up front)
        force: replace existing files

    Returns:
        ``Path(path)`` for each path, in order
    """
    given = [check_writable(path, force=force) for path in files]
    staged: list[tuple[str, Path, str | os.PathLike, bool]] = []  # (temporary, target, path, target existed)
    try:
        streams = []
        for path, data in files.items():
            target = _target(path)
            if _is_stream(target):
                streams.append((target, path, data))
            else:
                staged.append((_stage(target, path, data), target, path, os.path.lexists(target)))
        for target, path, data in streams:
            _write_in_place(target, path, data)
        with _interrupts_held():
            _rename_all(staged, force=force)
    finally:
        for tmp, *_ in staged:
            if os.path.lexists(tmp):
                os.unlink(tmp)
    return given


def _is_stream(target: Path) -> bool:
    """Whether ``target`` is an existing FIFO or character device (written in place, never replaced)."""
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def _stage(target: Path, path: str | os.PathLike, data: bytes) -> str:
    """``data`` written and synced to a new temporary file beside ``target``; returns its name (removed again if
    writing it fails)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:24]}.", suffix=".tmp", dir=target.parent)
        # mkstemp creates the file readable by its owner only; give it the permissions a plain open() would
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException as exc:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise FewBitError(f"cannot write {os.fspath(path)!r}: {exc.strerror or exc}") from None
        raise
    return tmp


def _rename_all(staged: list[tuple[str, Path, str | os.PathLike, bool]], *, force: bool) -> None:
    """Give every finished temporary file its name: the new files first, each of which may fail (the name taken
    meanwhile) and is then undone with the ones before it; then the replacements (``force``)."""
    created: list[Path] = []
    for tmp, target, path, existed in sorted(staged, key=lambda item: item[3]):
        try:
            if force:
                os.replace(tmp, target)
            else:
                _link_new(tmp, target, path)
        except OSError as exc:
            for done in created:
                os.unlink(done)
            if isinstance(exc, FileExistsError):
                raise _exists(path) from None
            raise FewBitError(f"cannot write {os.fspath(path)!r}: {exc.strerror or exc}") from None
        if not existed:
            created.append(target)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold a Ctrl-C off until the block ends, then raise its KeyboardInterrupt: a few renames must all happen or
    none. Only in the main thread and where SIGINT has Python's default handler (any other handler is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _link_new(tmp: str, target: Path, path: str | os.PathLike) -> None:
    """Give the finished temporary file the name ``target`` unless that exists (atomically: a hard link, which fails
    with FileExistsError if the name exists). The caller removes ``tmp``."""
    try:
        os.link(tmp, target)
        return
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
            raise
    # A file system without hard links: claim the name with an exclusive create, then rename over the claim.
    claim = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(claim)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.unlink(target)
        raise


def write_text_atomic(path: str | os.PathLike, text: str, *, force: bool = False) -> Path:
    """:func:`write_bytes_atomic` of ``text`` in UTF-8.

    Args:
        path: the file to write
        text: its content
        force: replace an existing file
    """
    return write_bytes_atomic(path, text.encode("utf-8"), force=force)
