"""``topology.detect`` over the environment dictionaries that SLURM and the MPI launchers really
produce (variable sets as observed under Slurm 22.05, Open MPI 4.1 and MPICH/Hydra)."""

from __future__ import annotations

import hostlist
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_horovod.common.errors import (
    BatchScriptWithoutSrunError,
    HeterogeneousJobError,
    SallocShellError,
    TopologyError,
    UnsupportedLauncherError,
)
from hpc_horovod.common.topology import Topology, detect

HOST = "laptop"


def job_env(ntasks: int, nodelist: str = "jean-zay-iam01", tasks_per_node: str | None = None,
            **extra: str) -> dict[str, str]:
    """What every process of a SLURM job sees: the batch script, an salloc shell, a task."""
    nnodes = len(hostlist.expand_hostlist(nodelist))
    env = {
        "SLURM_JOB_ID": "424242",
        "SLURM_JOBID": "424242",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(nnodes),
        "SLURM_NNODES": str(nnodes),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_TASKS_PER_NODE": tasks_per_node or str(ntasks),
        "SLURM_JOB_PARTITION": "gpu_p13",
        "SLURM_SUBMIT_DIR": "/gpfswork/rech/abc/user",
        "SLURM_CLUSTER_NAME": "jean-zay",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
    }
    env.update(extra)
    return env


def srun_tasks(nodelist: str, tasks_per_node: str) -> list[dict[str, str]]:
    """The environment of every task of ``srun`` with block distribution over ``nodelist``."""
    nodes = hostlist.expand_hostlist(nodelist)
    per_node = hostlist.parse_slurm_tasks_per_node(tasks_per_node)
    ntasks = sum(per_node)
    envs, rank = [], 0
    for node, (name, count) in enumerate(zip(nodes, per_node)):
        first = rank
        for local in range(count):
            envs.append(job_env(
                ntasks, nodelist, tasks_per_node,
                SLURM_STEP_ID="0", SLURM_STEPID="0",
                SLURM_PROCID=str(rank), SLURM_LOCALID=str(local), SLURM_NODEID=str(node),
                SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_STEP_NUM_NODES=str(len(nodes)),
                SLURM_STEP_NODELIST=nodelist, SLURM_STEP_TASKS_PER_NODE=tasks_per_node,
                SLURM_GTIDS=",".join(str(r) for r in range(first, first + count)),
                SLURMD_NODENAME=name, SLURM_TOPOLOGY_ADDR=name, SLURM_CPUS_ON_NODE="40",
                SLURM_TASK_PID=str(1000 + rank), SLURM_LAUNCH_NODE_IPADDR="10.0.0.1",
                SLURM_SRUN_COMM_HOST="10.0.0.1", SLURM_DISTRIBUTION="block",
                SLURM_STEP_LAUNCHER_PORT="40123", SLURM_UMASK="0022",
                PMIX_RANK=str(rank), PMIX_NAMESPACE="slurm.pmix.424242.0",
            ))
            rank += 1
    return envs


def ompi_env(rank: int, size: int, local_rank: int, local_size: int, **extra) -> dict[str, str]:
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_NODE_RANK": str(local_rank),
        "OMPI_UNIVERSE_SIZE": str(size),
        "OMPI_MCA_orte_ess_num_procs": str(size),
        "PMIX_RANK": str(rank),
        "PMIX_NAMESPACE": "2861105153",
    }
    env.update(extra)
    return env


# -- single process -------------------------------------------------------------------------------
def test_no_launcher_is_a_single_process():
    topo = detect({"HOME": "/root", "PATH": "/usr/bin"}, hostname=HOST)
    assert topo == Topology(0, 1, 0, 1, 0, 1, HOST, "single")
    assert not topo.needs_mpi and topo.is_complete


def test_default_environment_and_hostname_are_the_process_own(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith(
            ("SLURM_", "OMPI_", "PMI_", "HOROVOD_", "TORCHELASTIC"))]:
        monkeypatch.delenv(key)
    topo = detect()
    assert topo.launcher == "single"
    assert topo.hostname == __import__("socket").gethostname()


