"""Every NCCL backend collective on device buffers, run on each rank (one GPU per rank).

Inputs are made on the default stream and handed over with an event and wait_for, results are
read after the consumer's stream waited for done_event, as the engine does: a missing ordering
shows up as wrong data.
Usage: python nccl_device_worker.py (one rank) or mpirun -np N ... (N GPUs).
"""

from __future__ import annotations

import cupy
import numpy as np
from mpi4py import MPI

from hpc_horovod.backends.nccl import NcclBackend
from hpc_horovod.common.errors import HorovodInternalError
from hpc_horovod.common.gpu_probe import bfloat16_on_device
from hpc_horovod.common.types import Max, Min, Product, Sum, bfloat16

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
device = rank % cupy.cuda.runtime.getDeviceCount()
cupy.cuda.Device(device).use()

FOLD = {Sum: np.add, Product: np.multiply, Min: np.minimum, Max: np.maximum}
REDUCTIONS = [
    (np.float32, Sum), (np.float64, Product), (np.float16, Sum), (np.float16, Max),
    (np.int32, Sum), (np.int64, Min), (np.int16, Sum), (np.uint8, Max), (np.bool_, Min),
    (np.bool_, Max), (np.int8, Sum), (np.uint8, Product),
] + ([(bfloat16, Sum), (bfloat16, Min)] if bfloat16_on_device() else [])


def ready_event(stream_ptr: int):
    """An event at the current end of the producer's stream."""
    event = cupy.cuda.Event(disable_timing=True)
    cupy.cuda.runtime.eventRecord(event.ptr, stream_ptr)
    return event


def stream_wait(stream_ptr: int, event) -> None:
    """The consumer's stream waits for ``event``."""
    cupy.cuda.runtime.streamWaitEvent(stream_ptr, event.ptr, 0)


def inputs(r: int, n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 * r + n)
    if dtype == np.bool_:
        return rng.random(n) < 0.7
    if np.dtype(dtype).kind == "f" or dtype == bfloat16:
        return (rng.standard_normal(n) + 1.5).astype(dtype)
    return rng.integers(0 if np.dtype(dtype).kind == "u" else -5, 6, n).astype(dtype)


def to_device(backend: NcclBackend, host: np.ndarray):
    array = cupy.asarray(host)
    backend.wait_for(ready_event(cupy.cuda.get_current_stream().ptr))
    return array


def to_host(backend: NcclBackend, array) -> np.ndarray:
    stream_wait(cupy.cuda.get_current_stream().ptr, backend.done_event())
    return array.get()


def check_allreduce(backend: NcclBackend) -> None:
    for dtype, op in REDUCTIONS:
        for n in (1, 3, 1000, 4097):
            buf = to_device(backend, inputs(rank, n, dtype))
            backend.allreduce(buf, op)
            got = to_host(backend, buf)
            everyone = np.stack([inputs(r, n, dtype) for r in range(size)])
            if np.dtype(dtype).kind == "f" or dtype == bfloat16:
                expected = FOLD[op].reduce(everyone.astype(np.float64), axis=0)
                tol = {np.dtype(np.float16): 1e-2, bfloat16: 3e-2}.get(np.dtype(dtype), 1e-6)
                np.testing.assert_allclose(got.astype(np.float64), expected, rtol=tol, atol=tol)
            else:
                with np.errstate(over="ignore"):
                    expected = FOLD[op].reduce(everyone, axis=0).astype(dtype)
                np.testing.assert_array_equal(got, expected, err_msg=f"{dtype} {op} {n}")


def check_out_of_place(backend: NcclBackend) -> None:
    """``allreduce(buf, op, send=...)``: NCCL reads ``send`` and writes ``buf``; ``send`` is
    left as it was."""
    for dtype in (np.float32, np.int16):
        send = to_device(backend, inputs(rank, 257, dtype))
        buf = cupy.zeros(257, dtype=dtype)
        backend.allreduce(buf, Sum, send=send)
        expected = np.sum([inputs(r, 257, dtype) for r in range(size)], axis=0, dtype=dtype)
        np.testing.assert_allclose(to_host(backend, buf), expected, rtol=1e-6)
        np.testing.assert_array_equal(to_host(backend, send), inputs(rank, 257, dtype))


def check_data_movement(backend: NcclBackend) -> None:
    for dtype in (np.float32, np.float16, np.int16, np.bool_):
        for counts in ([5] * size, [r + 1 for r in range(size)], [0] + [3] * (size - 1)):
            send = to_device(backend, inputs(rank, counts[rank], dtype))
            recv = cupy.empty(sum(counts), dtype=dtype)
            backend.allgatherv(send, recv, counts)
            expected = np.concatenate([inputs(r, counts[r], dtype) for r in range(size)])
            np.testing.assert_array_equal(to_host(backend, recv), expected)

        root = size - 1
        buf = to_device(backend, inputs(rank, 33, dtype))
        backend.bcast(buf, root)
        np.testing.assert_array_equal(to_host(backend, buf), inputs(root, 33, dtype))

    # alltoallv: rank i sends (i + j) % 3 values i * 100 + j to rank j
    send_counts = [(rank + j) % 3 for j in range(size)]
    recv_counts = [(j + rank) % 3 for j in range(size)]
    host = np.concatenate([np.full(c, rank * 100 + j, np.int64) for j, c in enumerate(send_counts)])
    send = to_device(backend, host)
    recv = cupy.empty(sum(recv_counts), dtype=np.int64)
    backend.alltoallv(send, send_counts, recv, recv_counts)
    expected = np.concatenate([np.full(c, j * 100 + rank, np.int64)
                               for j, c in enumerate(recv_counts)])
    np.testing.assert_array_equal(to_host(backend, recv), expected)


