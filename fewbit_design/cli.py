"""The ``fewbit-design`` command.

``fewbit-design ACTIVATION [options]`` designs one table (the default command); the named subcommands
(``list``, ``tables``, ``plot``, ``curves``, ``snr``) do the rest. Every user error prints one line on stderr,
``fewbit-design: error: ...``, and exits with status 2: no traceback and no partial output file.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from ._version import __version__
from .errors import FewBitError
from .weights import WEIGHT_KINDS

PROG = "fewbit-design"


def weight_options(function):
    """The weight options shared by every command that designs tables: --weight, --loc, --scale, --df, --samples,
    --range. Values are checked by :func:`fewbit_design.weights.make_weight` (one line naming the constraint)."""
    options = [
        click.option(
            "--weight",
            default="uniform",
            show_default=True,
            metavar="|".join(WEIGHT_KINDS),
            help="Weight w(x): the expected distribution of pre-activations.",
        ),
        click.option("--loc", type=float, default=None, help="Location of normal/laplace/student-t (default 0)."),
        click.option("--scale", type=float, default=None, help="Scale of normal/laplace/student-t (default 1)."),
        click.option("--df", type=float, default=None, help="Degrees of freedom of student-t."),
        click.option(
            "--samples",
            type=click.Path(dir_okay=False),
            default=None,
            help="A .npy file of recorded pre-activations (weight 'empirical').",
        ),
        click.option(
            "--range",
            "design_range",
            type=(float, float),
            default=(-10.0, 10.0),
            show_default=True,
            metavar="A B",
            help="Design range [A, B]; w = 0 outside.",
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


class _DefaultCommandGroup(click.Group):
    """A group whose first argument, when it is not a subcommand, is an activation for ``design``."""

    default_command = "design"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "ACTIVATION [OPTIONS] | COMMAND [ARGS]...")


@click.group(cls=_DefaultCommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name=PROG)
def cli() -> None:
    """Design optimal few-bit approximations of activation derivatives.

    \b
    Examples:
      fewbit-design gelu --bits 3 --weight normal
      fewbit-design silu --bits 4 --mode intervals --json | jq .error
      fewbit-design list
    """


def _fail(message: str) -> None:
    click.echo(f"{PROG}: error: {message}", err=True)
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: run the CLI, turning every user error into one line on stderr and exit status 2."""
    # Commands register themselves on import; importing here keeps `import fewbit_design.cli` cheap.
    from . import _commands  # noqa: F401

    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name=PROG, standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo(f"{PROG}: aborted", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        _fail(exc.format_message().replace("\n", " "))
    except FewBitError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        click.echo(f"{PROG}: interrupted", err=True)
        sys.exit(130)
    sys.exit(0)
