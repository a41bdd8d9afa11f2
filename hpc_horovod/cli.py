"""``hpc-horovod``: one entry point, one sub-command per job a user has.

Each sub-command lives in the module that does the work and registers itself through a
``register(subparsers)`` function; this file only assembles them.
"""

from __future__ import annotations

import argparse
import importlib
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    args = parser.parse_args(argv)
    return exit_status(f"hpc-horovod {args.subcommand}", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
