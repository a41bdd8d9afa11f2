"""float16/bfloat16 sums over real MPI processes with the native operations (src_native/)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mpi_output import assert_every_rank_says

try:
    from hpc_horovod import _native  # noqa: F401
except ImportError:
    if shutil.which("mpicc"):
        pytest.fail("hpc_horovod._native is not built although mpicc is here: run "
                    "`pip install -e .` or `python setup.py build_ext --inplace`", pytrace=False)
    pytest.skip("no mpicc: the native extension cannot be built on this machine",
                allow_module_level=True)

WORKER = Path(__file__).with_name("native_reductions_worker.py")


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_half_sums_with_native_operations(mpirun, ranks):
    proc = mpirun(ranks, WORKER, timeout=120)
    assert_every_rank_says(proc, ranks, "native reductions ok")
