"""Where am I? Rank, size, local and cross (node) coordinates from the launcher's environment.

Sources are tried in this order, and the first that applies wins:

1. explicit ``HOROVOD_RANK``/``HOROVOD_SIZE`` (+ ``HOROVOD_LOCAL_RANK``, ...);
2. torchrun (``TORCHELASTIC_RUN_ID``), refused when it started several processes. It is always
   the innermost launcher, so it is checked before the SLURM and MPI variables its workers inherit
   (``srun torchrun --nproc-per-node=4`` would otherwise give four processes of rank 0);
3. Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_*``). It must win over SLURM: under ``mpirun`` inside
   an allocation every rank inherits the ``SLURM_PROCID=0`` of the daemon that spawned it;
4. a SLURM job step (``SLURM_STEP_ID`` with ``SLURM_PROCID``): ``srun python train.py``;
5. MPICH/Hydra or Intel MPI (``PMI_RANK``/``PMI_SIZE``);
6. a single process (a laptop, a notebook, a one-task batch script); a multi-task SLURM job
   outside ``srun`` is refused instead.

The function is pure over an environment mapping so that every branch is tested with the variable
sets SLURM and the MPI launchers really produce.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace

import hostlist

from .errors import (
    BatchScriptWithoutSrunError,
    HeterogeneousJobError,
    SallocShellError,
    TopologyError,
    UnsupportedLauncherError,
)

SINGLE = "single"
EXPLICIT = "explicit"
OPENMPI = "openmpi"
SLURM = "slurm"
PMI = "pmi"


@dataclass(frozen=True)
class Topology:
    """This process's coordinates. ``cross_*`` is the node index and the node count.

    ``local_rank``/``local_size``/``cross_rank``/``cross_size`` may be ``None`` when the launcher
    of a job of several processes does not announce them; the MPI backend then derives them
    from shared-memory groups. A process alone always has them: 0 of 1.
    """

    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    cross_rank: int | None
    cross_size: int | None
    hostname: str
    launcher: str
    nodes: tuple[str, ...] = ()
    tasks_per_node: tuple[int, ...] = ()

    @property
    def needs_mpi(self) -> bool:
        """A process of a multi-process job: MPI must wire it to its peers."""
        return self.size > 1 or self.launcher in (OPENMPI, PMI)

    @property
    def is_complete(self) -> bool:
        return None not in (self.local_rank, self.local_size, self.cross_rank, self.cross_size)


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise TopologyError(f"{name}={value!r} is not an integer") from None


def _require(env: Mapping[str, str], name: str, launcher: str) -> int:
    value = _int(env, name)
    if value is None:
        raise TopologyError(f"{launcher} launch detected but {name} is not set")
    return value


def _first_int(env: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set (an explicit 0 counts: it is then rejected)."""
    for name in names:
        value = _int(env, name)
        if value is not None:
            return value
    return None


def _check(rank: int, size: int, local_rank, local_size, source: str) -> None:
    if size < 1 or not 0 <= rank < size:
        raise TopologyError(f"{source}: rank {rank} is not within a job of size {size}")
    if local_rank is not None and (local_rank < 0 or local_size is not None
                                   and local_rank >= local_size):
        raise TopologyError(
            f"{source}: local rank {local_rank} is not within {local_size} local processes"
        )


def _explicit(env: Mapping[str, str], host: str) -> Topology:
    rank = _require(env, "HOROVOD_RANK", "HOROVOD_RANK")
    size = _require(env, "HOROVOD_SIZE", "HOROVOD_RANK")
    local_rank, local_size = _int(env, "HOROVOD_LOCAL_RANK"), _int(env, "HOROVOD_LOCAL_SIZE")
    cross_rank, cross_size = _int(env, "HOROVOD_CROSS_RANK"), _int(env, "HOROVOD_CROSS_SIZE")
    _check(rank, size, local_rank, local_size, "HOROVOD_RANK/HOROVOD_SIZE")
    return Topology(rank, size, local_rank, local_size, cross_rank, cross_size, host, EXPLICIT)


