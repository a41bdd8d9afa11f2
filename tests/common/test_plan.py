"""The engine's execution plans: order, grouping and fusion layout, the same on every rank."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_horovod.common.execution import Plan
from hpc_horovod.common.fusion import SOLO_BYTES
from hpc_horovod.common.request import signature_of
from hpc_horovod.common.types import Adasum, Average, Sum

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
             for _, activity, start, stop, fused in plan.steps]
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
    assert [plan.order[start:stop] for _, _, start, stop, _ in plan.steps] == [[0, 2], [1], [3]]