def test_one_task_batch_script_is_a_single_process():
    env = job_env(1, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    topo = detect(env, hostname=HOST)
    assert (topo.rank, topo.size, topo.launcher) == (0, 1, "single")


def test_one_task_salloc_shell_is_a_single_process():
    assert detect(job_env(1), hostname=HOST).launcher == "single"


# -- SLURM steps ----------------------------------------------------------------------------------
@pytest.mark.parametrize("nodelist,tasks_per_node,expected_local", [
    ("jean-zay-iam01", "4", [4]),
    ("jean-zay-iam[01-02]", "3,1", [3, 1]),
    ("jean-zay-iam[01-03]", "4(x2),3", [4, 4, 3]),
    ("jean-zay-iam[01-04,07]", "2(x5)", [2, 2, 2, 2, 2]),
    ("jean-zay-iam[01-04,07]", "4(x2),3,1(x2)", [4, 4, 3, 1, 1]),
    ("r2i0n[3-5],r3i1n0", "1(x4)", [1, 1, 1, 1]),
])
def test_srun_step_gives_every_task_its_coordinates(nodelist, tasks_per_node, expected_local):
    envs = srun_tasks(nodelist, tasks_per_node)
    nodes = tuple(hostlist.expand_hostlist(nodelist))
    topos = [detect(env, hostname="ignored") for env in envs]
    assert [t.rank for t in topos] == list(range(len(envs)))
    for topo in topos:
        assert topo.launcher == "slurm" and topo.is_complete and topo.needs_mpi == (len(envs) > 1)
        assert topo.size == sum(expected_local)
        assert topo.cross_size == len(expected_local)
        assert topo.local_size == expected_local[topo.cross_rank]
        assert 0 <= topo.local_rank < topo.local_size
        assert topo.hostname == nodes[topo.cross_rank]  # SLURMD_NODENAME, not gethostname()
        assert topo.nodes == nodes
        assert topo.tasks_per_node == tuple(expected_local)
    # every (node, local rank) pair appears exactly once
    assert len({(t.cross_rank, t.local_rank) for t in topos}) == len(topos)


def test_srun_non_uniform_split_gives_the_lone_task_its_own_node():
    env = srun_tasks("jean-zay-iam[01-02]", "3,1")[3]
    topo = detect(env, hostname=HOST)
    assert (topo.rank, topo.local_rank, topo.local_size) == (3, 0, 1)
    assert (topo.cross_rank, topo.cross_size) == (1, 2)
    assert topo.hostname == "jean-zay-iam02"


def test_srun_step_of_one_task_needs_no_mpi():
    (env,) = srun_tasks("jean-zay-iam01", "1")
    topo = detect(env, hostname=HOST)
    assert (topo.launcher, topo.size, topo.needs_mpi) == ("slurm", 1, False)


def test_srun_step_smaller_than_the_job_uses_the_step_variables():
    # sbatch -N 2 -n 8 then `srun -n 2 -N 1 python ...`: the step, not the job, decides.
    env = job_env(8, "jean-zay-iam[01-02]", "4(x2)", SLURM_STEP_ID="3", SLURM_PROCID="1",
                  SLURM_LOCALID="1", SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="2",
                  SLURM_STEP_NUM_NODES="1", SLURM_STEP_NODELIST="jean-zay-iam01",
                  SLURM_STEP_TASKS_PER_NODE="2")
    topo = detect(env, hostname=HOST)
    assert (topo.rank, topo.size, topo.local_size, topo.cross_size) == (1, 2, 2, 1)


def test_srun_step_without_layout_variables_knows_local_size_only_on_one_node():
    base = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
            "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "4"}
    one_node = detect(dict(base, SLURM_STEP_NUM_NODES="1"), hostname=HOST)
    assert (one_node.local_size, one_node.cross_size) == (4, 1)
    two_nodes = detect(dict(base, SLURM_STEP_NUM_NODES="2"), hostname=HOST)
    # four tasks on two nodes: the local size is not 4; MPI derives it
    assert two_nodes.local_size is None and two_nodes.cross_size == 2
    assert not two_nodes.is_complete


def test_heterogeneous_job_is_refused_with_the_fix():
    env = srun_tasks("jean-zay-iam[01-02]", "2(x2)")[0]
    env.update(SLURM_HET_SIZE="2", SLURM_JOB_ID_HET_GROUP_0="424242")
    with pytest.raises(HeterogeneousJobError) as info:
        detect(env, hostname=HOST)
    message = str(info.value)
    assert "heterogeneous job of 2 components" in message
    assert "srun python" in message and "--ntasks-per-node" in message


# -- SLURM outside a step -------------------------------------------------------------------------
def test_batch_script_without_srun_is_refused_naming_srun():
    # the batch step: SLURM_PROCID=0 and SLURM_NTASKS=4 but no SLURM_STEP_ID
    env = job_env(4, "jean-zay-iam01", "4", SLURM_PROCID="0", SLURM_LOCALID="0",
                  SLURM_NODEID="0", SLURM_CPUS_ON_NODE="40", SLURMD_NODENAME="jean-zay-iam01",
                  SLURM_GTIDS="0", SLURM_TASK_PID="4242")
    with pytest.raises(BatchScriptWithoutSrunError) as info:
        detect(env, hostname=HOST)
    message = str(info.value)
    assert "424242" in message and "4 tasks" in message
    assert "srun python train.py" in message


def test_salloc_shell_is_refused_naming_srun():
    env = job_env(2, "jean-zay-iam[01-02]", "1(x2)")  # salloc -N 2 -n 2: no SLURM_PROCID
    with pytest.raises(SallocShellError) as info:
        detect(env, hostname=HOST)
    message = str(info.value)
    assert "salloc" in message and "2 tasks" in message and "srun" in message


def test_batch_and_salloc_errors_are_topology_errors():
    assert issubclass(BatchScriptWithoutSrunError, TopologyError)
    assert issubclass(SallocShellError, TopologyError)
    assert issubclass(HeterogeneousJobError, TopologyError)
    assert issubclass(UnsupportedLauncherError, TopologyError)


# -- MPI launchers --------------------------------------------------------------------------------
def test_openmpi_mpirun():
    topo = detect(ompi_env(2, 4, 0, 2), hostname=HOST)
    assert (topo.launcher, topo.rank, topo.size, topo.local_rank, topo.local_size) == \
        ("openmpi", 2, 4, 0, 2)
    # mpirun does not announce the node index: left to the MPI backend
    assert topo.cross_rank is None and not topo.is_complete and topo.needs_mpi


def test_openmpi_singleton_of_size_one_still_needs_mpi():
    assert detect(ompi_env(0, 1, 0, 1), hostname=HOST).needs_mpi


def test_mpirun_inside_an_allocation_wins_over_slurm_variables():
    # Under mpirun in a job every rank inherits SLURM_PROCID=0 (and the orted step's variables).
    slurm = srun_tasks("jean-zay-iam01", "1")[0]
    slurm.update(SLURM_NTASKS="4", SLURM_TASKS_PER_NODE="4")
    topos = [detect(dict(slurm, **ompi_env(r, 4, r, 4)), hostname=HOST) for r in range(4)]
    assert [t.rank for t in topos] == [0, 1, 2, 3]
    assert {t.launcher for t in topos} == {"openmpi"}
    assert {t.size for t in topos} == {4}


def test_mpirun_inside_a_batch_step_is_not_mistaken_for_the_batch_script():
    env = job_env(4, SLURM_PROCID="0", **ompi_env(3, 4, 3, 4))
    assert detect(env, hostname=HOST).rank == 3


def test_mpich_hydra_pmi_variables():
    env = {"PMI_RANK": "1", "PMI_SIZE": "3", "PMI_FD": "6", "MPI_LOCALRANKID": "1",
           "MPI_LOCALNRANKS": "3", "HYDI_CONTROL_FD": "7"}
    topo = detect(env, hostname=HOST)
    assert (topo.launcher, topo.rank, topo.size, topo.local_rank, topo.local_size) == \
        ("pmi", 1, 3, 1, 3)
    assert topo.needs_mpi and not topo.is_complete


def test_mpich_under_srun_pmi2_uses_the_slurm_step():
    env = srun_tasks("jean-zay-iam[01-02]", "1(x2)")[1]
    env.update(PMI_RANK="1", PMI_SIZE="2", PMI_FD="9", PMI_JOBID="424242.0")
    topo = detect(env, hostname=HOST)
    assert (topo.launcher, topo.rank, topo.cross_rank) == ("slurm", 1, 1)


# -- explicit -------------------------------------------------------------------------------------
def test_explicit_variables_win_over_everything():
    env = dict(srun_tasks("jean-zay-iam01", "2")[0], **ompi_env(0, 2, 0, 2))
    env.update(HOROVOD_RANK="5", HOROVOD_SIZE="8", HOROVOD_LOCAL_RANK="1",
               HOROVOD_LOCAL_SIZE="4", HOROVOD_CROSS_RANK="1", HOROVOD_CROSS_SIZE="2")
    topo = detect(env, hostname=HOST)
    assert topo == Topology(5, 8, 1, 4, 1, 2, HOST, "explicit")


def test_explicit_rank_and_size_alone_leave_the_rest_to_mpi():
    topo = detect({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, hostname=HOST)
    assert (topo.rank, topo.size, topo.local_rank, topo.cross_size) == (0, 2, None, None)
    assert topo.needs_mpi


def test_explicit_process_alone_is_local_rank_0_of_1():
    topo = detect({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"}, hostname=HOST)
    assert (topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == (0, 1, 0, 1)
    assert not topo.needs_mpi
    one_task = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
                "SLURM_STEP_NUM_TASKS": "1"}
    assert detect(one_task, hostname=HOST).is_complete


def test_local_rank_is_an_int_after_init_under_horovod_rank_and_size():
    """What the README's torch.cuda.set_device(hvd.local_rank()) needs, in a real process."""
    import subprocess
    import sys

    from support import clean_env

    code = ("import hpc_horovod as hvd; hvd.init(); "
            "print(hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=clean_env({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"}))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "1", "0", "1"]


@pytest.mark.parametrize("env,names", [
    ({"HOROVOD_RANK": "0"}, "HOROVOD_SIZE"),
    ({"HOROVOD_SIZE": "2"}, "HOROVOD_RANK"),
])
def test_explicit_needs_both_rank_and_size(env, names):
    with pytest.raises(TopologyError, match=f"{names} is not set"):
        detect(env, hostname=HOST)


# -- torchrun -------------------------------------------------------------------------------------
def torchrun_env(world: int, rank: int = 0, **extra) -> dict[str, str]:
    env = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": str(world), "RANK": str(rank),
           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
    env.update(extra)
    return env


def test_torchrun_with_several_processes_is_refused_naming_the_launchers():
    with pytest.raises(UnsupportedLauncherError) as info:
        detect(torchrun_env(4, 2), hostname=HOST)
    message = str(info.value)
    assert "torchrun started 4 processes" in message
    assert "hpc-horovod run -np N" in message and "srun python" in message


def test_torchrun_inside_srun_is_refused_not_run_as_copies_of_rank_0():
    # `srun -n 1 torchrun --nproc-per-node=4 train.py`: four workers inherit the one task's
    # SLURM_PROCID=0; they must not each become rank 0 of a job of size 1.
    env = dict(srun_tasks("jean-zay-iam01", "1")[0], **torchrun_env(4, 3))
    with pytest.raises(UnsupportedLauncherError):
        detect(env, hostname=HOST)


def test_torchrun_with_one_process_is_a_single_process():
    assert detect(torchrun_env(1), hostname=HOST).launcher == "single"


def test_world_size_exported_by_a_job_script_is_not_torchrun():
    # Job scripts written for torch.distributed often export these for srun tasks.
    env = srun_tasks("jean-zay-iam01", "2")[1]
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="jean-zay-iam01")
    assert detect(env, hostname=HOST).launcher == "slurm"


