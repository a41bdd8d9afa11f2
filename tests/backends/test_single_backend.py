"""The backends' common ground without MPI: what ``Backend`` says of a call a backend does not
support, the size-1 backend every job of one process runs (each collective a local copy, with
Horovod's scale factors), and the host scaling arithmetic the backends share (``scaling.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_horovod.backends.base import Backend
from hpc_horovod.backends.scaling import scale_inplace, scale_into
from hpc_horovod.backends.single import SingleBackend
from hpc_horovod.common.types import Sum, bfloat16

CALLS = {
    "negotiate": (lambda b: b.negotiate(np.zeros(2, np.uint64), 1.0), "negotiate"),
    "agree": (lambda b: b.agree(1, list), "agree"),
    "allgather_ints": (lambda b: b.allgather_ints(np.zeros(1)), "allgather_ints"),
    "alltoall_ints": (lambda b: b.alltoall_ints(np.zeros(1)), "alltoall_ints"),
    "allreduce": (lambda b: b.allreduce(np.zeros(1), Sum), "allreduce"),
    "allgatherv": (lambda b: b.allgatherv(np.zeros(1), np.zeros(1), [1]), "allgather"),
    "bcast": (lambda b: b.bcast(np.zeros(1), 0), "broadcast"),
    "alltoallv": (lambda b: b.alltoallv(np.zeros(1), [1], np.zeros(1), [1]), "alltoall"),
    "reduce_scatter": (lambda b: b.reduce_scatter(np.zeros(1), np.zeros(1), [1], Sum),
                       "reducescatter"),
    "barrier": (lambda b: b.barrier(), "barrier"),
    "fusion_buffer": (lambda b: b.fusion_buffer(np.float32, 4), "fusion buffers"),
    "sub": (lambda b: b.sub([0]), "process sets"),
}


@pytest.mark.parametrize("call", CALLS)
def test_an_unsupported_call_names_the_backend_and_the_operation(call):
    class Partial(Backend):
        name = "partial"

    run, what = CALLS[call]
    with pytest.raises(NotImplementedError, match=f"^partial does not support {what}$"):
        run(Partial())


def test_the_defaults_of_a_host_backend():
    backend = Backend()
    assert backend.device is None and backend.bucket_memory(64) is None
    assert backend.check_async_error() is None and backend.abort() is None
    assert backend.free() is None


# -- the size-1 backend ---------------------------------------------------------------------------
def test_single_allreduce_in_place_and_from_a_send_buffer():
    backend = SingleBackend()
    buf = np.arange(4, dtype=np.float32)
    backend.allreduce(buf, Sum, prescale=2.0, postscale=0.5)
    np.testing.assert_array_equal(buf, np.arange(4))
    send = np.full(3, 4.0)
    out = np.zeros(3)
    backend.allreduce(out, Sum, send=send, postscale=0.25)
    np.testing.assert_array_equal(out, [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(send, [4.0, 4.0, 4.0])


def test_single_collectives_are_local_copies():
    backend = SingleBackend()
    assert (backend.rank, backend.size) == (0, 1)
    assert backend.agree({"a": 1}, lambda objs: (len(objs), objs[0])) == (1, {"a": 1})
    ints = np.array([3, 4], np.int64)
    assert backend.allgather_ints(ints).tolist() == [[3, 4]]
    assert backend.alltoall_ints(ints).tolist() == [3, 4]
    send, recv = np.arange(6.0).reshape(2, 3), np.zeros((2, 3))
    backend.allgatherv(send, recv, [6])
    np.testing.assert_array_equal(recv, send)
    recv = np.zeros(6)
    backend.alltoallv(send, [6], recv, [6])
    np.testing.assert_array_equal(recv, send.reshape(-1))
    recv = np.zeros(6)
    backend.reduce_scatter(send, recv, [6], Sum)
    np.testing.assert_array_equal(recv, send.reshape(-1))
    buf = np.ones(2)
    backend.bcast(buf, 0)
    backend.barrier()
    np.testing.assert_array_equal(buf, [1.0, 1.0])
    assert isinstance(backend.sub([0]), SingleBackend)
    assert backend.negotiate(np.zeros(2, np.uint64), 1.0) is None


# -- scaling --------------------------------------------------------------------------------------
def test_a_factor_of_one_copies():
    src, dst = np.arange(3, dtype=np.int8), np.zeros(3, np.int8)
    scale_into(src, 1.0, dst)
    np.testing.assert_array_equal(dst, src)
    buf = np.arange(3.0)
    scale_inplace(buf, 1.0)
    np.testing.assert_array_equal(buf, np.arange(3.0))


def test_integers_are_scaled_in_float64_and_truncated():
    buf = np.array([-3, 3, 7], np.int32)
    scale_inplace(buf, 0.5)
    assert buf.tolist() == [-1, 1, 3]


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_is_scaled_in_float32_and_rounded_once(dtype):
    src = np.array([1.0, 3.0, 1000.0], np.float32).astype(dtype)
    dst = np.empty(3, dtype)
    scale_into(src, 0.1, dst)
    want = (src.astype(np.float32) * np.float32(0.1)).astype(dtype)
    np.testing.assert_array_equal(dst.astype(np.float32), want.astype(np.float32))


def test_float64_keeps_its_precision():
    buf = np.array([1.0 + 2**-40])
    scale_inplace(buf, 3.0)
    assert buf[0] == (1.0 + 2**-40) * 3.0
