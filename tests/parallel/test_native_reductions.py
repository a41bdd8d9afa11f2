"""float16/bfloat16 sums over real MPI processes with the native operations (src_native/)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support import mpi_checks

try:
    from hpc_horovod import _native  # noqa: F401
except ImportError:
    if shutil.which("mpicc"):
        pytest.fail("hpc_horovod._native is not built although mpicc is here: run "
                    "`pip install -e .` or `python setup.py build_ext --inplace`", pytrace=False)
    pytest.skip("no mpicc: the native extension cannot be built on this machine",
                allow_module_level=True)

test_native_reductions = mpi_checks(Path(__file__).with_name("mpi_native_reductions.py"),
                                    ranks=(2, 3))