# -- malformed values -----------------------------------------------------------------------------
@pytest.mark.parametrize("env,fragment", [
    (ompi_env(0, 2, 0, 2, OMPI_COMM_WORLD_RANK="zero"), "OMPI_COMM_WORLD_RANK='zero'"),
    (ompi_env(0, 2, 0, 2, OMPI_COMM_WORLD_SIZE="2.0"), "OMPI_COMM_WORLD_SIZE='2.0'"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK is not set"),
    (ompi_env(2, 2, 0, 2), "rank 2 is not within a job of size 2"),
    (ompi_env(0, 2, 2, 2), "local rank 2 is not within 2 local processes"),
    (ompi_env(0, 0, 0, 1), "rank 0 is not within a job of size 0"),
    ({"HOROVOD_RANK": "-1", "HOROVOD_SIZE": "2"}, "rank -1 is not within"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "-1"},
     "local rank -1 is not within"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "two"}, "HOROVOD_SIZE='two'"),
    ({"PMI_RANK": "4", "PMI_SIZE": "4"}, "rank 4 is not within a job of size 4"),
    ({"PMI_RANK": "x", "PMI_SIZE": "4"}, "PMI_RANK='x'"),
    (torchrun_env(1, WORLD_SIZE="many"), "WORLD_SIZE='many'"),
    (job_env(4, SLURM_NTASKS="four", SLURM_PROCID="0"), "SLURM_NTASKS='four'"),
])
def test_malformed_launcher_values_are_topology_errors_naming_the_variable(env, fragment):
    with pytest.raises(TopologyError) as info:
        detect(env, hostname=HOST)
    assert fragment in str(info.value)


