"""The ``fewbit-design`` command group and the options its command families share.

The bottom of the CLI: every command module (:mod:`.design`, :mod:`.tables`, :mod:`.snr`) registers its commands
on :data:`cli` from here, and :mod:`fewbit_design.cli` imports those modules. Imports go downward only.
"""

from __future__ import annotations

import click

from .._version import __version__
from ..design.weights import WEIGHT_KINDS

__all__ = ["PROG", "WEIGHT_KINDS", "cli", "weight_options"]

PROG = "fewbit-design"


def weight_options(function):
    """The weight options shared by every command that designs tables: --weight, --loc, --scale, --df, --samples,
    --range. Values are checked by :func:`fewbit_design.design.weights.make_weight` (one line naming the constraint)."""
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
