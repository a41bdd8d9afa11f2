"""``hpc_horovod.common.execution`` on the size-1 backend: the plans (order, grouping and fusion
layout, the same on every rank), how ready allreduces are grouped, the scale factors in Horovod's
order, one group's pack/reduce/unpack (in place, out of place as views of the fusion buffer, half
precision widened on the wire, a joined rank's zeros), and the pool of large result buffers,
reused only when nothing holds them."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_horovod.backends.single import SingleBackend
from hpc_horovod.common import collectives
from hpc_horovod.common.collectives import scale_factors
from hpc_horovod.common.execution import (
    SOLO_BYTES,
    BufferPool,
    FusedAllreduce,
    Plan,
    group_allreduces,
)
from hpc_horovod.common.request import Request, signature_of
from hpc_horovod.common.types import Adasum, Average, Max, Sum


def sig(shape=(4,), dtype=np.float32, op=Sum, pre=1.0, post=1.0):
    return signature_of("allreduce", np.empty(shape, dtype), op, prescale=pre, postscale=post)


# -- grouping -------------------------------------------------------------------------------------
def test_agreeing_small_tensors_share_a_group_in_their_order():
    sigs = [sig((4,)), sig((2, 2)), sig((8,))]
    assert group_allreduces(sigs, [2, 0, 1], threshold=1024) == [[2, 0, 1]]


def test_a_group_closes_at_the_threshold():
    sigs = [sig((4,)) for _ in range(5)]  # 16 bytes each
    assert group_allreduces(sigs, list(range(5)), threshold=32) == [[0, 1], [2, 3], [4]]


def test_a_tensor_larger_than_the_threshold_still_gets_a_group():
    sigs = [sig((100,)), sig((1,))]
    assert group_allreduces(sigs, [0, 1], threshold=16) == [[0], [1]]


@pytest.mark.parametrize("other", [
    {"dtype": np.float64}, {"op": Max}, {"pre": 2.0}, {"post": 0.5},
], ids=["dtype", "op", "prescale", "postscale"])
def test_tensors_that_differ_go_to_separate_groups(other):
    sigs = [sig(), sig(**other), sig(), sig(**other)]
    assert group_allreduces(sigs, [0, 1, 2, 3], threshold=1 << 20) == [[0, 2], [1, 3]]


def test_large_tensors_are_reduced_alone():
    big = sig((SOLO_BYTES // 4,))
    sigs = [sig(), big, sig()]
    assert group_allreduces(sigs, [0, 1, 2], threshold=1 << 30) == [[0, 2], [1]]


def test_a_zero_threshold_puts_each_tensor_alone():
    sigs = [sig() for _ in range(3)]
    assert group_allreduces(sigs, [0, 1, 2], threshold=0) == [[0], [1], [2]]


# -- scale factors --------------------------------------------------------------------------------
def test_average_divides_after_the_sum_and_other_ops_do_not():
    assert scale_factors(sig(op=Average, pre=2.0, post=3.0), 4) == (2.0, 0.75)
    assert scale_factors(sig(op=Sum, pre=2.0, post=3.0), 4) == (2.0, 3.0)
    assert scale_factors(sig(op=Max), 4) == (1.0, 1.0)


def test_the_reduction_is_computed_once_per_size():
    group = FusedAllreduce([sig(op=Average, post=2.0)])
    first = group.reduction(2)
    assert first[1] == Sum and first[4] == 1.0  # Average goes on the wire as Sum, then / 2
    assert group.reduction(2) == first and group._reduction[0] == 2
    assert group.reduction(4)[4] == 0.5 and group._reduction[0] == 4


# -- one group on the size-1 backend --------------------------------------------------------------
def requests(arrays, op=Sum, pre=1.0, post=1.0, in_place=False):
    return [Request(f"t{i}", a, signature_of("allreduce", a, op, prescale=pre, postscale=post),
                    output=a if in_place else None) for i, a in enumerate(arrays)]


def test_out_of_place_results_are_scaled_views_of_one_buffer():
    arrays = [np.arange(4, dtype=np.float32), np.ones((2, 3), np.float32)]
    reqs = requests(arrays, op=Average, pre=2.0, post=3.0)
    FusedAllreduce([r.signature for r in reqs])(SingleBackend(), reqs)
    for req, a in zip(reqs, arrays):
        assert req.result.shape == a.shape and req.result.dtype == a.dtype
        np.testing.assert_array_equal(req.result, a * 6.0)
    assert np.shares_memory(reqs[0].result.base, reqs[1].result.base)
    np.testing.assert_array_equal(arrays[0], np.arange(4))  # the inputs are untouched


def test_in_place_results_are_written_back():
    arrays = [np.arange(4, dtype=np.float64), np.full(3, 2.0)]
    reqs = requests(arrays, op=Sum, post=0.5, in_place=True)
    FusedAllreduce([r.signature for r in reqs])(SingleBackend(), reqs)
    assert reqs[0].result is arrays[0] and reqs[1].result is arrays[1]
    np.testing.assert_array_equal(arrays[0], np.arange(4) * 0.5)
    np.testing.assert_array_equal(arrays[1], [1.0, 1.0, 1.0])


def test_a_tensor_alone_is_reduced_in_its_own_memory():
    a = np.arange(6, dtype=np.float32)
    (req,) = requests([a], pre=2.0, in_place=True)
    FusedAllreduce([req.signature])(SingleBackend(), [req])
    assert req.result is a
    np.testing.assert_array_equal(a, np.arange(6) * 2.0)


@pytest.mark.parametrize("dtype", [np.float16, np.int32], ids=str)
def test_results_keep_their_dtype(dtype):
    arrays = [np.arange(5).astype(dtype), np.arange(3).astype(dtype)]
    reqs = requests(arrays, pre=0.5)
    FusedAllreduce([r.signature for r in reqs])(SingleBackend(), reqs)
    for req, a in zip(reqs, arrays):
        assert req.result.dtype == np.dtype(dtype)
        # integers are scaled in float64 and truncated, like a cast
        np.testing.assert_array_equal(req.result, (a.astype(np.float64) * 0.5).astype(dtype))


def test_a_joined_ranks_share_is_zeros_and_gets_no_result():
    a = np.ones(4, np.float32)
    reqs = requests([a, np.ones(2, np.float32)])
    group = FusedAllreduce([r.signature for r in reqs])
    group(SingleBackend(), [reqs[0], None])
    np.testing.assert_array_equal(reqs[0].result, a)
    assert reqs[1].result is None


# -- the pool of result buffers -------------------------------------------------------------------
def test_small_buffers_are_not_pooled():
    pool = BufferPool()
    a = pool.empty((16,), np.float32)
    del a
    assert pool._buffers == {}


def test_a_large_buffer_is_reused_only_when_nothing_holds_it():
    pool = BufferPool()
    n = BufferPool.MIN_BYTES // 4
    a = pool.empty((n,), np.float32)
    view = a[:10]
    address = a.__array_interface__["data"][0]
    del a
    b = pool.empty((n,), np.float32)  # a view of the first is still alive
    assert b.__array_interface__["data"][0] != address
    del b, view
    c = pool.empty((n // 2, 2), np.float32)
    assert c.__array_interface__["data"][0] == address and c.shape == (n // 2, 2)


def test_the_pool_keeps_a_few_buffers_per_size():
    pool = BufferPool()
    held = [pool.empty((BufferPool.MIN_BYTES,), np.uint8) for _ in range(BufferPool.PER_SIZE + 2)]
    assert len(pool._buffers[BufferPool.MIN_BYTES]) == BufferPool.PER_SIZE
    assert len({h.__array_interface__["data"][0] for h in held}) == len(held)


def test_the_wire_dtype_of_half_precision():
    wire = collectives.wire_dtype(np.dtype(np.float16), Sum)
    assert wire in (np.dtype(np.float16), np.dtype(np.float32))  # native half sums, or widened
    assert collectives.wire_dtype(np.dtype(np.float16), Max) == np.float32  # no native Max
    assert collectives.wire_dtype(np.dtype(np.float16), Max, device=True) == np.float16
    assert collectives.wire_dtype(np.dtype(np.int32), Sum) == np.int32


# -- plans -----------------------------------------------------------------------------------------
F32, F64 = np.zeros((4, 2), np.float32), np.zeros(3, np.float64)


def test_allreduces_first_fused_by_dtype_and_op_then_gathers_then_the_rest():
    sigs = [
        signature_of("broadcast", F32, root=0),       # 0
        signature_of("allreduce", F32, Sum),          # 1
        signature_of("allgather", F32),               # 2
        signature_of("allreduce", F64, Sum),          # 3
        signature_of("allreduce", F32, Sum),          # 4
        signature_of("allreduce", F32, Adasum),       # 5: not fused
        signature_of("allreduce", F32, Average),      # 6
    ]
    names = [f"t{i}" for i in range(len(sigs))]
    plan = Plan(names, sigs, threshold=1 << 20)
    steps = [(activity, [plan.order[i] for i in range(start, stop)], fused is not None)
             for _, activity, start, stop, fused, _ in plan.steps]
    assert steps == [
        ("ALLREDUCE", [1, 4], True),
        ("ALLREDUCE", [3], True),
        ("ALLREDUCE", [6], True),
        ("ALLGATHER", [2], False),
        ("BROADCAST", [0], False),
        ("ALLREDUCE", [5], False),
    ]
    assert plan.names == [names[i] for i in plan.order]
    assert plan.sigs == [sigs[i] for i in plan.order]


def test_fusion_threshold_splits_groups_and_layout_follows_the_shapes():
    sigs = [signature_of("allreduce", np.zeros(shape, np.float32), Sum)
            for shape in [(4, 2), (3,), (5,)]]
    plan = Plan(["a", "b", "c"], sigs, threshold=11 * 4)  # 8 + 3 elements fit, 5 more do not
    fused = [step[4] for step in plan.steps]
    assert [f.shapes for f in fused] == [[(4, 2), (3,)], [(5,)]]
    assert fused[0].bounds == [(0, 8), (8, 11)] and fused[0].total == 11
    assert not fused[0].flat and fused[1].flat


def test_signatures_are_interned_and_checked_once():
    a = signature_of("allreduce", np.zeros(3, np.float32), Sum)
    assert signature_of("allreduce", np.ones(3, np.float32), Sum) is a
    assert signature_of("allreduce", np.ones(3, np.float32), Average) is not a
    assert signature_of("allgather", np.zeros((5, 2), np.int32)).shape == (-1, 2)
    with pytest.raises(ValueError, match="does not support dtype complex64"):
        signature_of("allreduce", np.zeros(3, np.complex64), Sum)


def test_large_tensors_are_reduced_alone_between_the_fused_small_ones():
    small, large = np.zeros(16, np.float32), np.zeros(SOLO_BYTES // 4, np.float32)
    sigs = [signature_of("allreduce", a, Sum) for a in (small, large, small, large)]
    plan = Plan(["a", "b", "c", "d"], sigs, threshold=64 << 20)
    assert [plan.order[start:stop] for _, _, start, stop, _, _ in plan.steps] == [[0, 2], [1], [3]]
