"""Typed errors. Collective failures are RuntimeErrors, as in Horovod; launch mistakes are
TopologyErrors whose message always names the fix."""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed (mismatched metadata, a peer that died or stalled, an MPI error).

    Raised on every rank that takes part, with the same text, at ``synchronize``. ``culprit``
    says in one line where a fatal error started ("rank 1 failed first: ..."), when it did not
    start on this rank; the one-line summary of a failed job prints it.
    """

    culprit: str | None = None
    #: every rank reached this error in the same cycle (a stall past the limit, a peer's
    #: shutdown): nobody needs to be told; otherwise it started here or on one peer
    agreed: bool = False
    #: a peer ended without a word (killed, out of memory, its node failed): elastic training
    #: restarts on the ranks that are left
    peer_lost: bool = False

    def copy(self) -> HorovodInternalError:
        """The same error, to raise again (a traceback per raise)."""
        error = HorovodInternalError(str(self))
        error.culprit = self.culprit
        error.agreed = self.agreed
        error.peer_lost = self.peer_lost
        return error


class HostsUpdatedInterrupt(RuntimeError):
    """The job's hosts changed: raised by ``state.check_host_updates()`` (and ``commit()``) on
    every rank at the same point. ``hvd.elastic.run`` ends the process for a restart on the new
    hosts. ``skip_sync``: hosts were only removed (Horovod's meaning: the state needs no sync)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the job's hosts were updated" + (" (some removed)" if skip_sync
                                                             else ""))
        self.skip_sync = skip_sync


class TopologyError(RuntimeError):
    """The processes were started in a way that cannot work; the message says how to fix it."""


class BatchScriptWithoutSrunError(TopologyError):
    """The job script itself runs the training while the job asked for several tasks."""


class SallocShellError(TopologyError):
    """The training was started in an ``salloc`` shell, outside any job step."""


class HeterogeneousJobError(TopologyError):
    """The step spans the components of a heterogeneous job."""


class MpiWiringError(TopologyError):
    """MPI's world does not match the step SLURM (or the launcher) announced."""


class UnsupportedLauncherError(TopologyError):
    """A launcher that cannot wire MPI (e.g. torchrun) started several processes."""


NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."
SHUT_DOWN = "Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to submit an operation after hvd.shutdown()."  # noqa: E501


class SharedMemoryError(RuntimeError):
    """The node's shared-memory window cannot be made (too small a ``/dev/shm``, a memory cgroup
    limit): raised by ``init`` with the size asked for, the limit hit and the variable that
    turns the stage off."""
