"""Every collective over real MPI processes (2 and 3 ranks): results against numpy, Horovod's
mismatch errors on every rank, join, fusion, process sets. The checks run in worker scripts
(``*_worker.py``), one mpirun per group of checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mpi_output import assert_every_rank_says

HERE = Path(__file__).parent
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_op_and_dtype_against_numpy(mpirun, ranks):
    proc = mpirun(ranks, HERE / "ops_worker.py", timeout=120)
    assert_every_rank_says(proc, ranks, "ops ok")


@pytest.mark.parametrize("ranks", [2, 3])
def test_mismatches_fail_on_every_rank_with_horovods_text(mpirun, ranks):
    proc = mpirun(ranks, HERE / "errors_worker.py", timeout=120)
    assert_every_rank_says(proc, ranks, "errors ok")


@pytest.mark.parametrize("ranks", [2, 3])
def test_join_with_uneven_work(mpirun, ranks):
    proc = mpirun(ranks, HERE / "join_worker.py", timeout=120)
    assert_every_rank_says(proc, ranks, "join ok")


FUSION_RUNS = {
    "default": {},  # 128 MiB: everything ready in one cycle is fused
    "unfused": {"HOROVOD_FUSION_THRESHOLD": "0"},  # every tensor on its own
    # small buffers, and a response cache too small for the names: constant eviction
    "small": {"HOROVOD_FUSION_THRESHOLD": "256", "HOROVOD_CACHE_CAPACITY": "2"},
}


def test_fusion_gives_the_bits_of_no_fusion(mpirun, tmp_path):
    digests, fused = {}, {}
    for run, env in FUSION_RUNS.items():
        timeline = tmp_path / f"{run}.json"
        proc = mpirun(2, HERE / "fusion_worker.py", timeout=120,
                      env={**env, "HOROVOD_TIMELINE": str(timeline)})
        assert_every_rank_says(proc, 2, "fusion ok")
        found = set(re.findall(r"rank \d: digest ([0-9a-f]{64})", proc.stdout))
        assert len(found) == 1, proc.stdout  # both ranks hold the same bits
        digests[run] = found.pop()
        events = json.loads(timeline.read_text())
        fused[run] = [e["args"]["fused_tensors"] for e in events
                      if e.get("name") == "MPI_ALLREDUCE"]
    assert digests["default"] == digests["unfused"] == digests["small"]
    assert max(fused["default"]) > 1, "the default threshold never fused anything"
    assert set(fused["unfused"]) == {1}, "HOROVOD_FUSION_THRESHOLD=0 still fused tensors"
    # 256 bytes hold at most 64 float32 (bigger tensors travel alone)
    assert 1 < max(fused["small"]) <= 64


@pytest.mark.parametrize("ranks", [2, 3])
def test_process_sets(mpirun, ranks):
    proc = mpirun(ranks, HERE / "process_sets_worker.py", timeout=120,
                  env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert_every_rank_says(proc, ranks, "process sets ok")


SCRIPT_AFTER_CHECK_BUILD = """
import numpy as np

from hpc_horovod import check_build

check_build.report()  # imports mpi4py without starting MPI, as on a login node
import hpc_horovod as hvd

hvd.init()
assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2
print(f"rank {hvd.rank()}: started MPI itself", flush=True)
"""


def test_init_starts_mpi_that_mpi4py_did_not_start(mpirun, tmp_path):
    script = tmp_path / "after_check_build.py"
    script.write_text(SCRIPT_AFTER_CHECK_BUILD)
    proc = mpirun(2, script, timeout=60)  # and exits cleanly: MPI is finalized at exit
    assert_every_rank_says(proc, 2, "started MPI itself")


@pytest.mark.parametrize("ranks", [2, 3])
def test_repeated_steps_reuse_and_replace_execution_plans(mpirun, ranks):
    proc = mpirun(ranks, HERE / "steps_worker.py", timeout=120)
    assert_every_rank_says(proc, ranks, "steps ok")


def test_more_tensors_than_the_cache_holds_evict_the_least_recently_used(mpirun):
    # 30 to 40 names a step against 16 cache bits: names are evicted and cached again
    proc = mpirun(2, HERE / "steps_worker.py", timeout=120, env={"HOROVOD_CACHE_CAPACITY": "16"})
    assert_every_rank_says(proc, 2, "steps ok")
