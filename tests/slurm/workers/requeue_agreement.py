"""Under mpirun: only rank 1 gets SIGUSR2, at step 5; every rank must stop at the same step,
and only rank 0 saves. Outside SLURM nothing is requeued."""

import os
import signal
import warnings

import numpy as np

import hpc_horovod as hvd
from hpc_horovod.slurm import requeue_on_signal

hvd.init()
saved = []
step = 0
with requeue_on_signal(lambda: saved.append(step)) as stopper:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1000):  # noqa: B007 - the checkpoint callback reads it
            if stopper.should_stop():
                break
            if hvd.rank() == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGUSR2)
            hvd.allreduce(np.ones(8), name="grad")
    assert stopper.should_stop()  # stays stopped, without a second checkpoint
stops = hvd.allgather_object(step)
assert stops == [6] * hvd.size(), stops
assert saved == ([6] if hvd.rank() == 0 else []), saved
assert stopper.requeued is None
assert (len(caught) == 1) == (hvd.rank() == 0), [str(w.message) for w in caught]
assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
print(f"rank {hvd.rank()}: stopped at step {step}", flush=True)
hvd.shutdown()
