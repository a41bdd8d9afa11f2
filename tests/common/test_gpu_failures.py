"""The GPU path's arithmetic and failure handling where there is no GPU: the dtype device buffers
are scaled in, the NCCL abort when the engine stops on an error, the watch for NCCL's
asynchronous errors while the engine waits for peers, and the caller's current device given
back after device work.

What cannot exist here is replaced, and each stand-in says so: CuPy's NCCL module and
communicator (:class:`StandInNccl`, :class:`StandInCommunicator`), the MPI request of a peer
that never answers, and the CUDA current-device API (:class:`StandInDevices`). The engine, the
NCCL backend's own code, its MPI communicator (``COMM_SELF``), the request waiter and numpy's
arithmetic are the real ones. The same defects on a GPU: ``tests/gpu/test_device_failures.py``.
"""

from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest

from hpc_horovod.backends import waiting
from hpc_horovod.common.config import Settings
from hpc_horovod.common.engine import Engine
from hpc_horovod.common.errors import HorovodInternalError
from hpc_horovod.common.execution import _scale_into, device_scale_dtype
from hpc_horovod.common.gpu_stream import on_device, pin_thread
from hpc_horovod.common.request import Request, signature_of
from hpc_horovod.common.types import Sum, bfloat16

pytestmark = pytest.mark.timeout(120)  # a regression here hangs rather than fails


# -- the scale factor's dtype -------------------------------------------------------------------
@pytest.mark.parametrize("dtype, wide", [
    (bfloat16, np.float32), (np.float16, np.float32), (np.float32, np.float32),
    (np.float64, np.float64), (np.int32, np.float64), (np.int8, np.float64),
])
def test_device_buffers_are_scaled_in_float32_or_wider(dtype, wide):
    assert device_scale_dtype(dtype) == np.dtype(wide)


@pytest.mark.parametrize("dtype", [bfloat16, np.float16])
@pytest.mark.parametrize("size", [3, 5, 6, 12])
def test_half_averages_match_the_float32_reference_exactly(dtype, size):
    """Average's 1/size applied the way the device path does it (numpy's multiply with the
    same dtype arguments CuPy gets), against the float32 reference that the host path computes:
    equal bit for bit. Scaling by the factor cast to the buffer's type instead (what CuPy does
    with a Python float: 1/3 is 0.33398 in bfloat16) is off, always the same way."""
    sums = (np.arange(-600, 600, 7, dtype=np.float32) * 0.25).astype(dtype)  # exact in dtype
    factor = 1.0 / size
    reference = (sums.astype(np.float32) * np.float32(factor)).astype(dtype)

    wide = device_scale_dtype(sums.dtype)
    device = np.empty_like(sums)
    np.multiply(sums, wide.type(factor), out=device, dtype=wide, casting="unsafe")
    assert device.tobytes() == reference.tobytes()

    host = np.empty_like(sums)
    _scale_into(sums, factor, host)
    assert host.tobytes() == reference.tobytes()

    narrow = (sums * np.array(factor, dtype=dtype)).astype(dtype)
    off = narrow.astype(np.float64) - reference.astype(np.float64)
    assert np.any(off != 0), "the factor cast to the buffer's type should be biased"
    signs = np.sign(off[off != 0] * np.sign(sums.astype(np.float64)[off != 0]))
    if size == 3:  # 1/3 rounds up in bfloat16, down in float16: one direction each
        assert len(set(signs.tolist())) == 1


# -- stand-ins for CuPy's NCCL ------------------------------------------------------------------
class StandInNccl(types.ModuleType):
    """Stands in for ``cupy.cuda.nccl`` (CuPy is not installed here): only what the backend
    touches before a device collective, and ``NcclError`` with its ``status``."""

    class NcclError(RuntimeError):
        def __init__(self, status: int, text: str):
            super().__init__(f"NCCL_ERROR: {text}")
            self.status = status

    available = True

    def __init__(self):
        super().__init__("cupy.cuda.nccl")


class StandInCommunicator:
    """Stands in for ``cupy.cuda.nccl.NcclCommunicator``: reports an asynchronous error once
    ``fail_after`` checks have passed (a peer died mid-collective), records ``abort``."""

    def __init__(self, nccl: StandInNccl, fail_after: int | None = None):
        self.nccl, self.fail_after = nccl, fail_after
        self.checks = 0
        self.aborted = self.destroyed = False

    def check_async_error(self) -> None:
        self.checks += 1
        if self.fail_after is not None and self.checks > self.fail_after:
            raise self.nccl.NcclError(6, "remote process exited or there was a network error")

    def abort(self) -> None:
        self.aborted = True

    def destroy(self) -> None:
        self.destroyed = True


