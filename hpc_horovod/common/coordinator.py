"""The coordinator: how the ranks of a process set agree, each cycle, on what runs.

The protocol. Each cycle, every member of a set runs :meth:`Coordinator.cycle` on it, in the
same order of sets on every rank (the engine's cycles are collectives):

1. **Cheap phase**, one bitwise-AND allreduce (``Backend.negotiate``) of ``2 + nwords`` 64-bit
   words (``negotiation.pack_words``): the OR flags, sent inverted; the AND flags; then one bit
   per name of the :class:`~.negotiation.ResponseCache` (every name agreed once owns a bit,
   identical on every rank) that this rank has pending with the same signature. A bit set in
   the result is a name every rank submitted: it is ready, with no name on the wire. A joined
   rank sends every valid bit: it takes part in whatever the others run.
2. **OR flags**: ``FLAG_UNCACHED`` (some pending name has no bit yet, or another signature),
   ``FLAG_STALL`` (this rank's oldest pending request is older than
   ``HOROVOD_STALL_CHECK_TIME_SECONDS`` and no report went out since), ``FLAG_ABORT`` (older
   than ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``), ``FLAG_SHUTDOWN`` (``shutdown()`` was called;
   set 0 only). **AND flag**: ``FLAG_JOINED`` (this rank joined; set on every rank: all joined).
3. **Full phase**, when any OR flag is set: every rank sends its pending
   ``(name, signature)`` list, whether it joined, whether it shuts down, to rank 0, where
   ``negotiation.match`` decides, and every rank receives that decision (``Backend.agree``):
   which names are ready (they get cache bits, in the same order on every rank, so bit
   assignments never diverge), which disagree (their requests fail on every rank that
   submitted them), and who is awaited for what. Ready names of both phases form one
   :class:`~.execution.Plan`, executed in the same order on every rank.
4. **Join**: a rank that joined contributes zeros to allreduces and takes part in barriers;
   other collectives fail on the ranks that submitted them. When the AND of ``FLAG_JOINED``
   is set every member joined: they exchange the cycle at which each joined
   (``Backend.allgather_ints``), the join returns the last rank to join on every member, and
   the set's join count (the epoch of automatic names) goes up.
5. **Stall**: with ``FLAG_STALL`` rank 0 prints who is missing what (and every rank's report
   clock restarts); with ``FLAG_ABORT`` every rank stops with that message.
6. **Shutdown**: with ``FLAG_SHUTDOWN`` every rank stops after this cycle. A rank that did not
   ask for it stops too: with an error when it has work pending (its ops would never
   complete), quietly otherwise (its next op raises the error: the script may be ending).

A failure outside this protocol (a rank's own error, a lost rank) reaches the peers through
``common.watch``: the alarm makes every wait of the cycle give up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from .config import Settings
from .errors import SHUT_DOWN, HorovodInternalError
from .execution import Execution, Plan
from .log import TRACE, log
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
from .whereabouts import Whereabouts

_FULL = FLAG_UNCACHED | FLAG_SHUTDOWN | FLAG_STALL | FLAG_ABORT


class ProcessSetState:
    """The coordinator's state of one process set this rank belongs to."""

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
            _log_plan(self.id, plan, "cached names")
        return plan


