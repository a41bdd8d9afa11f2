"""Elastic training with Horovod's API, in SLURM's terms.

MPI cannot shrink a world in place, so a lost rank is survived by restarting the job's ranks on
what is left; what survives a restart is the training state of the last ``state.commit()``.

The protocol between :func:`run_fn`'s wrapper and the launcher (``hpc-horovod run --min-np``,
:mod:`hpc_horovod.elastic_launch`), over the directory ``HOROVOD_ELASTIC_DIR`` that every node
sees:

* ``state.commit()`` saves the state in memory (Horovod's semantics); then rank 0 writes it
  atomically to ``COMMIT_FILE`` there.
* At the wrapper's start, rank 0 writes ``ranks/world.json`` (each rank's host) and loads the
  commit if one exists; the state is synced from rank 0; after a restart the reset callbacks
  then run on every rank, each seeing the same committed state and the new ``hvd.size()``.
* A rank ends with a record ``ranks/<rank>.json``: ``done`` (the script ended normally after
  the wrapper returned), ``restart`` (a peer was lost, or hosts were updated: the process exits
  with :data:`RESTART_EXIT`), or ``failed`` (an error of the script's own: no restart).
* ``requeue_job`` (:mod:`hpc_horovod.slurm.requeue`, which ``requeue_on_signal`` calls) writes
  ``REQUEUED_FILE`` once it requeued the job: the ranks then end well, and the launcher keeps
  the directory for the job's next run instead of removing it.
* The launcher reads the records once the attempt ended: ranks of the world without a record
  were lost. It restarts on what is left while at least ``--min-np`` ranks can run and
  ``--reset-limit`` allows.

Without ``HOROVOD_ELASTIC_DIR`` (a script started without an elastic launcher) commits stay in
memory and a lost peer ends the process as it would without the wrapper.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pickle
import queue
import socket
from collections.abc import Callable
from pathlib import Path

from ..checkpoint import atomic_write
from .errors import HostsUpdatedInterrupt
from .log import log

#: exit status of a rank that asks its launcher for a restart (``EX_TEMPFAIL``: try again)
RESTART_EXIT = 75
#: the durable commit, in ``HOROVOD_ELASTIC_DIR``
COMMIT_FILE = "commit.pkl"
#: the records of the current attempt, in ``HOROVOD_ELASTIC_DIR``
RANKS_DIR = "ranks"
WORLD_FILE = "world.json"
#: written to ``HOROVOD_ELASTIC_DIR`` once this run requeued its SLURM job: the directory is
#: the next run's starting point, even when this run then ends well
REQUEUED_FILE = "requeued"


def elastic_dir() -> Path | None:
    """``HOROVOD_ELASTIC_DIR``, or None when the script was started without an elastic
    launcher."""
    value = os.environ.get("HOROVOD_ELASTIC_DIR")
    return Path(value) if value else None


def host_name() -> str:
    """This rank's node as SLURM names it (``--exclude`` takes it), else its host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def write_record(rank: int, status: str, reason: str = "") -> None:
    """This rank's end record for the launcher (nothing without ``HOROVOD_ELASTIC_DIR``)."""
    directory = elastic_dir()
    if directory is None:
        return
    data = json.dumps({"rank": rank, "status": status, "host": host_name(),
                       "reason": reason}).encode()
    atomic_write(directory / RANKS_DIR / f"{rank}.json", lambda fh: fh.write(data))


