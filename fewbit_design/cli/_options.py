"""The ``fewbit-design`` command group and the options its command families share.

The bottom of the CLI: every command module (:mod:`.design`, :mod:`.tables`, :mod:`.snr`) registers its commands
on :data:`cli` from here, and :mod:`fewbit_design.cli` imports those modules. Imports go downward only.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import click

from .._version import __version__
from ..design.weights import WEIGHT_KINDS

__all__ = [
    "PROG",
    "WEIGHT_KINDS",
    "ActivationCommand",
    "Interrupted",
    "cli",
    "fold_name",
    "fold_option",
    "short_help",
    "weight_options",
]

PROG = "fewbit-design"


def fold_name(value: str | None, choices: tuple[str, ...]) -> str | None:
    """The choice that ``value`` names, ignoring case, surrounding spaces and ``_`` against ``-``
    (``Normal``, ``STUDENT_T``); ``value`` unchanged when it names none, so the caller's check quotes what was typed.

    >>> fold_name("Student_T", ("normal", "student-t"))
    'student-t'
    """
    if not isinstance(value, str):
        return value
    folded = {choice.lower().replace("_", "-"): choice for choice in choices}
    return folded.get(value.strip().lower().replace("_", "-"), value)


def fold_option(choices: tuple[str, ...]):
    """A click callback that folds an option's value onto ``choices`` with :func:`fold_name`."""

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        return fold_name(value, choices)

    return callback


def weight_options(function):
    """The weight options shared by every command that designs tables: --weight, --loc, --scale, --df, --samples,
    --range. Values are checked by :func:`fewbit_design.design.weights.make_weight` (one line naming the constraint)."""
    options = [
        click.option(
            "--weight",
            default="uniform",
            show_default=True,
            metavar="|".join(WEIGHT_KINDS),
            callback=fold_option(WEIGHT_KINDS),
            help="Weight w(x): the expected distribution of pre-activations (any case).",
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


class Interrupted(BaseException):
    """Ctrl-C in a command, carried past click (which answers a KeyboardInterrupt with a blank line on stderr) to
    :func:`fewbit_design.cli.main`, which prints the one line."""


class _DefaultCommandGroup(click.Group):
    """A group whose first argument, when it is not a subcommand, is an activation for ``design``."""

    default_command = "design"

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted from None

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "ACTIVATION [OPTIONS] | COMMAND [ARGS]...")

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [("ACTIVATION", "Design one table (the default; options: fewbit-design gelu --help).")]
        rows += _command_rows(self, ctx, formatter.width)
        with formatter.section("Commands"):
            formatter.write_dl(rows)


class ActivationCommand(click.Command):
    """The default command: its help and usage read ``fewbit-design ACTIVATION [OPTIONS]``, the way a user types it,
    not the name ``design`` it is registered under (which still works, and is hidden from the command list)."""

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        root = ctx.find_root().command_path
        formatter.write_usage(root, "ACTIVATION [OPTIONS]")
        formatter.write_usage(root, "--activation-module PKG.MOD:FN [OPTIONS]", prefix="   or: ")


def _command_rows(group: click.Group, ctx: click.Context, width: int) -> list[tuple[str, str]]:
    rows = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is not None and not command.hidden:
            rows.append((name, command.get_short_help_str(limit=max(width - 12 - len(name), 30))))
    return rows


def short_help(ctx: click.Context) -> str:
    """What a group given no arguments prints (``fewbit-design``, ``fewbit-design tables``): its usage line, the
    first paragraph of its help, and one line per command."""
    group = ctx.command
    formatter = ctx.make_formatter()
    group.format_usage(ctx, formatter)
    summary = inspect.cleandoc(group.help or "").split("\n\n")[0]
    if summary:
        formatter.write_paragraph()
        formatter.write_text(summary)
    if isinstance(group, click.Group):
        group.format_commands(ctx, formatter)
    formatter.write_paragraph()
    hint = f" or '{PROG} gelu --help' for the design options" if ctx.parent is None else ""
    formatter.write_text(f"Try '{ctx.command_path} --help' for more{hint}.")
    return formatter.getvalue().rstrip("\n")


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


def stage(message: str) -> None:
    """A stage of long work, as one line on stderr, only for a person watching a terminal (stdout and pipes stay
    clean: ``--json`` rows, logs)."""
    if sys.stderr.isatty():
        click.echo(f"  {message} ...", err=True)
