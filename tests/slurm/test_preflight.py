"""Preflight verdicts on the environments SLURM really gives (see FACTS.md and
test_real_slurm.py, which runs the same checks under srun)."""

import os
import subprocess
import sys

import pytest

from hpc_horovod.slurm import preflight
from hpc_horovod.slurm.doctor import format_table

STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURMD_NODENAME": "n1", "SLURM_MPI_TYPE": "pmix", "PMIX_RANK": "1"}


def levels(report):
    return [(f.level, f.message) for f in report.findings if f.level != preflight.OK]


def test_clean_step_is_ready():
    report = preflight.check({**STEP, "SLURM_GPUS_ON_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert report.ok and not report.blocking and levels(report) == []
    assert report.topology.size == 4 and report.visible_gpus == ("0", "1")
    assert report.verdict() == "ready"


def test_batch_script_without_srun_is_blocking():
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
    report = preflight.check(env)
    assert report.blocking and not report.ok and report.topology is None
    assert "BatchScriptWithoutSrunError" in report.findings[0].message
    assert "srun python train.py" in report.findings[0].message
    salloc = preflight.check({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})
    assert "SallocShellError" in salloc.findings[0].message


def test_mpi_plugin():
    none = {k: v for k, v in STEP.items() if k not in ("SLURM_MPI_TYPE", "PMIX_RANK")}
    report = preflight.check(none)
    assert report.blocking
    assert "--mpi=none" in levels(report)[0][1] and "srun --mpi=pmix" in levels(report)[0][1]
    pmi2 = preflight.check({**none, "SLURM_MPI_TYPE": "pmi2", "PMI_RANK": "1"})
    assert pmi2.ok and "need --mpi=pmix" in levels(pmi2)[0][1]
    single = {**none, "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NUM_NODES": "1",
              "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "1",
              "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert preflight.check(single).ok  # one task needs no wiring


@pytest.mark.parametrize("gpus, on_node, level, words", [
    ("0", "1", preflight.ERROR, "2 tasks on n1 share 1 GPU(s)"),
    ("0,1,2,3", "4", preflight.WARNING, "2 stay idle"),
    ("1", "2", preflight.WARNING, "torch.cuda.set_device(hvd.local_rank()) fails"),
    ("0,1", "4", preflight.WARNING, "trains on one"),
    ("", "2", preflight.ERROR, "hides them all"),
])
def test_tasks_against_gpus(gpus, on_node, level, words):
    report = preflight.check({**STEP, "CUDA_VISIBLE_DEVICES": gpus, "SLURM_GPUS_ON_NODE": on_node})
    ((found_level, message),) = levels(report)
    assert found_level == level and words in message, message


def test_cpu_jobs_and_visible_gpu_parsing():
    assert levels(preflight.check(STEP)) == []
    assert preflight.visible_gpus({}) is None
    assert preflight.visible_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) == ()
    assert preflight.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-1a, GPU-2b"}) == ("GPU-1a",
                                                                                 "GPU-2b")


def test_doctor_table_groups_findings():
    rows = [{"rank": r, "host": "vm", "node": f"n{r // 2 + 1}", "local": f"{r % 2}/2",
             "cross": f"{r // 2}/2", "launcher": "slurm", "gpus": "0",
             "findings": [("ok", "slurm launch"), ("error", f"2 tasks on n{r // 2 + 1} share")]}
            for r in (3, 0, 2, 1)]
    text = format_table(rows, {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "1"})
    lines = text.splitlines()
    assert lines[0] == ("hpc_horovod doctor: slurm launch, 4 process(es) on 2 node(s) "
                        "(SLURM job 9, step 1)")
    assert [line.split()[0] for line in lines[2:6]] == ["0", "1", "2", "3"]
    assert "error (rank 0-1): 2 tasks on n1 share" in lines
    assert "error (rank 2-3): 2 tasks on n2 share" in lines
    assert lines[-1] == "verdict: NOT READY: errors on 4 rank(s)"


def test_doctor_in_a_single_process():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI", "HOROVOD_"))}
    proc = subprocess.run([sys.executable, "-m", "hpc_horovod.cli", "doctor"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("hpc_horovod doctor: single launch, 1 process(es)")
    assert proc.stdout.rstrip().endswith("verdict: ready")
