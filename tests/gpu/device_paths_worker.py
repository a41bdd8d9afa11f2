"""The device paths of issue-sized concerns, through ``hpc_horovod.torch`` with NCCL, on each rank.

* every rank count: an input produced on a side stream and freed while the engine's stream is
  still busy is not handed out again by torch's allocator (the input is marked as used by the
  engine's stream);
* ``--fake-nodes`` (4 ranks, node = rank // 2, announced through HOROVOD_* variables so that the
  topology has two nodes on one machine):
  - by default one flat NCCL communicator serves every rank (no hierarchy);
  - ``--hierarchical``: HOROVOD_HIERARCHICAL_ALLREDUCE=1 turns on NCCL inside the node and MPI
    across nodes, and the sums stay right;
  - GPU Adasum is Horovod's: the nodes' averages combined by Adasum.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--fake-nodes", action="store_true")
parser.add_argument("--hierarchical", action="store_true")
args = parser.parse_args()

if args.fake_nodes:
    world_rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world_size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    assert world_size == 4, "--fake-nodes runs on 4 ranks"
    os.environ.update(HOROVOD_RANK=str(world_rank), HOROVOD_SIZE="4",
                      HOROVOD_LOCAL_RANK=str(world_rank % 2), HOROVOD_LOCAL_SIZE="2",
                      HOROVOD_CROSS_RANK=str(world_rank // 2), HOROVOD_CROSS_SIZE="2")
    if args.hierarchical:
        os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
    else:
        os.environ.pop("HOROVOD_HIERARCHICAL_ALLREDUCE", None)

import torch  # noqa: E402

import hpc_horovod.torch as hvd  # noqa: E402
from hpc_horovod.common import basics  # noqa: E402
from hpc_horovod.torch import mpi_ops  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
assert basics.device_transport() == "nccl", basics.device_transport()
device = torch.device("cuda", torch.cuda.current_device())

# -- inputs protected across streams ------------------------------------------------------------
side = torch.cuda.Stream()
n = 1 << 20
engine = mpi_ops._engine_stream(device.index)
with torch.cuda.stream(engine):
    torch.cuda._sleep(2_000_000_000)  # keeps the engine's stream busy for about a second
with torch.cuda.stream(side):  # produced and submitted on a side stream
    x = torch.full((n,), float(rank + 1), device=device)
    ptr = x.data_ptr()
    handle = hvd.allreduce_async(x, op=hvd.Sum, name="side.stream.input")
out = hvd.synchronize(handle)  # queued; the default stream (the consumer) waits, not `side`
del x  # freed while the collective that reads it still waits on the engine's stream
with torch.cuda.stream(side):
    y = torch.empty(n, device=device)  # same size, same stream: the freed block if allowed
    assert y.data_ptr() != ptr, "torch handed out the input's block while the engine may read it"
torch.cuda.synchronize()
assert torch.all(out == size * (size + 1) / 2).item(), out[:4]
print(f"rank {rank}: inputs kept for the engine's stream", flush=True)

if args.fake_nodes:
    backend = basics.engine().backend.on_device
    assert backend.node_id == rank // 2, backend.node_id
    assert backend.hierarchical == args.hierarchical, backend.hierarchical
    # allreduce across the two fake nodes
    for count in (1, 1000, 1 << 20):
        t = torch.arange(count, device=device, dtype=torch.float32) + rank
        got = hvd.allreduce(t, op=hvd.Sum, name=f"sum.{count}")
        want = 4 * torch.arange(count, device=device, dtype=torch.float32) + 6
        assert torch.equal(got, want), (count, got[:4])
    assert (backend._hierarchy is not None) == args.hierarchical, backend._hierarchy
    # Adasum: the nodes' averages (NCCL inside the node), combined by Adasum across nodes
    rng = [np.random.default_rng(100 + r) for r in range(4)]
    vectors = [g.standard_normal(257) for g in rng]
    mine = torch.tensor(vectors[rank], device=device)
    got = hvd.allreduce(mine, op=hvd.Adasum, name="adasum").cpu().numpy()
    a, b = (vectors[0] + vectors[1]) / 2, (vectors[2] + vectors[3]) / 2
    dot = a @ b
    want = (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    print(f"rank {rank}: fake nodes ok (hierarchical={args.hierarchical})", flush=True)

hvd.shutdown()
print(f"rank {rank}: device paths ok", flush=True)
