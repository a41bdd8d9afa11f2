"""Fusion over real MPI processes, run by every rank of ``mpirun -np N python -m pytest``
(test_ops.py): 200 small tensors of mixed dtypes, ops and scales against numpy, with the default
fusion threshold, without fusion (HOROVOD_FUSION_THRESHOLD=0) and with tiny buffers and a tiny
response cache; the three runs give the same bits, and the timeline shows what was fused.
Pooled result buffers are never handed out while a result still uses them."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from reference import inputs, reduce_reference, tolerance

import hpc_horovod as hvd
from hpc_horovod.common import basics

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()

RUNS = {
    "default": {},  # 128 MiB: everything ready in one cycle is fused
    "unfused": {"HOROVOD_FUSION_THRESHOLD": "0"},  # every tensor on its own
    # small buffers, and a response cache too small for the names: constant eviction
    "small": {"HOROVOD_FUSION_THRESHOLD": "256", "HOROVOD_CACHE_CAPACITY": "2"},
}
DTYPES = [np.float32, np.float64, np.int32, np.float16, np.int64]
SPECS = []  # (dtype, shape, op, prescale) per tensor
for i in range(200):
    dtype = DTYPES[i % len(DTYPES)]
    shape = (i % 13 + 1,) if i % 3 else (i % 5 + 1, 3)
    op = [hvd.Sum, hvd.Average, hvd.Max, hvd.Sum][i % 4]
    prescale = 2.0 if i % 7 == 0 else 1.0
    SPECS.append((dtype, shape, op, prescale))
DATA = [inputs(SIZE, dtype, shape, 5000 + i) for i, (dtype, shape, _, _) in enumerate(SPECS)]
DIGESTS: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _job():
    hvd.init()  # a new engine after a check that stopped it


@pytest.fixture
def engine_with(monkeypatch):
    """``engine_with(env)``: the engine started again with ``env`` and a timeline (rank 0
    writes it); returns the timeline's path. The default engine again afterwards."""
    directory = tempfile.mkdtemp()

    def start(env: dict) -> Path:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        path = Path(directory) / "timeline.json"
        monkeypatch.setenv("HOROVOD_TIMELINE", str(path))
        hvd.shutdown()
        hvd.init()
        return path

    yield start
    hvd.shutdown()
    monkeypatch.undo()
    hvd.init()


@pytest.mark.parametrize("run", RUNS)
def test_small_tensors_against_numpy(run, engine_with):
    timeline = engine_with(RUNS[run])
    handles = {}  # half of them one by one, half as groups of one enqueue each
    for i in range(100):
        dtype, shape, op, prescale = SPECS[i]
        handles[i] = hvd.allreduce_async(DATA[i][RANK], name=f"small.{i}", op=op,
                                         prescale_factor=prescale)
    for key in sorted({(SPECS[i][2], SPECS[i][3]) for i in range(100, 200)}):
        members = [i for i in range(100, 200) if (SPECS[i][2], SPECS[i][3]) == key]
        group = hvd.grouped_allreduce_async([DATA[i][RANK] for i in members], op=key[0],
                                            prescale_factor=key[1], name=f"group.{key}")
        handles.update(zip(members, group))
    digest = hashlib.sha256()
    for i, handle in sorted(handles.items()):
        dtype, shape, op, prescale = SPECS[i]
        out = hvd.synchronize(handle)
        expected = reduce_reference(DATA[i], op, prescale)
        assert out.dtype == np.dtype(dtype) and out.shape == shape, (i, out.dtype, out.shape)
        np.testing.assert_allclose(out.astype(np.float64), expected.astype(np.float64),
                                   err_msg=f"tensor {i}", **tolerance(dtype))
        digest.update(out.tobytes())
    everyone = hvd.allgather_object(digest.hexdigest())
    assert everyone == [everyone[0]] * SIZE, everyone  # every rank holds the same bits
    DIGESTS[run] = everyone[0]
    hvd.shutdown()  # the timeline is complete
    if RANK == 0:
        fused = [e["args"]["fused_tensors"] for e in json.loads(timeline.read_text())
                 if e.get("name") == "MPI_ALLREDUCE"]
        if run == "default":
            assert max(fused) > 1, "the default threshold never fused anything"
        elif run == "unfused":
            assert set(fused) == {1}, "HOROVOD_FUSION_THRESHOLD=0 still fused tensors"
        else:  # 256 bytes hold at most 64 float32 (bigger tensors travel alone)
            assert 1 < max(fused) <= 64, fused
    else:
        assert not timeline.exists(), "a rank other than 0 wrote the timeline"


