"""``hpc-horovod module install|render``: the Lmod module an administrator installs once."""

from __future__ import annotations

import argparse
import sys

from .clusters import known_clusters
from .modulefile import install_modulefile, render_modulefile
from .spec import DEFAULT_SETENV, MODULE_NAME, ModuleSpec, parse_setenv


def _spec(args) -> ModuleSpec:
    depends_on = None if args.depends_on is None else [
        name for name in args.depends_on.split(",") if name]
    return ModuleSpec.for_environment(args.python_env, cluster=args.cluster,
                                      version=args.version, depends_on=depends_on,
                                      setenv=parse_setenv(args.setenv))


def _render(args) -> int:
    sys.stdout.write(render_modulefile(_spec(args)))
    return 0


def _install(args) -> int:
    path = install_modulefile(_spec(args), args.prefix, force=args.force)
    version = path.stem
    print(f"installed {path}\nusers now run:  module use {args.prefix}; "
          f"module load {MODULE_NAME}/{version}")
    return 0


def _add_spec_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="generic", choices=known_clusters(),
                        help="cluster profile whose modules (CUDA, NCCL, MPI, Python) are "
                             "loaded with this one (default: generic, none)")
    parser.add_argument("--depends-on", metavar="MOD,MOD",
                        help="comma-separated modules to load with this one, instead of the "
                             "cluster's (site names: see `module avail`; '' for none)")
    parser.add_argument("--python-env", metavar="PATH",
                        help="prefix of the venv or conda env holding hpc_horovod "
                             f"(default: this one, {sys.prefix})")
    parser.add_argument("--version", help="module version (default: the package's)")
    defaults = ", ".join(f"{k}={v}" for k, v in DEFAULT_SETENV.items())
    parser.add_argument("--setenv", action="append", default=[], metavar="NAME=VALUE",
                        help=f"site default of a variable, repeatable (built in: {defaults})")


def register(sub) -> None:
    p = sub.add_parser("module", help="render or install the Lmod modulefile (module load horovod)",
                       description=__doc__)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True

    install = actions.add_parser("install", help="write PREFIX/horovod/<version>.lua")
    install.add_argument("--prefix", required=True, metavar="DIR",
                         help="module tree users add with `module use DIR`")
    install.add_argument("--force", action="store_true",
                         help="replace an existing file with other content")
    _add_spec_options(install)
    install.set_defaults(func=_install)

    render = actions.add_parser("render", help="print the modulefile to stdout")
    _add_spec_options(render)
    render.set_defaults(func=_render)
