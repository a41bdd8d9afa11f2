"""The torch binding end to end on one rank's tensors: every check of ``check-build --gpu``
(``hpc_horovod.gpu_check.GpuCheck``: allreduce of every dtype and op kind, in place and
not, scaled, non-contiguous, grouped, one flat bucket, a producer on a side stream, allgather,
broadcast, alltoall, reducescatter, Adasum, an optimizer step), each against the result computed
on the CPU, plus what only a test looks at on a GPU:

- the transport is the expected one (``--expect nccl|single``);
- CuPy's memory pool stayed empty: every device array came from torch's allocator;
- a rank whose GPU is not 0 created no context on GPU 0;
- a tensor on another GPU than the rank's is refused with a clear error;
- a synchronous op leaves the caller's current device as it found it.

Usage: ``python torch_device_worker.py [--device cpu] [--no-cupy] [--no-set-device]
[--expect TRANSPORT]``, alone (one process) or under ``mpirun -np N``. ``--device cpu`` runs the
same checks on CPU tensors (it checks the checks; no GPU involved). ``--no-cupy`` hides CuPy
(its import fails), ``--no-set-device`` leaves torch's current device alone and puts the
tensors on ``cuda:<local rank>`` explicitly.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--device", default=None)
parser.add_argument("--no-cupy", action="store_true")
parser.add_argument("--no-set-device", action="store_true")
parser.add_argument("--expect", default=None)
args = parser.parse_args()
if args.no_cupy:
    sys.modules["cupy"] = None  # every `import cupy` raises ImportError

import torch  # noqa: E402

import hpc_horovod.torch as hvd  # noqa: E402
from hpc_horovod.common import basics  # noqa: E402
from hpc_horovod.gpu_check import GpuCheck  # noqa: E402
from hpc_horovod.torch import adapter  # noqa: E402

hvd.init()
rank = hvd.rank()
device = args.device
if device is None and args.no_set_device:
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
check = GpuCheck(hvd, torch, device)
transport = basics.device_transport()
failures = []


def extra(name: str, condition: bool, detail: str = "") -> None:
    check.rows.append((name, condition, detail))


if args.expect is not None:
    extra("transport", transport == args.expect, f"{transport}, expected {args.expect}")
check.all_checks()

if check.dev.type == "cuda":
    cupy = sys.modules.get("cupy")
    if cupy is not None and transport in ("nccl", "single"):
        pool = cupy.get_default_memory_pool()
        extra("device arrays in torch memory (CuPy pool unused)", pool.total_bytes() == 0,
              f"CuPy pool holds {pool.total_bytes()} bytes")
    if check.dev.index != 0:
        cuda = ctypes.CDLL("libcuda.so.1")
        handle, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(handle), 0)
        cuda.cuDevicePrimaryCtxGetState(handle, ctypes.byref(flags), ctypes.byref(active))
        extra("no context on GPU 0", active.value == 0, "a context exists on GPU 0")
    if torch.cuda.device_count() > 1 and transport in ("nccl", "single"):
        # a synchronous op leaves the caller's current device as it was (one with a context)
        other = (check.dev.index + 1) % torch.cuda.device_count()
        previous = torch.cuda.current_device()
        torch.cuda.set_device(other)
        torch.zeros(1, device=other)
        hvd.allreduce(torch.ones(3, device=check.dev), name="keeps.the.device")
        extra("caller's current device kept", torch.cuda.current_device() == other,
              f"cuda:{torch.cuda.current_device()} after the op, cuda:{other} before")
        torch.cuda.set_device(previous)
    views = adapter.device_views(transport, torch.float32, check.dev.index)
    if torch.cuda.device_count() > 1 and views:
        other = torch.device("cuda", (check.dev.index + 1) % torch.cuda.device_count())
        try:
            hvd.allreduce(torch.ones(3, device=other))
            extra("tensor on another GPU refused", False, "no error")
        except ValueError as exc:
            extra("tensor on another GPU refused", "this rank's GPU" in str(exc), str(exc))

for name, ok, detail in check.rows:
    if not ok:
        failures.append(f"{name}: {detail}")
        print(f"rank {rank}: FAIL {name}: {detail}", flush=True)
hvd.shutdown()
if failures:
    sys.exit(1)
print(f"rank {rank}: torch device ok ({transport}, {len(check.rows)} checks)", flush=True)
