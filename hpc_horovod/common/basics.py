"""init/shutdown, the rank and size queries and process sets: the API every binding shares over
the process's one :class:`Runtime`."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace

from ..backends import compose
from . import gpu_layout
from . import topology as topology_mod
from .config import Settings
from .engine import Engine
from .errors import NOT_INITIALIZED, SHUT_DOWN, HorovodInternalError
from .gpu_probe import cuda_built, nccl_built  # noqa: F401 - part of the API
from .log import configure as configure_log
from .log import log
from .request import Request, control_signature
from .streams import line_buffered
from .timeline import Timeline
from .whereabouts import IDLE, rank_list


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


class Runtime:
    """What one ``init()`` builds and one ``shutdown()`` drops: the settings read at init, the
    job's topology, the backend :func:`hpc_horovod.backends.compose` chose, the engine and its
    thread, the process sets and the counters behind automatic tensor names. ``init`` after
    ``shutdown``, or after a fatal error, builds a new one: new communicators, caches and
    process sets."""

    def __init__(self, comm=None, process_sets: Sequence = ()):
        """Collective over the job's ranks (or ``comm``'s) when the job has several: creates
        the communicators, then the engine, whose thread starts last."""
        self.settings = settings = Settings.from_env()
        detected = topology_mod.detect()
        # configured before compose, so that the backends' own lines are tagged too; again
        # when MPI gave this process another rank (``comm``)
        configure_log(settings, detected.rank, detected.hostname)
        composed = compose(detected, settings, comm)
        self.topology = topo = composed.topology
        if topo.rank != detected.rank:
            configure_log(settings, topo.rank, topo.hostname)
        log.debug("backend: %s", _why_backend(composed, settings))
        self.backend_name = composed.name
        self.mpi_threads = composed.mpi_threads
        timeline = None
        if settings.timeline and settings.timeline != "DYNAMIC" and topo.rank == 0:
            timeline = Timeline(settings.timeline, settings.timeline_mark_cycles, composed.name)
        self.engine = engine = Engine(composed.backend, settings, timeline)
        #: the first failure's one-line summary, once rank 0 printed it
        self.summary_printed = False
        self.first_culprit = ""
        self.told = False  # the peers know why this rank stops
        self.watch = None
        if topo.size > 1:
            from .watch import PeerWatch

            self.watch = PeerWatch(composed.comm, self._peer_failed, engine.whereabouts)
            engine.use_census(self.watch.census)
            engine.on_local_error = lambda error: self.tell_peers(str(error).splitlines()[0])
        #: id -> the ProcessSet object handed to the user (0: the global set)
        self.process_sets: dict[int, ProcessSet] = {0: global_process_set}
        self._counters: dict[tuple[int, str, int], int] = {}
        self._lock = threading.Lock()
        for ps in process_sets:
            if not isinstance(ps, ProcessSet):
                ps = ProcessSet(ps)
            bad = [r for r in ps.ranks if not 0 <= r < topo.size]
            if bad:
                raise ValueError(f"process set ranks {bad} are outside the job of size "
                                 f"{topo.size}")
            engine.whereabouts.setting_up(f"creating process set {rank_list(ps.ranks)}")
            ps_id = engine.add_static_process_set(ps.ranks, composed.backend.sub(ps.ranks))
            ps.process_set_id = ps_id
            self.process_sets[ps_id] = ps
        engine.whereabouts.now = IDLE
        engine.start()

    def next_name(self, process_set_id: int, kind: str) -> str:
        """Horovod's automatic names: identical on ranks that submit unnamed ops in one
        order. A completed join is a point every member reaches together, so the counters
        restart there, under a new prefix: ranks whose unnamed ops differed while some had
        joined (and the others got join's refusals) agree again afterwards."""
        epoch = self.engine.join_epoch(process_set_id)
        with self._lock:
            key = (process_set_id, kind, epoch)
            n = self._counters.get(key, 0)
            self._counters[key] = n + 1
        return f"{kind}.noname.{n}" if not epoch else f"{kind}.noname.{epoch}.{n}"

    def tell_peers(self, reason: str) -> None:
        """This rank stops on an error of its own: the peers' engines stop with ``reason``,
        whatever they are doing, and their errors name this rank."""
        if self.watch is not None and not self.told and self.engine.peer_error is None:
            self.told = True
            self.watch.tell(reason)

    def _peer_failed(self, text: str, culprit: str, lost: bool, first: bool) -> None:
        """From the watch's thread: a peer failed (``text`` says why), was lost, or a data
        call is stuck (a census named who is frozen and where the others are). The engine
        stops with the error, so that pending and later ops raise it. A lost rank, or a data
        call that never returns, breaks MPI's world for good: if the script has not ended by
        itself ``LOST_GRACE_S`` later (its error caught, or a thread blocked in MPI), the
        process ends, non-zero, as its launcher would end it with ``--kill-on-bad-exit``."""
        error = HorovodInternalError(f"{SHUT_DOWN} {text}")
        error.culprit = culprit
        error.peer_lost = lost
        self.engine.peer_failed(error)
        if first:
            self.first_culprit = culprit
        if lost and self.topology.rank == 0 and on_peer_lost is None:  # else: a restart
            self.print_summary(self.first_culprit)
        if lost:
            timer = threading.Timer(LOST_GRACE_S, self._exit_after_loss, args=(text,))
            timer.daemon = True
            timer.start()

    def _exit_after_loss(self, text: str) -> None:
        if on_peer_lost is not None:
            on_peer_lost(text)
        log.error("exiting, %s%s", text[0].lower(), text[1:])
        _exit_now(1, end_step=self.topology.launcher == topology_mod.SLURM)

    def ends_step(self) -> bool:
        """Whether this process, exiting after a fatal error, cancels its srun step (see
        :func:`_cancel_step`): a census named ranks that did not answer (``PeerWatch.frozen``,
        a negotiation past the peer timeout), and srun would wait for them until the time
        limit. A rank lost, or frozen inside a data call, ends the step from the watch's
        thread instead (:meth:`_exit_after_loss`)."""
        return (self.watch is not None and bool(self.watch.frozen)
                and self.topology.launcher == topology_mod.SLURM)

    def print_summary(self, culprit: str) -> None:
        """Rank 0's one line for the whole job, once."""
        if not self.summary_printed:
            self.summary_printed = True
            log.error("job failed: %s", culprit.splitlines()[0])

    def release(self) -> None:
        """Free what this runtime holds, locally (never a collective that waits for a peer):
        the side channel (a normal end for the peers) and the ids of its process sets. The
        backends were closed by the cycle that stopped the engine on every rank (its end
        awaited here: it may still be closing them on the engine thread); after a failure
        they stay: MPI may still complete an operation this rank gave up on, and writes into
        them."""
        if self.engine.error is None:
            self.engine.shutdown()  # stopped already: waits for the thread to end
        else:
            self.engine.abandon_backends()
        if self.watch is not None:
            self.watch.close()
        for ps in self.process_sets.values():
            if ps is not global_process_set:
                ps.process_set_id = None


def _why_backend(composed, settings: Settings) -> str:
    """The backends ``compose`` chose, and the setting or condition that chose each (the
    debug log's line at ``init``)."""
    topo = composed.topology
    if composed.name == "single":
        return f"single: a process alone ({topo.launcher}), MPI not loaded"
    host = getattr(composed.backend, "host", composed.backend)
    if host.name == "hierarchical":
        why = (f"HOROVOD_HIERARCHICAL_ALLREDUCE=1 and {topo.local_size} ranks on this node: "
               "the node's shared window, MPI across nodes")
    elif settings.hierarchical_allreduce:
        why = "HOROVOD_HIERARCHICAL_ALLREDUCE=1, but every node holds one rank"
    else:
        why = "HOROVOD_HIERARCHICAL_ALLREDUCE=0"
    device = ("nccl (CuPy, NCCL and a GPU of its own on every rank)" if composed.name == "nccl"
              else "none: GPU tensors, if any, go through host memory")
    return (f"{host.name} for host buffers ({why}); device buffers: {device}; "
            f"{topo.size} ranks, {topo.launcher}")


_runtime: Runtime | None = None
_hooks_installed = False


def _require() -> Runtime:
    if _runtime is None:
        raise ValueError(NOT_INITIALIZED)
    return _runtime


def device_transport() -> str:
    """How GPU tensors move in this job: "nccl", "single" (one process: local copies) or
    "host" (staged through host memory over MPI). Bindings read it to hand GPU tensors over
    zero-copy (DLPack) or copy them to the host."""
    name = _require().backend_name
    return name if name in ("nccl", "single") else "host"


def init(comm=None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Start hpc_horovod in this process (idempotent while the engine runs).

    ``comm``: an mpi4py communicator (or a list of world ranks) to run on instead of the whole
    job. Without a launcher, and without ``comm``, the process runs alone and MPI is not loaded.
    After a fatal error (the engine stopped on every rank) it starts afresh, as Horovod does.
    """
    global _runtime
    if _runtime is not None:
        if not _runtime.engine.stopped:
            return
        _runtime.release()
        _runtime = None
    if os.environ.get("HPC_HOROVOD_REQUEUE_SIGNAL"):  # SLURM may send it while the job starts
        importlib.import_module("hpc_horovod.slurm.requeue").catch_early_signal()
    _runtime = Runtime(comm, process_sets or ())
    importlib.import_module("hpc_horovod.slurm.preflight").warn_threads(_runtime.topology)
    line_buffered(_runtime.topology.launcher)
    _install_hooks()


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_at_exit)
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        previous(kind, value, tb)  # this rank's own message first
        _end_job(kind, value)

    sys.excepthook = excepthook


#: how long a rank whose peer was lost lets its script end by itself before it exits
LOST_GRACE_S = 3.0
#: set by ``hvd.elastic.run`` while it runs under an elastic launcher: how this process ends
#: when a peer was lost and the script did not end by itself (a restart, not a failure)
on_peer_lost: Callable[[str], None] | None = None


def _end_job(kind, value) -> None:
    """An exception nobody caught ends this process at once, non-zero, in a job of several
    ranks: first the peers learn why (their error names this rank), then rank 0 prints a
    one-line summary of who failed first, then the process exits without ``MPI_Finalize``,
    which would wait for peers that may never come. The launcher (``mpirun``, ``srun
    --kill-on-bad-exit``) then ends the other ranks; when a census found ranks frozen, which
    plain srun would wait for, the process cancels its step (:meth:`Runtime.ends_step`)."""
    runtime = _runtime
    if runtime is None or runtime.topology.size == 1:
        return
    if not (isinstance(value, HorovodInternalError) and (value.agreed or value.culprit)):
        try:
            runtime.tell_peers(f"{kind.__name__}: {value}".splitlines()[0])
        except Exception:  # noqa: BLE001 - never mask the user's exception
            pass
    if runtime.topology.rank == 0:
        culprit = getattr(value, "culprit", None)
        if culprit is None:
            culprit = (f"a collective failed on every rank: {value}"
                       if isinstance(value, HorovodInternalError)
                       else f"rank 0 failed first: {kind.__name__}: {value}")
        runtime.print_summary(culprit)
    _exit_now(1, end_step=runtime.ends_step())


#: how long a failing srun task lingers after its last words: srun ends the step as soon as it
#: learns that a task failed, and may not print what that task wrote just before
SRUN_LAST_WORDS_S = 0.5


def _exit_now(status: int, end_step: bool = False) -> None:
    """Exit at once, without MPI_Finalize. ``end_step``: the job is broken for good (a rank
    lost, or frozen); this srun step is cancelled too (see :func:`_cancel_step`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to say
            pass
    if "SLURM_STEP_ID" in os.environ:
        time.sleep(SRUN_LAST_WORDS_S)
        if end_step:
            _cancel_step()
    os._exit(status)


def _cancel_step() -> None:
    """``scancel`` this process's own srun step, with a line that says so. Without
    ``--kill-on-bad-exit`` (SLURM's default), srun waits for every task: a task frozen inside
    a collective (stopped, blocked in the kernel), or a child a lost rank left behind, would
    hold the step, and its allocation, until the time limit. SLURM then continues and
    terminates every task of the step, this one too."""
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    scancel = shutil.which("scancel")
    if not (job and step and step.isdigit()) or scancel is None:
        return
    log.warning("ending step %s.%s (scancel): a frozen or orphaned task would hold it until "
                "the job's time limit", job, step)
    try:
        subprocess.run([scancel, "--quiet", f"{job}.{step}"], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.SubprocessError):  # the task ends anyway, as before
        pass


def _at_exit() -> None:
    """The end of the script: a normal ``shutdown`` while the engine works. After a fatal error
    that the script caught, the peers may be gone or stuck, and MPI_Finalize would wait for
    them: the process exits now, non-zero (cancelling its srun step when a census found ranks
    frozen, as :func:`_end_job` does)."""
    runtime = _runtime
    if runtime is not None and runtime.engine.stopped and runtime.engine.error is not None \
            and runtime.topology.size > 1:
        log.error("exiting after a fatal error: %s", str(runtime.engine.error).splitlines()[0])
        _exit_now(1, end_step=runtime.ends_step())
    shutdown()


def shutdown() -> None:
    """Stop the engine on every rank. Pending handles raise; ``init`` may be called again."""
    global _runtime
    runtime = _runtime
    if runtime is None:
        return
    _runtime = None
    runtime.engine.shutdown()
    runtime.release()


def is_initialized() -> bool:
    return _runtime is not None


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
    runtime = _runtime  # no _require(): this runs once per submitted request
    if runtime is None:
        raise ValueError(NOT_INITIALIZED)
    return runtime.engine


def mpi_threads_supported() -> bool:
    runtime = _require()
    if runtime.mpi_threads is None:
        return False
    from mpi4py import MPI

    return runtime.mpi_threads == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return _require().backend_name in ("mpi", "nccl")


def mpi_built() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
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
    return _require().next_name(process_set_id, kind)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Create a process set at run time (every rank must call it, in the same order)."""
    runtime = _require()
    if not runtime.settings.dynamic_process_sets:
        raise ValueError("add_process_set needs HOROVOD_DYNAMIC_PROCESS_SETS=1 set before "
                         "hvd.init(); otherwise pass the sets to hvd.init(process_sets=[...])")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    for existing in runtime.process_sets.values():
        if existing is not global_process_set and existing.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} already exists")
    bad = [r for r in ps.ranks if not 0 <= r < size()]
    if bad:
        raise ValueError(f"process set ranks {bad} are outside the job of size {size()}")
    req = Request(next_name(0, "process_set_add"), None,
                  control_signature("process_set_add", shape=tuple(ps.ranks)))
    (handle,) = runtime.engine.enqueue([req])
    ps.process_set_id = runtime.engine.wait(handle).result
    runtime.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    runtime = _require()
    if not runtime.settings.dynamic_process_sets:
        raise ValueError("remove_process_set needs HOROVOD_DYNAMIC_PROCESS_SETS=1")
    ps_id = process_set.process_set_id
    if ps_id in (None, 0) or ps_id not in runtime.process_sets:
        return False
    req = Request(next_name(0, "process_set_remove"), None,
                  control_signature("process_set_remove", root=ps_id))
    (handle,) = runtime.engine.enqueue([req])
    runtime.engine.wait(handle)
    runtime.process_sets.pop(ps_id, None)
    process_set.process_set_id = None
    return True


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a timeline now (``HOROVOD_TIMELINE=DYNAMIC``)."""
    runtime = _require()
    if runtime.settings.timeline != "DYNAMIC":
        warnings.warn("start_timeline works best with HOROVOD_TIMELINE=DYNAMIC", stacklevel=2)
    if runtime.topology.rank != 0:
        return
    stop_timeline()
    runtime.engine.settings = replace(runtime.engine.settings, timeline_mark_cycles=mark_cycles)
    runtime.engine.timeline = Timeline(os.fspath(file_path), mark_cycles, runtime.backend_name)


def stop_timeline() -> None:
    runtime = _require()
    timeline, runtime.engine.timeline = runtime.engine.timeline, None
    if timeline is not None:
        timeline.close()


def pin_gpu(framework: str | None = None, *, exclusive: bool = True) -> int | None:
    """Make this rank use its own GPU; returns the device index, or None on a CPU-only rank.

    ``framework``: "torch" (``torch.cuda.set_device``), "cupy" (``cupy.cuda.Device(d).use()``)
    or "tensorflow" (``tf.config.set_visible_devices``); None pins every one of them that is
    already imported. Call it after ``hvd.init()``.
    """
    if framework not in (None, "torch", "cupy", "tensorflow"):
        raise ValueError(f"pin_gpu: unknown framework {framework!r}; use 'torch', 'cupy', "
                         "'tensorflow' or None")
    if framework is not None:
        importlib.import_module(framework)
    env = os.environ
    runtime = None if "CUDA_VISIBLE_DEVICES" in env else gpu_layout.runtime_count(framework)
    device = gpu_layout.select_gpu(local_rank(), local_size(), env, runtime,
                        exclusive=exclusive)
    if device is None:
        return None
    loaded = [name for name in ("torch", "cupy", "tensorflow")
              if (framework in (None, name)) and name in sys.modules]
    for name in loaded:
        module = sys.modules[name]
        if name == "torch":
            module.cuda.set_device(device)
        elif name == "cupy":
            module.cuda.Device(device).use()
        else:
            gpus = module.config.list_physical_devices("GPU")
            module.config.set_visible_devices(gpus[device], "GPU")
    return device


# -- device transport selection -----------------------------------------------------------------
