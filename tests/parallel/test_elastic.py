"""``hvd.elastic``'s states and sampler across ranks: the checks of mpi_elastic.py, each a test
per N (support.mpi_checks). Restarts on real lost ranks: tests/torch/test_torch_elastic_run.py."""

from __future__ import annotations

from pathlib import Path

from support import mpi_checks

HERE = Path(__file__).parent

test_elastic = mpi_checks(HERE / "mpi_elastic.py", ranks=(2,))
