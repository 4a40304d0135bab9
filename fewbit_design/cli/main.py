"""The ``fewbit-design`` command's entry point (:func:`main`; :mod:`fewbit_design.cli` re-exports it).

``fewbit-design ACTIVATION [options]`` designs one table (the default command); the named subcommands
(``list``, ``tables``, ``plot``, ``curves``, ``snr``) do the rest. Every user error prints one line on stderr,
``fewbit-design: error: ...``, and exits with status 2: no traceback and no partial output file.

Layout (imports go downward only): :mod:`._options` holds the group and the shared options; one module per
command family registers its commands on the group (:mod:`.design`: design and list; :mod:`.tables`: tables,
plot, curves; :mod:`.snr`: snr; :mod:`.memory`: memory); this module imports them inside :func:`main` (its own
module level loads the standard library only, so that Ctrl-C is handled from the start) and runs the group. The CLI
may import everything below it (the design math, tables, plots, and the runtime lazily, inside a command); nothing
imports the CLI.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import FewBitError

__all__ = ["main", "for_shell", "commands"]

# Module level imports the standard library only: click, numpy and the command modules load inside main(), once its
# Ctrl-C handler is in place (see _interrupt_exits). The program name is _options.PROG, which imports click.
_INTERRUPTED = b"fewbit-design: interrupted\n"


def commands() -> Any:
    """The ``fewbit-design`` click group with every command registered (this imports click, numpy and the command
    modules)."""
    from . import design, memory, snr, tables  # noqa: F401  (each registers its commands on the group)
    from ._options import cli

    return cli


def __getattr__(name: str) -> Any:
    if name == "cli":  # the group, loaded on first use like the commands it holds
        return commands()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fail(message: str) -> None:
    import click

    from ._options import PROG

    click.echo(f"{PROG}: error: {message}", err=True)
    sys.exit(2)


def for_shell(message: str) -> str:
    """A library message said to a shell user: Python keyword spellings become the command's options.

    >>> for_shell("output file 'a.json' exists; pass --force (force=True) to overwrite it")
    "output file 'a.json' exists; pass --force to overwrite it"
    """
    message = message.replace("--force (force=True)", "--force")
    return re.sub(r"(?<![-\w])force=True\b", "--force", message)


#: optional dependencies a command may need -> how to install them (one line instead of an import traceback)
_INSTALL = {
    "torch": "bash scripts/setup.sh (the build for this machine), or pip install 'fewbit-design[runtime]'",
    "transformers": "pip install 'fewbit-design[models]'",
}


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: run the CLI, turning every user error into one line on stderr and exit status 2, and
    Ctrl-C (from the first moment, while the modules import) into one line and exit status 130.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``)
    """
    try:
        with _interrupt_exits():
            group = commands()
    except KeyboardInterrupt:  # Ctrl-C in the first lines, before the handler of _interrupt_exits was installed
        _interrupted()
    import click

    from ._options import PROG, Interrupted, short_help

    try:
        with _interrupts_kept():
            group.main(args=list(argv) if argv is not None else None, prog_name=PROG, standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):  # click turns Ctrl-C into Abort: exit as interrupted
            _interrupted()
        click.echo(f"{PROG}: aborted", err=True)
        sys.exit(1)
    except click.exceptions.NoArgsIsHelpError as exc:  # bare `fewbit-design`: a short help, not a one-line error
        click.echo(short_help(exc.ctx) if exc.ctx is not None else exc.format_message(), err=True)
        sys.exit(2)
    except click.ClickException as exc:
        _fail(exc.format_message().replace("\n", " "))
    except FewBitError as exc:
        _fail(for_shell(str(exc)))
    except ModuleNotFoundError as exc:  # an optional dependency the command needs (torch, transformers, ...)
        if exc.name not in _INSTALL:
            raise
        _fail(f"this command needs {exc.name}, which is not installed here: {_INSTALL[exc.name]}")
    except (KeyboardInterrupt, Interrupted):
        _interrupted()
    sys.exit(0)


@contextlib.contextmanager
def _interrupt_exits() -> Iterator[None]:
    """While the command's modules import (click, numpy, the commands: up to a second on a cold start), Ctrl-C ends
    the process at once: one line and exit status 130. A KeyboardInterrupt raised there would surface from deep in
    an import, or be lost in a library's ``except BaseException``; nothing is written yet, so there is nothing to
    clean up. Only in the main thread, and only where SIGINT has Python's default handler (an ignored SIGINT, as in a
    background job, stays ignored)."""
    installed = False
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        with contextlib.suppress(ValueError):  # ValueError: not the main thread, whose signals are not ours
            signal.signal(signal.SIGINT, _exit_interrupted)
            installed = True
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _exit_interrupted(signum: int, frame: Any) -> None:
    os.write(2, _interrupted_line(os.isatty(2)))
    os._exit(130)


def _interrupted_line(terminal: bool) -> bytes:
    """The one line of Ctrl-C; on a terminal after a line break, which ends the ``^C`` the terminal echoed."""
    return (b"\n" if terminal else b"") + _INTERRUPTED


@contextlib.contextmanager
def _interrupts_kept():
    """Keep a Ctrl-C that Python would swallow. Its KeyboardInterrupt is raised wherever the main thread runs Python
    code next, which may be a finalizer (``__del__``, a weakref callback); there it is "ignored" and the command ran
    on. While the command runs, such a KeyboardInterrupt is delivered to the main thread again, until it lands in
    ordinary code and stops the command."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_type, type) and issubclass(unraisable.exc_type, KeyboardInterrupt):
            # From another thread, a moment later: raised here, in the hook, it would be swallowed again.
            _thread.start_new_thread(_interrupt_main_soon, ())
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _interrupt_main_soon() -> None:
    time.sleep(0.02)
    _thread.interrupt_main()


def _interrupted() -> None:
    """Ctrl-C: one line and exit status 130. Clean-up has run on the way here (temporary files, worker processes);
    a further Ctrl-C while exiting is ignored rather than printed as a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import click

    click.echo(_interrupted_line(sys.stderr.isatty()).decode(), err=True, nl=False)
    sys.exit(130)