def _task(**changes) -> dict[str, str]:
    env = srun_tasks("jean-zay-iam[01-03]", "4(x2),3")[5]
    for key, value in changes.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    return env


@pytest.mark.parametrize("changes,fragment", [
    ({"SLURM_PROCID": "five"}, "SLURM_PROCID='five'"),
    ({"SLURM_PROCID": "11"}, "rank 11 is not within a job of size 11"),
    ({"SLURM_LOCALID": "4"}, "local rank 4 is not within 4 local processes"),
    ({"SLURM_NODEID": "3"}, "SLURM_NODEID=3 is outside the 3 nodes"),
    ({"SLURM_NODEID": "-1"}, "SLURM_NODEID=-1 is outside"),
    ({"SLURM_NODEID": None}, "not SLURM_NODEID"),
    ({"SLURM_STEP_NUM_TASKS": "12"}, "announces 12 tasks but its layout 4(x2),3 holds 11"),
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2),3,0", "SLURM_STEP_NODELIST": "n[1-4]"},
     "a node with no task"),
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, "3 nodes (jean-zay-iam[01-03]) but tasks for 2"),
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)+3"}, "cannot parse the SLURM node layout"),
    ({"SLURM_STEP_NODELIST": "jean-zay-iam[03-01]"}, "cannot parse the SLURM node layout"),
    ({"SLURM_STEP_NODELIST": "jean-zay-iam[01-03"}, "cannot parse the SLURM node layout"),
])
def test_malformed_slurm_step_values_are_topology_errors(changes, fragment):
    with pytest.raises(TopologyError) as info:
        detect(_task(**changes), hostname=HOST)
    assert fragment in str(info.value)