@pytest.fixture
def nccl(monkeypatch) -> StandInNccl:
    """``cupy`` and ``cupy.cuda.nccl`` as stand-ins, for the NCCL backend's imports."""
    module = StandInNccl()
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "14.2.0"
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = module
    cupy.cuda = cuda
    for name, value in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", module)):
        monkeypatch.setitem(sys.modules, name, value)
    return module


def nccl_backend(nccl: StandInNccl, comm: StandInCommunicator):
    """A real NcclBackend over MPI's COMM_SELF whose NCCL communicator is ``comm`` (no device
    collective ever runs, so no stream and no device is touched)."""
    from mpi4py import MPI

    from hpc_horovod.backends.nccl import NcclBackend

    backend = NcclBackend(MPI.COMM_SELF.Dup(), 0)
    backend._nccl_comm = comm
    return backend


def routed_backend(nccl: StandInNccl, comm: StandInCommunicator):
    """What ``compose`` builds with a GPU: the host backend (MPI over COMM_SELF) and the NCCL
    backend of :func:`nccl_backend`, routed by where each buffer lives."""
    from mpi4py import MPI

    from hpc_horovod.backends.mpi import MpiBackend
    from hpc_horovod.backends.routed import RoutedBackend

    return RoutedBackend(MpiBackend(MPI.COMM_SELF.Dup()), nccl_backend(nccl, comm))


def allreduce(name: str, x: np.ndarray) -> Request:
    return Request(name, x, signature_of("allreduce", x, Sum), 0, None)


def test_an_nccl_error_stops_the_engine_naming_the_rank_and_aborts_nccl(nccl):
    comm = StandInCommunicator(nccl, fail_after=0)
    engine = Engine(routed_backend(nccl, comm), Settings())  # no engine thread: waiters cycle
    handle = engine.submit(allreduce("grad", np.ones(4, np.float32)))
    with pytest.raises(HorovodInternalError) as info:
        engine.wait(handle)
    text = str(info.value)
    assert "NCCL communication on rank 0 failed" in text and "A peer rank failed" in text
    assert engine.stopped and engine.error is not None
    assert comm.aborted and not comm.destroyed


def test_a_normal_stop_lets_device_work_finish(nccl):
    """Shutdown agreed by every rank: every collective was launched everywhere and ends, so the
    communicator is destroyed after the stream drains (``close`` by the stopping cycle), never
    aborted."""
    comm = StandInCommunicator(nccl)
    engine = Engine(routed_backend(nccl, comm), Settings())
    assert engine.wait(engine.submit(allreduce("x", np.ones(2)))).result.tolist() == [1.0, 1.0]
    engine.shutdown()
    engine.run_cycle()  # the cycle that stops closes the backends
    assert engine.stopped and engine.error is None
    assert not comm.aborted and comm.destroyed


def test_abort_ends_the_node_communicator_too_and_frees_the_fusion_buffers(nccl):
    comm, node_comm = StandInCommunicator(nccl), StandInCommunicator(nccl, fail_after=0)
    backend = nccl_backend(nccl, comm)
    local = nccl_backend(nccl, node_comm)
    backend._levels = (local, None)  # the node levels (hierarchical allreduce, GPU Adasum)
    for which in (backend, local):  # stand-in device buffers, as FusionBuffers keeps them
        which.fusion._buffers[np.dtype(np.float32)] = np.zeros(4, np.float32)
    with pytest.raises(HorovodInternalError, match="rank 0 failed"):
        backend.check_async_error()  # the node communicator's error is the set's
    backend.abort()
    assert comm.aborted and node_comm.aborted
    assert backend._nccl_comm is None and local._nccl_comm is None
    assert not backend.fusion._buffers and not local.fusion._buffers  # no device memory kept
    backend._levels = None
    backend.free()
    local.free()


class NeverAnswers:
    """Stands in for the MPI request of a negotiation whose peer died: never completes."""

    def __init__(self):
        self.tests = 0

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.tests += 1
        return False


def test_waiting_for_peers_watches_nccl_errors(nccl):
    """A negotiation waits for a dead peer up to the peer timeout; an NCCL error seen meanwhile
    ends the wait at once, and the MPI request is kept (MPI may still write its buffer)."""
    from hpc_horovod.backends.routed import DeviceWatch

    comm = StandInCommunicator(nccl, fail_after=5)
    backend = nccl_backend(nccl, comm)
    request = NeverAnswers()
    abandoned = len(waiting.abandoned)
    with pytest.raises(HorovodInternalError, match="NCCL communication on rank 0 failed"):
        waiting.RequestWaiter(2).wait(request, 3600.0, "negotiation",
                                      DeviceWatch(None, backend.check_async_error))
    assert request.tests >= 6 and comm.checks == 6
    assert waiting.abandoned[abandoned:] == [request]
    del waiting.abandoned[abandoned:]
    backend._nccl_comm = None
    backend.free()