def test_fused_bits_equal_unfused_bits():
    assert set(DIGESTS) == set(RUNS), f"runs that did not finish: {set(RUNS) - set(DIGESTS)}"
    assert DIGESTS["default"] == DIGESTS["unfused"] == DIGESTS["small"], DIGESTS


def test_pooled_results_are_not_reused_while_alive():
    """Results of 1 MiB and more come from a buffer pool: a buffer must never be reused while
    any result (or a view of one) still points into it."""
    n = (1 << 20) // 4
    kept = [hvd.allreduce(np.full(n, RANK + k, np.float32), op=hvd.Sum, name=f"big.{k}")
            for k in range(6)]
    view = hvd.allreduce(np.full(n, 100.0, np.float32), op=hvd.Sum, name="big.view")[10:20]
    for k in range(6, 12):  # dropped at once: their buffers may be reused
        hvd.allreduce(np.full(n, RANK + k, np.float32), op=hvd.Sum, name=f"big.{k}")
    fused = hvd.grouped_allreduce([np.full(n // 2, 7.0, np.float32)] * 2, op=hvd.Sum,
                                  name="bigg")
    for k, out in enumerate(kept):
        assert (out == sum(r + k for r in range(SIZE))).all(), f"pooled result {k} overwritten"
    assert (view == 100.0 * SIZE).all(), "a view into a pooled result was overwritten"
    assert all((f == 7.0 * SIZE).all() for f in fused)


#: In-place tensors whose fused groups are above the size MPI reduces alone (the stages' path):
#: float32 (Sum, Average, prescaled) and int64 groups of 1-3 MiB, packed into the window's
#: fusion memory when a group fits the staging half, into private memory when it does not.
INPLACE = [(np.float32 if i % 3 else np.int64, 20_000 + 4_099 * i) for i in range(12)]
INPLACE_DATA = [inputs(SIZE, dtype, (n,), 9000 + i) for i, (dtype, n) in enumerate(INPLACE)]
INPLACE_RUNS = {
    "window": {},  # 128 MiB: every group fits the staging half
    "private": {"HOROVOD_FUSION_THRESHOLD": str(1 << 20)},  # groups of 1 MiB, half of 512 KiB
}
INPLACE_DIGESTS: dict[str, str] = {}


@pytest.mark.parametrize("run", INPLACE_RUNS)
def test_inplace_fused_groups_against_numpy(run, engine_with):
    engine_with(INPLACE_RUNS[run])
    backend = basics.engine().backend
    packed = []  # (bytes asked for, whether the window had them) per fused group

    def fusion_memory(nbytes, asked=backend.fusion_memory):
        memory = asked(nbytes)
        packed.append((nbytes, memory is not None))
        return memory

    backend.fusion_memory = fusion_memory
    digest = hashlib.sha256()
    for op, prescale in ((hvd.Sum, 1.0), (hvd.Average, 1.0), (hvd.Sum, 0.5)):
        tensors = [data[RANK].copy() for data in INPLACE_DATA]
        handles = [hvd.allreduce_async_(t, name=f"inplace.{op}.{prescale}.{i}", op=op,
                                        prescale_factor=prescale)
                   for i, t in enumerate(tensors)]
        for i, (t, handle) in enumerate(zip(tensors, handles)):
            assert hvd.synchronize(handle) is t
            dtype = INPLACE[i][0]
            expected = reduce_reference(INPLACE_DATA[i], op, prescale)
            np.testing.assert_allclose(t.astype(np.float64), expected.astype(np.float64),
                                       err_msg=f"tensor {i}, {op}, {prescale}",
                                       **tolerance(dtype))
            digest.update(t.tobytes())
    everyone = hvd.allgather_object(digest.hexdigest())
    assert everyone == [everyone[0]] * SIZE, everyone
    INPLACE_DIGESTS[run] = everyone[0]
    if run == "window":
        assert packed and all(got for _, got in packed), packed
    else:
        assert any(not got and nbytes > (1 << 20) // 2 for nbytes, got in packed), packed


def test_inplace_groups_in_the_window_give_the_bits_of_private_memory():
    assert set(INPLACE_DIGESTS) == set(INPLACE_RUNS), INPLACE_DIGESTS
    assert INPLACE_DIGESTS["window"] == INPLACE_DIGESTS["private"], INPLACE_DIGESTS
