"""Run on 2 or 3 ranks with NCCL by test_device_failures.py: rank 1 fails while every rank has a
device allreduce in flight, and the job must end, naming rank 1.

* ``kill``: rank 1 SIGKILLs itself right after its allreduce is queued (its kernel dies with
  it); the other ranks wait for their results on the device.
* ``linger``: rank 1's allreduce is queued behind a long kernel of its own (its NCCL kernel
  does not start), then rank 1 fails with an error and stays alive for 90 s, as a process
  stuck in its own clean-up would: the launcher does not end the job for the others, so the
  other ranks must get out of their device wait by themselves (their engine stops on rank 1's
  error and aborts NCCL). Each prints ``rank R: released after S s`` when its wait returns.

Rank 1 writes the wall-clock time it fails at into $JOB_END_MARK.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

import hpc_horovod.torch as hvd
from hpc_horovod.common import basics

scenario = sys.argv[1]
hvd.init()
RANK = hvd.rank()
torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
assert basics.device_transport() == "nccl", basics.device_transport()
big = torch.ones(64 << 20, device="cuda")  # 256 MiB: the collective lasts a while
for step in range(3):
    hvd.allreduce_(big, op=hvd.Sum, name=f"warm.{step}")
torch.cuda.synchronize()
big.fill_(1.0)
hvd.barrier()
print(f"rank {RANK}: started", flush=True)


def failing() -> None:
    with open(os.environ["JOB_END_MARK"], "w") as mark:
        mark.write(f"{time.time():.3f}")


if RANK == 1 and scenario == "linger":
    torch.cuda._sleep(200_000_000_000)  # about 100 s on the producer's stream
handle = hvd.allreduce_async_(big, op=hvd.Sum, name="in.flight")
out = hvd.synchronize(handle)  # returns once queued: the wait is on the device
if RANK == 1:
    failing()
    if scenario == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    basics.engine().shutdown(reason="RuntimeError: rank 1 fails on purpose", timeout_s=10)
    time.sleep(90)
    print("rank 1: lingered to the end", flush=True)
    os._exit(1)
start = time.monotonic()
total = float(out[:1024].sum())  # blocks until the device collective ended or was aborted
print(f"rank {RANK}: released after {time.monotonic() - start:.1f} s (sum {total})", flush=True)
hvd.allreduce(torch.ones(1, device="cuda"), name="after")  # raises: the engine stopped
print(f"rank {RANK}: not stopped", flush=True)
