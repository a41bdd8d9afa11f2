"""Regenerate the reference modulefile kept in the source tree: ``python -m
hpc_horovod.modules.reference [DIR]`` writes ``DIR/horovod/<version>.lua`` (DIR defaults to
``modulefiles``).

It shows what ``hpc-horovod module install`` writes for the usual layout, the package installed
with pip into its own environment under ``/opt/hpc_horovod/<version>``; a test checks that the
file in the tree is up to date with the template.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..version import __version__
from .modulefile import render_modulefile
from .spec import MODULE_NAME, ModuleSpec

REFERENCE_ENV = Path("/opt/hpc_horovod") / __version__


def reference_spec() -> ModuleSpec:
    """The module of a pip install into ``/opt/hpc_horovod/<version>``, no cluster modules."""
    return ModuleSpec(python_env=REFERENCE_ENV)


def write_reference(directory: str | Path) -> Path:
    target = Path(directory) / MODULE_NAME / f"{__version__}.lua"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_modulefile(reference_spec()), encoding="utf-8")
    return target


if __name__ == "__main__":
    print(write_reference(sys.argv[1] if len(sys.argv) > 1 else "modulefiles"))
