"""``hpc_horovod.common.collectives`` on the size-1 backend: allgather groups with a joined rank,
broadcast into an output, alltoall's splits, reducescatter's scaling in Horovod's order (prescale,
sum, postscale and Average's 1/size) and dtypes, and Adasum's pairwise combination."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_horovod.backends.single import SingleBackend
from hpc_horovod.common.collectives import (
    _adasum_pair,
    adasum_one,
    allgather_group,
    alltoall_one,
    broadcast_one,
    reducescatter_one,
)
from hpc_horovod.common.request import Request, signature_of
from hpc_horovod.common.types import Adasum, Average, Max, Sum

BACKEND = SingleBackend()


def request(kind, array, op=None, root=-1, pre=1.0, post=1.0, output=None, splits=None):
    return Request("t", array, signature_of(kind, array, op, root, pre, post), output=output,
                   splits=splits)


def test_allgather_group_with_a_joined_rank():
    a, b = np.arange(6.0).reshape(3, 2), np.arange(4, dtype=np.int32)
    reqs = [request("allgather", a), None, request("allgather", b)]
    group = [(reqs[0].signature, reqs[0]), (signature_of("allgather", np.empty((0, 5))), None),
             (reqs[2].signature, reqs[2])]
    allgather_group(BACKEND, group)
    np.testing.assert_array_equal(reqs[0].result, a)
    assert reqs[0].result is not a and reqs[2].result.dtype == np.int32
    np.testing.assert_array_equal(reqs[2].result, b)


def test_broadcast_copies_the_root_tensor_or_fills_the_output():
    a = np.arange(3.0)
    req = request("broadcast", a, root=0)
    broadcast_one(BACKEND, req.signature, req)
    np.testing.assert_array_equal(req.result, a)
    assert req.result is not a
    out = np.zeros(3)
    req = request("broadcast", a, root=0, output=out)
    broadcast_one(BACKEND, req.signature, req)
    assert req.result is out
    np.testing.assert_array_equal(out, a)
    broadcast_one(BACKEND, req.signature, None)  # a joined rank's share


def test_alltoall_without_and_with_splits():
    a = np.arange(8).reshape(4, 2)
    req = request("alltoall", a)
    alltoall_one(BACKEND, req.signature, req)
    got, received = req.result
    np.testing.assert_array_equal(got, a)
    assert received.tolist() == [4]
    req = request("alltoall", a, splits=np.array([4], np.int32))
    alltoall_one(BACKEND, req.signature, req)
    assert req.result[1].tolist() == [4]


@pytest.mark.parametrize("op, pre, post, factor", [
    (Sum, 1.0, 1.0, 1.0), (Sum, 2.0, 3.0, 6.0), (Average, 0.5, 4.0, 2.0), (Max, 3.0, 1.0, 3.0),
], ids=["sum", "scaled sum", "scaled average", "scaled max"])
def test_reducescatter_scales_in_horovods_order(op, pre, post, factor):
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    req = request("reducescatter", a, op, pre=pre, post=post)
    reducescatter_one(BACKEND, req.signature, req)
    assert req.result.shape == (3, 2) and req.result.dtype == np.float32
    np.testing.assert_allclose(req.result, a * factor)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int64], ids=str)
def test_reducescatter_keeps_the_dtype(dtype):
    a = np.arange(5).astype(dtype)
    req = request("reducescatter", a, Sum, pre=0.5)
    reducescatter_one(BACKEND, req.signature, req)
    assert req.result.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(req.result, (a.astype(np.float64) * 0.5).astype(dtype))


def test_adasum_of_one_rank_is_the_scaled_tensor_in_its_dtype():
    a = np.array([1.0, -2.0, 3.0], np.float32)
    req = request("allreduce", a, Adasum, pre=2.0, post=0.5)
    adasum_one(BACKEND, req.signature, req)
    assert req.result.dtype == np.float32
    np.testing.assert_array_equal(req.result, a)
    out = np.zeros(3, np.float32)
    req = request("allreduce", a, Adasum, output=out)
    adasum_one(BACKEND, req.signature, req)
    assert req.result is out
    np.testing.assert_array_equal(out, a)
    adasum_one(BACKEND, req.signature, None)  # a joined rank's share


def test_adasum_pair():
    a, b = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    np.testing.assert_array_equal(_adasum_pair(a, b), a + b)  # orthogonal: summed
    np.testing.assert_array_equal(_adasum_pair(a, a), a)  # parallel and equal: averaged
    np.testing.assert_array_equal(_adasum_pair(a, np.zeros(2)), a)  # zero: the other one
    a, b = np.array([3.0, 1.0]), np.array([1.0, 2.0])
    dot = a @ b
    want = (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b
    np.testing.assert_allclose(_adasum_pair(a, b), want)