class State:
    """What elastic training keeps across resets: subclasses say how to save, restore and sync
    their objects; this class keeps the reset callbacks and the host updates.

    ``bcast_object(obj)`` returns rank 0's ``obj`` on every rank; ``get_rank()`` this rank.
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int]):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list[Callable[[], object]] = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called, in order, after every reset (e.g. to rescale the learning rate to
        the new ``hvd.size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After a reset: :meth:`reset`, then the registered callbacks in their order."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, removed: bool) -> None:
        """A notice that hosts changed (``removed``: some went away); the next
        :meth:`check_host_updates` raises :class:`HostsUpdatedInterrupt` on every rank."""
        self._host_messages.put((timestamp, removed))

    def commit(self) -> None:
        """Save the state (in memory; and on rank 0 to ``HOROVOD_ELASTIC_DIR`` for a
        restart), then check for host updates. A commit copies the state: commit every few
        batches rather than every one (``benchmarks/elastic_commit.py`` measures it)."""
        self.save()
        self.write_durable()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank, at the same point, when rank 0
        got a notice of changed hosts since the last check (collective: rank 0 decides)."""
        newest, removed = self._last_updated_timestamp, False
        while not self._host_messages.empty():
            timestamp, was_removed = self._host_messages.get()
            if timestamp > newest:
                newest = timestamp
                removed = removed or was_removed
        previous, self._last_updated_timestamp, removed = self._bcast_object(
            (self._last_updated_timestamp, newest, removed))
        if self._last_updated_timestamp > previous:
            raise HostsUpdatedInterrupt(removed)

    def write_durable(self) -> None:
        """Rank 0: the last saved state to ``COMMIT_FILE``, atomically (nothing without
        ``HOROVOD_ELASTIC_DIR``)."""
        directory = elastic_dir()
        if directory is None or self._rank() != 0:
            return
        data = pickle.dumps(self.saved_state(), protocol=pickle.HIGHEST_PROTOCOL)
        atomic_write(directory / COMMIT_FILE, lambda fh: fh.write(data))

    def load_durable(self) -> bool:
        """Rank 0 loads the durable commit into its objects, if there is one; True on every
        rank when it did (collective)."""
        directory = elastic_dir()
        found = False
        if self._rank() == 0 and directory is not None and (directory / COMMIT_FILE).exists():
            with open(directory / COMMIT_FILE, "rb") as fh:
                self.load_saved_state(pickle.load(fh))
            self.restore()
            found = True
        return bool(self._bcast_object(found))

    def saved_state(self):
        """The last saved state as one picklable object (what a durable commit holds)."""
        raise NotImplementedError()

    def load_saved_state(self, saved) -> None:
        """Make ``saved`` (from :meth:`saved_state`) the last saved state."""
        raise NotImplementedError()

    def save(self) -> None:
        """Copy the state to host memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Put the last saved state back, undoing what changed since."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Make every rank's state rank 0's (collective)."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Rebuild what depends on the ranks after a reset, before the callbacks run."""


class ObjectState(State):
    """A state of plain Python objects, given as keyword arguments and kept as attributes."""

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int], **kwargs):
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def saved_state(self):
        return {"objects": self._saved_state}

    def load_saved_state(self, saved) -> None:
        self._saved_state = dict(saved["objects"])

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


def _lost_peer(basics) -> str | None:
    """Why this rank's job lost a peer (the first line of the error), if that is what stopped
    its engine: a peer that ended without a word, not one that failed on an error."""
    runtime = basics._runtime
    error = None if runtime is None else runtime.engine.peer_error
    if error is None or not error.peer_lost:
        return None
    return str(error).splitlines()[0]


def _restart(rank: int, reason: str) -> None:
    """End this process, asking the launcher for a restart."""
    from .basics import _exit_now

    write_record(rank, "restart", reason)
    log.warning("%s; exiting with status %d for a restart from the last commit", reason,
                RESTART_EXIT)
    _exit_now(RESTART_EXIT)


def run_fn(func: Callable, reset: Callable[[], None]) -> Callable:
    """The ``hvd.elastic.run`` decorator over ``func(state, ...)``.

    On start: rank 0 records the world and loads the durable commit if there is one, the state
    is synced from rank 0, and, when a commit was loaded, the reset callbacks run (as after a
    reset in Horovod). When an elastic launcher started the process, an error raised while a
    peer was lost (the engine stopped because a rank ended without a word, whatever type the
    error took on its way up, e.g. through ``tf.function``) or a
    :class:`HostsUpdatedInterrupt` ends the process with :data:`RESTART_EXIT`; any other error
    is recorded as a failure and raised. Without a launcher, errors propagate. ``reset``
    (``shutdown`` then ``init``) is not needed: a restart is a new process.
    """
    del reset

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        from . import basics
        from .ops import allgather_object

        rank = basics.rank()
        launched = elastic_dir() is not None
        if launched:
            basics.on_peer_lost = lambda text: _restart(rank, text)
            hosts = allgather_object(host_name(), name="hpc_horovod.elastic.hosts")
            if rank == 0:
                data = json.dumps({"hosts": hosts}).encode()
                atomic_write(elastic_dir() / RANKS_DIR / WORLD_FILE, lambda fh: fh.write(data))
        try:
            restarted = state.load_durable()
            state.sync()
            if restarted:
                state.on_reset()
            result = func(state, *args, **kwargs)
        except BaseException as exc:
            if not launched:
                raise
            lost = _lost_peer(basics)
            if lost is not None:  # whatever the error became on its way (tf.function's)
                _restart(rank, lost)
            if isinstance(exc, HostsUpdatedInterrupt):
                _restart(rank, "hosts updated" + (" (some removed)" if exc.skip_sync else ""))
            write_record(rank, "failed", f"{type(exc).__name__}: {exc}".splitlines()[0])
            raise
        if launched:
            basics.on_peer_lost = None
            atexit.register(write_record, rank, "done")
        return result

    return wrapper
