"""Elastic training under ``hpc-horovod run --min-np``: one rank (``--kill-rank``) SIGKILLs
itself in the middle of an epoch of the first attempt.

Every rank appends what its committed batches processed to ``LOG_DIR/committed-<host>-<pid>``
(``epoch index`` lines) once ``state.commit()`` returned, and its final parameters' checksum to
``LOG_DIR/final-<rank>``. The killed rank writes the time of its death to ``LOG_DIR/killed``;
after the restart, rank 0 prints how long it took to train again.

With ``--hold``, every rank of the job's first run (``SLURM_RESTART_COUNT`` 0) writes
``LOG_DIR/held-<rank>`` at that point instead and sleeps until it is ended: a test requeues the
job there and writes the time of the requeue to ``LOG_DIR/killed``. With ``--stop-on-signal``
as well, the held ranks wait for SIGUSR2 instead, and ``requeue_on_signal`` stops them at the
next batch and requeues the job (each batch is committed already: nothing more to save).
"""

import argparse
import os
import signal
import socket
import sys
import time

import torch

import hpc_horovod.torch as hvd
from hpc_horovod.checkpoint import atomic_write
from hpc_horovod.slurm.requeue import requeue_on_signal, restart_count

parser = argparse.ArgumentParser()
parser.add_argument("log_dir")
parser.add_argument("--samples", type=int, default=48)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--kill-rank", type=int, default=2)
parser.add_argument("--kill-size", type=int, default=3, help="only in a job of this size")
parser.add_argument("--kill-host", default="", help="kill every rank of this host instead")
parser.add_argument("--kill-epoch", type=int, default=1)
parser.add_argument("--kill-batch", type=int, default=1)
parser.add_argument("--hold", action="store_true",
                    help="in the first run of a SLURM job, every rank sleeps at the kill point")
parser.add_argument("--stop-on-signal", action="store_true",
                    help="stop and requeue the job on SIGUSR2 (requeue_on_signal)")
args = parser.parse_args()

hvd.init()
stopper = requeue_on_signal(lambda: None) if args.stop_on_signal else None
torch.set_num_threads(1)
torch.manual_seed(0)
data = torch.randn(args.samples, 8)
target = data.sum(dim=1, keepdim=True)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.5)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(list(range(args.samples)), shuffle=True, seed=1)
log = open(os.path.join(args.log_dir, f"committed-{socket.gethostname()}-{os.getpid()}"), "a")


def on_reset():
    for group in optimizer.param_groups:
        group["lr"] = 0.01 * hvd.size()
    print(f"reset callback: rank {hvd.rank()} of {hvd.size()}, epoch {state.epoch}, "
          f"processed {sampler.processed_num}", flush=True)


def die_here(epoch: int, batch: int) -> bool:
    if (hvd.size(), epoch, batch) != (args.kill_size, args.kill_epoch, args.kill_batch):
        return False
    if args.hold:
        if restart_count() == 0:
            with open(os.path.join(args.log_dir, f"held-{hvd.rank()}"), "w") as fh:
                fh.write(repr(time.time()))
            while stopper is None or not stopper.signalled:
                time.sleep(0.1)
        return False
    if args.kill_host:
        return socket.gethostname() == args.kill_host
    return hvd.rank() == args.kill_rank


@hvd.elastic.run
def train(state):
    first = True
    while state.epoch < args.epochs:
        pending = []
        for batch, index in enumerate(_batches(state.sampler)):
            if first and hvd.rank() == 0 and os.path.exists(os.path.join(args.log_dir, "killed")):
                with open(os.path.join(args.log_dir, "killed")) as fh:
                    killed = float(fh.read())
                print(f"training again {time.time() - killed:.2f} s after the kill, at "
                      f"{hvd.size()} ranks", flush=True)
            first = False
            if die_here(state.epoch, batch):
                # whole or absent: rank 0 may look for it at this very batch
                atomic_write(os.path.join(args.log_dir, "killed"),
                             lambda fh: fh.write(repr(time.time()).encode()))
                os.kill(os.getpid(), signal.SIGKILL)
            if stopper is not None and stopper.should_stop():
                return
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data[index]), target[index])
            loss.backward()
            optimizer.step()
            pending += [f"{state.epoch} {i}\n" for i in index.tolist()]
            state.sampler.record_batch(batch, args.batch_size)
            state.commit()
            log.write("".join(pending))
            log.flush()
            pending = []
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


def _batches(sampler):
    indices = torch.tensor(list(sampler))
    return indices.split(args.batch_size)


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
state.register_reset_callbacks([on_reset])
train(state)
if stopper is not None and stopper.stopped:
    print(f"rank {hvd.rank()}: stopped on the signal, job requeued", flush=True)
    sys.exit(0)
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
with open(os.path.join(args.log_dir, f"final-{hvd.rank()}"), "w") as fh:
    fh.write(" ".join(repr(v) for v in flat.tolist()))
print(f"rank {hvd.rank()} of {hvd.size()} done", flush=True)
sys.stdout.flush()
