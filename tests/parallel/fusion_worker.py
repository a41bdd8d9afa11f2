"""Run on every rank by test_ops.py, with and without fusion (HOROVOD_FUSION_THRESHOLD=0): 200
small tensors of mixed dtypes, ops and scales. Checks them against numpy, then prints a digest of
every result's bytes so the test can compare the fused run with the unfused one bit for bit.
Also checks that pooled result buffers are never handed out while a result still uses them."""

from __future__ import annotations

import hashlib

import numpy as np
from reference import inputs, reduce_reference, tolerance

import hpc_horovod as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()

DTYPES = [np.float32, np.float64, np.int32, np.float16, np.int64]
SPECS = []  # (dtype, shape, op, prescale) per tensor
for i in range(200):
    dtype = DTYPES[i % len(DTYPES)]
    shape = (i % 13 + 1,) if i % 3 else (i % 5 + 1, 3)
    op = [hvd.Sum, hvd.Average, hvd.Max, hvd.Sum][i % 4]
    prescale = 2.0 if i % 7 == 0 else 1.0
    SPECS.append((dtype, shape, op, prescale))
DATA = [inputs(SIZE, dtype, shape, 5000 + i) for i, (dtype, shape, _, _) in enumerate(SPECS)]

# half of them one by one, half as groups of one enqueue each
handles = {}
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
print(f"rank {RANK}: digest {digest.hexdigest()}", flush=True)

# Results of 1 MiB and more come from a buffer pool: a buffer must never be reused while any
# result (or a view of one) still points into it.
n = (1 << 20) // 4
kept = [hvd.allreduce(np.full(n, RANK + k, np.float32), op=hvd.Sum, name=f"big.{k}")
        for k in range(6)]
view = hvd.allreduce(np.full(n, 100.0, np.float32), op=hvd.Sum, name="big.view")[10:20]
for k in range(6, 12):  # dropped at once: their buffers may be reused
    hvd.allreduce(np.full(n, RANK + k, np.float32), op=hvd.Sum, name=f"big.{k}")
fused = hvd.grouped_allreduce([np.full(n // 2, 7.0, np.float32)] * 2, op=hvd.Sum, name="bigg")
for k, out in enumerate(kept):
    assert (out == sum(r + k for r in range(SIZE))).all(), f"pooled result {k} was overwritten"
assert (view == 100.0 * SIZE).all(), "a view into a pooled result was overwritten"
assert all((f == 7.0 * SIZE).all() for f in fused)
hvd.shutdown()
print(f"rank {RANK}: fusion ok", flush=True)