# -- one device backend, beside the host one ----------------------------------------------------
HOST = np.zeros(4, np.float32)
HOST_ONLY = [
    ("negotiate", lambda b: b.negotiate(np.zeros(2, np.uint64), 1.0)),
    ("agree", lambda b: b.agree("name", list)),
    ("allgather_ints", lambda b: b.allgather_ints(np.zeros(1, np.int64))),
    ("alltoall_ints", lambda b: b.alltoall_ints(np.zeros(1, np.int64))),
    ("barrier", lambda b: b.barrier()),
    ("host buffers (numpy arrays)", lambda b: b.allreduce(HOST, Sum)),
    ("host buffers (numpy arrays)", lambda b: b.allgatherv(HOST, HOST, [4])),
    ("host buffers (numpy arrays)", lambda b: b.bcast(HOST, 0)),
    ("host buffers (numpy arrays)", lambda b: b.alltoallv(HOST, [4], HOST, [4])),
    ("host buffers (numpy arrays)", lambda b: b.reduce_scatter(HOST, HOST, [4], Sum)),
    ("allreduce with scale factors (scale on the device)",
     lambda b: b.allreduce(HOST, Sum, prescale=0.5)),
]


@pytest.mark.parametrize("op, call", HOST_ONLY,
                         ids=[f"{i}-{op.split()[0]}" for i, (op, _) in enumerate(HOST_ONLY)])
def test_the_nccl_backend_refuses_host_work(nccl, op, call):
    """The NCCL backend is a device backend only: it is no MPI backend, and the negotiation,
    the small host collectives and host buffers, which the host backend beside it moves, are
    refused by name."""
    from mpi4py import MPI

    from hpc_horovod.backends.mpi import MpiBackend

    comm = StandInCommunicator(nccl)
    backend = nccl_backend(nccl, comm)
    assert not isinstance(backend, MpiBackend)
    with pytest.raises(NotImplementedError, match=f"^nccl does not support {re.escape(op)}$"):
        call(backend)
    backend.free()
    assert comm.destroyed and backend.comm == MPI.COMM_NULL


def test_process_sets_of_the_routed_backend_pair_a_host_and_a_device_backend(nccl):
    from mpi4py import MPI

    from hpc_horovod.backends.mpi import MpiBackend
    from hpc_horovod.backends.nccl import NcclBackend

    routed = routed_backend(nccl, StandInCommunicator(nccl))
    sub = routed.sub([0])
    assert type(sub.host) is MpiBackend and type(sub.on_device) is NcclBackend
    assert (sub.on_device.rank, sub.on_device.size, sub.on_device.device) == (0, 1, 0)
    assert sub.on_device.comm not in (routed.on_device.comm, MPI.COMM_NULL)
    sub.free()
    assert sub.on_device.comm == MPI.COMM_NULL and sub.host.comm == MPI.COMM_NULL
    assert routed.sub([]) is None
    routed.free()


# -- the caller's current device ----------------------------------------------------------------
class StandInDevices:
    """Stands in for the CUDA current-device API (``gpu_stream.CudaDevices``): the thread's
    current device, the devices whose context exists, and every ``set`` call."""

    def __init__(self, current: int, contexts: set[int]):
        self.current, self.contexts, self.sets = current, set(contexts), []

    def get(self) -> int:
        return self.current

    def set(self, device: int) -> None:
        self.sets.append(device)
        self.current = device
        self.contexts.add(device)  # making a device current creates its context

    def has_context(self, device: int) -> bool:
        return device in self.contexts


def test_device_work_gives_the_caller_its_device_back():
    devices = StandInDevices(current=0, contexts={0, 2})
    with on_device(2, devices):
        assert devices.get() == 2
    assert devices.get() == 0 and devices.sets == [2, 0]


def test_the_device_comes_back_after_an_error_too():
    devices = StandInDevices(current=1, contexts={1, 3})
    with pytest.raises(RuntimeError), on_device(3, devices):
        raise RuntimeError("a collective failed")
    assert devices.get() == 1


def test_no_context_is_created_to_give_a_device_back():
    """A thread that never used its current device (device 0 of a rank on GPU 2) keeps GPU 2:
    making device 0 current again would create a context there (about 0.5 GiB)."""
    devices = StandInDevices(current=0, contexts={2})
    with on_device(2, devices):
        pass
    assert devices.sets == [2] and 0 not in devices.contexts


def test_already_on_the_device_nothing_is_set():
    devices = StandInDevices(current=2, contexts={2})
    with on_device(2, devices):
        pin_thread(2, devices)
    assert devices.sets == []
