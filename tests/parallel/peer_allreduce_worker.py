"""Run on every rank by test_peer_allreduce.py: sums through the other ranks' memory
(``backends/peer.py``) between real MPI processes, against MPI's own Allreduce, then the float
sums inside hpc_horovod, fused ones through the shared window and large ones alone through the
peers' memory (in place, out of place, averaged, mixed across ranks, with a joined rank, in a
process set), a peer that does not come, and the fall back to MPI when a kernel refuses
cross-memory attach.

With 2 ranks a sum gives MPI's bits exactly (one addition, commutative). With more, the sums
are compared within rounding, and every rank must hold the same bits.
"""

from __future__ import annotations

import hashlib
import sys
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

import hpc_horovod as hvd
from hpc_horovod.backends import peer
from hpc_horovod.backends.peer import PeerAllreduce
from hpc_horovod.backends.waiting import RequestWaiter
from hpc_horovod.common import basics

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
GROUPS = [[4096] * 200, [300_000, 7, 250_000], [0, 5, 0, 1000], [1], [8] * 1500]


def same_on_every_rank(arrays: list[np.ndarray], what: str) -> None:
    digest = hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()
    assert len(set(COMM.allgather(digest))) == 1, f"{what}: ranks hold different results"


def check_against_mpi() -> None:
    reducer = PeerAllreduce.open(COMM, RequestWaiter(SIZE))
    assert reducer is not None, "cross-memory attach works between these processes"
    rng = np.random.default_rng(RANK)
    for dtype in map(np.dtype, [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]):
        for sizes in GROUPS:
            for in_place in (True, False):
                xs = [(rng.standard_normal(n) * 4).astype(dtype) for n in sizes]
                flat = np.concatenate([x.astype(np.float64) for x in xs])
                exact = np.empty_like(flat)
                COMM.Allreduce(flat, exact)
                inputs = [x.copy() for x in xs]
                outputs = inputs if in_place else [np.empty_like(x) for x in xs]
                reducer.allreduce(inputs, outputs, dtype, 1.0, 30.0)
                got = np.concatenate([o.astype(np.float64) for o in outputs])
                what = f"{dtype} sum of {len(sizes)} tensors, in place {in_place}"
                if dtype.itemsize >= 4 and SIZE == 2:
                    mpi = np.concatenate([x.reshape(-1) for x in xs])
                    COMM.Allreduce(MPI.IN_PLACE, mpi)
                    assert np.array_equal(np.concatenate(outputs), mpi), what
                else:  # SIZE - 1 roundings here, and as many in the float64 reference
                    eps = float(ml_dtypes.finfo(dtype).eps) if dtype.itemsize == 2 else \
                        float(np.finfo(dtype).eps)
                    total = np.empty_like(flat)
                    COMM.Allreduce(np.abs(flat), total)
                    bound = 2 * (SIZE - 1) * eps * total
                    assert np.all(np.abs(got - exact) <= bound), what
                if not in_place:
                    assert all(np.array_equal(a, b) for a, b in zip(inputs, xs)), what
                same_on_every_rank(outputs, what)


def check_absent_peer_is_reported() -> None:
    """Rank 0 waits for peers that come 1 s late: with a 0.3 s timeout it gets an error naming
    the reduction instead of a hang; the latecomers then find it in the exchange's
    collectives, which it completes without reading or writing anyone's memory."""
    comm = COMM.Dup()
    reducer = PeerAllreduce.open(comm, RequestWaiter(SIZE))
    tensors = [np.full(1000, 1.0, np.float32)]
    if RANK == 0:
        try:
            reducer.allreduce(tensors, tensors, np.dtype(np.float32), 1.0, 0.3)
        except hvd.HorovodInternalError as exc:
            assert "no answer from some of the" in str(exc), exc
            assert "allreduce of 1 tensors of float32 through the node's memory" in str(exc)
        else:
            raise AssertionError("no error although the peers never came")
        comm.Ibarrier().Wait()  # the latecomers' second collective
    else:
        time.sleep(1.0)
        reducer.allreduce(tensors, tensors, np.dtype(np.float32), 1.0, 30.0)
    comm.Barrier()
    comm.Free()


def backend():
    return basics._require().engine.backend


