"""The background thread that owns every collective after ``init``.

Callers enqueue :class:`Request` objects and get handles back at once. The engine thread wakes as
soon as something is enqueued (or every ``HOROVOD_CYCLE_TIME`` ms while idle, since peers may
need it), and for each process set this rank belongs to, in id order, runs one cycle:

1. negotiate (``negotiation``): which pending names are ready on every rank;
2. execute the agreed ones: allreduces fused per (dtype, op, scales) (``fusion``), the other
   collectives one by one (``collectives``), in an order identical on every rank;
3. complete the handles and wake the callers.

A shutdown, a stall past ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``, a peer's fatal error or a
peer that stops answering ends the engine on every rank with a message that names who and why;
every pending handle then raises it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

import numpy as np

from .collectives import (
    adasum_one,
    allgather_group,
    alltoall_one,
    broadcast_one,
    reducescatter_one,
)
from .config import Settings
from .errors import SHUT_DOWN, HorovodInternalError
from .fusion import allreduce_group, group_allreduces
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
from .request import Request
from .types import Adasum

log = logging.getLogger("hpc_horovod")
_FULL = FLAG_UNCACHED | FLAG_SHUTDOWN | FLAG_STALL | FLAG_ABORT


class ProcessSetState:
    """Engine-side state of one process set this rank belongs to."""

    def __init__(self, ps_id: int, ranks: list[int], backend, settings: Settings):
        self.id = ps_id
        self.ranks = ranks
        self.backend = backend
        self.cache = ResponseCache(settings.cache_capacity)
        self.pending: dict[str, Request] = {}
        self.join_request: Request | None = None
        self.join_cycle = 0
        self.last_stall_report = time.monotonic()


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
        self._queue: list[Request] = []
        self._cond = threading.Condition()
        self._done = threading.Condition()
        self._inflight: dict[tuple[int, str], Request] = {}
        self._handles: dict[int, Request] = {}
        self._next_handle = 0
        self._shutdown_reason: str | None = None
        self._error: HorovodInternalError | None = None
        self._stopped = False
        self._cycle = 0
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

    def process_set_ids(self) -> list[int]:
        return sorted(self._members)

    def enqueue(self, requests: list[Request]) -> list[int]:
        """Hand requests to the engine; returns their handles. Raises on duplicate names."""
        with self._cond:
            self._raise_if_stopped()
            keys = set()
            for req in requests:
                key = (req.process_set_id, req.name)
                if key in self._inflight or key in keys:
                    raise ValueError(
                        "Requested to allreduce, allgather, or broadcast a tensor with the same "
                        "name as another tensor that is currently being processed.  If you want "
                        f"to request another tensor, use a different tensor name. [{req.name}]"
                    )
                if req.process_set_id not in self._members:
                    raise ValueError(f"process set {req.process_set_id} does not exist")
                keys.add(key)
            for req in requests:
                self._inflight[(req.process_set_id, req.name)] = req
                req.handle = self._next_handle
                self._handles[self._next_handle] = req
                self._next_handle += 1
            self._queue.extend(requests)
            self._cond.notify()
        return [req.handle for req in requests]

    def request(self, handle: int) -> Request:
        try:
            return self._handles[handle]
        except KeyError:
            raise ValueError(f"handle {handle} was not created or has been cleared") from None

    def poll(self, handle: int) -> bool:
        return self.request(handle).done

    def wait(self, handle: int) -> Request:
        """Block until the handle completes; forget it; raise its error if it failed."""
        req = self.request(handle)
        if not req.done:
            with self._done:
                while not req.done:
                    self._done.wait(1.0)
        self._handles.pop(handle, None)
        if req.error is not None:
            raise req.error
        return req

    def shutdown(self, reason: str | None = None) -> None:
        """Stop on every rank: peers learn ``reason`` (None for a normal exit)."""
        with self._cond:
            if self._shutdown_reason is None:
                self._shutdown_reason = reason or ""
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def error(self) -> HorovodInternalError | None:
        return self._error

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise HorovodInternalError(str(self._error))
        if self._stopped or self._shutdown_reason is not None:
            raise ValueError(SHUT_DOWN)

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        idle_s = self.settings.cycle_time_ms / 1000.0
        try:
            while True:
                with self._cond:
                    if not self._queue and self._shutdown_reason is None:
                        self._cond.wait(idle_s)
                    new, self._queue = self._queue, []
                    reason = self._shutdown_reason
                for req in new:
                    self._admit(req)
                self._cycle += 1
                if self.timeline is not None and self.settings.timeline_mark_cycles:
                    self.timeline.mark_cycle()
                if self._cycle_set(self._sets[0], reason):
                    break
                for ps_id in sorted(self._sets):
                    if ps_id != 0 and ps_id in self._sets:
                        self._cycle_set(self._sets[ps_id], None)
        except HorovodInternalError as exc:
            self._error = exc
        except BaseException as exc:  # an MPI error or a bug: never leave callers hanging
            self._error = HorovodInternalError(f"{type(exc).__name__}: {exc}")
            log.exception("hpc_horovod engine failed")
        finally:
            self._stop()

    def _admit(self, req: Request) -> None:
        ps = self._sets.get(req.process_set_id)
        if ps is None:
            self._complete(req, error=ValueError(
                f"this rank is not a member of process set {req.process_set_id}"))
            return
        if req.kind == "join":
            ps.join_request = req
            ps.join_cycle = self._cycle
            return
        ps.pending[req.name] = req
        if self.timeline is not None:
            self.timeline.negotiate_start(req.name, req.kind)

    def _cycle_set(self, ps: ProcessSetState, shutdown_reason: str | None) -> bool:
        """One negotiation and execution round on ``ps``; True when the engine must stop."""
        backend, cache = ps.backend, ps.cache
        or_flags, bits = 0, 0
        joined = ps.join_request is not None
        if joined:
            bits = cache.valid_bits()
        oldest = None
        for name, req in ps.pending.items():
            bit = cache.bit(name, req.signature)
            if bit is None:
                or_flags |= FLAG_UNCACHED
            else:
                bits |= 1 << bit
            if oldest is None or req.submitted_at < oldest:
                oldest = req.submitted_at
        now = time.monotonic()
        settings = self.settings
        if oldest is not None:
            age = now - oldest
            if (settings.stall_check and age > settings.stall_check_time_s
                    and now - ps.last_stall_report > settings.stall_check_time_s):
                or_flags |= FLAG_STALL
            if settings.stall_shutdown_time_s and age > settings.stall_shutdown_time_s:
                or_flags |= FLAG_ABORT
        if shutdown_reason is not None:
            or_flags |= FLAG_SHUTDOWN
        words = pack_words(or_flags, FLAG_JOINED if joined else 0, bits, cache.nwords)
        backend.negotiate(words, settings.peer_timeout_s)
        or_all, and_all, ready_bits = unpack_words(words)
        all_joined = bool(and_all & FLAG_JOINED)

        responses = []
        if not all_joined:
            for bit in iter_bits(ready_bits):
                name = cache.name(bit)
                responses.append((cache.signature(name), ps.pending.pop(name, None)))
        stop = False
        if or_all & _FULL:
            stop = self._full_negotiation(ps, or_all, shutdown_reason, responses)
        self._execute(ps, responses)
        if all_joined:
            self._finish_join(ps)
        with self._done:
            self._done.notify_all()
        return stop

    def _full_negotiation(self, ps, or_all, shutdown_reason, responses) -> bool:
        backend, cache = ps.backend, ps.cache
        mine = [(name, req.signature) for name, req in ps.pending.items()]
        gathered = backend.allgather_object((mine, ps.join_request is not None, shutdown_reason))
        joined = {r for r, g in enumerate(gathered) if g[1]}
        agreement = match([g[0] for g in gathered], joined, ps.ranks)
        for name, sig in agreement.ready:
            cache.put(name, sig)
            responses.append((sig, ps.pending.pop(name, None)))
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
                    raise HorovodInternalError(
                        text + "\nAll ranks stop now: a stall lasted longer than "
                        f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={self.settings.stall_shutdown_time_s:g}."
                    )
                if backend.rank == 0:
                    print(f"[hpc_horovod] WARNING: {text}", file=sys.stderr, flush=True)
        if or_all & FLAG_SHUTDOWN:
            stopping = [(ps.ranks[r], g[2]) for r, g in enumerate(gathered) if g[2] is not None]
            errors = [(r, why) for r, why in stopping if why]
            if errors:
                rank, why = errors[0]
                raise HorovodInternalError(
                    f"{SHUT_DOWN} Rank {rank} stopped first, with: {why}")
            if shutdown_reason is None:
                ranks = ", ".join(str(r) for r, _ in stopping)
                raise HorovodInternalError(
                    f"{SHUT_DOWN} Rank(s) {ranks} called shutdown while this rank still runs.")
            return True
        return False

    def _execute(self, ps: ProcessSetState, responses) -> None:
        if not responses:
            return
        backend = ps.backend
        reductions, gathers, others = [], [], []
        for sig, req in responses:
            if sig.kind == "allreduce" and sig.op != Adasum:
                reductions.append((sig, req))
            elif sig.kind == "allgather":
                gathers.append((sig, req))
            else:
                others.append((sig, req))
        tl = self.timeline
        for group in group_allreduces(reductions, max(self.settings.fusion_threshold, 1)):
            self._run_group(backend, group, tl, "ALLREDUCE",
                            lambda g=group: allreduce_group(backend, g))
        for device in (False, True):
            subset = [(sig, req) for sig, req in gathers if sig.device == device]
            if subset:
                self._run_group(backend, subset, tl, "ALLGATHER",
                                lambda g=subset: allgather_group(backend, g))
        for sig, req in others:
            self._run_group(backend, [(sig, req)], tl, sig.kind.upper(),
                            lambda s=sig, r=req: self._execute_one(ps, s, r))

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

    def _run_group(self, backend, group, tl, activity, fn) -> None:
        if group[0][0].device:
            fn = self._on_device_stream(backend, group, fn)
        if tl is not None:
            for _, req in group:
                if req is not None:
                    tl.negotiate_end(req.name)
                    tl.op_start(req.name, activity)
        try:
            if tl is not None:
                with tl.activity([r.name for _, r in group if r is not None], activity):
                    fn()
            else:
                fn()
        except Exception as exc:
            # Validated inputs make local failures impossible; what is left is the backend
            # failing, after which the communicator cannot be trusted: stop everywhere.
            error = exc if isinstance(exc, HorovodInternalError) else HorovodInternalError(
                f"{activity.lower()} failed: {type(exc).__name__}: {exc}")
            for _, req in group:
                if req is not None:
                    self._complete(req, error=error)
            raise error from exc
        for _, req in group:
            if req is not None:
                if tl is not None:
                    tl.op_end(req.name)
                self._complete(req)
        with self._done:
            self._done.notify_all()

    @staticmethod
    def _on_device_stream(backend, group, fn):
        """GPU groups run on the backend's stream, after the producers' ready events, and leave
        a done event for the consumers: no host or device-wide synchronization."""

        def run() -> None:
            activate = getattr(backend, "activate", contextlib.nullcontext)
            with activate():
                for _, req in group:
                    if req is not None and req.ready_event is not None:
                        if hasattr(backend, "wait_for"):
                            backend.wait_for(req.ready_event)
                        else:
                            req.ready_event.synchronize()
                fn()
                done = backend.done_event() if hasattr(backend, "done_event") else None
            for _, req in group:
                if req is not None:
                    req.done_event = done

        return run

    def _finish_join(self, ps: ProcessSetState) -> None:
        cycles = ps.backend.allgather_ints(np.array([ps.join_cycle], dtype=np.int64))[:, 0]
        last = max(range(len(cycles)), key=lambda r: (cycles[r], r))
        req, ps.join_request = ps.join_request, None
        req.result = ps.ranks[last]
        self._complete(req)

    def _complete(self, req: Request, error: BaseException | None = None) -> None:
        req.error = error
        self._inflight.pop((req.process_set_id, req.name), None)
        req.done = True

    def _stop(self) -> None:
        with self._cond:
            self._stopped = True
            leftovers = list(self._queue)
            self._queue = []
        error = self._error or HorovodInternalError(SHUT_DOWN)
        for ps in self._sets.values():
            leftovers.extend(ps.pending.values())
            ps.pending.clear()
            if ps.join_request is not None:
                leftovers.append(ps.join_request)
                ps.join_request = None
        for req in leftovers:
            if not req.done:
                self._complete(req, error=HorovodInternalError(str(error)))
        if self.timeline is not None:
            self.timeline.close()
        with self._done:
            self._done.notify_all()

    def free_backends(self) -> None:
        for ps_id, ps in self._sets.items():
            if ps_id != 0:
                ps.backend.free()
