"""float16/bfloat16 sums over real MPI processes with the native operations (src_native/)."""

from __future__ import annotations

from pathlib import Path

from support import mpi_checks, native_or_skip

native_or_skip()

test_native_reductions = mpi_checks(Path(__file__).with_name("mpi_native_reductions.py"),
                                    ranks=(2, 3))
