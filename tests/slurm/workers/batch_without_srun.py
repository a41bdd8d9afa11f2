"""Started by the job script itself (no srun) in a job of several tasks: hvd.init() must refuse."""

import hpc_horovod as hvd

try:
    hvd.init()
except hvd.TopologyError as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    raise SystemExit(3) from None
print("hvd.init() accepted a batch script without srun", flush=True)
