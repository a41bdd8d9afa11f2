"""Where this rank's engine is, for the watch (``common.watch``): the deadline of the data call
it is inside, and what it answers to a census of the ranks.

The data collectives are blocking MPI calls with no deadline of their own (Open MPI's
non-blocking collectives are slower for all but small buffers), so a peer frozen inside one
(stopped, or blocked in the kernel or in C while holding the GIL), whose side channel stays
open, would leave the others waiting for ever. The execution records each step it hands to the
backend (:meth:`Whereabouts.enter`, one tuple stored, no lock: the watch's thread reads it
whole; the coordinator records each negotiation, and the engine the end of each cycle), and the
watch's thread, which runs while the engine's thread is blocked in MPI (mpi4py lets go of the
GIL there), notices a call past its deadline (:func:`deadline`). The census it then runs
asks every rank where it is (:meth:`Whereabouts.answer`) and names, in one line
(:func:`census_text`), the ranks that did not answer and where each of the others is.
"""

from __future__ import annotations

import math
import time

#: the slowest transfer a data call is allowed on top of the peer timeout: one second per
#: 100 MB of this rank's tensors (an allgather's result counts whole). A job whose links are
#: slower than that raises HOROVOD_PEER_TIMEOUT_SECONDS.
FLOOR_BYTES_PER_S = 100e6

#: the engine outside a cycle (asleep, or its caller computing)
IDLE = ("idle", 0.0)


def deadline(since: float, timeout_s: float, nbytes: int) -> float:
    """When a data call that started at ``since`` and moves ``nbytes`` is late: the peer
    timeout plus ``nbytes / FLOOR_BYTES_PER_S``; never (infinity) with a timeout of 0."""
    if not timeout_s:
        return math.inf
    return since + timeout_s + nbytes / FLOOR_BYTES_PER_S


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _names(names) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class Whereabouts:
    """What the engine of this rank is doing: ``now``, one tuple replaced whole.

    ``("idle", 0)``; ``("setup", since, what)`` while ``init`` builds what the engine needs
    with MPI calls of its own (a process set's communicators and window: only its members
    take part, so the others may already wait for them in a negotiation);
    ``("negotiation", since, process set id)``; or ``("data", since, kind,
    names, start, stop, nbytes, process set id)`` while the step of a plan whose names are
    ``names[start:stop]`` runs in the backend. What runs per step stores the tuple and
    nothing else: the watch's thread computes its deadline (:meth:`overdue`).
    """

    __slots__ = ("now", "timeout_s")

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.now: tuple = IDLE

    def negotiating(self, ps_id: int) -> None:
        self.now = ("negotiation", time.monotonic(), ps_id)

    def setting_up(self, what: str) -> None:
        self.now = ("setup", time.monotonic(), what)

    def enter(self, kind: str, names: list[str], start: int, stop: int, nbytes: int,
              ps_id: int) -> None:
        """A data call starts: ``kind`` of ``names[start:stop]`` (``nbytes`` moved) on
        process set ``ps_id``."""
        self.now = ("data", time.monotonic(), kind, names, start, stop, nbytes, ps_id)

    def overdue(self, now: float) -> float | None:
        """The start of the data call under way when it is past its :func:`deadline`, else
        None."""
        state = self.now
        if state[0] == "data" and now > deadline(state[1], self.timeout_s, state[6]):
            return state[1]
        return None

    def answer(self, now: float | None = None) -> dict:
        """This rank's answer to a census: ``{"phase": ..., "what": text, "for_s": seconds}``
        (``phase``: the first item of ``now``)."""
        state = self.now
        now = time.monotonic() if now is None else now
        phase, since = state[0], state[1]
        if phase == "data":
            kind, names, start, stop, nbytes, ps_id = state[2:]
            what = (f"in {kind} {_names(names[start:stop])} ({_size(nbytes)}, process set "
                    f"{ps_id})")
        elif phase == "negotiation":
            what = f"in the negotiation of process set {state[2]}"
        elif phase == "setup":
            what = f"in hvd.init, {state[2]}"
        else:
            return {"phase": phase, "what": "idle (outside a collective)", "for_s": 0.0}
        return {"phase": phase, "what": what, "for_s": round(now - since, 1)}


def rank_list(ranks) -> str:
    """``0, 1, 2``: at most 16 ranks shown, then how many more."""
    ranks = list(ranks)
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + rank_list(ranks)


def census_text(size: int, answers: dict[int, dict], waited_s: float) -> str:
    """One line: the ranks (of ``size``) that did not answer a census within ``waited_s``, then
    where the others are, grouped by place; ranks inside different data calls diverged, and
    the line says so first."""
    parts = []
    silent = [r for r in range(size) if r not in answers]
    if silent:
        parts.append(f"{_ranks(silent)} did not answer within {waited_s:g} s (stopped, or "
                     "blocked outside Python)")
    places: dict[str, list[int]] = {}
    for rank in sorted(answers):
        places.setdefault(answers[rank]["what"], []).append(rank)
    for what, ranks in places.items():
        longest = max(answers[r]["for_s"] for r in ranks)
        parts.append(f"{_ranks(ranks)} {what}"
                     + ("" if what.startswith("idle") else f" for {longest:.0f} s"))
    if len({a["what"] for a in answers.values() if a["phase"] == "data"}) > 1:
        parts.insert(0, "the ranks diverged (they are in different collectives)")
    return "; ".join(parts)
