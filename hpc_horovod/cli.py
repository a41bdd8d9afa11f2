"""``hpc-horovod``: one entry point, one sub-command per job a user has.

Each sub-command lives in the module that does the work and registers itself through a
``register(subparsers)`` function; this file only assembles them. No option may be abbreviated
(``--gpus`` must never be read as ``--gpus-per-node``): every parser of the tree is a
:class:`Parser`, whose unknown options are refused with the nearest known spellings.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys

from .launch import exit_status
from .version import __version__

#: modules that provide sub-commands, in the order ``--help`` lists them
COMMAND_MODULES = (
    "hpc_horovod.launch",  # run
    "hpc_horovod.check_build",  # check-build
    "hpc_horovod.timeline_plot",  # timeline
    "hpc_horovod.modules.cli",  # module
    "hpc_horovod.notebooks_cli",  # notebooks
    "hpc_horovod.slurm.cli",  # sbatch, doctor
)


#: a reST role (``:func:`~a.b.c```), a literal (````x````) or interpreted text (```x```)
_REST = re.compile(r":[a-z]+:`(~?)([^`]+)`|``([^`]+)``|`([^`]+)`")


def _plain_match(match: re.Match) -> str:
    tilde, target, literal, text = match.groups()
    if target is not None:
        return target.rsplit(".", 1)[-1] if tilde else target
    return literal if literal is not None else text


def plain(text: str) -> str:
    """``text`` with its reST markup as a terminal shows it: ````srun hpc-horovod doctor````
    becomes srun hpc-horovod doctor, ``:func:`~hpc_horovod.slurm.submit``` becomes submit.

    The help texts come from docstrings written for Sphinx; a terminal would show their
    backticks and roles as they are."""
    return _REST.sub(_plain_match, text)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes no abbreviation of a long option, for itself and for
    every sub-command parser made from it (``add_subparsers`` makes parsers of its class), and
    whose help shows the docstrings it is made from without their reST markup
    (:func:`plain`)."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        return plain(super().format_help())

    def error(self, message: str):
        """A refusal of the command line: the one line that says what is wrong, and where the
        options are listed (argparse would print the whole usage block first)."""
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists the options)\n")


def _parser_for(parser: argparse.ArgumentParser, args: argparse.Namespace
                ) -> argparse.ArgumentParser:
    """The innermost sub-command parser that ``args`` went through."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                return _parser_for(action.choices[chosen], args)
    return parser


def unknown_options_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """``unrecognized arguments: --gpu 2``, with the known options nearest to each unknown one."""
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    hints = []
    for word in extras:
        if word.startswith("-"):
            name = word.split("=", 1)[0]
            near = sorted((s for s in known if s.startswith(name)), key=len)[:3] or \
                difflib.get_close_matches(name, known, n=3, cutoff=0.75)
            if near:
                hints.append(f"{name}: did you mean {' or '.join(near)}?")
    return f"unrecognized arguments: {' '.join(extras)}" + "".join(f"\n  {h}" for h in hints)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="hpc-horovod",
        description="Data-parallel training on SLURM clusters, Horovod style.",
    )
    parser.add_argument("--version", action="version", version=f"hpc_horovod {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extras = parser.parse_known_args(argv)
    args.argv = argv  # what the user typed, so that a refusal names an option as it was written
    if extras:
        inner = _parser_for(parser, args)
        inner.error(unknown_options_message(inner, extras))
    return exit_status(f"hpc-horovod {args.subcommand}", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
