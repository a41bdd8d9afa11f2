"""The background thread that owns every collective after ``init``.

Callers enqueue :class:`Request` objects and get handles back at once. The engine thread wakes as
soon as something is enqueued (and, since peers may need it, every ``HOROVOD_CYCLE_TIME`` ms
while busy, backing off to ``IDLE_MAX_S`` while every rank is idle), and for each process set
this rank belongs to, in id order, runs one cycle:

1. negotiate (``negotiation``): which pending names are ready on every rank;
2. execute the agreed ones: allreduces fused per (dtype, op, scales) (``fusion``), the other
   collectives one by one (``collectives``), in an order identical on every rank;
3. complete the handles and wake the callers.

Cycles are collectives, so they run one at a time (``_cycle_lock``), but not always on the
engine thread: a caller blocked in :meth:`Engine.wait` runs them itself, which saves the two
thread switches of a hand-off, and the engine thread leaves them to it meanwhile. The thread is
still what moves asynchronous work that nobody waits for yet, and what keeps idle peers
company; synchronous ops do not even wake it (:meth:`Engine.synchronous`).

A shutdown, a stall past ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``, a peer's fatal error or a
peer that stops answering ends the engine on every rank with a message that names who and why;
every pending handle then raises it.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import sys
import threading
import time

import numpy as np

from ..backends.waiting import abandoned, take_deferred
from .collectives import (
    adasum_one,
    allgather_group,
    alltoall_one,
    broadcast_one,
    reducescatter_one,
)
from .config import Settings
from .errors import SHUT_DOWN, HorovodInternalError
from .fusion import FusedAllreduce, group_allreduces
from .negotiation import (
    FLAG_ABORT,
    FLAG_JOINED,
    FLAG_SHUTDOWN,
    FLAG_STALL,
    FLAG_UNCACHED,
    ResponseCache,
    iter_bits,
    match,
    pack_words,
    stall_message,
    unpack_words,
)
from .patience import waiting_caller
from .request import Request
from .types import Adasum, Signature

log = logging.getLogger("hpc_horovod")
_FULL = FLAG_UNCACHED | FLAG_SHUTDOWN | FLAG_STALL | FLAG_ABORT
#: the longest an idle engine waits between cycles (see Engine._run)
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


class Plan:
    """How one set of agreed tensors executes, identically on every rank: their names and
    signatures in execution order, and the steps, each a slice of them:
    ``(activity, start, stop, FusedAllreduce or None)``. Allreduces come first, fused per
    dtype/op/scales up to the fusion threshold, then allgathers (host, then device), then the
    other collectives one by one. ``order[i]`` is the position, in the lists the plan was built
    from, of its i-th tensor.

    A training step submits the same gradients every time, so plans of ready sets that came
    from the response cache are kept (:meth:`ProcessSetState.cached_plan`): the grouping and
    the fusion layout are then computed once, not once per step.
    """

    __slots__ = ("names", "sigs", "steps", "order")

    def __init__(self, names: list[str], sigs: list[Signature], threshold: int):
        reductions, gathers, devices, others = [], [], [], []
        for i, sig in enumerate(sigs):
            if sig.kind == "allreduce" and sig.op != Adasum:
                reductions.append(i)
            elif sig.kind == "allgather":
                (devices if sig.device else gathers).append(i)
            else:
                others.append(i)
        groups = [("ALLREDUCE", g, True)
                  for g in group_allreduces(sigs, reductions, threshold)]
        groups += [("ALLGATHER", g, False) for g in (gathers, devices) if g]
        groups += [(sigs[i].kind.upper(), [i], False) for i in others]
        self.order, self.steps = [], []
        for activity, indices, fuse in groups:
            start = len(self.order)
            self.order += indices
            fused = FusedAllreduce([sigs[i] for i in indices]) if fuse else None
            self.steps.append((activity, start, len(self.order), fused))
        self.names = [names[i] for i in self.order]
        self.sigs = [sigs[i] for i in self.order]


def _cache_bits(pending: dict[str, Request], entries: dict) -> tuple[int, bool]:
    """(the response cache's bits of the pending requests it holds with the same signature,
    whether some request is not there)."""
    bits, uncached = 0, False
    for name, req in pending.items():
        entry = entries.get(name)
        if entry is not None and (entry[1] is req.signature or entry[1] == req.signature):
            bits |= 1 << entry[0]
        else:
            uncached = True
    return bits, uncached


class ProcessSetState:
    """Engine-side state of one process set this rank belongs to."""

    MAX_PLANS = 64

    def __init__(self, ps_id: int, ranks: list[int], backend, settings: Settings):
        self.id = ps_id
        self.ranks = ranks
        self.backend = backend
        self.cache = ResponseCache(settings.cache_capacity)
        self.pending: dict[str, Request] = {}
        self.join_request: Request | None = None
        self.join_cycle = 0
        #: joins completed on this set: automatic names restart after each (see join_epoch)
        self.joins = 0
        self.last_stall_report = time.monotonic()
        self._plans: dict[int, Plan] = {}
        self._plans_generation = -1

    def cached_plan(self, ready_bits: int, threshold: int) -> Plan:
        """The plan of the tensors whose cache bits are ``ready_bits``; valid while the cache's
        bit assignments do not change."""
        cache = self.cache
        if self._plans_generation != cache.generation or len(self._plans) >= self.MAX_PLANS:
            self._plans.clear()
            self._plans_generation = cache.generation
        plan = self._plans.get(ready_bits)
        if plan is None:
            names = [cache.name(bit) for bit in iter_bits(ready_bits)]
            sigs = [cache.signature(name) for name in names]
            plan = self._plans[ready_bits] = Plan(names, sigs, threshold)
        return plan


class _Alarm:
    """Set by the thread that watches the peers (``common.watch``) when one failed or was
    lost; every wait of a cycle gives up with it, and so does the next cycle."""

    __slots__ = ("error",)

    def __init__(self):
        self.error: HorovodInternalError | None = None


class _Synchronous:
    """:meth:`Engine.synchronous`: one per engine, its state kept per thread (nestable)."""

    __slots__ = ("_engine", "_local")

    def __init__(self, engine: Engine):
        self._engine = engine
        self._local = engine._local

    def __enter__(self) -> None:
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1

    def __exit__(self, *exc_info) -> None:
        local = self._local
        local.depth -= 1
        engine = self._engine
        if not local.depth and not engine._callers and not engine._idle():
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
        self._cond = threading.Condition()
        self._sleeping = False  # the engine waits on _cond: submitters must notify it
        # Threads inside wait(): they run the cycles themselves, and the engine thread leaves
        # the work to them until the last one goes (see _loop).
        self._callers = 0
        self._local = threading.local()  # .depth: this thread is inside synchronous ops
        self._synchronous = _Synchronous(self)
        self._done = threading.Condition()  # notified when a stopping engine fails requests
        # Held for a whole cycle, by the engine thread or by a caller of wait(): cycles are
        # collectives and must run one at a time, in the same order on every rank.
        self._cycle_lock = threading.Lock()
        self._inflight: dict[tuple[int, str], Request] = {}
        self._handles: dict[int, Request] = {}
        self._handle_counter = _HANDLES
        self._shutting_down = False  # shutdown() was called: the next cycle says so
        self._error: HorovodInternalError | None = None
        #: the error a later op gets after peers shut down while this rank had nothing pending
        #: (its script may be about to end too: that is no failure)
        self._stopped_by_peers: HorovodInternalError | None = None
        self._stopped = False
        self._closed = False  # any of: shutdown asked, engine failed, engine stopped
        self._worked = False  # the current cycle had something to do, here or on a peer
        self._alarm = _Alarm()
        #: called once with the error when this engine stops on an error of its own (not one
        #: every rank reached together, not a peer's): the peers must learn it
        self.on_local_error = None
        self._cycles = 0
        self._thread = threading.Thread(target=self._run, name="hpc_horovod-engine",
                                         daemon=True)

    # -- caller side ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def add_static_process_set(self, ps_id: int, ranks: list[int], backend) -> None:
        """Register a set created collectively at init, before the thread starts."""
        self._members[ps_id] = list(ranks)
        if backend is not None:
            self._sets[ps_id] = ProcessSetState(ps_id, list(ranks), backend, self.settings)
        self._next_set_id = max(self._next_set_id, ps_id + 1)

    def process_set_ranks(self, ps_id: int) -> list[int]:
        try:
            return self._members[ps_id]
        except KeyError:
            raise ValueError(f"process set {ps_id} does not exist (or was removed)") from None

    def join_epoch(self, ps_id: int) -> int:
        """How many joins completed on the set: the same on every member once its join
        returned, whatever collectives each rank submitted before (see basics.next_name)."""
        state = self._sets.get(ps_id)
        return 0 if state is None else state.joins

    def process_set_ids(self) -> list[int]:
        return sorted(self._members)

    def enqueue(self, requests: list[Request]) -> list[int]:
        """Hand requests to the engine, all or none; returns their handles. Raises on duplicate
        names."""
        if self._closed:
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
        if self._closed:
            self._raise_if_stopped()
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
        if self._sleeping:
            self._on_sleeping_engine()
        if self._stopped:  # stopped meanwhile: nobody else will complete it
            self._fail_leftovers()
        return handle

    def _on_sleeping_engine(self) -> None:
        """A submission found the engine thread asleep: wake it, unless the submitter is
        inside a synchronous op and runs the cycles itself."""
        if not getattr(self._local, "depth", 0):
            self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._sleeping = False
            self._cond.notify()

    def _leave(self) -> None:
        """A caller leaves wait(): the last one hands what is left on this rank (another
        thread's work, or what an error cut short) to the engine thread, unless it is inside
        a synchronous op, whose exit does that."""
        self._callers -= 1
        if not self._callers and not getattr(self._local, "depth", 0) and not self._idle():
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
            if not self._stopped and lock.acquire(timeout=WAIT_POLL_S):
                try:
                    if not req.done and not self._stopped:
                        self._guarded_cycle()
                finally:
                    lock.release()
                    interrupt = take_deferred()
                if interrupt is not None:  # held while peers were awaited: the cycle is over
                    raise interrupt
            elif self._stopped:  # every request is being completed with the engine's error
                with self._done:
                    if not req.done:
                        self._done.wait(1.0)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop on every rank (a normal end: a failure reaches the peers through
        ``common.watch``). Waits for the engine thread's last cycle, at most ``timeout_s``
        (None: as long as it takes)."""
        with self._cond:
            self._shutting_down = self._closed = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

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
    def stopped(self) -> bool:
        """The engine ran its last cycle (shut down, or failed): a new one is needed."""
        return self._stopped

    @property
    def error(self) -> HorovodInternalError | None:
        return self._error

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise self._error.copy()
        if self._stopped_by_peers is not None:
            raise self._stopped_by_peers.copy()
        if self._stopped or self._shutting_down:
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
        while not self._stopped:
            if self._callers and not self._shutting_down:
                # Callers run the cycles, and every cycle admits the whole queue: a cycle here
                # would only make them wait for it (two thread switches and a GIL hand-off on
                # a shared core). Submissions do not notify meanwhile (_sleeping stays False);
                # the last caller to go hands over what is left (_leave).
                with self._cond:
                    if self._callers and not self._shutting_down:
                        self._cond.wait(cycle_s)
                continue
            woken = False
            if not self._queue and not self._shutting_down:
                with self._cond:
                    self._sleeping = True  # set before looking: see submit
                    if not self._queue and not self._shutting_down:
                        woken = self._cond.wait(idle_s)
                    self._sleeping = False
            with self._cycle_lock:
                stopped = self._stopped
                # Woken by a submission, but a waiting caller already ran the cycle that
                # completed it (see wait): nothing is left for peers to wait on.
                ran = not stopped and not (woken and self._idle())
                if ran:
                    self._worked = False
                    self._guarded_cycle()
            if stopped:
                break
            if not ran:
                continue
            # Idle cycles only keep peers company (stall reports, shutdown, a late peer):
            # back off so that an idle engine does not take the GIL from the training
            # thread a thousand times a second. A submission wakes it at once anyway.
            idle_s = cycle_s if self._worked else min(idle_s * 2, max(cycle_s, IDLE_MAX_S))

    def _has_work(self) -> bool:
        """Some request of this rank is queued or pending (a join included)."""
        return bool(self._queue) or any(ps.pending or ps.join_request
                                        for ps in self._sets.values())

    def _idle(self) -> bool:
        return (not self._queue and not self._shutting_down
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

    def _cycle(self) -> bool:
        """Admit the queue, then one negotiation and execution round on every process set;
        True when the engine must stop."""
        if self._alarm.error is not None:
            raise self._alarm.error.copy()
        shutting_down = self._shutting_down
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
        if self._cycle_set(sets[0], shutting_down):
            return True
        for ps_id in sorted(sets):
            if ps_id != 0 and ps_id in sets:
                self._cycle_set(sets[ps_id], None)
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

    def _cycle_set(self, ps: ProcessSetState, shutting_down: bool) -> bool:
        """One negotiation and execution round on ``ps``; True when the engine must stop."""
        backend, cache, pending = ps.backend, ps.cache, ps.pending
        or_flags, bits = 0, 0
        joined = ps.join_request is not None
        if pending or joined:
            self._worked = True
        if joined:
            bits = cache.valid_bits()
        cached, uncached = _cache_bits(pending, cache.entries)
        bits |= cached
        if uncached:
            or_flags |= FLAG_UNCACHED
        settings = self.settings
        if pending:
            now = time.monotonic()
            age = now - next(iter(pending.values())).submitted_at  # admitted oldest first
            if (settings.stall_check and age > settings.stall_check_time_s
                    and now - ps.last_stall_report > settings.stall_check_time_s):
                or_flags |= FLAG_STALL
            if settings.stall_shutdown_time_s and age > settings.stall_shutdown_time_s:
                or_flags |= FLAG_ABORT
        if shutting_down:
            or_flags |= FLAG_SHUTDOWN
        and_flags = FLAG_JOINED if joined else 0
        words = pack_words(or_flags, and_flags, bits, cache.nwords)
        backend.negotiate(words, settings.peer_timeout_s, self._alarm)
        or_all, and_all, ready_bits = unpack_words(words)
        all_joined = bool(and_all & FLAG_JOINED)

        plan, reqs = None, []
        if ready_bits or or_all:
            self._worked = True  # peers are busy: stay responsive
        if ready_bits and not all_joined:
            plan = ps.cached_plan(ready_bits, settings.fusion_threshold)
            pop = pending.pop
            reqs = [pop(name, None) for name in plan.names]
            if cache.tracks_use:
                cache.touch(plan.names)
        stop = False
        if or_all & _FULL:
            names, sigs = (list(plan.names), list(plan.sigs)) if plan is not None else ([], [])
            known = len(names)
            stop = self._full_negotiation(ps, or_all, shutting_down, names, sigs, reqs)
            if len(names) > known:
                plan = Plan(names, sigs, settings.fusion_threshold)
                reqs = [reqs[i] for i in plan.order]
        if plan is not None:
            self._execute(ps, plan, reqs)
        if all_joined:
            self._finish_join(ps)
        return stop

    def _full_negotiation(self, ps, or_all, shutting_down, names, sigs, reqs) -> bool:
        """Exchange every pending (name, signature); the newly agreed ones are appended to
        ``names``, ``sigs`` and ``reqs``. True when the engine must stop."""
        backend, cache = ps.backend, ps.cache
        mine = [(name, req.signature) for name, req in ps.pending.items()]
        gathered = backend.allgather_object((mine, ps.join_request is not None, shutting_down))
        joined = {r for r, g in enumerate(gathered) if g[1]}
        agreement = match([g[0] for g in gathered], joined, ps.ranks)
        for name, sig in agreement.ready:
            req = ps.pending.pop(name, None)
            if req is not None and req.signature == sig:
                sig = req.signature  # the interned one, so that later cycles compare identity
            cache.put(name, sig)
            names.append(name)
            sigs.append(sig)
            reqs.append(req)
        for name, message in agreement.errors:
            cache.evict(name)
            req = ps.pending.pop(name, None)
            if req is not None:
                self._complete(req, error=HorovodInternalError(message))
        now = time.monotonic()
        if or_all & (FLAG_STALL | FLAG_ABORT):
            ps.last_stall_report = now
            if agreement.waiting:
                text = stall_message(agreement.waiting, self.settings.stall_check_time_s)
                if or_all & FLAG_ABORT:
                    limit = self.settings.stall_shutdown_time_s
                    error = HorovodInternalError(
                        text + "\nAll ranks stop now: a stall lasted longer than "
                        f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={limit:g}."
                    )
                    late = sorted({r for ranks in agreement.waiting.values() for r in ranks})
                    error.agreed = True
                    error.culprit = (f"rank(s) {', '.join(map(str, late))} stalled: they did not "
                                     f"submit {', '.join(sorted(agreement.waiting)[:3])} for "
                                     f"{limit:g} s")
                    raise error
                if backend.rank == 0:
                    print(f"[hpc_horovod] WARNING: {text}", file=sys.stderr, flush=True)
        if or_all & FLAG_SHUTDOWN:
            if not shutting_down:
                ranks = ", ".join(str(ps.ranks[r]) for r, g in enumerate(gathered) if g[2])
                error = HorovodInternalError(
                    f"{SHUT_DOWN} Rank(s) {ranks} called shutdown while this rank still runs.")
                error.culprit = (f"rank(s) {ranks} finished (hvd.shutdown or the end of the "
                                 "script) while the others still ran collectives")
                error.agreed = True
                if self._has_work():
                    raise error
                self._stopped_by_peers = error
            return True
        return False

    def _execute(self, ps: ProcessSetState, plan: Plan, reqs: list[Request | None]) -> None:
        """Run the plan's steps, in the same order on every rank."""
        backend, tl = ps.backend, self.timeline
        for activity, start, stop, fused in plan.steps:
            sigs, group = plan.sigs[start:stop], reqs[start:stop]
            if fused is not None:
                fn = functools.partial(fused, backend, group)
            elif activity == "ALLGATHER":
                fn = functools.partial(allgather_group, backend, list(zip(sigs, group)))
            else:
                fn = functools.partial(self._execute_one, ps, sigs[0], group[0])
            self._run_group(backend, sigs[0].device, group, tl, activity, fn)

    def _execute_one(self, ps: ProcessSetState, sig, req) -> None:
        backend = ps.backend
        if sig.kind == "allreduce":
            adasum_one(backend, sig, req)
        elif sig.kind == "broadcast":
            broadcast_one(backend, sig, req)
        elif sig.kind == "alltoall":
            alltoall_one(backend, sig, req)
        elif sig.kind == "reducescatter":
            reducescatter_one(backend, sig, req)
        elif sig.kind == "barrier":
            backend.barrier()
        elif sig.kind == "process_set_add":
            ranks = list(sig.shape)
            sub = backend.sub(ranks)
            ps_id = self._next_set_id
            self._next_set_id += 1
            self._members[ps_id] = ranks
            if sub is not None:
                self._sets[ps_id] = ProcessSetState(ps_id, ranks, sub, self.settings)
            req.result = ps_id
        elif sig.kind == "process_set_remove":
            state = self._sets.pop(sig.root, None)
            self._members.pop(sig.root, None)
            if state is not None:
                for pending in list(state.pending.values()):
                    self._complete(pending, error=ValueError(
                        f"process set {sig.root} was removed while this op was pending"))
                state.backend.free()
        else:  # pragma: no cover - guarded at submission
            raise ValueError(f"unknown collective {sig.kind}")

    def _run_group(self, backend, device: bool, group: list[Request | None], tl, activity: str,
                   fn) -> None:
        if device:
            fn = self._on_device_stream(backend, group, fn)
        if tl is not None:
            for req in group:
                if req is not None:
                    tl.negotiate_end(req.name)
                    tl.op_start(req.name, activity)
        try:
            if tl is not None:
                with tl.activity([r.name for r in group if r is not None], activity):
                    fn()
            else:
                fn()
        except Exception as exc:
            # Validated inputs make local failures impossible; what is left is the backend
            # failing, after which the communicator cannot be trusted: stop everywhere.
            error = exc if isinstance(exc, HorovodInternalError) else HorovodInternalError(
                f"{activity.lower()} failed: {type(exc).__name__}: {exc}")
            for req in group:
                if req is not None:
                    self._complete(req, error=error)
            raise error from exc
        if tl is not None:
            for req in group:
                if req is not None:
                    tl.op_end(req.name)
        self._forget_done(group)

    @staticmethod
    def _on_device_stream(backend, group, fn):
        """GPU groups run on the device's stream (``gpu_stream.DeviceStream``), after the
        producers' ready events, and leave a done event for the consumers: no host or
        device-wide synchronization. The thread works on the group's device meanwhile and gets
        its own current device back after (a caller blocked in ``wait`` runs cycles too).
        NCCL's asynchronous errors (a lost peer or link) surface here, before more work is
        queued behind a collective that will never end, and while the engine waits for peers
        (``NcclBackend.negotiate``)."""

        def run() -> None:
            from .gpu_stream import device_stream, group_device, on_device

            backend.check_async_error()
            device = group_device(backend, [r.tensor for r in group if r is not None])
            stream = device_stream(device)
            with on_device(device), stream.activate():
                for req in group:
                    if req is not None and req.ready_event is not None:
                        stream.wait_for(req.ready_event)
                fn()
                done = stream.done_event()
            for req in group:
                if req is not None:
                    req.done_event = done

        return run

    def _finish_join(self, ps: ProcessSetState) -> None:
        cycles = ps.backend.allgather_ints(np.array([ps.join_cycle], dtype=np.int64))[:, 0]
        last = max(range(len(cycles)), key=lambda r: (cycles[r], r))
        req, ps.join_request = ps.join_request, None
        req.result = ps.ranks[last]
        ps.joins += 1
        self._complete(req)

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
        error = self._error or HorovodInternalError(SHUT_DOWN)
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
        if self._stopped:
            return
        self._stopped = self._closed = True
        error = self._error
        if error is not None:  # device work in flight may wait for a peer that is gone
            for ps in self._sets.values():
                ps.backend.abort()
            if not error.agreed and self._alarm.error is None and self.on_local_error:
                self.on_local_error(error)
        # Every accepted request not yet completed (all are in _inflight until then): queued,
        # pending, a join, or one cut off mid-execution.
        leftovers = self._drain_queue() + list(self._inflight.values())
        for ps in self._sets.values():
            ps.pending.clear()
            ps.join_request = None
        if self.timeline is not None:
            self.timeline.close()
        self._fail(leftovers)

    def free_backends(self) -> None:
        """Release every process set's backend, set 0's included. After a shutdown (which
        stops every rank in the same cycle, the ones that did not ask for it too) each is
        closed, collectively over its set and in the same order on every rank
        (``Backend.close``: what the ranks share, the node's shared window, is released too,
        within the peer timeout); after an error, freed locally (``Backend.free``; the runtime
        keeps a failed engine's backends instead: :meth:`abandon_backends`)."""
        normal = self._error is None
        for ps in self._sets.values():
            if normal:
                ps.backend.close()
            else:
                ps.backend.free()

    def abandon_backends(self) -> None:
        """After a failure: keep every backend (and its communicator) alive for the life of
        the process instead of freeing it, since a collective this rank gave up on may still
        complete and MPI then writes through it."""
        abandoned.extend(ps.backend for ps in self._sets.values())
