"""``join`` over real MPI processes, run by every rank of ``mpirun -np N python -m pytest``
(test_ops.py, N = 2 to 5). Joined ranks contribute zeros (an Average still divides by the job
size, as Horovod's), ``join`` returns the rank that joined last, the same on every rank.
Allgather, broadcast, alltoall and reducescatter fail at once, with the same error, on the ranks
that still run while another has joined (Horovod's rule), and the job goes on.

The checks after an early join go through every rank as the one that joined first, and a few
sets of joined ranks, at whatever size the job has."""

from __future__ import annotations

import numpy as np
import pytest

import hpc_horovod as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


@pytest.fixture(autouse=True)
def _job():
    hvd.init()  # a new engine after a check that stopped it


def joined_sets() -> list[list[int]]:
    """Every single rank, then every rank but one (the first, the last), then the even ranks."""
    sets = [[r] for r in range(SIZE)]
    sets += [list(range(1, SIZE)), list(range(SIZE - 1)), list(range(0, SIZE, 2))]
    unique = []
    for s in sets:
        if s not in unique and len(s) < SIZE:
            unique.append(s)
    return unique


def epoch(steps_of: list[int], tag: str) -> int:
    """Every rank runs ``steps_of[rank]`` steps of allreduces, then joins."""
    for step in range(steps_of[RANK]):
        active = [r for r in range(SIZE) if steps_of[r] > step]
        value = np.full(4, RANK + 1.0, np.float32)
        summed = hvd.allreduce(value, op=hvd.Sum, name=f"{tag}.sum.{step}")
        assert summed.tolist() == [float(sum(r + 1 for r in active))] * 4, (step, summed)
        averaged = hvd.allreduce(value, name=f"{tag}.avg.{step}")
        expected = sum(r + 1 for r in active) / SIZE
        np.testing.assert_allclose(averaged, expected, rtol=1e-6)
        maxed = hvd.allreduce(np.full(2, RANK - 10, np.int64), op=hvd.Max,
                              name=f"{tag}.max.{step}")
        # a joined rank's zeros take part in the Max as well
        contributions = [r - 10 for r in active] + [0] * (SIZE - len(active))
        assert maxed.tolist() == [max(contributions)] * 2, (step, maxed)
        in_place = np.full(3, 1.0)
        hvd.allreduce_(in_place, op=hvd.Sum, name=f"{tag}.inplace.{step}")
        assert in_place.tolist() == [float(len(active))] * 3
        if len(active) == SIZE:  # nobody joined yet: every collective works
            gathered = hvd.allgather(np.full((RANK + 1, 2), RANK), name=f"{tag}.gather.{step}")
            assert gathered[:, 0].tolist() == sum([[r] * (r + 1) for r in active], [])
            got = hvd.broadcast(np.full(2, RANK), root_rank=0, name=f"{tag}.bcast.{step}")
            assert got.tolist() == [0, 0]
    return hvd.join()


def agreed(last: int) -> int:
    """``last`` (a join's result) is the same on every rank."""
    everyone = hvd.allgather_object(last)
    assert everyone == [last] * SIZE, everyone
    return last


def test_uneven_epochs():
    # rank r has r + 2 batches: the last rank joins last
    assert agreed(epoch([r + 2 for r in range(SIZE)], "e1")) == SIZE - 1
    # the next epoch the other way round; join's state starts afresh
    assert agreed(epoch([SIZE + 1 - r for r in range(SIZE)], "e2")) == 0


def test_even_epoch_joins_at_once():
    assert 0 <= agreed(epoch([1] * SIZE, "e3")) < SIZE


def test_the_job_goes_on_after_a_join():
    agreed(hvd.join())
    assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [SIZE] * 2
    assert hvd.allgather(np.array([RANK])).tolist() == list(range(SIZE))


# -- every collective while some ranks have joined ---------------------------------------------

def _value(rank: int, shape=(2, 3)) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) % 5 + rank + 1


def _after_join(joined: list[int], call, tag: str) -> None:
    """The ranks in ``joined`` join; the others run ``call()`` then join. Every join returns
    the same rank, one of those that ran ``call`` (they joined last)."""
    try:
        if RANK not in joined:
            call()
    finally:  # whatever call() did: the others wait in join() for this rank
        last = hvd.join()
    last = agreed(last)
    assert last not in joined, f"{tag}: join() returned {last}, which joined first"