def _openmpi(env: Mapping[str, str], host: str) -> Topology:
    rank = _require(env, "OMPI_COMM_WORLD_RANK", "Open MPI")
    size = _require(env, "OMPI_COMM_WORLD_SIZE", "Open MPI")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    _check(rank, size, local_rank, local_size, "Open MPI")
    # The node index is not announced by mpirun: the MPI backend derives it.
    return Topology(rank, size, local_rank, local_size, None, None, host, OPENMPI)


def _slurm_layout(env: Mapping[str, str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    try:
        nodes = tuple(hostlist.expand_hostlist(nodelist)) if nodelist else ()
        tasks = tuple(hostlist.parse_slurm_tasks_per_node(per_node)) if per_node else ()
    except hostlist.BadHostlist as exc:
        raise TopologyError(f"cannot parse the SLURM node layout: {exc}") from None
    if nodes and tasks and len(nodes) != len(tasks):
        raise TopologyError(
            f"SLURM announced {len(nodes)} nodes ({nodelist}) but tasks for {len(tasks)} "
            f"({per_node})"
        )
    return nodes, tasks


def _slurm_step(env: Mapping[str, str], host: str) -> Topology:
    if env.get("SLURM_HET_SIZE") or env.get("SLURM_PACK_SIZE"):
        raise HeterogeneousJobError(
            f"this step belongs to a heterogeneous job of {env.get('SLURM_HET_SIZE') or env.get('SLURM_PACK_SIZE')} "  # noqa: E501
            "components, which hpc_horovod cannot span: ask for one homogeneous allocation "
            "(e.g. sbatch --nodes=N --ntasks-per-node=G --gres=gpu:G) and run `srun python ...`"
        )
    rank = _require(env, "SLURM_PROCID", "SLURM step")
    size = _first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    size = 1 if size is None else size
    nodes, tasks = _slurm_layout(env)
    node = _int(env, "SLURM_NODEID")
    local_rank = _int(env, "SLURM_LOCALID")
    cross_size = len(tasks) or _first_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    if tasks:
        if sum(tasks) != size or min(tasks) < 1:
            raise TopologyError(
                f"SLURM step announces {size} tasks but its layout "
                f"{env.get('SLURM_STEP_TASKS_PER_NODE') or env.get('SLURM_TASKS_PER_NODE')} "
                f"holds {sum(tasks)} (a node with no task cannot be part of a step)"
            )
        local_size = tasks[node] if node is not None and 0 <= node < len(tasks) else None
    else:
        # Without a layout only a one-node step has a known local size: all of it.
        local_size = size if cross_size == 1 else None
    if node is not None and (node < 0 or cross_size is not None and node >= cross_size):
        raise TopologyError(f"SLURM_NODEID={node} is outside the {cross_size} nodes of the step")
    if tasks and node is None:
        raise TopologyError("SLURM step announces its node layout but not SLURM_NODEID")
    _check(rank, size, local_rank, local_size, "SLURM step")
    hostname = env.get("SLURMD_NODENAME") or host
    return Topology(
        rank, size, local_rank, local_size, node, cross_size, hostname, SLURM, nodes, tasks
    )


def _slurm_outside_step(env: Mapping[str, str]) -> None:
    """Raise when a multi-task job runs its training outside ``srun``; return when harmless."""
    ntasks = _int(env, "SLURM_NTASKS") or 1
    if ntasks <= 1:
        return
    job = env.get("SLURM_JOB_ID", "?")
    if "SLURM_PROCID" in env:
        raise BatchScriptWithoutSrunError(
            f"this process is the batch script of SLURM job {job}, which asked for {ntasks} "
            "tasks, but it was not started by srun, so only one process would train. "
            "Launch the training with `srun python train.py ...` inside the job script "
            "(`hpc-horovod sbatch` writes such a script)."
        )
    raise SallocShellError(
        f"this process runs in the salloc shell of SLURM job {job} ({ntasks} tasks), outside "
        "any job step, so only one process would train. Launch it with "
        "`srun python train.py ...` (or `srun --mpi=pmix ...`) from this shell."
    )


def _pmi(env: Mapping[str, str], host: str) -> Topology:
    rank = _require(env, "PMI_RANK", "PMI")
    size = _require(env, "PMI_SIZE", "PMI")
    local_rank = _int(env, "MPI_LOCALRANKID")
    local_size = _int(env, "MPI_LOCALNRANKS")
    _check(rank, size, local_rank, local_size, "PMI")
    return Topology(rank, size, local_rank, local_size, None, None, host, PMI)


def _torchrun(env: Mapping[str, str]) -> None:
    size = _int(env, "WORLD_SIZE")
    if size is not None and size > 1:
        raise UnsupportedLauncherError(
            f"torchrun started {size} processes, but it cannot wire MPI between them. Start the "
            "script with `hpc-horovod run -np N python train.py` on one machine, or "
            "`srun python train.py` in a SLURM job."
        )


def detect(env: Mapping[str, str] | None = None, hostname: str | None = None) -> Topology:
    """Return this process's topology from ``env`` (default: ``os.environ``)."""
    env = os.environ if env is None else env
    return _alone_is_complete(_detect(env, hostname or socket.gethostname()))


def _detect(env: Mapping[str, str], host: str) -> Topology:
    if "HOROVOD_RANK" in env or "HOROVOD_SIZE" in env:
        return _explicit(env, host)
    if "TORCHELASTIC_RUN_ID" in env:
        _torchrun(env)
    if "OMPI_COMM_WORLD_SIZE" in env:
        return _openmpi(env, host)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return _slurm_step(env, host)
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _pmi(env, host)
    if "SLURM_JOB_ID" in env:
        _slurm_outside_step(env)
    return Topology(0, 1, 0, 1, 0, 1, host, SINGLE)


def _alone_is_complete(topo: Topology) -> Topology:
    """A job of one process is rank 0 of 1 on its node and node 0 of 1, whatever its launcher
    left out (``HOROVOD_RANK=0 HOROVOD_SIZE=1``, a one-task step): no MPI will fill them in,
    and ``torch.cuda.set_device(hvd.local_rank())`` needs an int."""
    if topo.size != 1 or topo.is_complete:
        return topo
    return replace(topo, local_rank=0 if topo.local_rank is None else topo.local_rank,
                   local_size=1 if topo.local_size is None else topo.local_size,
                   cross_rank=0 if topo.cross_rank is None else topo.cross_rank,
                   cross_size=1 if topo.cross_size is None else topo.cross_size)


def missing_mpi_plugin(env: Mapping[str, str], topo: Topology) -> str | None:
    """Why no MPI library can connect the tasks of this multi-task ``srun`` step (it was started
    without an MPI plugin), or None. Checked before MPI starts: Open MPI would abort with a
    message that does not say why, and MPICH would start separate jobs of size 1."""
    if topo.launcher != SLURM or topo.size < 2:
        return None
    if env.get("SLURM_MPI_TYPE") is not None or "PMIX_RANK" in env or "PMI_RANK" in env:
        return None
    return (f"srun started these {topo.size} tasks without an MPI plugin (--mpi=none, or a "
            "site whose MpiDefault is none), so no MPI library can connect them: Open MPI "
            f"aborts, MPICH starts {topo.size} separate jobs of size 1. Use `srun --mpi=pmix "
            "...` (Open MPI, and most PMIx-enabled builds) or `srun --mpi=pmi2 ...` (MPICH, "
            "Intel MPI); `srun --mpi=list` shows this site's plugins.")
