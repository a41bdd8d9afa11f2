"""The engine: the intake of requests, the background thread and the lifecycle, the public face
over the :mod:`coordinator` (what the ranks agree on each cycle: the protocol is written there)
and :mod:`execution` (how agreed tensors run).

Callers enqueue :class:`Request` objects and get handles back at once. The engine thread wakes as
soon as something is enqueued (and, since peers may need it, every ``HOROVOD_CYCLE_TIME`` ms
while busy, backing off to ``IDLE_MAX_S`` while every rank is idle, both counted from the
rank's last cycle, whichever thread ran it), and runs a cycle: the queue
is admitted, then the coordinator runs one round on each process set this rank belongs to, in
id order, and the handles it completes wake their callers.

Cycles are collectives, so they run one at a time (``_cycle_lock``), but not always on the
engine thread: a caller blocked in :meth:`Engine.wait` runs them itself, which saves the two
thread switches of a hand-off, and the engine thread leaves them to it meanwhile. The thread is
still what moves asynchronous work that nobody waits for yet, and what keeps idle peers
company; synchronous ops do not even wake it (:meth:`Engine.synchronous`). On a rank that runs
on one core, where nothing overlaps the training anyway, host work does not wake it either: it
is run by the thread that waits for it (:func:`overlaps`).

Lifecycle (:class:`State`): RUNNING from creation (a caller may run cycles before the thread
starts); STOPPING once ``shutdown()`` asked (the next cycle tells every rank); then STOPPED
(every rank agreed to stop, or the peers shut down: in that same cycle every rank closes its
backends, whether it asked or not, and its pending handles raise) or FAILED (an error: a stall
past ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``, a peer's fatal error or a peer that stops
answering ends the engine on every rank with a message that names who and why; every pending
handle then raises it).

Counters that several threads change (the threads inside :meth:`Engine.wait`, inside
synchronous ops, ``patience``'s waiting threads) change under a lock of their own: ``+=`` is no
atomic step even under the GIL, and one lost update would leave a count wrong for good. They
are read without it. What changes only inside a cycle (cycle and join counts, cache
generations, set ids) is guarded by the cycle lock, which one thread holds at a time.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import itertools
import os
import threading
import time
from collections.abc import Callable

from ..backends.waiting import abandoned
from .config import Settings
from .coordinator import Coordinator, ProcessSetState
from .errors import SHUT_DOWN, HorovodInternalError
from .execution import Execution
from .interrupts import HeldSignals
from .log import log
from .patience import waiting_caller
from .request import Request
from .whereabouts import IDLE, Whereabouts

#: the longest an idle engine waits between cycles (see Engine._loop)
IDLE_MAX_S = 0.05
#: how often a caller blocked in ``wait`` behind another thread's cycle looks whether that
#: cycle completed its request
WAIT_POLL_S = 0.001
#: handles are unique in the process, across engines: a handle kept from before a re-init can
#: never name a request of the new engine
_HANDLES = itertools.count()
_DUPLICATE = ("Requested to allreduce, allgather, or broadcast a tensor with the same name as "
              "another tensor that is currently being processed.  If you want to request "
              "another tensor, use a different tensor name. [{}]")


def overlaps() -> bool:
    """Whether this process may run on more than one core (its CPU affinity). With one, the
    engine thread and the training thread never run at once: a host reduction in the
    background cannot overlap the training, it only takes turns with it on the core, and pays
    the thread switches and the peers' wake-ups of work done out of sight (a rank bound to one
    core: ``srun --cpus-per-task=1``, ``hpc-horovod run`` with one core per rank). There, the
    thread that waits for a host result runs its cycles, on its own core, as the synchronous
    ops do; device work (NCCL on the GPU's stream) still starts at once, and host work nobody
    waits for yet moves at the engine's idle pace."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):  # not Linux
        return True


class State(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"  # shutdown() asked: the next cycle tells every rank
    STOPPED = "stopped"  # the ranks stopped together (a shutdown): a new engine is needed
    FAILED = "failed"  # stopped on an error (``Engine.error``)


class _Alarm:
    """Set by the thread that watches the peers (``common.watch``) when one failed or was
    lost; every wait of a cycle gives up with it, and so does the next cycle. ``census``,
    when the ranks have a side channel: a wait that times out calls it for one line naming
    the ranks that did not answer and where the others are (``PeerWatch.census``)."""

    __slots__ = ("error", "census")

    def __init__(self):
        self.error: HorovodInternalError | None = None
        self.census: Callable[[], str] | None = None


class _Synchronous:
    """:meth:`Engine.synchronous`: one per engine, its state kept per thread (nestable)."""

    __slots__ = ("_engine", "_local")

    def __init__(self, engine: Engine):
        self._engine = engine
        self._local = engine._local

    def __enter__(self) -> None:
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        if local.depth == 1:
            engine = self._engine
            with engine._count_lock:
                engine._synchronous_threads += 1

    def __exit__(self, *exc_info) -> None:
        local = self._local
        local.depth -= 1
        if local.depth:
            return
        engine = self._engine
        with engine._count_lock:
            engine._synchronous_threads -= 1
        if not engine._callers and engine._left_over():
            engine._wake()


class Engine:
    def __init__(self, backend, settings: Settings, timeline=None):
        self.settings = settings
        self.timeline = timeline
        self.backend = backend
        self.rank = backend.rank
        self.size = backend.size
        self._sets: dict[int, ProcessSetState] = {
            0: ProcessSetState(0, list(range(backend.size)), backend, settings)
        }
        self._members: dict[int, list[int]] = {0: list(range(backend.size))}
        self._next_set_id = 1
        self._queue: collections.deque[Request] = collections.deque()
        #: whether the engine thread runs host work in the background (see :func:`overlaps`)
        self.overlaps = overlaps()
        self._cond = threading.Condition()
        self._sleeping = False  # the engine waits on _cond: submitters must notify it
        #: guards the counts of threads below (see the module's docstring)
        self._count_lock = threading.Lock()
        #: threads inside wait(): they run the cycles themselves, and the engine thread leaves
        #: the work to them until the last one goes (see _loop)
        self._callers = 0
        self._local = threading.local()  # .depth: this thread is inside synchronous ops
        #: threads inside synchronous ops: what they submit, they run the cycles for themselves
        self._synchronous_threads = 0
        self._synchronous = _Synchronous(self)
        self._done = threading.Condition()  # notified when a stopping engine fails requests
        # Held for a whole cycle, by the engine thread or by a caller of wait(): cycles are
        # collectives and must run one at a time, in the same order on every rank.
        self._cycle_lock = threading.Lock()
        #: a cycle a caller runs holds the signals (``interrupts``): alone, a rank has no peers
        #: to leave inside a collective, and its cycles need not pay for it
        self._hold_signals = HeldSignals if backend.size > 1 else contextlib.nullcontext
        self._inflight: dict[tuple[int, str], Request] = {}
        self._handles: dict[int, Request] = {}
        self._handle_counter = _HANDLES
        #: changed under ``_cond`` (shutdown() and the cycle that stops race otherwise)
        self._state = State.RUNNING
        self._error: HorovodInternalError | None = None
        self._alarm = _Alarm()
        #: where this engine is: the watch bounds its data calls and answers censuses with it
        self.whereabouts = Whereabouts(settings.peer_timeout_s)
        self._coordinator = Coordinator(
            Execution(self._control, self._complete, self._forget_done, self.whereabouts),
            self._complete, self._alarm, self.whereabouts)
        #: called once with the error when this engine stops on an error of its own (not one
        #: every rank reached together, not a peer's): the peers must learn it
        self.on_local_error = None
        #: called each time a submission or a leaving caller wakes the engine thread (a test's
        #: window on the hand-offs between threads)
        self.on_wake = None
        #: called at the start of every cycle, on the thread that runs it
        self.on_cycle = None
        #: called by :meth:`submit` after its check that the engine runs, before the request is
        #: claimed and queued: a test's window on a stop that lands right there
        self.on_submit = None
        self._cycles = 0
        #: when this rank's last cycle ended, whichever thread ran it: the engine thread's
        #: pace counts from there (see _loop)
        self._cycle_ended = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="hpc_horovod-engine",
                                         daemon=True)

    # -- caller side ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def add_static_process_set(self, ranks: list[int], backend) -> int:
        """Register a set created collectively at init, before the thread starts; returns its
        id."""
        ps_id = self._next_set_id
        self._next_set_id += 1
        self._members[ps_id] = list(ranks)
        if backend is not None:
            self._sets[ps_id] = ProcessSetState(ps_id, list(ranks), backend, self.settings)
        return ps_id

    def process_set_ranks(self, ps_id: int) -> list[int]:
        try:
            return self._members[ps_id]
        except KeyError:
            raise ValueError(f"process set {ps_id} does not exist (or was removed)") from None

    def process_set_backend(self, ps_id: int):
        """The backend of process set ``ps_id`` on this rank; None where this rank is not a
        member (or the set does not exist)."""
        state = self._sets.get(ps_id)
        return None if state is None else state.backend

    def join_epoch(self, ps_id: int) -> int:
        """How many joins completed on the set: the same on every member once its join
        returned, whatever collectives each rank submitted before (see basics.next_name)."""
        state = self._sets.get(ps_id)
        return 0 if state is None else state.joins

    def enqueue(self, requests: list[Request]) -> list[int]:
        """Hand requests to the engine, all or none; returns their handles. Raises on duplicate
        names."""
        if self._state is not State.RUNNING:
            self._raise_if_stopped()
        for i, req in enumerate(requests):
            try:
                self._claim(req)
            except ValueError:
                self._forget(requests[:i])
                raise
        return [self._push(req) for req in requests]

    def submit(self, req: Request) -> int:
        """:meth:`enqueue` of one request: the path every gradient takes.

        No lock here: the GIL makes ``dict.setdefault``, ``deque.append`` and ``next(count)``
        atomic, and the engine thread is woken only when it sleeps.
        """
        if self._state is not State.RUNNING:
            self._raise_if_stopped()
        if self.on_submit is not None:
            self.on_submit()
        self._claim(req)
        return self._push(req)

    def _claim(self, req: Request) -> None:
        if req.process_set_id not in self._members:
            raise ValueError(f"process set {req.process_set_id} does not exist")
        if self._inflight.setdefault(req.key, req) is not req:
            raise ValueError(_DUPLICATE.format(req.name))

    def _push(self, req: Request) -> int:
        req.handle = handle = next(self._handle_counter)
        self._handles[handle] = req
        self._queue.append(req)
        if self._sleeping and (self.overlaps or req.signature.device):
            self._on_sleeping_engine()
        if self.stopped:  # stopped meanwhile: nobody else will complete it
            self._fail_leftovers()
        return handle

    def _on_sleeping_engine(self) -> None:
        """A submission found the engine thread asleep: wake it, unless the submitter is
        inside a synchronous op and runs the cycles itself."""
        if not getattr(self._local, "depth", 0):
            self._wake()

    def _wake(self) -> None:
        if self.on_wake is not None:
            self.on_wake()
        with self._cond:
            self._sleeping = False
            self._cond.notify()

    def _leave(self) -> None:
        """A caller leaves wait(): the last one hands what is left on this rank (another
        thread's work, or what an error cut short) to the engine thread, unless it is inside
        a synchronous op, whose exit does that."""
        with self._count_lock:
            self._callers -= 1
        if not self._callers and not getattr(self._local, "depth", 0) and self._left_over():
            self._wake()

    def synchronous(self) -> _Synchronous:
        """Context of an op that waits for what it submits (``allreduce``, not
        ``allreduce_async``): its submissions leave the engine thread asleep, since the caller
        runs the cycles itself in :meth:`wait`. Waking the thread for nothing costs two thread
        switches and a GIL hand-off, more than the whole of a small allreduce. On leaving, work
        this rank still has (another thread's, or what an error cut short) is handed to the
        thread."""
        return self._synchronous

    def _forget(self, requests: list[Request]) -> None:
        for req in requests:
            self._inflight.pop(req.key, None)

    def request(self, handle: int) -> Request:
        try:
            return self._handles[handle]
        except KeyError:
            raise ValueError(f"handle {handle} was not created or has been cleared") from None

    def poll(self, handle: int) -> bool:
        return self.request(handle).done

    def wait(self, handle: int) -> Request:
        """Block until the handle completes; forget it; raise its error if it failed.

        The caller runs the engine's cycles itself instead of waking the engine thread and
        sleeping in turn: two thread switches are most of the latency of a small synchronous
        allreduce. Meanwhile the engine thread
        leaves the cycles to it (see _loop): a timer cycle of its own would only make the
        caller wait for the lock.
        """
        req = self._handles.get(handle)
        if req is None:
            raise ValueError(f"handle {handle} was not created or has been cleared")
        if not req.done:
            with self._count_lock:
                self._callers += 1
            try:
                with waiting_caller:  # the rank has nothing else to run: waits keep the core
                    self._run_cycles_until(req)
            finally:
                self._leave()
        del self._handles[handle]
        if req.error is not None:
            raise req.error
        return req

    def _run_cycles_until(self, req: Request) -> None:
        lock = self._cycle_lock
        while not req.done:
            # A blocking acquire, which lets go of the GIL: the lock may be on its way to a
            # thread that holds it already but waits for the GIL to go on (it is then held,
            # yet not ``locked()``). Polling for it without letting go of the GIL would starve
            # that thread until the interpreter's switch interval. The timeout: a cycle of
            # another thread may complete ``req`` long before it ends.
            if not self.stopped and lock.acquire(timeout=WAIT_POLL_S):
                try:
                    if not req.done and not self.stopped:
                        with self._hold_signals():  # an interrupt waits for the cycle's end
                            self._guarded_cycle()
                finally:
                    lock.release()
            elif self.stopped:  # every request is being completed with the engine's error
                with self._done:
                    if not req.done:
                        self._done.wait(1.0)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop on every rank (a normal end: a failure reaches the peers through
        ``common.watch``). Waits for the engine thread's last cycle, at most ``timeout_s``
        (None: as long as it takes)."""
        with self._cond:
            if self._state is State.RUNNING:
                self._state = State.STOPPING
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def use_census(self, census: Callable[[], str]) -> None:
        """The side channel's census (``PeerWatch.census``): a wait for peers that times out
        names the ranks that did not answer, and where the others are, with it."""
        self._alarm.census = census

    def peer_failed(self, error: HorovodInternalError) -> None:
        """A peer failed or was lost (from the watch's thread): the cycle under way gives up
        and the engine stops with ``error``; the next op raises it."""
        if self._alarm.error is None:
            self._alarm.error = error
        self._wake()

    @property
    def peer_error(self) -> HorovodInternalError | None:
        """The error a failed or lost peer brought (see :meth:`peer_failed`), if any."""
        return self._alarm.error

    @property
    def state(self) -> State:
        return self._state

    @property
    def stopped(self) -> bool:
        """The engine ran its last cycle (shut down, or failed): a new one is needed."""
        return self._state is State.STOPPED or self._state is State.FAILED

    @property
    def asleep(self) -> bool:
        """The engine thread waits for a submission (or its timer): a submission wakes it."""
        return self._sleeping

    @property
    def cycles(self) -> int:
        """How many cycles ran, on any thread."""
        return self._cycles

    @property
    def queued(self) -> int:
        """Requests submitted and not yet admitted by a cycle."""
        return len(self._queue)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def paused(self):
        """Context in which no cycle runs (it holds the cycle lock): submissions queue up."""
        return self._cycle_lock

    def run_cycle(self) -> None:
        """One cycle now, on this thread (the engine's thread, or a waiter's, runs them
        otherwise): what a test of an engine without a thread needs."""
        with self._cycle_lock:
            if not self.stopped:
                self._guarded_cycle()

    @property
    def error(self) -> HorovodInternalError | None:
        return self._error

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise self._error.copy()
        peers = self._coordinator.stopped_by_peers
        if peers is not None:
            raise peers.copy()
        if self._state is not State.RUNNING:
            raise ValueError(SHUT_DOWN)

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:  # normally already stopped by the cycle that agreed on it, or failed
            with self._cycle_lock:
                self._stop()

    def _loop(self) -> None:
        cycle_s = idle_s = self.settings.cycle_time_ms / 1000.0
        while not self.stopped:
            if self._callers and self._state is State.RUNNING:
                # Callers run the cycles, and every cycle admits the whole queue: a cycle here
                # would only make them wait for it (two thread switches and a GIL hand-off on
                # a shared core). Submissions do not notify meanwhile (_sleeping stays False);
                # the last caller to go hands over what is left (_leave).
                with self._cond:
                    if self._callers and self._state is State.RUNNING:
                        self._cond.wait(cycle_s)
                continue
            woken = False
            if not self._eager(self._queue) and self._state is State.RUNNING:
                with self._cond:
                    self._sleeping = True  # set before looking: see submit
                    # The pace is the longest this rank goes without a cycle: it counts from
                    # the last one, which a waiting caller may have run meanwhile. A rank whose
                    # training thread waits for its buckets every step has kept its peers
                    # company already; a timer cycle in the middle of its next backward would
                    # only agree on part of the step's buckets (one more round for the rest)
                    # and make the caller that comes to wait queue behind it for the lock.
                    while not woken and not self._eager(self._queue) \
                            and self._state is State.RUNNING:
                        left = self._cycle_ended + idle_s - time.monotonic()
                        if left <= 0:
                            break
                        woken = self._cond.wait(left)
                    self._sleeping = False
            with self._cycle_lock:
                stopped = self.stopped
                # Woken by a submission, but a waiting caller already ran the cycle that
                # completed it (see wait): nothing is left for peers to wait on.
                ran = not stopped and not (woken and self._idle())
                if ran:
                    self._guarded_cycle()
            if stopped:
                break
            if not ran:
                continue
            # While this rank has work pending, a peer that submits it later needs this
            # rank's next negotiation soon: cycle every HOROVOD_CYCLE_TIME. Otherwise cycles
            # only keep peers company (stall reports, shutdown, a peer that never submits):
            # a peer's work cannot be ready before this rank submits it too, and a submission
            # wakes the engine at once. So an engine with nothing of its own backs off, even
            # right after work, and does not take the core from the training thread (or make
            # a peer's engine wait for it) between a training step's buckets. Work that a
            # caller submitted during this cycle is the caller's to run: were it counted here,
            # the pace would stay at HOROVOD_CYCLE_TIME, a timer cycle would start in every
            # gap between synchronous ops and meet a peer's op cycle, and every op would take
            # one more round of negotiation (a caller that leaves work behind wakes the
            # engine: _leave, and _Synchronous.__exit__ for the thread of a synchronous op).
            # Host work on a rank of one core is not the thread's own either (see overlaps):
            # it moves at the idle pace until somebody waits for it.
            mine = self._own_work() and not (self._callers or self._synchronous_threads)
            idle_s = cycle_s if mine else min(idle_s * 2, max(cycle_s, IDLE_MAX_S))

    def _eager(self, requests) -> bool:
        """Whether some of ``requests`` (the queue, or a set's pending requests) is work the
        engine thread runs as soon as it can: any request where it overlaps the training (see
        :func:`overlaps`), else a device one. Other threads change these containers: they are
        looked at through a copy (``tuple`` takes it under the GIL, in one step)."""
        if self.overlaps:
            return bool(requests)
        return any(req.signature.device for req in tuple(requests))

    def _own_work(self) -> bool:
        """Some request of this rank that the engine thread runs as soon as it can
        (:meth:`_eager`) is queued or pending, or a join is."""
        eager = self._eager
        return eager(self._queue) or any(ps.join_request or eager(ps.pending.values())
                                         for ps in tuple(self._sets.values()))

    def _left_over(self) -> bool:
        """What a leaving caller hands to the engine thread: its own work, or a stop."""
        return self._state is not State.RUNNING or self._own_work()

    def _idle(self) -> bool:
        return (not self._queue and self._state is State.RUNNING
                and not any(ps.pending or ps.join_request for ps in self._sets.values()))

    def _guarded_cycle(self) -> None:
        """One cycle, by whichever thread holds ``_cycle_lock``. Whatever it raises ends the
        engine on this rank (peers learn it from the broken negotiation or their timeout): its
        cycles are collectives, and one cut short leaves this rank out of step with the others.
        """
        try:
            if self._cycle():
                self._stop()
        except HorovodInternalError as exc:
            self._error = exc
            self._stop()
        except BaseException as exc:
            # An MPI error, a bug, or, in a caller blocked in wait(), whatever interrupted it
            # (KeyboardInterrupt, a signal handler's exception): the engine stops with an
            # error that says so, the peers learn it, and a caller sees its own exception.
            self._error = HorovodInternalError(f"{type(exc).__name__}: {exc}")
            self._stop()
            if threading.current_thread() is not self._thread:
                raise
            log.exception("hpc_horovod engine failed")
        finally:
            self.whereabouts.now = IDLE
            self._cycle_ended = time.monotonic()

    def _cycle(self) -> bool:
        """Admit the queue, then one negotiation and execution round on every process set;
        True when the engine must stop."""
        if self._alarm.error is not None:
            raise self._alarm.error.copy()
        if self.on_cycle is not None:
            self.on_cycle()
        shutting_down = self._state is State.STOPPING
        queue, sets, tl = self._queue, self._sets, self.timeline
        now = time.monotonic()
        while queue:
            req = queue.popleft()
            req.submitted_at = now
            ps = sets.get(req.process_set_id)
            if ps is None or req.signature.kind == "join":
                self._admit(req)
            else:
                ps.pending[req.name] = req
                if tl is not None:
                    tl.negotiate_start(req.name, req.signature.kind)
        self._cycles += 1
        if tl is not None and self.settings.timeline_mark_cycles:
            tl.mark_cycle()
        cycle, settings = self._coordinator.cycle, self.settings
        if cycle(sets[0], shutting_down, settings, tl):
            return True
        for ps_id in sorted(sets):
            if ps_id != 0 and ps_id in sets:  # a control step may remove sets
                cycle(sets[ps_id], False, settings, tl)
        return False

    def _admit(self, req: Request) -> None:
        """The uncommon admissions: a join, or a set this rank is not a member of."""
        ps = self._sets.get(req.process_set_id)
        if ps is None:
            self._complete(req, error=ValueError(
                f"this rank is not a member of process set {req.process_set_id}"))
            return
        if req.kind == "join":
            ps.join_request = req
            ps.join_cycle = self._cycles

    def _control(self, ps: ProcessSetState, sig, req: Request) -> None:
        """A control step, agreed like a collective (``execution.CONTROL``): a process set
        created or removed, on every rank in the same cycle. Creation is collective over
        ``ps``'s communicator."""
        if sig.kind == "process_set_add":
            ranks = list(sig.shape)
            sub = ps.backend.sub(ranks)
            ps_id = self._next_set_id
            self._next_set_id += 1
            self._members[ps_id] = ranks
            if sub is not None:
                self._sets[ps_id] = ProcessSetState(ps_id, ranks, sub, self.settings)
            req.result = ps_id
            return
        state = self._sets.pop(sig.root, None)
        self._members.pop(sig.root, None)
        if state is not None:
            for pending in list(state.pending.values()):
                self._complete(pending, error=ValueError(
                    f"process set {sig.root} was removed while this op was pending"))
            state.backend.free()

    def _forget_done(self, group: list[Request | None]) -> None:
        """Mark a group's requests done and free their names."""
        forget = self._inflight.pop
        for req in group:
            if req is not None:
                forget(req.key, None)
                req.done = True

    def _complete(self, req: Request, error: BaseException | None = None) -> None:
        req.error = error
        self._inflight.pop(req.key, None)
        req.done = True

    def _fail(self, requests) -> None:
        """Complete ``requests`` with the engine's error (or the shutdown text) and wake the
        callers."""
        error = (self._error or self._coordinator.stopped_by_peers
                 or HorovodInternalError(SHUT_DOWN))
        for req in requests:
            if not req.done:
                self._complete(req, error=error.copy())
        with self._done:
            self._done.notify_all()

    def _drain_queue(self) -> list[Request]:
        drained = []
        while self._queue:
            drained.append(self._queue.popleft())
        return drained

    def _fail_leftovers(self) -> None:
        """Complete with the engine's error whatever was enqueued after it stopped."""
        self._fail(self._drain_queue())

    def _stop(self) -> None:
        """The last cycle ran (under ``_cycle_lock``): fail what is left."""
        error = self._error
        with self._cond:
            if self.stopped:
                return
            self._state = State.STOPPED if error is None else State.FAILED
        if error is not None:  # device work in flight may wait for a peer that is gone
            for ps in self._sets.values():
                ps.backend.abort()
            if not error.agreed and self._alarm.error is None and self.on_local_error:
                self.on_local_error(error)
        else:
            # Every rank stops in this cycle: the one moment they all close together. Later
            # (at a rank's next init, shutdown or exit) a rank that did not ask would come
            # when it likes, and the others would wait for it up to the peer timeout.
            for ps in self._sets.values():
                ps.backend.close()
        # Every accepted request not yet completed (all are in _inflight until then): queued,
        # pending, a join, or one cut off mid-execution.
        leftovers = self._drain_queue() + list(self._inflight.values())
        for ps in self._sets.values():
            ps.pending.clear()
            ps.join_request = None
        if self.timeline is not None:
            self.timeline.close()
        self._fail(leftovers)

    def abandon_backends(self) -> None:
        """After a failure: keep every backend (and its communicator) alive for the life of
        the process instead of freeing it, since a collective this rank gave up on may still
        complete and MPI then writes through it."""
        abandoned.extend(ps.backend for ps in self._sets.values())
