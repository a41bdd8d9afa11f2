"""Build of the optional extension ``hpc_horovod._native`` (src_native/), and the copy of the
top-level ``slurm_templates/`` and ``notebooks/`` into the package; metadata is in setup.cfg.

Those two folders are the single source of the job templates, cluster profiles and example
notebooks; ``build_py`` copies them into ``hpc_horovod/`` of a built wheel, where
``hpc_horovod.shipped`` finds them (a source checkout reads them where they are).

The extension needs a C compiler, numpy's headers (a build requirement) and an MPI library with
its headers (found through the ``mpicc`` wrapper, or ``$MPICC``). Without them the package
installs without it and reduces float16/bfloat16 in float32 instead: slower, same API.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

SOURCES = sorted(str(p) for p in Path("src_native").glob("*.c"))


def _run(argv: list[str]) -> list[str] | None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return shlex.split(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None


def mpi_flags() -> dict[str, list[str]] | None:
    """Include/library flags of the MPI behind ``mpicc``: Open MPI's ``--showme:compile`` and
    ``--showme:link``, else MPICH's ``-show``. None when there is no MPI wrapper."""
    mpicc = shutil.which(os.environ.get("MPICC", "mpicc"))
    if mpicc is None:
        return None
    compile_args, link_args = _run([mpicc, "--showme:compile"]), _run([mpicc, "--showme:link"])
    if compile_args is None or link_args is None:
        shown = _run([mpicc, "-show"])
        if shown is None:
            return None
        compile_args = link_args = shown[1:]
    flags: dict[str, list[str]] = {"include_dirs": [], "library_dirs": [], "libraries": [],
                                   "extra_link_args": []}
    for arg in compile_args:
        if arg.startswith("-I"):
            flags["include_dirs"].append(arg[2:])
    for arg in link_args:
        if arg.startswith("-L"):
            flags["library_dirs"].append(arg[2:])
        elif arg.startswith("-l"):
            flags["libraries"].append(arg[2:])
        elif arg.startswith("-Wl,"):
            flags["extra_link_args"].append(arg)
    if "mpi" not in flags["libraries"]:
        return None
    flags["runtime_library_dirs"] = list(flags["library_dirs"])
    return flags


def native_extensions() -> list[Extension]:
    flags = mpi_flags()
    try:
        import numpy
    except ImportError:
        numpy = None
    if flags is None or numpy is None or not SOURCES:
        print(f"hpc_horovod: no {'mpicc' if flags is None else 'numpy'} found, building without "
              "the native extension (float16/bfloat16 sums go through float32)")
        return []
    flags["include_dirs"].append(numpy.get_include())
    return [Extension(
        "hpc_horovod._native",
        sources=SOURCES,
        depends=[str(p) for p in Path("src_native").glob("*.h")],
        extra_compile_args=["-O3", "-std=c11", "-fno-fast-math"],
        optional=True,  # a failed compile (no compiler, no mpi.h) skips it, never the install
        **flags,
    )]


#: the top-level folders a wheel carries inside the package, with the files of each
SHIPPED = {"slurm_templates": ("*.j2", "profiles/*.toml"), "notebooks": ("*.ipynb",)}


class BuildPyWithShipped(build_py):
    """``build_py`` that also copies :data:`SHIPPED` into ``hpc_horovod/`` of the build."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads them from the checkout
        for folder, patterns in SHIPPED.items():
            for pattern in patterns:
                for source in sorted(Path(folder).glob(pattern)):
                    target = Path(self.build_lib, "hpc_horovod", source)
                    self.mkpath(str(target.parent))
                    self.copy_file(str(source), str(target))


setup(ext_modules=native_extensions(), cmdclass={"build_py": BuildPyWithShipped})