def _log_plan(ps_id: int, plan: Plan, source: str) -> None:
    """The debug log's line for a plan just built."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("process set %d: plan of %d tensor(s) (%s): %s", ps_id, len(plan.names),
                  source, plan.describe())


def _flags(or_flags: int, and_flags: int) -> str:
    """The trace log's names of a cycle's flags."""
    names = [name for flag, name in ((FLAG_UNCACHED, "uncached"), (FLAG_STALL, "stall"),
                                     (FLAG_ABORT, "abort"), (FLAG_SHUTDOWN, "shutdown"))
             if or_flags & flag]
    names += ["joined"] if and_flags & FLAG_JOINED else []
    return f"flags {'+'.join(names)}" if names else "no flags"


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


class Coordinator:
    """Runs the protocol above, one set at a time. ``complete(req, error=None)`` completes a
    request; ``alarm.error`` is set when a peer failed or was lost; ``whereabouts`` says, to
    a census of the ranks, which set this rank negotiates on (``common.whereabouts``)."""

    def __init__(self, execution: Execution, complete: Callable, alarm,
                 whereabouts: Whereabouts):
        self._execution = execution
        self._complete = complete
        self._alarm = alarm
        self._whereabouts = whereabouts
        #: whether each cycle's negotiation is logged (HOROVOD_LOG_LEVEL=trace), looked up
        #: once: the cheap phase runs every cycle
        self._trace = log.isEnabledFor(TRACE)
        #: set when peers shut down while this rank still ran: what its pending and later ops
        #: raise
        self.stopped_by_peers: HorovodInternalError | None = None

    def cycle(self, ps: ProcessSetState, shutting_down: bool, settings: Settings,
              timeline) -> bool:
        """One negotiation and execution round on ``ps``; True when the engine must stop."""
        backend, cache, pending = ps.backend, ps.cache, ps.pending
        or_flags, bits = 0, 0
        joined = ps.join_request is not None
        if joined:
            bits = cache.valid_bits()
        cached, uncached = _cache_bits(pending, cache.entries)
        bits |= cached
        if uncached:
            or_flags |= FLAG_UNCACHED
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
        self._whereabouts.negotiating(ps.id)
        backend.negotiate(words, settings.peer_timeout_s, self._alarm)
        or_all, and_all, ready_bits = unpack_words(words)
        all_joined = bool(and_all & FLAG_JOINED)
        if self._trace:
            log.log(TRACE, "process set %d: cycle: sent %s and %d cache bit(s); agreed %s, "
                    "%d cached name(s) ready", ps.id, _flags(or_flags, and_flags),
                    bits.bit_count(), _flags(or_all, and_all), ready_bits.bit_count())

        plan, reqs = None, []
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
            stop = self._full(ps, or_all, shutting_down, settings, names, sigs, reqs)
            if len(names) > known:
                plan = Plan(names, sigs, settings.fusion_threshold)
                _log_plan(ps.id, plan, "with names just agreed")
                reqs = [reqs[i] for i in plan.order]
        if plan is not None:
            self._execution.run(ps, plan, reqs, timeline)
        if all_joined:
            self._finish_join(ps, settings)
        return stop

    def _full(self, ps, or_all, shutting_down, settings, names, sigs, reqs) -> bool:
        """The full phase: every pending (name, signature) exchanged; the newly agreed ones
        are appended to ``names``, ``sigs`` and ``reqs``. True when the engine must stop."""
        backend, cache = ps.backend, ps.cache
        mine = [(name, req.signature) for name, req in ps.pending.items()]

        def decide(gathered):
            joined = {r for r, g in enumerate(gathered) if g[1]}
            leaving = [ps.ranks[r] for r, g in enumerate(gathered) if g[2]]
            return match([g[0] for g in gathered], joined, ps.ranks), leaving

        agreement, leaving = backend.agree((mine, ps.join_request is not None, shutting_down),
                                           decide, settings.peer_timeout_s, self._alarm)
        for name, sig in agreement.ready:
            req = ps.pending.pop(name, None)
            if req is not None and req.signature == sig:
                sig = req.signature  # the interned one, so that later cycles compare identity
            cache.put(name, sig)
            log.debug("process set %d: agreed %r: %s %s %s", ps.id, name, sig.kind, sig.dtype,
                      list(sig.shape))
            names.append(name)
            sigs.append(sig)
            reqs.append(req)
        for name, message in agreement.errors:
            cache.evict(name)
            req = ps.pending.pop(name, None)
            if req is not None:
                self._complete(req, HorovodInternalError(message))
        if or_all & (FLAG_STALL | FLAG_ABORT):
            ps.last_stall_report = time.monotonic()
            if agreement.waiting:
                self._stall(agreement.waiting, or_all, settings, backend.rank)
        if or_all & FLAG_SHUTDOWN:
            if not shutting_down:
                ranks = ", ".join(map(str, leaving))
                error = HorovodInternalError(
                    f"{SHUT_DOWN} Rank(s) {ranks} called shutdown while this rank still runs.")
                error.culprit = (f"rank(s) {ranks} finished (hvd.shutdown or the end of the "
                                 "script) while the others still ran collectives")
                error.agreed = True
                self.stopped_by_peers = error
            return True
        return False

    @staticmethod
    def _stall(waiting: dict[str, list[int]], or_all: int, settings: Settings,
               rank: int) -> None:
        """Step 5 of the protocol: report the stall (rank 0), or stop every rank on it."""
        text = stall_message(waiting, settings.stall_check_time_s)
        if or_all & FLAG_ABORT:
            limit = settings.stall_shutdown_time_s
            error = HorovodInternalError(
                text + "\nAll ranks stop now: a stall lasted longer than "
                f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={limit:g}."
            )
            late = sorted({r for ranks in waiting.values() for r in ranks})
            error.agreed = True
            error.culprit = (f"rank(s) {', '.join(map(str, late))} stalled: they did not "
                             f"submit {', '.join(sorted(waiting)[:3])} for {limit:g} s")
            raise error
        if rank == 0:
            log.warning("%s", text)

    def _finish_join(self, ps: ProcessSetState, settings: Settings) -> None:
        """Step 4's end: every member joined."""
        self._whereabouts.negotiating(ps.id)
        cycles = ps.backend.allgather_ints(np.array([ps.join_cycle], dtype=np.int64),
                                           settings.peer_timeout_s, self._alarm)[:, 0]
        last = max(range(len(cycles)), key=lambda r: (cycles[r], r))
        req, ps.join_request = ps.join_request, None
        req.result = ps.ranks[last]
        ps.joins += 1
        self._complete(req)
