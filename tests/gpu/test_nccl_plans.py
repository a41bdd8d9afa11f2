"""The parts of the NCCL backend that need no GPU: the unique id on the wire, the error text,
the dtype/op mapping, and the call plans for uneven collectives. The plans are checked by
replaying them on numpy arrays the way NCCL executes them (NCCL itself needs a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_horovod.backends.nccl import (
    NCCL_UNIQUE_ID_BYTES,
    FusionBuffers,
    deserialize_unique_id,
    nccl_error,
    offsets,
    p2p_plan,
    reduction_plan,
    segments,
    serialize_unique_id,
    unique_id_form,
)
from hpc_horovod.common.errors import HorovodInternalError
from hpc_horovod.common.types import Adasum, Average, Max, Min, Product, Sum, bfloat16

RAW = bytes(range(256))[:NCCL_UNIQUE_ID_BYTES - 3] + b"\x80\xfe\xff"


# -- unique id ------------------------------------------------------------------------------------
def test_unique_id_forms_of_cupy_versions():
    assert unique_id_form("14.2.0", "x86_64") == "bytes"
    assert unique_id_form("15.0.0rc1", "aarch64") == "bytes"
    assert unique_id_form("13.6.0", "x86_64") == "signed"
    assert unique_id_form("12.3.0", "AMD64") == "signed"
    assert unique_id_form("13.6.0", "aarch64") == "unsigned"
    assert unique_id_form("13.6.0", "ppc64le") == "unsigned"


def test_bytes_round_trip():
    data = serialize_unique_id(RAW)
    assert data == RAW
    assert deserialize_unique_id(data, "bytes") == RAW


def test_signed_tuple_of_old_cupy_on_x86_round_trips():
    signed = tuple(b - 256 if b > 127 else b for b in RAW)  # what get_unique_id() returned
    data = serialize_unique_id(signed)
    assert data == RAW
    back = deserialize_unique_id(data, "signed")
    assert back == signed
    assert min(back) >= -128 and max(back) <= 127


def test_unsigned_tuple_round_trips():
    unsigned = tuple(RAW)
    assert serialize_unique_id(unsigned) == RAW
    back = deserialize_unique_id(RAW, "unsigned")
    assert back == unsigned and min(back) >= 0 and max(back) <= 255


def test_bad_unique_ids_are_rejected():
    with pytest.raises(ValueError, match="128 bytes, got 4"):
        serialize_unique_id(b"abcd")
    with pytest.raises(ValueError, match="unknown unique id form"):
        deserialize_unique_id(RAW, "list")


def test_real_unique_id_of_the_installed_cupy():
    nccl = pytest.importorskip("cupy.cuda.nccl", reason="cupy is not installed")
    if not nccl.available:
        pytest.skip("cupy finds no NCCL library (nvidia-nccl-cu12 not installed)")
    import platform

    import cupy

    unique_id = nccl.get_unique_id()  # works without a GPU
    wire = serialize_unique_id(unique_id)
    assert deserialize_unique_id(wire, unique_id_form(cupy.__version__,
                                                      platform.machine())) == unique_id


# -- errors ---------------------------------------------------------------------------------------
class _StatusError(RuntimeError):
    """Stands in for cupy's NcclError (same ``status`` attribute and text), which cannot be
    raised here without the NCCL library."""

    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status


def test_network_failures_name_the_usual_fixes():
    exc = _StatusError(2, "NCCL_ERROR_SYSTEM_ERROR: unhandled system error")
    err = nccl_error(exc, "allreduce")
    assert isinstance(err, HorovodInternalError)
    text = str(err)
    assert text.startswith("NCCL allreduce failed: NCCL_ERROR_SYSTEM_ERROR")
    for fix in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE=1", "NCCL_DEBUG=INFO"):
        assert fix in text
    assert "NCCL_SOCKET_IFNAME" in str(nccl_error(_StatusError(6, "remote error"), "x"))
    assert "NCCL_SOCKET_IFNAME" in str(nccl_error(RuntimeError("no status"), "x"))


def test_cuda_failures_point_at_memory_and_driver():
    text = str(nccl_error(_StatusError(1, "unhandled cuda error"), "ncclCommInitRank"))
    assert "out of memory" in text and "nvidia-smi" in text and "cu13" in text
    assert "NCCL_DEBUG=INFO" in text


def test_two_ranks_on_one_gpu_is_invalid_usage_with_the_fixes():
    # NCCL <= 2.29 answers "Duplicate GPU detected" with ncclInvalidUsage (5)
    text = str(nccl_error(_StatusError(5, "invalid usage"), "ncclCommInitRank"))
    assert "Duplicate GPU" in text and "--gpus-per-task=1" in text
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in text and "CUDA_VISIBLE_DEVICES" in text
    assert "different orders" in text


def test_invalid_arguments_are_reported_as_bugs():
    assert "a bug" in str(nccl_error(_StatusError(4, "invalid argument"), "x"))


def test_real_nccl_error_translates():
    nccl = pytest.importorskip("cupy.cuda.nccl", reason="cupy is not installed")
    if not nccl.available:
        pytest.skip("cupy finds no NCCL library (nvidia-nccl-cu12 not installed)")
    text = str(nccl_error(nccl.NcclError(2), "broadcast"))
    assert "NCCL broadcast failed: NCCL_ERROR_SYSTEM_ERROR" in text
    assert "NCCL_SOCKET_IFNAME" in text


# -- reductions -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, op, expected", [
    (np.float32, Sum, ("NCCL_FLOAT32", "NCCL_SUM", None)),
    (np.float16, Max, ("NCCL_FLOAT16", "NCCL_MAX", None)),
    (np.float64, Product, ("NCCL_FLOAT64", "NCCL_PROD", None)),
    (np.int64, Min, ("NCCL_INT64", "NCCL_MIN", None)),
    (np.uint8, Sum, ("NCCL_UINT8", "NCCL_SUM", None)),
    (np.bool_, Min, ("NCCL_UINT8", "NCCL_MIN", None)),
    (np.bool_, Max, ("NCCL_UINT8", "NCCL_MAX", None)),
    (np.int16, Sum, ("NCCL_INT32", "NCCL_SUM", np.dtype(np.int32))),
    (bfloat16, Sum, ("NCCL_BFLOAT16", "NCCL_SUM", None)),
    (bfloat16, Max, ("NCCL_BFLOAT16", "NCCL_MAX", None)),
])
def test_reduction_plan(dtype, op, expected):
    assert tuple(reduction_plan(dtype, op)) == expected


def test_int16_staging_through_int32_wraps_like_int16():
    rng = np.random.default_rng(0)
    parts = [rng.integers(-2**15, 2**15, 64, dtype=np.int16) for _ in range(3)]
    for fold in (np.add, np.multiply):
        with np.errstate(over="ignore"):
            expected = fold.reduce(np.stack(parts), axis=0, dtype=np.int16)
            wide = fold.reduce(np.stack([p.astype(np.int32) for p in parts]), axis=0,
                               dtype=np.int32)
        staged = np.empty_like(parts[0])
        np.copyto(staged, wide, casting="unsafe")
        np.testing.assert_array_equal(staged, expected)


def test_reductions_nccl_cannot_do():
    with pytest.raises(ValueError, match="Average"):
        reduction_plan(np.float32, Average)
    with pytest.raises(ValueError, match="Adasum"):
        reduction_plan(np.float32, Adasum)
    with pytest.raises(ValueError, match="logical"):
        reduction_plan(np.bool_, Sum)
    with pytest.raises(TypeError, match="complex64"):
        reduction_plan(np.complex64, Sum)


# -- call plans, replayed as NCCL runs them -------------------------------------------------------
COUNTS = [[3, 0, 5, 1], [0, 0, 2, 0], [4, 4, 4, 4], [1, 2, 3]]


def test_offsets():
    assert offsets([3, 0, 5, 1]) == [0, 3, 3, 8]
    assert offsets([]) == []


@pytest.mark.parametrize("counts", COUNTS)
def test_allgatherv_as_one_broadcast_per_rank(counts):
    rng = np.random.default_rng(1)
    sends = [rng.standard_normal(c) for c in counts]
    for _rank in range(len(counts)):
        recv = np.full(sum(counts), np.nan)
        for root, off, count in segments(counts):  # ncclBroadcast(root) into recv[off:]
            recv[off:off + count] = sends[root]
        np.testing.assert_array_equal(recv, np.concatenate(sends))


@pytest.mark.parametrize("counts", COUNTS)
def test_reduce_scatter_as_one_reduce_per_rank(counts):
    rng = np.random.default_rng(2)
    size = len(counts)
    sends = [rng.standard_normal(sum(counts)) for _ in range(size)]
    total = np.sum(sends, axis=0)
    recvs = [np.full(c, np.nan) for c in counts]
    for root, off, count in segments(counts):  # ncclReduce(root) of send[off:off + count]
        recvs[root][...] = np.sum([s[off:off + count] for s in sends], axis=0)
    for rank, start in enumerate(offsets(counts)):
        np.testing.assert_allclose(recvs[rank], total[start:start + counts[rank]])


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_alltoallv_as_grouped_send_recv(size):
    rng = np.random.default_rng(size)
    send_counts = rng.integers(0, 4, (size, size))  # [i, j]: rows i sends to j
    sends = [rng.standard_normal(send_counts[i].sum()) for i in range(size)]
    plans = [p2p_plan(send_counts[i], send_counts[:, i]) for i in range(size)]
    recvs = [np.full(send_counts[:, i].sum(), np.nan) for i in range(size)]
    for i, plan in enumerate(plans):
        for kind, peer, off, count in plan:
            if kind != "send":
                continue
            # The matching receive on the peer: exactly one, of the same size.
            (match,) = [p for p in plans[peer] if p[0] == "recv" and p[1] == i]
            assert match[3] == count
            recvs[peer][match[2]:match[2] + count] = sends[i][off:off + count]
    for i in range(size):
        assert sum(1 for p in plans[i] if p[0] == "recv") == np.count_nonzero(send_counts[:, i])
        pieces = [sends[j][send_counts[j, :i].sum():send_counts[j, :i + 1].sum()]
                  for j in range(size)]
        np.testing.assert_array_equal(recvs[i], np.concatenate(pieces))


def test_fusion_buffers_reuse_grow_and_keep_dtypes_apart():
    allocations = []

    def allocate(count, dtype):
        allocations.append((count, dtype))
        return np.empty(count, dtype)

    buffers = FusionBuffers(allocate)
    a = buffers.get(np.float32, 100)
    b = buffers.get("float32", 60)
    assert b.size == 60 and np.shares_memory(a, b)
    c = buffers.get(np.float64, 10)
    assert c.dtype == np.float64 and not np.shares_memory(a, c)
    d = buffers.get(np.float32, 200)
    assert d.size == 200 and not np.shares_memory(a, d)
    assert allocations == [(100, np.float32), (10, np.float64), (200, np.float32)]
    buffers.clear()
    buffers.get(np.float32, 1)
    assert allocations[-1] == (1, np.float32)
