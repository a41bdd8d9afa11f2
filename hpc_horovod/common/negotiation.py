"""Agreeing on which tensors are ready on every rank: the pure functions and the one
deterministic cache of the protocol that ``coordinator`` runs (and describes).

The cache changes only through :func:`match`'s output, in the same order on every rank, so bit
assignments never diverge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .types import Signature, mismatch_message

# Flags OR-ed over ranks (sent inverted in a word that is AND-ed).
FLAG_UNCACHED = 1
FLAG_SHUTDOWN = 2
FLAG_STALL = 4
FLAG_ABORT = 8
# Flags AND-ed over ranks.
FLAG_JOINED = 1


class ResponseCache:
    """Name -> (bit, signature) for tensors already agreed on; identical on every rank.

    ``entries`` is read directly by the coordinator's cycle (``coordinator._cache_bits``);
    ``generation`` changes whenever a bit changes owner, which invalidates what was derived from
    bit sets.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.generation = 0
        self.entries: dict[str, tuple[int, Signature]] = {}
        self._names: list[str | None] = []
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nwords(self) -> int:
        return (len(self._names) + 63) // 64

    def bit(self, name: str, signature: Signature) -> int | None:
        entry = self.entries.get(name)
        return entry[0] if entry is not None and entry[1] == signature else None

    def name(self, bit: int) -> str | None:
        return self._names[bit]

    def signature(self, name: str) -> Signature:
        return self.entries[name][1]

    def valid_bits(self) -> int:
        mask = 0
        for bit, _ in self.entries.values():
            mask |= 1 << bit
        return mask

    def put(self, name: str, signature: Signature) -> None:
        """Cache ``name``; when full, the least recently used name makes room (as Horovod's
        cache does), so that a model with more tensors than the capacity keeps the recent
        ones cached instead of freezing the first ones in."""
        entry = self.entries.get(name)
        if entry is not None:
            if entry[1] == signature:
                return
            self.evict(name)
        if not self._free and len(self._names) >= self.capacity and self.entries:
            self.evict(next(iter(self.entries)))  # dicts keep order: the first is the oldest
        if self._free:
            bit = min(self._free)
            self._free.remove(bit)
        elif len(self._names) < self.capacity:
            bit = len(self._names)
            self._names.append(None)
        else:
            return
        self._names[bit] = name
        self.entries[name] = (bit, signature)
        self.generation += 1

    @property
    def tracks_use(self) -> bool:
        """Recency only matters once the cache may fill up: below half its capacity the
        engine skips :meth:`touch` (a cost per tensor). Identical on every rank."""
        return 2 * len(self.entries) > self.capacity

    def touch(self, names: list[str]) -> None:
        """Mark ``names`` (just executed, in the same order on every rank) most recently used."""
        entries = self.entries
        for name in names:
            entry = entries.pop(name, None)
            if entry is not None:
                entries[name] = entry

    def evict(self, name: str) -> None:
        entry = self.entries.pop(name, None)
        if entry is not None:
            self._names[entry[0]] = None
            self._free.append(entry[0])
            self.generation += 1


_WORD = (1 << 64) - 1


def words_for(capacity: int) -> int:
    """The most words a negotiation vector takes with a response cache of ``capacity`` names:
    the two flag words and one per 64 cache bits."""
    return 2 + -(-max(capacity, 0) // 64)


def pack_words(or_flags: int, and_flags: int, bits: int, nwords: int) -> np.ndarray:
    """The negotiation vector: inverted OR flags, AND flags, then the cache bits (a writable
    array of ``2 + nwords`` little-endian words, built from one integer: a cycle's Python runs
    on cold caches, where every numpy call counts)."""
    value = (bits << 128) | (and_flags << 64) | (~or_flags & _WORD)
    return np.frombuffer(bytearray(value.to_bytes(8 * (2 + nwords), "little")), dtype="<u8")


def unpack_words(words: np.ndarray) -> tuple[int, int, int]:
    value = int.from_bytes(words.tobytes(), "little")
    return ~value & _WORD, (value >> 64) & _WORD, value >> 128


def iter_bits(mask: int):
    """Set bit indices of ``mask`` in increasing order."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


#: what a joined rank takes part in (contributing zeros to allreduces); any other collective
#: fails on the ranks that submitted it, as in Horovod, instead of waiting for the joined ones
_WITH_JOIN = ("allreduce", "barrier")


@dataclass
class Agreement:
    """The outcome of one full negotiation, the same on every rank."""

    ready: list[tuple[str, Signature]]  # in execution order
    errors: list[tuple[str, str]]  # (name, message)
    waiting: dict[str, list[int]]  # name -> global ranks that have not submitted it


def match(gathered: list[list[tuple[str, Signature]]], joined: set[int],
          members: list[int] | None = None) -> Agreement:
    """Decide from every rank's pending list which names are ready and which disagree.

    A name is ready when every rank either submitted it or has joined. Order of execution is the
    order of first appearance scanning ranks in order, so it is identical on every rank.
    ``gathered`` is indexed by rank inside the process set; ``members`` maps those positions
    to global ranks, which is what messages (and ``Agreement.waiting``) name.
    """
    size = len(gathered)
    members = list(range(size)) if members is None else members
    table: dict[str, dict[int, Signature]] = {}
    for rank, entries in enumerate(gathered):
        for name, sig in entries:
            table.setdefault(name, {})[rank] = sig
    ready, errors, waiting = [], [], {}
    for name, by_rank in table.items():
        ranks = sorted(by_rank)
        first = by_rank[ranks[0]]
        if joined and first.kind not in _WITH_JOIN:
            # Refused at once, without waiting for the other ranks that have not joined: they
            # may never submit this name (automatic names drift apart once some ranks joined
            # and others got this very error), and they get the same refusal for theirs.
            errors.append((name, f"{first.kind.capitalize()} is not supported with Join at "
                                 f"this time. [tensor '{name}']"))
            continue
        missing = [r for r in range(size) if r not in by_rank and r not in joined]
        if missing:
            waiting[name] = [members[r] for r in missing]
            continue
        message = None
        for other in ranks[1:]:
            message = mismatch_message(_global_root(first, members),
                                       _global_root(by_rank[other], members))
            if message:
                message += (f" [tensor '{name}': rank {members[ranks[0]]} vs rank "
                            f"{members[other]}]")
                break
        if message:
            errors.append((name, message))
        else:
            ready.append((name, first))
    return Agreement(ready, errors, waiting)


def _global_root(sig: Signature, members: list[int]) -> Signature:
    """Roots travel as positions inside the process set; users know them as global ranks."""
    return sig._replace(root=members[sig.root]) if 0 <= sig.root < len(members) else sig


def stall_message(waiting: dict[str, list[int]], seconds: float) -> str:
    """Horovod's stall warning, naming the missing ranks and the tensors they owe."""
    by_rank: dict[int, list[str]] = {}
    for name, ranks in waiting.items():
        for rank in ranks:
            by_rank.setdefault(rank, []).append(name)
    lines = [
        "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of "
        f"ranks and are waiting for remainder of ranks for more than {seconds:g} seconds. This "
        "may indicate that different ranks are trying to submit different tensors or that only "
        "subset of ranks is submitting tensors, which will cause deadlock.",
        "Missing ranks:",
    ]
    for rank in sorted(by_rank):
        names = by_rank[rank]
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        lines.append(f"{rank}: [{shown}]")
    return "\n".join(lines)
