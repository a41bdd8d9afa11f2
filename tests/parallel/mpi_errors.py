"""Metadata mismatches fail on every rank with the same Horovod text, and the engine stays
usable afterwards: run by every rank of ``mpirun -np N python -m pytest`` (test_ops.py)."""

from __future__ import annotations

import numpy as np
import pytest

import hpc_horovod as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
FIRST = RANK == 0  # rank 0 disagrees with all the others


@pytest.fixture(autouse=True)
def _job():
    hvd.init()  # a new engine after a check that stopped it


def expect_failure(name: str, submit, text: str) -> None:
    """``submit()`` returns a handle; it must fail with ``text`` identically on every rank."""
    try:
        hvd.synchronize(submit())
    except hvd.HorovodInternalError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{name}: no error on rank {RANK}")
    assert message == f"{text} [tensor '{name}': rank 0 vs rank 1]", message
    everyone = hvd.allgather_object(message)
    assert everyone == [message] * SIZE, everyone
    # the engine is still usable, and the failed name is free again
    assert hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"after.{name}").tolist() == [SIZE] * 2


f32, i32 = np.ones((17, 3), np.float32), np.ones((17, 3), np.int32)
CASES = [
    ("bad.dtype",
     lambda: hvd.allreduce_async(f32 if FIRST else i32, name="bad.dtype"),
     "Mismatched data types: One rank had type float32, but another rank had type int32."),
    ("bad.shape",
     lambda: hvd.allreduce_async(np.ones((17, 3 if FIRST else 4)), name="bad.shape"),
     "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [17, 3], but "
     "another rank sent a tensor of shape [17, 4]."),
    ("bad.rank",
     lambda: hvd.broadcast_async(np.ones((2, 2)) if FIRST else np.ones(4), 0, name="bad.rank"),
     "Mismatched BROADCAST tensor shapes: One rank sent a tensor of rank 2, but another rank "
     "sent a tensor of rank 1."),
    ("bad.op",
     lambda: hvd.allreduce_async(f32, op=hvd.Sum if FIRST else hvd.Max, name="bad.op"),
     "Mismatched reduction operation: One rank sent reduction op Sum, but another rank sent "
     "reduction op Max."),
    ("bad.root",
     lambda: hvd.broadcast_async(f32, root_rank=0 if FIRST else 1, name="bad.root"),
     "Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank "
     "specified root rank 1."),
    ("bad.kind",
     lambda: (hvd.allreduce_async(f32, name="bad.kind") if FIRST
              else hvd.allgather_async(f32, name="bad.kind")),
     "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER."),
    ("bad.adasum",
     lambda: hvd.allreduce_async(f32, op=hvd.Sum if FIRST else hvd.Adasum, name="bad.adasum"),
     "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ADASUM."),
    ("bad.prescale",
     lambda: hvd.allreduce_async(f32, prescale_factor=0.5 if FIRST else 1.0,
                                 name="bad.prescale"),
     "Mismatched prescale and/or postscale factors: One rank sent factors (0.5, 1), but "
     "another rank sent factors (1, 1)."),
    ("bad.gather",
     lambda: hvd.allgather_async(np.ones((RANK + 1, 3 if FIRST else 4)), name="bad.gather"),
     "Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 equal to 3, "
     "but another rank sent a tensor with dimension 1 equal to 4."),
    ("bad.scatter",
     lambda: hvd.reducescatter_async(np.ones((4 if FIRST else 6, 2)), op=hvd.Sum,
                                     name="bad.scatter"),
     "Mismatched REDUCESCATTER tensor shapes: One rank sent a tensor of shape [4, 2], but "
     "another rank sent a tensor of shape [6, 2]."),
    ("bad.a2a",
     lambda: hvd.alltoall_async(np.ones((SIZE, 2), np.float64 if FIRST else np.float32),
                                name="bad.a2a"),
     "Mismatched data types: One rank had type float64, but another rank had type float32."),
]


@pytest.mark.parametrize("name, submit, text", CASES, ids=[c[0] for c in CASES])
def test_mismatch(name, submit, text):
    expect_failure(name, submit, text)


def test_mismatch_of_a_cached_name():
    """A name agreed once lives in the response cache; changed metadata must still be caught."""
    for _ in range(3):
        assert hvd.allreduce(np.ones(3), op=hvd.Sum, name="cached").tolist() == [SIZE] * 3
    expect_failure(
        "cached",
        lambda: hvd.allreduce_async(np.ones(3 if FIRST else 5), op=hvd.Sum, name="cached"),
        "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [3], but another "
        "rank sent a tensor of shape [5].")
    assert hvd.allreduce(np.ones(3), op=hvd.Sum, name="cached").tolist() == [SIZE] * 3


def test_only_the_bad_member_of_a_group_fails():
    group = [np.ones(2), np.ones(3) if FIRST else np.ones(4), np.ones(5)]
    handles = hvd.grouped_allreduce_async(group, op=hvd.Sum, name="grp")
    assert hvd.synchronize(handles[0]).tolist() == [SIZE] * 2
    assert hvd.synchronize(handles[2]).tolist() == [SIZE] * 5
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.synchronize(handles[1])
    assert "Mismatched ALLREDUCE tensor shapes" in str(info.value), str(info.value)
    assert "'grp.1'" in str(info.value), str(info.value)


def test_unnamed_mismatch():
    """Unnamed ops get the same automatic names on every rank: a mismatch is still reported."""
    with pytest.raises(hvd.HorovodInternalError) as info:
        hvd.allreduce(np.ones(2) if FIRST else np.ones(2, np.float32))
    assert str(info.value).startswith(
        "Mismatched data types: One rank had type float64, but another rank had type float32. "
        "[tensor 'allreduce.noname."), str(info.value)
    assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [SIZE] * 2
