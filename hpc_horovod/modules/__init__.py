"""Lmod modulefiles for an installed hpc_horovod.

An administrator installs the package once into a Python environment and runs
``hpc-horovod module install --prefix /path/to/modulefiles``; users then only type
``module load horovod``. :class:`ModuleSpec` holds what goes into the file (and rejects what
could break out of a Lua string), :func:`render_modulefile` turns it into Lua,
:func:`install_modulefile` writes it as ``PREFIX/horovod/<version>.lua``.
"""

from .clusters import cluster_modules, known_clusters
from .modulefile import install_modulefile, render_modulefile
from .spec import ModuleSpec

__all__ = [
    "ModuleSpec",
    "cluster_modules",
    "install_modulefile",
    "known_clusters",
    "render_modulefile",
]