def _reduced(joined: list[int], average: bool, shape=(2, 3)) -> np.ndarray:
    total = sum(_value(r, shape) for r in range(SIZE) if r not in joined)
    return total / SIZE if average else total


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_allreduce_after_join(op):
    for joined in joined_sets():
        def call(joined=joined):
            got = hvd.allreduce(_value(RANK), op=getattr(hvd, op), name=f"ar.{joined}")
            np.testing.assert_allclose(got, _reduced(joined, op == "Average"), rtol=1e-12,
                                       err_msg=f"joined {joined}")
        _after_join(joined, call, f"allreduce, joined {joined}")


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_grouped_allreduce_after_join(op):
    shapes = [(3,), (2, 2), (5, 1)]
    for joined in joined_sets():
        def call(joined=joined):
            outs = hvd.grouped_allreduce([_value(RANK, s) for s in shapes], op=getattr(hvd, op),
                                         name=f"gar.{joined}")
            for shape, got in zip(shapes, outs):
                np.testing.assert_allclose(got, _reduced(joined, op == "Average", shape),
                                           rtol=1e-12, err_msg=f"joined {joined}")
        _after_join(joined, call, f"grouped allreduce, joined {joined}")


def test_barrier_after_join():
    for joined in joined_sets():
        _after_join(joined, hvd.barrier, f"barrier, joined {joined}")


UNSUPPORTED = {
    "Allgather": lambda name: hvd.allgather(np.ones((2, 2)), name=name),
    "Broadcast": lambda name: hvd.broadcast(np.ones(2), root_rank=SIZE - 1, name=name),
    "Alltoall": lambda name: hvd.alltoall(np.ones(SIZE), name=name),
    "Reducescatter": lambda name: hvd.reducescatter(np.ones(SIZE), op=hvd.Sum, name=name),
}


@pytest.mark.parametrize("what", UNSUPPORTED)
@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_unsupported_collective_after_join_fails_alike_on_every_rank(what, named):
    for joined in joined_sets():
        message = None

        def call(joined=joined):
            nonlocal message
            with pytest.raises(hvd.HorovodInternalError) as info:
                UNSUPPORTED[what](f"{what}.{joined}" if named else None)
            message = str(info.value)
            assert message.startswith(f"{what} is not supported with Join at this time"), message

        _after_join(joined, call, f"{what}, joined {joined}")
        messages = [m for m in hvd.allgather_object(message) if m is not None]
        assert len(messages) == SIZE - len(joined), messages
        # the same error on every rank that called it (unnamed ops: but for each rank's name)
        assert len({m.split(" [tensor ")[0] for m in messages}) == 1, messages
        if named:
            assert len(set(messages)) == 1, messages
        # unnamed ops agree again afterwards: the automatic names restart after a join
        assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [SIZE] * 2
        assert hvd.allgather(np.array([RANK])).tolist() == list(range(SIZE))


def test_process_set_after_join():
    """Join within a process set (the ranks but the first): the set's ranks outside ``joined``
    reduce, the others of the set contribute zeros; the ranks outside the set are untouched."""
    if SIZE < 3:
        pytest.skip("a set smaller than the job needs 3 ranks")
    members = list(range(1, SIZE))
    ps = hvd.add_process_set(members)
    try:
        for joined in ([m] for m in members):
            if RANK in members:
                if RANK in joined:
                    last = hvd.join(process_set=ps)
                else:
                    got = hvd.allreduce(_value(RANK), op=hvd.Sum, process_set=ps,
                                        name=f"ps.{joined}")
                    want = sum(_value(r) for r in members if r not in joined)
                    np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=f"{joined}")
                    with pytest.raises(hvd.HorovodInternalError, match="Allgather is not "
                                       "supported with Join at this time"):
                        hvd.allgather(np.ones(2), process_set=ps)
                    last = hvd.join(process_set=ps)
                everyone = hvd.allgather_object(last, process_set=ps)
                assert everyone == [last] * len(members), everyone
                assert last in members and last not in joined, (joined, last)
            # the global set is not joined: everyone reduces there
            assert hvd.allreduce(np.ones(1), op=hvd.Sum).tolist() == [SIZE]
    finally:
        hvd.remove_process_set(ps)
