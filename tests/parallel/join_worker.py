"""Run on every rank by test_ops.py: ``join`` with uneven amounts of work per rank. Joined ranks
contribute zeros (an average still divides by the job size), and ``join`` returns the rank that
joined last, the same on every rank. Allgather, broadcast, alltoall and reducescatter fail at
once on the ranks that still run while another has joined (Horovod's rule), and the job goes on.
Prints ``rank R: join ok``."""

from __future__ import annotations

import numpy as np

import hpc_horovod as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


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


# rank r has r + 2 batches: the last rank joins last
last = epoch([r + 2 for r in range(SIZE)], "e1")
assert last == SIZE - 1, last
print(f"rank {RANK}: uneven join ok", flush=True)

# the next epoch the other way round; join's state starts afresh
last = epoch([SIZE + 1 - r for r in range(SIZE)], "e2")
assert last == 0, last

# everyone even: join returns at once, the last rank to join is one of them
last = epoch([1] * SIZE, "e3")
assert 0 <= last < SIZE and hvd.allgather_object(last) == [last] * SIZE

# while rank 0 has joined, the collectives join does not support fail at once on the others,
# with a RuntimeError (HorovodInternalError) naming the joined ranks; then they join too
if RANK == 0:
    last = hvd.join()
else:
    for what, call in [
        ("Allgather", lambda: hvd.allgather(np.ones((2, 2)), name="gather.joined")),
        ("Broadcast", lambda: hvd.broadcast(np.ones(2), root_rank=SIZE - 1, name="bc.joined")),
        ("Alltoall", lambda: hvd.alltoall(np.ones(SIZE), name="a2a.joined")),
        ("Reducescatter", lambda: hvd.reducescatter(np.ones(SIZE), name="rs.joined")),
    ]:
        try:
            call()
        except RuntimeError as exc:
            assert isinstance(exc, hvd.HorovodInternalError), type(exc)
            assert str(exc).startswith(f"{what} is not supported with Join"), str(exc)
            assert "ranks [0] have joined" in str(exc), str(exc)
        else:
            raise AssertionError(f"{what} with a joined rank did not fail")
    last = hvd.join()
assert last != 0 and hvd.allgather_object(last) == [last] * SIZE, last

# and the job goes on normally afterwards
assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [SIZE] * 2
hvd.shutdown()
print(f"rank {RANK}: join ok", flush=True)