# -- properties -----------------------------------------------------------------------------------
SLURM_NAMES = [
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
    "SLURM_NTASKS", "SLURM_NNODES", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "SLURM_HET_SIZE", "SLURM_PACK_SIZE", "SLURMD_NODENAME",
]
OTHER_NAMES = [
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
]
small_ints = st.integers(-2, 12).map(str)
values = st.one_of(
    small_ints,
    st.sampled_from(["", " 3", "3 ", "0x2", "1e3", "٣", "9" * 5000, "4(x2),3", "3,1", "2(x0)",
                     "1(x100001)", "n[01-04,07]", "n[1-3]", "n[3-1]", "n[", "a,,b", "n[1-100001]",
                     "n[01-02],m[5-6]", "1(x2)(x3)"]),
    st.text(max_size=12),
)


def _check_invariants(topo: Topology) -> None:
    assert topo.size >= 1 and 0 <= topo.rank < topo.size
    if topo.size == 1:  # nothing else will fill them in: hvd.local_rank() must be an int
        assert (topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == \
            (0, 1, 0, 1), topo
    if topo.local_rank is not None:
        assert topo.local_rank >= 0
        if topo.local_size is not None:
            assert topo.local_rank < topo.local_size
    if topo.tasks_per_node:
        assert sum(topo.tasks_per_node) == topo.size
        assert topo.local_size == topo.tasks_per_node[topo.cross_rank]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(SLURM_NAMES), values, max_size=len(SLURM_NAMES)))
def test_any_slurm_variable_set_gives_a_topology_or_a_topology_error(env):
    try:
        topo = detect(env, hostname=HOST)
    except TopologyError:
        return
    _check_invariants(topo)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(SLURM_NAMES + OTHER_NAMES), values, max_size=12))
def test_any_launcher_variable_set_gives_a_topology_or_a_topology_error(env):
    try:
        topo = detect(env, hostname=HOST)
    except TopologyError:
        return
    _check_invariants(topo)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.data())
def test_every_srun_layout_maps_ranks_one_to_one(per_node, data):
    nodelist = f"n[1-{len(per_node)}]"
    # SLURM's compressed form, e.g. "4(x2),3"
    parts, i = [], 0
    while i < len(per_node):
        j = i
        while j < len(per_node) and per_node[j] == per_node[i]:
            j += 1
        parts.append(str(per_node[i]) + (f"(x{j - i})" if j - i > 1 else ""))
        i = j
    envs = srun_tasks(nodelist, ",".join(parts))
    env = data.draw(st.sampled_from(envs))
    topo = detect(env, hostname=HOST)
    _check_invariants(topo)
    assert topo.tasks_per_node == tuple(per_node)
    assert topo.cross_size == len(per_node)