def check_inside_hpc_horovod() -> None:
    hvd.init()
    grads = [np.full(1000 + i, RANK + i, np.float32) for i in range(50)]  # 200 KB: fused
    handles = [hvd.allreduce_async(g, name=f"g{i}", op=hvd.Sum) for i, g in enumerate(grads)]
    for i, h in enumerate(handles):
        got = hvd.synchronize(h)
        assert got.shape == grads[i].shape and np.all(got == SIZE * i + SIZE * (SIZE - 1) / 2)
    assert backend()._node is not None, "the fused sum did not go through the window"
    assert backend()._peer is None, "fused sums do not need the peers' memory"
    handles = [hvd.allreduce_async_(g, name=f"g{i}") for i, g in enumerate(grads)]
    for h, g in zip(handles, grads):
        assert hvd.synchronize(h) is g
    for i, g in enumerate(grads):
        assert np.allclose(g, i + (SIZE - 1) / 2), f"in-place average {i}"
    shaped = [np.full((40, 50 + i), RANK + 1.0, np.float64) for i in range(10)]
    handles = [hvd.allreduce_async(t, name=f"s{i}", op=hvd.Sum, prescale_factor=2.0,
                                   postscale_factor=0.25) for i, t in enumerate(shaped)]
    for t, h in zip(shaped, handles):
        got = hvd.synchronize(h)
        assert got.shape == t.shape and np.all(got == SIZE * (SIZE + 1) / 4), "scaled"
    # tensors alone in their group (fusion.node_sum): 24 MiB in place and out of place through
    # the peers' memory, 2.4 MB out of place and 4 MiB in place through the window, 4 KiB
    # through MPI; fused groups through the window, whatever their size
    counts, real = [], backend().reduce_through_peers
    backend().reduce_through_peers = lambda inputs, *args: (counts.append(len(inputs)),
                                                            real(inputs, *args))
    window = backend().window  # counts the groups and tensors it sums, whichever way
    sums, tensors = window.sums, window.tensors
    big = np.full(3 << 20, RANK + 1.0)
    assert hvd.allreduce_(big, op=hvd.Sum) is big and np.all(big == SIZE * (SIZE + 1) / 2)
    got = hvd.allreduce(big, op=hvd.Average)
    assert got is not big and np.all(got == SIZE * (SIZE + 1) / 2), "large out of place"
    got = hvd.allreduce(np.full((600, 500), RANK + 1.0), op=hvd.Average)
    assert got.shape == (600, 500) and np.all(got == (SIZE + 1) / 2), "solo out of place"
    middle = np.full(1 << 20, RANK + 1.0, np.float32)
    hvd.allreduce_(middle, op=hvd.Sum)
    assert np.all(middle == SIZE * (SIZE + 1) / 2), "solo in place"
    small = np.full(1024, RANK + 1.0, np.float32)
    hvd.allreduce_(small, op=hvd.Sum)
    assert np.all(small == SIZE * (SIZE + 1) / 2), "small, through MPI"
    assert counts == [1, 1], f"tensors alone through the peers: {counts}"
    fused = (window.sums - sums, window.tensors - tensors)
    assert fused == (2, 2), f"(groups, tensors) alone through the window: {fused}"
    large = [np.full(225_000, RANK + 1.0, np.float32) for i in range(6)]  # one cycle
    assert all(np.all(t == SIZE * (SIZE + 1) / 2) for t in hvd.grouped_allreduce(large, op=hvd.Sum))
    fused = (window.sums - sums, window.tensors - tensors)
    assert counts == [1, 1] and fused == (3, 8), f"peers {counts}, window {fused}"
    del backend().reduce_through_peers
    # mixed across ranks: in place on some, out of place on others
    for step in range(3):
        tensors = [np.full(5000 + i, RANK + 1.0, np.float32) for i in range(8)]
        submit = hvd.allreduce_async_ if (RANK + step) % 2 == 0 else hvd.allreduce_async
        handles = [submit(t, name=f"mixed{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        for h in handles:
            assert np.all(hvd.synchronize(h) == SIZE * (SIZE + 1) / 2), f"step {step}"
    if RANK == SIZE - 1:  # joins at once: contributes zeros to the others' fused group
        hvd.join()
    else:
        tensors = [np.full((100, 30 + i), 2.0, np.float32) for i in range(10)]
        handles = [hvd.allreduce_async_(t, name=f"joined{i}", op=hvd.Sum)
                   for i, t in enumerate(tensors)]
        for t, h in zip(tensors, handles):
            hvd.synchronize(h)
            assert np.all(t == 2.0 * (SIZE - 1)), "a joined rank must contribute zeros"
        hvd.join()
    ps = hvd.add_process_set([0, SIZE - 1])
    if RANK in (0, SIZE - 1):
        tensors = [np.full(20_000, RANK + 1.0, np.float32) for _ in range(4)]
        handles = [hvd.allreduce_async_(t, name=f"ps{i}", op=hvd.Sum, process_set=ps)
                   for i, t in enumerate(tensors)]
        for t, h in zip(tensors, handles):
            hvd.synchronize(h)
            assert np.all(t == 1.0 + SIZE), "process set sum"
        assert basics._require().engine._sets[ps.process_set_id].backend._node is not None
    hvd.remove_process_set(ps)
    hvd.shutdown()


class _Refusing:
    """The native module as a kernel that refuses cross-memory attach would leave it (EPERM on
    the last rank only): a seccomp profile cannot be set up on this machine, so the refusal is
    simulated; every other call is the real one."""

    def __init__(self, native):
        self._native = native

    def __getattr__(self, name):
        return getattr(self._native, name)

    def peer_read(self, *args):
        if RANK == SIZE - 1:
            raise PermissionError(1, "Operation not permitted")
        return self._native.peer_read(*args)


def check_refusal_falls_back() -> None:
    """Where one rank cannot reach the others' memory, every rank sums large tensors through
    MPI, and large fused groups through the shared window."""
    real, peer._native = peer._native, _Refusing(peer._native)
    try:
        hvd.init()
        big = np.full(3 << 20, RANK + 1.0)
        assert hvd.allreduce_(big, op=hvd.Sum) is big and np.all(big == SIZE * (SIZE + 1) / 2)
        assert backend()._peer is None and backend()._peer_refused, "every rank falls back"
        grads = [np.full(225_000, RANK + 1.0, np.float32) for i in range(6)]
        for got in hvd.grouped_allreduce(grads, op=hvd.Sum):
            assert np.all(got == SIZE * (SIZE + 1) / 2), "sum after the refusal"
        assert backend()._node is not None, "through the shared window instead"
        COMM.Barrier()  # no rank stops (which releases every rank's window) before all looked
        hvd.shutdown()
    finally:
        peer._native = real


def main() -> None:
    check_against_mpi()
    check_absent_peer_is_reported()
    check_inside_hpc_horovod()
    check_refusal_falls_back()
    print(f"rank {RANK}: peer allreduce ok", flush=True)


if __name__ == "__main__":
    sys.exit(main())
