"""Host buffers in stages, as NCCL inside a node and Horovod's hierarchical allreduce across nodes.

The ranks of one node share memory through MPI itself (``Comm.Split_type(COMM_TYPE_SHARED)``
and ``Win.Allocate_shared``). An allreduce of :data:`MPI_BELOW_BYTES` or more goes in chunks of
at most :data:`CHUNK_BYTES` (a smaller one is MPI's own ``Allreduce``, faster there); for each:

1. every rank publishes where its data lies in its segment of the window (a bucket laid out
   in the window already, a group of tensors the engine packed into the window, or one of two
   staging halves it copies the chunk into, in turn), then arrives;
2. **reduce-scatter inside the node by direct loads**: rank ``i`` of ``k`` reduces slice ``i``
   from every rank's data with the native one-pass kernel (``_native.reduce_slices``:
   pre-scale, the op, post-scale). With one node it writes the result straight into every
   rank's data (the push that replaces an allgather). With several nodes that hold as many
   ranks each, it writes its own copy, **allreduces the slice across nodes** with MPI over the
   ranks of the same local rank (one ``Comm.Split`` communicator), post-scales and pushes it
   to every rank of the node. When nodes hold different numbers of ranks (``srun -N 2 -n 3``),
   slices cannot pair up across nodes: every rank writes its reduced slice into the data of
   the node's leader (local rank 0), the leaders **allreduce the node's whole sum** across
   nodes with MPI, and every rank copies the result out of the leader's data, post-scaled;
3. a rank that staged copies the other slices out into its buffer after the next arrival
   (the next chunk's, or a last one): one arrival per chunk, the copies of one chunk
   overlapping the reduction of the next on the other ranks. Nodes of different sizes go in
   chunks of a whole staging area, with two arrivals each and the leader's in between.

A node makes no MPI data call at all, and on one node the engine's negotiation goes through the
window too (every rank's words, one arrival, their AND), not through MPI. Arrivals are counters
in the window (MPI's unified memory model: ``Win_sync`` before a counter's store, after the
loads that saw it): a rank that waits knows which peers are late, names them after
``HOROVOD_PEER_TIMEOUT_SECONDS``, gives up when the engine's alarm (handed over at each
negotiation) says a peer failed, and meanwhile keeps its core while a thread of the rank waits
for a result (``common.patience``), or else sleeps in the kernel until the last peer's arrival
wakes it (see :class:`NodeWindow`): a wait in the background costs little CPU however long it
lasts, and ends as soon as the peers are there. Either way it calls into MPI at every turn: Open
MPI moves this rank's queued messages, which a peer may need to come, only inside its calls.
After the last arrival no rank touches another's segment for this chunk, so the window is
never written while a peer still reads it.

Every rank's segment is ``HOROVOD_FUSION_THRESHOLD`` bytes: a staging half, and a half from
which :meth:`HierarchicalBackend.bucket_memory` hands gradient buckets out, so that backward
writes them straight into shared memory. The staging half is also where the engine packs a
group of tensors it fuses (:meth:`HierarchicalBackend.fusion_memory`): packed there, the group
is reduced where it lies, with nothing staged. The segment file is unlinked by MPI once every rank
has mapped it: nothing is left behind by a rank that dies. The window is freed collectively by
:meth:`HierarchicalBackend.close`; :meth:`free` (local) keeps it mapped until the process
exits, since views of it (``p.grad``) may still be alive.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from ..common import patience
from ..common.config import Settings
from ..common.errors import HorovodInternalError, SharedMemoryError
from ..common.negotiation import words_for
from ..common.types import HALF_DTYPES, OP_NAMES, Max, Min, Product, Sum
from .mpi import MpiBackend, sub_communicator
from .waiting import no_answer

try:
    from .. import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _native = None

log = logging.getLogger("hpc_horovod")

ALIGN = 64  # slice bounds and handed-out memory on cache lines
_LINE = ALIGN // 8  # int64s per control line: arrivals, two published offsets, asleep
_ASLEEP = 3  # the control line's word that says its rank blocks until an arrival wakes it
#: The negotiation words a window holds by default: those of the default response cache.
_WORDS = words_for(Settings.cache_capacity)
#: A wait blocked until a peer's arrival wakes it comes back this often, to let MPI progress
#: and to look at the engine's alarm (see :meth:`NodeWindow._wait`).
BLOCK_S = 0.002
#: windows given up by free() while views of them may live: mapped until the process exits
_retained: list = []
SWITCH_OFF = "HOROVOD_HIERARCHICAL_ALLREDUCE=0"
#: Allreduces of fewer bytes go to MPI's own ``Allreduce`` over the whole set: below this size
#: the stages' fixed cost (two arrivals at least, each rank's Python passes, peers waiting on
#: the slowest) outweighs the copies they save. Measured with ``benchmarks/allreduce.py``
#: (see benchmarks/RESULTS.md); an algorithm chosen by size, as NCCL chooses its own.
MPI_BELOW_BYTES = 256 << 10
#: The stages go in chunks of at most this many bytes: a chunk staged, reduced and copied back
#: stays in the caches between these passes, and the next chunk's copy in overlaps the peers'
#: work on this one. Smaller chunks pay more arrivals. Measured with ``benchmarks/allreduce.py``.
CHUNK_BYTES = 1 << 20


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def slice_bounds(count: int, itemsize: int, k: int, i: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of ``count`` that rank ``i`` of ``k`` reduces: equal slices on
    cache-line bounds (no two ranks write one line)."""
    step = max(1, ALIGN // itemsize)
    per = -(-count // (k * step)) * step
    lo = min(i * per, count)
    return lo, min(lo + per, count)


def backing_directory() -> str:
    """Where the MPI library puts shared windows: Open MPI's ``osc_sm_backing_directory``
    (``/dev/shm`` on Linux), else ``/dev/shm`` (MPICH's ``shm_open``)."""
    return os.environ.get("OMPI_MCA_osc_sm_backing_directory", "/dev/shm")


def _cgroup_room() -> tuple[int, str] | None:
    """(bytes this process's cgroup may still charge, the file that says so), or None without a
    memory limit. Pages of a shared window count against the cgroup that touches them."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":  # cgroup v2
            base = "/sys/fs/cgroup" + parts[2].rstrip("/")
            limit_file, used_file = base + "/memory.max", base + "/memory.current"
        elif "memory" in parts[1].split(","):  # cgroup v1
            base = "/sys/fs/cgroup/memory" + parts[2].rstrip("/")
            limit_file, used_file = (base + "/memory.limit_in_bytes",
                                     base + "/memory.usage_in_bytes")
        else:
            continue
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(used_file) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            return None
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return int(limit) - used, limit_file
    return None


def window_problem(node_bytes: int, per_rank: int, local_size: int) -> str | None:
    """Why a window of ``node_bytes`` cannot be made on this node, or None: a full tmpfs lets
    the allocation succeed and kills the job with SIGBUS at a page's first touch, and a cgroup
    limit kills it with the OOM killer; neither says why."""
    asked = (f"the hierarchical allreduce's shared window needs {node_bytes} bytes on this node "
             f"({local_size} ranks x {per_rank} bytes, HOROVOD_FUSION_THRESHOLD plus a "
             "control page)")
    remedy = (f"make room, lower HOROVOD_FUSION_THRESHOLD, or turn the stage off with "
              f"{SWITCH_OFF}")
    directory = backing_directory()
    try:
        stat = os.statvfs(directory)
    except OSError as exc:
        return f"{asked}, but its directory {directory} cannot be used ({exc}): {remedy}"
    free = stat.f_bavail * stat.f_frsize
    if free < node_bytes:
        return (f"{asked}, but {directory} has {free} bytes free (a container's /dev/shm is "
                f"often 64 MiB: docker --shm-size): {remedy}")
    room = _cgroup_room()
    if room is not None and room[0] < node_bytes:
        return (f"{asked}, but the memory cgroup limit ({room[1]}) leaves {room[0]} bytes: "
                f"{remedy}")
    return None


def _refuse_if_any(node: MPI.Comm, problem: str | None) -> None:
    """Collective over ``node``: raise SharedMemoryError on every rank with the first rank's
    ``problem`` when any rank has one, so that no rank goes on half set up."""
    problems = [p for p in node.allgather(problem) if p is not None]
    if problems:
        raise SharedMemoryError(problems[0])


def _drain(sock: socket.socket) -> None:
    """Read every datagram pending on the non-blocking ``sock``."""
    try:
        while True:
            sock.recv(64)
    except BlockingIOError:
        pass


def _wake_sockets(node: MPI.Comm) -> tuple[socket.socket, list[bytes]]:
    """Collective over ``node``: this rank's wake socket (non-blocking, bound to a name of the
    abstract namespace, which no file backs and the kernel drops with the process) and every
    rank's name. Raises SharedMemoryError when a peer's socket cannot be reached: ranks that
    share memory but not a network namespace (containers that share only IPC).

    Names of the abstract namespace belong to a network namespace, so rank 0 reaching every
    peer's socket proves that all of them share its namespace: one probe per peer, from rank 0
    alone. A socket queues at most ``net.unix.max_dgram_qlen`` datagrams (10 by default), so
    probes from every rank to every rank would fill it on a node of more than about ten ranks.
    """
    token = node.bcast(os.urandom(8).hex() if node.Get_rank() == 0 else None)
    names = [f"\0hpc_horovod-{token}-{q}".encode() for q in range(node.Get_size())]
    me = node.Get_rank()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(names[me])
        sock.setblocking(False)
        node.Barrier()
        problem = None
        for q in range(1, node.Get_size()) if me == 0 else ():
            try:
                sock.sendto(b"", names[q])
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                problem = (f"rank 0 of this node cannot reach the wake socket of its local rank "
                           f"{q} ({exc}): ranks that share memory must share a network "
                           f"namespace too; run them in one, or turn the stage off with "
                           f"{SWITCH_OFF}")
                break
            except OSError as exc:
                problem = (f"rank 0 of this node cannot send to the wake socket of its local "
                           f"rank {q} ({exc}); turn the stage off with {SWITCH_OFF}")
                break
        _refuse_if_any(node, problem)
        _drain(sock)  # rank 0's probe
    except BaseException:
        sock.close()
        raise
    return sock, names


class NodeWindow:
    """The window of the ranks of one node: rank ``q``'s segment is ``segment(q)``, its first
    half a staging area and its second half the memory :meth:`take` hands out; rank 0's holds
    the control area before it: one line per rank (arrival counter, published data offsets,
    whether it is asleep), then every rank's negotiation words, two slots each.

    A wait for peers that does not keep its core (see ``common.patience``) blocks in the kernel
    on this rank's wake socket (a datagram socket of the abstract namespace, named after a
    token of this window): the rank that arrives last (it sees every counter there) sends one
    byte to every peer whose line says it is asleep, so a node of ``k`` ranks makes at most
    ``k - 1`` sends per arrival. The waiter says so, then looks at the counters once more
    before it blocks; the arriving rank stores its counter, then reads the counters and the
    flags; a full barrier (``Win_sync``) between the store and the loads on both sides means
    that one of them sees the other's, and that the last store is seen by its own rank.

    Creating it is collective over ``node`` (every rank of which shares this node's memory)."""

    def __init__(self, node: MPI.Comm, data_bytes: int, global_ranks: list[int],
                 timeout_s: float, negotiation_words: int = _WORDS):
        self.node = node
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self.global_ranks = global_ranks
        self.timeout_s = timeout_s
        half = max(4096, data_bytes // 2 // 4096 * 4096)  # a page each, whatever the threshold
        self.staging_bytes = half
        self.data_bytes = 2 * half
        words = -(-negotiation_words // _LINE) * _LINE
        ctrl_words = self.size * _LINE + self.size * 2 * words
        ctrl_bytes = -(-ctrl_words * 8 // 4096) * 4096
        problem = window_problem(self.size * self.data_bytes + ctrl_bytes,
                                 self.data_bytes, self.size)
        _refuse_if_any(node, problem)
        self._sock, self._wake_names = _wake_sockets(node)
        mine = self.data_bytes + (ctrl_bytes if self.rank == 0 else 0)
        try:
            self.win = MPI.Win.Allocate_shared(mine, 1, comm=node)
        except BaseException:
            self._sock.close()
            raise
        self.segments = []
        for q in range(self.size):
            memory, _ = self.win.Shared_query(q)
            skip = ctrl_bytes if q == 0 else 0
            if q == 0:
                self.ctrl = np.frombuffer(memory, dtype=np.int64, count=ctrl_bytes // 8)
            self.segments.append(np.frombuffer(memory, dtype=np.uint8, count=self.data_bytes,
                                               offset=skip))
            if q == self.rank:
                # its own root array: handed-out views keep it referenced (see in_use)
                self._arena = np.frombuffer(memory, dtype=np.uint8, count=half,
                                            offset=skip + half)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.ctrl[self.rank * _LINE:(self.rank + 1) * _LINE] = 0
        # The control lines as Python ints: a memoryview reads and writes one in a few
        # nanoseconds, where a numpy element or reduction costs a microsecond or more.
        self._lines = memoryview(self.ctrl)
        self.counters = self._lines[:self.size * _LINE:_LINE]  # every rank's arrivals
        #: where every rank's data lies, one slot per parity of chunk (see ``published``)
        self._published = [self._lines[1 + slot:self.size * _LINE:_LINE] for slot in (0, 1)]
        self._asleep = self._lines[_ASLEEP:self.size * _LINE:_LINE]
        #: every rank's negotiation words, in two slots used in turn (see ``negotiate``)
        self._words = self.ctrl[self.size * _LINE:ctrl_words].view(np.uint64).reshape(
            self.size, 2, words)
        self._negotiations = 0
        self._poll = select.poll()
        self._poll.register(self._sock.fileno(), select.POLLIN)
        #: views of the segments by (rank, byte offset, count, dtype): a chunk's views are the
        #: same at every step of a training loop (staging halves, buckets at fixed offsets)
        self._views: dict = {}
        self.seq = 0
        #: the engine's alarm (``.error`` set when a peer failed), from the last negotiation
        self.alarm = None
        self.win.Sync()
        node.Barrier()
        self.win.Sync()
        self._lo = _address(self.segments[self.rank])
        self._arena_used = 0
        self._lock = threading.Lock()

    # -- memory ----------------------------------------------------------------------------------
    def take(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of this rank's segment (uint8, cache-line aligned), or None when the half
        that holds buckets is full, or the window is closed (the engine stopped)."""
        with self._lock:
            if self._arena is None:
                return None
            start = self._arena_used
            end = start + -(-nbytes // ALIGN) * ALIGN
            if end > self._arena.size:
                return None
            self._arena_used = end
        return self._arena[start:start + nbytes]

    def scratch(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of this rank's staging half (uint8) for the data of one allreduce, which
        then needs no staging: the same memory at every call. It starts past the first cache
        line, where a rank that stages publishes its first chunk (offset 0), so that an offset
        above 0 says the data lies in the window already (see ``_in_chunks``). None when it
        does not fit, or the window is closed."""
        if self.win is None or nbytes > self.staging_bytes - ALIGN:
            return None
        return self.segments[self.rank][ALIGN:ALIGN + nbytes]

    def offset_of(self, a: np.ndarray) -> int | None:
        """Byte offset of ``a`` in this rank's segment, or None when it lies elsewhere."""
        start = _address(a) - self._lo
        if 0 <= start and start + a.nbytes <= self.data_bytes:
            return start
        return None

    # -- arrivals --------------------------------------------------------------------------------
    def arrive(self, offset: int | None, what: str, slot: int = 0) -> None:
        """Publish ``offset`` (in ``published(slot)``; None: nothing) and wait for every rank
        of the node to arrive here too; raise HorovodInternalError naming the ranks that did
        not within the peer timeout."""
        seq = self.seq = self.seq + 1
        line, lines = self.rank * _LINE, self._lines
        if offset is not None:
            lines[line + 1 + slot] = offset
        # Unified memory model: the data and the offset are visible to every peer before the
        # counter that says they are ready (release) ...
        sync = self.win.Sync
        sync()
        lines[line] = seq
        sync()  # ... and the counter before the flags of the peers asleep are read
        if min(self.counters) < seq:  # a stale read here only means one more look in _wait
            self._wait(seq, what)
        elif max(self._asleep):
            # The last to arrive wakes the sleepers: a full barrier between its counter's
            # store and these loads, as between a sleeper's flag and its last look at the
            # counters, means that the last store is seen by whoever comes after it
            self._wake_peers()
        # ... and no load of a peer's data comes before the counters that said it is ready
        # (acquire).
        self.win.Sync()

    def published(self, slot: int = 0) -> memoryview:
        """Every rank's offset last published in ``slot``. Chunks alternate between two slots:
        a rank that runs one arrival ahead overwrites the other slot, never the one its peers
        may still read."""
        return self._published[slot]

    def negotiate(self, words: np.ndarray) -> None:
        """In-place bitwise AND of ``words`` over the node's ranks, through the window: one
        arrival. The slots alternate: a rank writes a slot again two negotiations later, after
        an arrival that every rank makes only once it has read that slot."""
        n = words.size
        if n > self._words.shape[2]:
            raise ValueError(f"{n} negotiation words, the window holds {self._words.shape[2]}")
        slot = self._negotiations & 1
        self._negotiations += 1
        every = self._words[:, slot, :n]
        every[self.rank] = words
        self.arrive(None, "negotiation")
        np.bitwise_and.reduce(every, axis=0, out=words)

    def _wake_peers(self) -> None:
        """One byte to every peer asleep in a wait (a full socket already holds one)."""
        asleep, sock, names = self._asleep, self._sock, self._wake_names
        for q in range(self.size):
            if asleep[q] and q != self.rank:
                try:
                    sock.sendto(b"w", names[q])
                except OSError:  # full (a wake is pending), or the peer closed its window
                    pass

    def _wait(self, seq: int, what: str) -> None:
        """Until every rank's counter reaches ``seq``. Past its first spins, a wait calls into
        MPI at every turn (an ``Iprobe``): Open MPI moves a rank's messages only inside its
        MPI calls, and a collective this rank has left may have left eager sends queued that
        a peer still waits for, inside that collective, before it can come here."""
        counters = self.counters
        sync = self.win.Sync
        progress = self.node.Iprobe
        pace = patience.Pace()
        while True:
            sync()
            if min(counters) >= seq:
                return
            now = time.perf_counter()
            if pace.spinning(now):
                continue
            progress(MPI.ANY_SOURCE, MPI.ANY_TAG)
            alarm = self.alarm
            if alarm is not None and alarm.error is not None:
                raise alarm.error.copy()
            if self.timeout_s and now - pace.start > self.timeout_s:
                late = [self.global_ranks[q] for q in range(self.size) if counters[q] < seq]
                raise no_answer(self.size, self.timeout_s, what, alarm,
                                f"rank(s) {', '.join(map(str, late))} did not arrive in the "
                                "node's shared window: a peer died or is blocked")
            if pace.yields(now):
                os.sched_yield()
            else:
                self._block(seq, now - pace.start)

    def _block(self, seq: int, waited: float) -> None:
        """Sleep until a peer's arrival wakes this rank, ``BLOCK_S`` at most (then the caller
        calls into MPI and looks at the alarm and the deadline again)."""
        asleep, me = self._asleep, self.rank
        asleep[me] = 1
        self.win.Sync()  # the flag before the counters are read (see the class docstring)
        if min(self.counters) < seq:
            left = self.timeout_s - waited if self.timeout_s else BLOCK_S
            self._poll.poll(max(1, int(1000 * min(BLOCK_S, left))))
        asleep[me] = 0
        _drain(self._sock)

    def data(self, q: int, offset: int, lo: int, hi: int, dtype: np.dtype) -> np.ndarray:
        """Elements ``[lo, hi)`` of ``dtype`` from byte ``offset`` of rank ``q``'s segment."""
        start = offset + lo * dtype.itemsize
        key = (q, start, hi - lo, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 4096:  # a bound on the cache, never reached by one model
                self._views.clear()
            view = self._views[key] = self.segments[q][
                start:start + (hi - lo) * dtype.itemsize].view(dtype)
        return view

    # -- lifetime --------------------------------------------------------------------------------
    def in_use(self) -> bool:
        """Whether memory handed out by :meth:`take` may still be viewed (a bucket, a
        ``p.grad``): then the mapping must stay."""
        # References: the attribute, and getrefcount's argument.
        return self._arena_used > 0 and sys.getrefcount(self._arena) > 2

    def retire(self) -> None:
        """Locally: end the access epoch and keep the mapping until the process exits."""
        if self.win is not None:
            self.win.Unlock_all()
            _retained.append(self.win)
            self.win = None
            self._sock.close()

    def close(self) -> None:
        """Collective over the node: free the window, unless a rank still has views of it
        (then every rank retires it). The ranks agree through one more arrival, bounded by the
        peer timeout like every other: a rank that does not come is named in a warning, and
        the window retired instead (the late rank then finds this one absent, and does so
        too)."""
        if self.win is None:
            return
        try:
            self.arrive(int(self.in_use()), "closing the window")
        except HorovodInternalError as exc:
            self.ctrl[self.rank * _LINE] = -1  # not here: a late peer must not go on to free
            self.win.Sync()
            log.warning("rank %d: the node's shared window stays mapped until exit: %s",
                        self.global_ranks[self.rank], exc)
            self.retire()
            return
        if max(self.published()) > 0:  # some rank still views memory of it
            self.retire()
            return
        self.win.Unlock_all()
        self._views.clear()
        self.segments = self.ctrl = self.counters = self._published = self._arena = None
        self._lines = self._asleep = self._words = None
        self.win.Free()
        self.win = None
        self._sock.close()


class HierarchicalBackend(MpiBackend):
    """An :class:`MpiBackend` whose allreduce goes in stages through the node's shared window
    (see the module's docstring); every other collective is MPI's over the whole set.

    Build it with :func:`create`, which gives a plain :class:`MpiBackend` when every node has one
    rank of the set."""

    name = "hierarchical"

    def __init__(self, comm: MPI.Comm, node: MPI.Comm, window_bytes: int, timeout_s: float,
                 mpi_below_bytes: int = MPI_BELOW_BYTES,
                 negotiation_words: int = _WORDS):
        """Collective over ``comm``, whose ranks ``node`` splits into nodes (ranks that share
        memory); the backend owns both communicators from now on. Allreduces of fewer than
        ``mpi_below_bytes`` go to MPI's ``Allreduce``; negotiations take up to
        ``negotiation_words`` words (``negotiation.words_for`` the response cache's capacity).
        """
        super().__init__(comm)
        self.mpi_below_bytes = mpi_below_bytes
        self.node = node
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        sizes = comm.allgather((self.local_rank, self.local_size))
        self.cross_size = sum(1 for local_rank, _ in sizes if local_rank == 0)
        #: every node holds as many ranks: the ranks of one local rank reduce their slice across
        #: nodes; otherwise the nodes' leaders (local rank 0) reduce the node's whole sum
        self.by_slice = len({size for _, size in sizes}) == 1
        if self.by_slice:
            self.cross = comm.Split(color=self.local_rank, key=self.rank)
        else:
            leader = self.local_rank == 0
            self.cross = comm.Split(color=0 if leader else MPI.UNDEFINED, key=self.rank)
        self.window_bytes, self.timeout_s = window_bytes, timeout_s
        self.negotiation_words = negotiation_words
        self._bounds_of: dict = {}  # see _bounds
        try:
            self.window = NodeWindow(node, window_bytes, node.allgather(self.rank), timeout_s,
                                     negotiation_words)
        except BaseException:
            if self.cross != MPI.COMM_NULL:
                self.cross.Free()
            raise

    def negotiate(self, words: np.ndarray, timeout_s: float, alarm=None) -> None:
        """The bitwise AND of ``words`` over the set: on one node through the window (one
        arrival, whose wait a peer's arrival wakes), across nodes :meth:`MpiBackend.negotiate`.
        The window's waits for peers of the cycle it starts give up as soon as ``alarm.error``
        is set."""
        self.window.alarm = alarm
        if self.cross_size == 1:
            self.window.negotiate(words)
        else:
            super().negotiate(words, timeout_s, alarm)

    # -- memory ----------------------------------------------------------------------------------
    def bucket_memory(self, nbytes: int) -> np.ndarray | None:
        return self.window.take(nbytes)

    def fusion_memory(self, nbytes: int) -> np.ndarray | None:
        return self.window.scratch(nbytes)

    # -- data ------------------------------------------------------------------------------------
    def allreduce(self, buf: np.ndarray, op: int, send: np.ndarray | None = None,
                  prescale: float = 1.0, postscale: float = 1.0) -> None:
        """In place, or from ``send`` into ``buf``; see the module's docstring."""
        out = buf.reshape(-1)
        if not _supported(out.dtype, op):
            raise ValueError(f"{self.name} does not support allreduce {OP_NAMES.get(op, op)} of "
                             f"{out.dtype}")
        if out.size == 0:
            return
        if out.nbytes < self.mpi_below_bytes:
            MpiBackend.allreduce(self, buf, op, send, prescale, postscale)
            return
        src = out if send is None else send.reshape(-1)
        base = self.window.offset_of(out) if send is None else None
        if self.cross_size > 1 and not self.by_slice:
            self._uneven_nodes(src, out, op, prescale, postscale, base)
        else:
            self._in_chunks(src, out, op, prescale, postscale, base)

    def _in_chunks(self, src: np.ndarray, out: np.ndarray, op: int, pre: float, post: float,
                   base: int | None) -> None:
        """One node, or nodes of equal sizes: chunks of at most :data:`CHUNK_BYTES`, one
        arrival each plus a last one, pipelined. Chunk ``c`` (data in the window at ``base``,
        or staged in the half ``c % 2`` of the staging area) is published in slot ``c % 2``;
        after its arrival a rank copies the previous chunk's results out of its staging half
        (its peers pushed them before they arrived), then reduces its slice of chunk ``c`` and
        pushes the result into every rank's data. A staging half is written again two chunks
        later, after an arrival that tells every peer is done with it.

        On one node, when the first chunk's arrival shows every rank's data in the window (a
        gradient bucket or a packed group everywhere: no offset 0, the offset of a staged first
        chunk), nothing is staged and there is nothing to pipeline: that chunk becomes the
        whole buffer (its data is all there before the arrival): two arrivals in all, instead
        of one per chunk. Every rank of
        the node sees the same offsets, so every rank cuts the same chunks (across nodes the
        chunks' slices pair up in MPI calls, and another node cannot see these offsets)."""
        win, dtype = self.window, out.dtype
        item, size = dtype.itemsize, out.size
        half = win.staging_bytes // 2
        chunk = max(1, min(CHUNK_BYTES, half) // item // ALIGN) * ALIGN
        staged = base is None
        unread = None  # (results, staging offset) of the chunk whose results are to copy out
        c = lo = 0
        while lo < size:
            hi = min(lo + chunk, size)
            slot = c % 2
            part, results = src[lo:hi], out[lo:hi]
            if staged:
                offset = slot * half
                self._stage(part, offset, hi - lo, 1)
            else:
                offset = base + lo * item
            win.arrive(offset, "allreduce: data ready", slot)
            offsets = win.published(slot)
            if c == 0 and self.cross_size == 1 and min(offsets) > 0:
                # every rank's data lies in the window, all of it ready: one chunk
                chunk = hi = size
                part, results = src, out
            if unread is not None:
                self._stage(unread[0], unread[1], unread[0].size, -1)
            self._reduce_slice(part, results, op, pre, post, offsets)
            unread = (results, offset) if staged else None
            c, lo = c + 1, hi
        win.arrive(0, "allreduce: results written", c % 2)
        if unread is not None:
            self._stage(unread[0], unread[1], unread[0].size, -1)

    def _bounds(self, n: int, item: int) -> tuple[tuple[int, int], list[tuple[int, int]]]:
        """(this rank's slice, the other ranks' slices) of ``n`` elements of ``item`` bytes
        (:func:`slice_bounds`); every chunk but the last has the same."""
        key = (n, item)
        bounds = self._bounds_of.get(key)
        if bounds is None:
            k, me = self.local_size, self.local_rank
            if len(self._bounds_of) >= 1024:
                self._bounds_of.clear()
            bounds = self._bounds_of[key] = (
                slice_bounds(n, item, k, me),
                [slice_bounds(n, item, k, q) for q in range(k) if q != me])
        return bounds

    def _stage(self, data: np.ndarray, offset: int, n: int, direction: int) -> None:
        """Copy the slices of ``data`` (``n`` elements) that the other ranks reduce into this
        rank's staging area at byte ``offset`` (``direction`` 1), or back out of it (-1)."""
        win, me, dtype = self.window, self.local_rank, data.dtype
        for a, b in self._bounds(n, dtype.itemsize)[1]:
            if a < b:
                if direction > 0:
                    win.data(me, offset, a, b, dtype)[...] = data[a:b]
                else:
                    data[a:b] = win.data(me, offset, a, b, dtype)

    def _reduce_slice(self, src: np.ndarray, out: np.ndarray, op: int, pre: float, post: float,
                      offsets: np.ndarray) -> None:
        """This rank's slice of a chunk, from every rank's data (at ``offsets``), into its own
        ``out`` and every peer's data; across nodes, the slice is allreduced with the ranks of
        the same local rank in between."""
        win, k, me, dtype = self.window, self.local_size, self.local_rank, out.dtype
        lo, hi = self._bounds(out.size, dtype.itemsize)[0]
        if lo >= hi:
            return
        peers = [win.data(q, offsets[q], lo, hi, dtype) for q in range(k) if q != me]
        inputs = peers[:me] + [src[lo:hi]] + peers[me:]
        mine = out[lo:hi]
        if self.cross_size == 1:
            _native.reduce_slices(inputs, [mine] + peers, op, pre, post)
        else:
            _native.reduce_slices(inputs, [mine], op, pre, 1.0)
            self._mpi_allreduce(self.cross, mine, op)
            _native.reduce_slices([mine], [mine] + peers, op, 1.0, post)

    def _uneven_nodes(self, src: np.ndarray, out: np.ndarray, op: int, pre: float, post: float,
                      base: int | None) -> None:
        """Nodes of different sizes: chunks of at most the staging area, each through the
        node's leader (:meth:`_through_leader`)."""
        win, me, dtype = self.window, self.local_rank, out.dtype
        item, k = dtype.itemsize, self.local_size
        chunk = win.staging_bytes // item // ALIGN * ALIGN
        for lo in range(0, out.size, chunk):
            hi = min(lo + chunk, out.size)
            n = hi - lo
            if base is None:
                offset = 0
                self._stage(src[lo:hi], 0, n, 1)
            else:
                offset = base + lo * item
            win.arrive(offset, "allreduce: data ready")
            a, b = slice_bounds(n, item, k, me)
            in_total = self._through_leader(src[lo:hi], out[lo:hi], op, pre, post, a, b)
            win.arrive(offset, "allreduce: results read")
            if in_total and post != 1.0:  # nobody reads the leader's data any more
                _native.reduce_slices([out[lo:hi]], [out[lo:hi]], op, 1.0, post)

    def _through_leader(self, src: np.ndarray, out: np.ndarray, op: int, pre: float,
                        post: float, lo: int, hi: int) -> bool:
        """The cross-node stage when nodes hold different numbers of ranks: every rank reduces
        its slice into the leader's data (local rank 0's, in the window), the leader
        allreduces that whole node sum with the other nodes' leaders, and every rank copies
        the result out of the leader's data, post-scaled. The caller's next arrival tells the
        leader its data has been read.

        Returns True on the leader when its result lies in that data already (a bucket in the
        window): the caller post-scales it after that arrival, not before (the other ranks
        would read it scaled twice)."""
        win, me, dtype, n = self.window, self.local_rank, out.dtype, out.size
        offsets = win.published()
        total = win.data(0, int(offsets[0]), 0, n, dtype)
        if lo < hi:
            inputs = [src[lo:hi] if q == me else win.data(q, int(offsets[q]), lo, hi, dtype)
                      for q in range(self.local_size)]
            _native.reduce_slices(inputs, [total[lo:hi]], op, pre, 1.0)
        win.arrive(int(offsets[me]), "allreduce: node reduced")
        if me == 0:
            self._mpi_allreduce(self.cross, total, op)
        win.arrive(int(offsets[me]), "allreduce: nodes reduced")
        if me == 0 and _address(total) == _address(out):
            return True
        _native.reduce_slices([total], [out], op, 1.0, post)
        return False

    # -- process sets and lifetime -----------------------------------------------------------------
    def sub(self, ranks) -> MpiBackend | None:
        """Collective over this set: a backend for ``ranks`` (None on non-members), staged as
        this one."""
        comm = sub_communicator(self.comm, ranks)
        return None if comm is None else create(comm, self.window_bytes, self.timeout_s,
                                                self.mpi_below_bytes, self.negotiation_words)

    def free(self) -> None:
        """Locally: keep the window mapped (see :meth:`NodeWindow.retire`), free the
        communicators."""
        self.window.retire()
        for comm in (self.node, self.cross):
            if comm != MPI.COMM_NULL:
                comm.Free()
        self.node = self.cross = MPI.COMM_NULL
        super().free()

    def close(self) -> None:
        """Collective: free the window (see :meth:`NodeWindow.close`), then :meth:`free`."""
        self.window.close()
        self.free()


def _supported(dtype: np.dtype, op: int) -> bool:
    """What the native slice reduction takes (src_native/slices.c): 16-bit floats sum, bools
    take Min and Max, every other dtype Sum, Min, Max and Product."""
    if dtype in HALF_DTYPES:
        return op == Sum
    if dtype == np.bool_:
        return op in (Min, Max)
    return op in (Sum, Min, Max, Product) and dtype.kind in "iuf"


def create(comm: MPI.Comm, window_bytes: int, timeout_s: float,
           mpi_below_bytes: int = MPI_BELOW_BYTES,
           negotiation_words: int = _WORDS) -> MpiBackend:
    """Collective over ``comm`` (which the backend owns from now on): a
    :class:`HierarchicalBackend` over the nodes MPI sees (``COMM_TYPE_SHARED``), or a plain
    :class:`MpiBackend` when every node holds one rank of ``comm`` (plain MPI is then all
    there is to do). Any number of ranks per node.

    Raises SharedMemoryError when the window cannot be made."""
    if _native is None:
        raise SharedMemoryError(
            "the hierarchical allreduce needs hpc_horovod's native extension (reinstall with an "
            f"MPI compiler wrapper, mpicc, on the PATH) or {SWITCH_OFF}")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    if max(comm.allgather(node.Get_size())) == 1:
        node.Free()
        return MpiBackend(comm)
    try:
        return HierarchicalBackend(comm, node, window_bytes, timeout_s, mpi_below_bytes,
                                   negotiation_words)
    except BaseException:
        node.Free()
        raise