def check_reduce_scatter(backend: NcclBackend) -> None:
    for dtype in (np.float32, np.int16):
        for counts in ([4] * size, [r + 1 for r in range(size)]):
            total = sum(counts)
            send = to_device(backend, inputs(rank, total, dtype))
            recv = cupy.empty(counts[rank], dtype=dtype)
            backend.reduce_scatter(send, recv, counts, Sum)
            full = np.sum([inputs(r, total, dtype) for r in range(size)], axis=0, dtype=dtype)
            start = sum(counts[:rank])
            np.testing.assert_allclose(to_host(backend, recv), full[start:start + counts[rank]],
                                       rtol=1e-6)


def check_stream_ordering(backend: NcclBackend) -> None:
    """The producer writes after a long spin: without the ready event NCCL would read zeros."""
    spin = cupy.RawKernel(
        'extern "C" __global__ void spin(long long cycles) {'
        " long long start = clock64(); while (clock64() - start < cycles) {} }", "spin")
    producer = cupy.cuda.Stream(non_blocking=True)
    consumer = cupy.cuda.Stream(non_blocking=True)
    with producer:
        buf = cupy.zeros(1 << 20, dtype=np.float32)
        spin((1,), (1,), (np.int64(200_000_000),))
        buf.fill(rank + 1)
        ready = ready_event(producer.ptr)
    backend.wait_for(ready)
    backend.allreduce(buf, Sum)
    stream_wait(consumer.ptr, backend.done_event())
    with consumer:
        got = buf.get(stream=consumer)
    assert np.all(got == size * (size + 1) / 2), got[:4]


def check_backend(backend: NcclBackend) -> None:
    check_allreduce(backend)
    check_out_of_place(backend)
    check_data_movement(backend)
    check_reduce_scatter(backend)
    check_stream_ordering(backend)


flat = NcclBackend(comm.Dup(), device)
check_backend(flat)
# device buffers only: the host collectives and host buffers are the host backend's
# (RoutedBackend pairs the two), refused here by name
for call, op in ((lambda: flat.allgather_ints(np.array([rank])), "allgather_ints"),
                 (flat.barrier, "barrier"),
                 (lambda: flat.allreduce(np.ones(4, np.float32), Sum), "host buffers")):
    try:
        call()
    except NotImplementedError as exc:
        assert str(exc).startswith(f"nccl does not support {op}"), exc
    else:
        raise AssertionError(f"the NCCL backend ran {op}")
# the fusion buffer is kept per dtype
first = flat.fusion_buffer(np.float32, 1000)
assert flat.fusion_buffer(np.float32, 10).data.ptr == first.data.ptr
assert flat.fusion_buffer(np.float64, 10).data.ptr != first.data.ptr
# a process set of rank 0 alone
sub = flat.sub([0])
assert (sub is None) == (rank != 0)
if sub is not None:
    buf = to_device(sub, np.arange(4, dtype=np.float32))
    sub.allreduce(buf, Sum)
    np.testing.assert_array_equal(to_host(sub, buf), np.arange(4, dtype=np.float32))
    sub.free()
# NCCL failures become HorovodInternalError with the usual fixes
try:
    flat.bcast(cupy.zeros(4, dtype=np.float32), root=size)
except HorovodInternalError as exc:
    assert "NCCL broadcast failed" in str(exc) and "NCCL_DEBUG=INFO" in str(exc), exc
else:
    raise AssertionError("a broadcast from a rank outside the communicator did not fail")
flat.free()

# Hierarchical allreduce, asked for: all ranks on one node (no cross-node stage: the flat
# allreduce), every rank a node of its own (the inter-node step, through host memory, carries
# all), and fake nodes of two ranks (node = rank // 2) where the ranks pair up.
for node_id in (0, rank, rank // 2):
    backend = NcclBackend(comm.Dup(), device, node_id=node_id, hierarchical=True)
    check_allreduce(backend)
    check_stream_ordering(backend)
    if node_id == 0:
        assert not backend.hierarchical and backend._hierarchy is None, "one node: flat"
    backend.free()
# Not asked for: one flat NCCL allreduce across nodes, whatever the node ids.
backend = NcclBackend(comm.Dup(), device, node_id=rank // 2)
check_allreduce(backend)
assert backend._hierarchy is None and backend._levels is None, "flat by default"
# abort() gives the fusion buffers back (an abandoned backend keeps no device memory)
backend.fusion_buffer(np.float32, 1 << 20)
backend.abort()
assert not backend.fusion._buffers
backend.free()

print(f"rank {rank}: nccl ok", flush=True)
