"""Training throughput and scaling of data-parallel training on the host: hpc_horovod's
paths against the code before a change, torch DistributedDataParallel, and the limit.

    python benchmarks/training.py [--processes 2] [--rounds 5] [--compare-with ../before]

Two models on synthetic data, every process with one compute thread:

* ``mlp``: a communication-heavy multilayer perceptron (four 1024-wide layers, more than
  10 MB of float32 gradients per step for little compute);
* ``cnn``: a small CNN (also built in Keras, for the TensorFlow binding).

For each model, ``--processes`` processes run, in every round (in an order that rotates from
round to round, so that load from elsewhere hits them alike):

* ``hpc_horovod.torch.DistributedOptimizer`` as it is (the hierarchical host path, the
  default), launched with ``hpc-horovod run``;
* the same with ``HOROVOD_HIERARCHICAL_ALLREDUCE=0`` (flat MPI);
* with ``--compare-with DIR``, the same worker importing ``hpc_horovod`` (launcher included)
  from ``DIR``, another checkout of this project with its native extension built in place
  (e.g. the code before a change): the reference of the speed-ups;
* torch's ``DistributedDataParallel`` over gloo (env:// rendezvous on 127.0.0.1);
* the limit: the plain optimizer in every process at once, with no communication (the
  processes only meet once before timing);
* ``horovod.torch`` when Horovod is importable (skipped, and said so, when not: ``make bench
  HOROVOD=DIR`` puts a Horovod built in DIR on the path);
* for the CNN, ``hpc_horovod.tensorflow.DistributedGradientTape`` in a ``tf.function`` step.

Separate jobs differ from one another beyond the configuration: each new set of processes
lays its memory out anew, and the rates of one configuration's jobs spread widely. So every
round also runs, for hpc_horovod and for the code of ``--compare-with``, one job whose
processes train copies of one model, one step of each in turn (the order rotating from step to
step):

* the plain optimizer, every process at once (the limit, in the same processes);
* ``DistributedOptimizer``;
* for hpc_horovod on several processes, the floor of the hierarchical path: the plain optimizer
  with that path's own data motion written out by hand between backward and the step, with
  nothing else (no engine, no negotiation, no bucket bookkeeping): every gradient copied into
  the node's shared window (as ``zero_grad()`` leaves it to the buckets), a barrier, each
  rank's slice reduced from every rank's copy and written back into all of them with the same
  native pass, a barrier. The hierarchical path makes these passes and meets its peers at least
  this often, on the same core as the training, so it cannot scale better than this: the
  distance from the limit to the floor is memory traffic and the ranks' skew; from the floor to
  ``DistributedOptimizer``, the engine's own cost.

Its ratios (plain step over ``DistributedOptimizer`` step: the scaling efficiency; ours over the
reference's: the speed-up) leave the differences between jobs out. A code whose threads take
CPU between steps slows the plain steps of its own job too, so this speed-up understates the
gain of a quieter engine. The same job on one process shows what the wrapper costs when there
is nothing to reduce (on the CNN).

Every worker runs with glibc's malloc thresholds fixed (:data:`MALLOC`). Left adaptive, they
depend on the order of a process's first allocations: in some processes torch's 4 MB gradient
temporaries are returned to the kernel and faulted in again at every step (thousands of page
faults a step), in others not, so that one process of a job, or one run of a configuration, is
20% slower than the next at random. Each worker reports its minor page faults per timed step.

Each worker also reports the CPU time per step of its training thread and of its other threads
(hpc_horovod's engine thread, Horovod's background thread, MPI's, gloo's and TensorFlow's
threads): with one core per process, the other threads' CPU is taken from the training.

A job's rate is its steps per second: timed steps over the time of its slowest process.
Scaling efficiency is a configuration's rate over the limit's in the same round; ratios are
taken round by round. hpc_horovod's workers also measure the exposed time of the last bucket:
from the arrival of the last gradient of backward (the first parameter's) to the end of the
reductions (``optimizer.synchronize()``), the communication that backward did not hide.

Results go to ``benchmarks/results/training.json``; ``benchmarks/report.py`` turns them into
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import RESULTS, ROOT, command_line, describe

RESULT = re.compile(r"RESULT (\{.*\})")
#: glibc's malloc thresholds for every worker, fixed (see the module's docstring): allocations of
#: up to 32 MiB come from the heap, and its top is never given back.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
OURS = "hpc_horovod.torch (hierarchical)"
FLAT = "hpc_horovod.torch (flat MPI)"
DDP = "torch DDP (gloo)"
LIMIT = "plain optimizer, no communication"
MODELS = {"mlp": "MLP, 1024 inputs, three hidden layers of 1024, 10 outputs (12.6 MB of float32 "
                 "gradients), batch 32 per process",
          "cnn": "small CNN (2 conv, 2 dense) on 32x32x3, batch 32 per process"}


# -- the workload (runs inside each worker process) --------------------------------------------

def build_model(kind: str):
    from torch import nn

    if kind == "mlp":
        return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def _batch(kind: str, batch_size: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    shape = (batch_size, 1024) if kind == "mlp" else (batch_size, 3, 32, 32)
    return torch.randn(*shape, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def _step(model, optimizer, data, target) -> None:
    import torch.nn.functional as F

    optimizer.zero_grad()
    F.cross_entropy(model(data), target).backward()
    optimizer.step()


def timed(step, args) -> tuple[float, float, float, float]:
    """What this process measured over ``args.steps`` calls of ``step()``, after
    ``args.warmup`` untimed ones: (steps per second, minor page faults per step, CPU ms per
    step of the calling thread, CPU ms per step of the process's other threads: the engine's,
    MPI's, gloo's, TensorFlow's pools)."""
    for _ in range(args.warmup):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu, thread_cpu = time.process_time(), time.thread_time()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    thread_cpu = time.thread_time() - thread_cpu
    cpu = time.process_time() - cpu
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return (args.steps / elapsed, faults / args.steps, thread_cpu / args.steps * 1e3,
            (cpu - thread_cpu) / args.steps * 1e3)


def measure(model, optimizer, args, rank: int, step=_step) -> tuple[float, float, float, float]:
    """:func:`timed` training steps of ``model`` on this rank's batch."""
    data, target = _batch(args.model, args.batch_size, rank)
    return timed(lambda: step(model, optimizer, data, target), args)


def _report(**result) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def _report_measured(per_rank: list, **extra) -> None:
    """:func:`_report` of every rank's :func:`timed` tuple, one list per quantity."""
    _report(rates=[r[0] for r in per_rank], faults_per_step=[r[1] for r in per_rank],
            thread_cpu_ms=[r[2] for r in per_rank], other_threads_cpu_ms=[r[3] for r in per_rank],
            **extra)


def torch_worker(args, module: str) -> None:
    """``module``: ``hpc_horovod.torch`` or ``horovod.torch``, which share one API. The step
    synchronizes explicitly, to time the last bucket's exposed reduction."""
    import importlib

    import torch
    import torch.nn.functional as F

    hvd = importlib.import_module(module)
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = build_model(args.model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                         momentum=0.9),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    last_grad = [0.0]
    exposed: list[float] = []
    # registered after the optimizer's hooks: runs once the last gradient has been handed over
    next(model.parameters()).register_post_accumulate_grad_hook(
        lambda p: last_grad.__setitem__(0, time.perf_counter()))

    def step(model, optimizer, data, target) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.synchronize()
        exposed.append(time.perf_counter() - last_grad[0])
        with optimizer.skip_synchronize():
            optimizer.step()

    measured = measure(model, optimizer, args, hvd.rank(), step)
    exposed_ms = statistics.median(exposed[args.warmup:]) * 1e3
    per_rank = hvd.allgather(torch.tensor([[*measured, exposed_ms]],
                                          dtype=torch.float64)).tolist()
    if hvd.rank() == 0:
        backend = None
        if hvd.__name__.startswith("hpc_horovod"):  # the host backend that ran
            from hpc_horovod.common import basics

            backend = getattr(getattr(basics.engine(), "backend", None), "name", None)
        _report_measured(per_rank, exposed_ms=[r[4] for r in per_rank], module=hvd.__file__,
                         backend=backend)
    hvd.shutdown()


def _floor_step(params: list, comm):
    """The floor's training step (see the module's docstring) for the ranks of ``comm``, one
    node: they share one MPI window (``Win.Allocate_shared``) holding every rank's gradients;
    between backward and the step, each rank copies its gradients in and makes them views of
    it, meets its peers, sums its slice (``hierarchical.slice_bounds``) of every rank's copy,
    averaged, into all of them with ``_native.reduce_slices``, and meets them again. MPI's
    barriers spin: with one thread per process there is nothing else for the core to run.
    Returns the step and the window (to free)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from hpc_horovod import _native
    from hpc_horovod.backends.hierarchical import slice_bounds
    from hpc_horovod.common.types import Sum

    rank, k = comm.Get_rank(), comm.Get_size()
    count = sum(p.numel() for p in params)
    dtype = params[0].detach().numpy().dtype
    window = MPI.Win.Allocate_shared(count * dtype.itemsize, dtype.itemsize, comm=comm)
    copies = [np.frombuffer(window.Shared_query(q)[0], dtype=dtype, count=count)
              for q in range(k)]
    lo, hi = slice_bounds(count, dtype.itemsize, k, rank)
    slices = [c[lo:hi] for c in copies]
    views = [v.view(p.shape) for p, v in
             zip(params, torch.from_numpy(copies[rank]).split([p.numel() for p in params]))]

    def step(model, optimizer, data, target) -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        for p, view in zip(params, views):
            view.copy_(p.grad)
            p.grad = view
        comm.Barrier()
        _native.reduce_slices(slices, slices, Sum, 1.0, 1.0 / k)
        comm.Barrier()
        optimizer.step()

    return step, window


def paired_worker(args) -> None:
    """The processes of one job train copies of one model, one step of each in turn, the order
    rotating from step to step: the plain optimizer, ``DistributedOptimizer`` and, with
    ``--floor`` on several ranks of one node, the floor (:func:`_floor_step`). Every copy starts
    from the same weights; the steps of the distributed and the floor's copies keep their
    replicas equal, which is checked at the end (the floor did reduce)."""
    import torch
    from mpi4py import MPI

    import hpc_horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    plain_model = build_model(args.model)
    wrapped_model = copy.deepcopy(plain_model)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9)
    wrapped = hvd.DistributedOptimizer(
        torch.optim.SGD(wrapped_model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=wrapped_model.named_parameters())
    cases = [("plain", plain_model, plain, _step), ("distributed", wrapped_model, wrapped, _step)]
    window = node = None
    if args.floor and hvd.size() > 1:
        node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
        if node.Get_size() != hvd.size():
            raise SystemExit("the floor runs its ranks on one node")
        floor_model = copy.deepcopy(plain_model)
        floor = torch.optim.SGD(floor_model.parameters(), lr=0.01, momentum=0.9)
        floor_step, window = _floor_step(list(floor_model.parameters()), node)
        cases.append(("floor", floor_model, floor, floor_step))
        node.Barrier()
    data, target = _batch(args.model, args.batch_size, hvd.rank())
    times: dict[str, list[float]] = {name: [] for name, *_ in cases}
    for i in range(args.warmup + args.step_pairs):
        shift = i % len(cases)
        for name, model, optimizer, step in cases[shift:] + cases[:shift]:
            start = time.perf_counter()
            step(model, optimizer, data, target)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    per_rank = hvd.allgather_object(medians)
    if window is not None:
        checksum = float(sum(p.detach().double().sum() for p in floor_model.parameters()))
        if len(set(node.allgather(checksum))) != 1:
            raise SystemExit("the floor's replicas diverged: its reduction is wrong")
        node.Barrier()
        window.Free()
    if hvd.rank() == 0:
        from hpc_horovod.common import basics

        _report(**{f"{name}_s": [r[name] for r in per_rank] for name in medians},
                module=hvd.__file__,
                backend=getattr(getattr(basics.engine(), "backend", None), "name", None))
    hvd.shutdown()


def build_keras_model():
    """:func:`build_model`'s CNN in Keras (channels last)."""
    import keras

    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10),
    ])


def tf_worker(args) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import hpc_horovod.tensorflow as hvd

    hvd.init()
    keras.utils.set_random_seed(0)
    model = build_keras_model()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    g = tf.random.Generator.from_seed(hvd.rank())
    data = g.normal([args.batch_size, 32, 32, 3])
    target = g.uniform([args.batch_size], maxval=10, dtype=tf.int64)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    train_step()  # builds the optimizer's slots, so that they can be broadcast
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables, root_rank=0)
    per_rank = hvd.allgather(tf.constant([timed(train_step, args)],
                                         dtype=tf.float64)).numpy().tolist()
    if hvd.rank() == 0:
        _report_measured(per_rank, module=hvd.__file__)
    hvd.shutdown()


def gloo_worker(args, ddp: bool) -> None:
    """torch DDP over gloo (``ddp``), or the plain optimizer with no communication at all once
    the processes have met (the limit)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(args.model)) if ddp else build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dist.barrier()
    measured = measure(model, optimizer, args, rank)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, measured)
    if rank == 0:
        _report_measured(per_rank, module=torch.__file__)
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_args(args, worker: str, model: str, flags: tuple = ()) -> list[str]:
    return [str(Path(__file__).resolve()), "--batch-size", str(args.batch_size),
            "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--step-pairs", str(args.step_pairs), "--model", model, "--worker", worker, *flags]


def _env(package_dir: Path = ROOT, extra: dict | None = None) -> dict:
    """The workers' environment: ``hpc_horovod`` imported from ``package_dir``."""
    env = {k: v for k, v in os.environ.items() if k != "HOROVOD_HIERARCHICAL_ALLREDUCE"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
                    [str(package_dir)] + [p for p in [env.get("PYTHONPATH")] if p]),
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                # on a loaded machine a rank may import torch for minutes before its peers
                "HOROVOD_PEER_TIMEOUT_SECONDS": "600", **MALLOC})
    env.update(extra or {})
    return env


def _result(stdout: str, what: str) -> dict:
    # mpirun tags every chunk it reads, and may cut a long line into tagged pieces
    stdout = re.sub(r"\[\d+,\d+\]<std(?:out|err)>:", "", stdout)
    match = RESULT.search(stdout)
    if match is None:
        raise RuntimeError(f"{what} printed no result:\n{stdout}")
    return json.loads(match.group(1))


def _launched(worker: str, package_dir: Path = ROOT, env: dict | None = None,
              backend: str | None = None, flags: tuple = ()):
    """A runner starting ``--worker worker`` (with ``flags``) on n ranks with ``hpc-horovod
    run``, importing ``hpc_horovod`` (launcher included) from ``package_dir``, with ``env`` on
    top; on several ranks it checks that the host backend is ``backend`` (when given)."""
    def run(args, n: int, model: str) -> dict:
        cmd = [sys.executable, "-m", "hpc_horovod.cli", "run", "-np", str(n), sys.executable,
               *_worker_args(args, worker, model, flags)]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=_env(package_dir, env), timeout=900)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        result = _result(proc.stdout, worker)
        if worker != "horovod" and not Path(result["module"]).resolve().is_relative_to(package_dir):
            raise RuntimeError(f"{worker} imported {result['module']}, not from {package_dir}")
        if backend is not None and n > 1 and result.get("backend") != backend:
            raise RuntimeError(f"{worker} ran on the {result.get('backend')} backend, not "
                               f"{backend}")
        return result
    return run


def _importable(module: str) -> str | None:
    """None when ``module`` imports in a fresh interpreter, else why not (one line)."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, env=_env(), timeout=300)
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def _gloo(worker: str):
    """A runner starting ``--worker worker`` on n processes that meet over gloo (env://)."""
    def run(args, n: int, model: str) -> dict:
        env = _env()
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                    "WORLD_SIZE": str(n)})
        procs = [subprocess.Popen([sys.executable, *_worker_args(args, worker, model)],
                                  env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(n)]
        outputs = [p.communicate(timeout=900) for p in procs]
        result = _result(outputs[0][0], worker)
        for p, (_, err) in zip(procs, outputs):
            if p.returncode:  # after the measurement: report it, keep the numbers
                print(f"warning: a {worker} worker exited with {p.returncode} after measuring: "
                      f"{err.strip()[-300:]}", file=sys.stderr)
        return result
    return run


def _package_dir(text: str) -> Path:
    path = Path(text).resolve()
    if not (path / "hpc_horovod" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text}: no hpc_horovod/ package in this folder "
                                         "(give the root of a checkout of this project)")
    return path


def _before_label(path: Path) -> str:
    proc = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    commit = proc.stdout.strip() if proc.returncode == 0 else path.name
    return f"hpc_horovod.torch at {commit}"


def _ratios(values: list[float], bases: list[float]) -> dict:
    ratios = [a / b for a, b in zip(values, bases)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--step-pairs", type=int, default=100,
                        help="timed steps of each copy in the jobs whose processes train "
                             "copies of one model in turn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--models", default="mlp,cnn", help="of: " + ", ".join(MODELS))
    parser.add_argument("--compare-with", type=_package_dir, metavar="DIR",
                        help="also run the torch worker with hpc_horovod from DIR (the "
                             "reference of the speed-ups)")
    parser.add_argument("--no-tensorflow", action="store_true",
                        help="skip hpc_horovod.tensorflow")
    parser.add_argument("--model", choices=list(MODELS), default="cnn", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["hvd", "paired", "tf", "ddp", "plain", "horovod"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if not models or any(m not in MODELS for m in models):
        parser.error(f"--models: a comma-separated list of {', '.join(MODELS)}")
    if min(args.batch_size, args.steps, args.step_pairs, args.rounds, args.processes) < 1:
        parser.error("sizes and counts must be positive")
    workers = {"hvd": lambda: torch_worker(args, "hpc_horovod.torch"),
               "horovod": lambda: torch_worker(args, "horovod.torch"),
               "paired": lambda: paired_worker(args), "tf": lambda: tf_worker(args),
               "ddp": lambda: gloo_worker(args, ddp=True),
               "plain": lambda: gloo_worker(args, ddp=False)}
    if args.worker:
        return workers[args.worker]()

    runners = {OURS: _launched("hvd", backend="hierarchical"),
               FLAT: _launched("hvd", env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"},
                               backend="mpi")}
    pairs = {OURS: _launched("paired", backend="hierarchical", flags=("--floor",))}
    before = None
    if args.compare_with:
        before = _before_label(args.compare_with)
        runners[before] = _launched("hvd", args.compare_with)
        pairs[before] = _launched("paired", args.compare_with)
    runners[DDP] = _gloo("ddp")
    runners[LIMIT] = _gloo("plain")
    only_cnn = {}
    if not args.no_tensorflow:
        only_cnn["hpc_horovod.tensorflow"] = _launched("tf")
    skipped = {}
    why = _importable("horovod.torch")
    if why is None:  # Open MPI's yield, as Horovod's own benchmarks on shared cores
        runners["horovod.torch"] = _launched("horovod", env={"OMPI_MCA_mpi_yield_when_idle": "1"})
    else:
        skipped["horovod.torch"] = why
    plan = [(model, name, runner) for model in models
            for name, runner in {**runners, **(only_cnn if model == "cnn" else {})}.items()]
    rates = {(model, name): [] for model, name, _ in plan}
    exposed = {(model, name): [] for model, name, _ in plan}
    faults = {(model, name): [] for model, name, _ in plan}
    thread_cpu = {(model, name): [] for model, name, _ in plan}
    other_cpu = {(model, name): [] for model, name, _ in plan}
    modules: dict[str, str] = {}
    paired: dict[str, dict[str, list[dict]]] = {model: {name: [] for name in pairs}
                                                for model in models}
    steps: dict[str, list[dict]] = {name: [] for name in pairs}
    for round_ in range(args.rounds):
        shift = round_ % len(plan)
        for model, name, runner in plan[shift:] + plan[:shift]:
            result = runner(args, args.processes, model)
            rates[model, name].append(min(result["rates"]))  # the slowest process's pace
            if "exposed_ms" in result:
                exposed[model, name].append(statistics.median(result["exposed_ms"]))
            faults[model, name].append(max(result["faults_per_step"]))  # the worst process
            thread_cpu[model, name].append(max(result["thread_cpu_ms"]))
            other_cpu[model, name].append(max(result["other_threads_cpu_ms"]))
            modules[name] = result["module"]
            print(f"round {round_ + 1}/{args.rounds}: {model} {name:40s} "
                  f"{rates[model, name][-1]:7.2f} steps/s, CPU per step "
                  f"{thread_cpu[model, name][-1]:.2f} + {other_cpu[model, name][-1]:.2f} ms"
                  + (f", last bucket exposed {exposed[model, name][-1]:.2f} ms"
                     if exposed[model, name] else ""), file=sys.stderr, flush=True)
        for model in models:
            for name, pair in pairs.items():
                result = pair(args, args.processes, model)
                # each case's median step, of the slowest process
                record = {key: max(v) for key, v in result.items() if key.endswith("_s")}
                record["efficiency"] = record["plain_s"] / record["distributed_s"]
                if "floor_s" in record:
                    record["floor_efficiency"] = record["plain_s"] / record["floor_s"]
                paired[model][name].append(record)
                print(f"round {round_ + 1}/{args.rounds}: {model} {name:40s} in the same "
                      "processes: " + ", ".join(f"{key[:-2]} {record[key] * 1e3:.2f} ms"
                                                for key in result if key.endswith("_s"))
                      + f", efficiency {record['efficiency']:.3f}", file=sys.stderr, flush=True)
        if "cnn" in models:
            for name, pair in pairs.items():
                result = pair(args, 1, "cnn")
                plain, wrapped = (result[k][0] for k in ("plain_s", "distributed_s"))
                steps[name].append({"plain_median_s": plain, "distributed_median_s": wrapped,
                                    "ratio": wrapped / plain})
                print(f"round {round_ + 1}/{args.rounds}: {name:40s} one-process CNN step: "
                      f"DistributedOptimizer {wrapped * 1e3:.2f} ms, plain {plain * 1e3:.2f} "
                      f"ms, x{wrapped / plain:.3f}", file=sys.stderr, flush=True)

    results = {}
    print(f"{args.processes} processes, 1 thread each, {os.cpu_count()} cores; median of "
          f"{args.rounds} rounds (range), ratios taken round by round")
    for model in models:
        configurations = []
        for m, name, _ in plan:
            if m != model:
                continue
            c = {"name": name, "module": modules[name], "rounds_steps_per_sec": rates[m, name],
                 "efficiency": _ratios(rates[m, name], rates[m, LIMIT])}
            if before is not None:
                c["vs_reference"] = _ratios(rates[m, name], rates[m, before])
            if exposed[m, name]:
                c["rounds_last_bucket_exposed_ms"] = exposed[m, name]
            c["rounds_page_faults_per_step"] = faults[m, name]
            c["rounds_thread_cpu_ms_per_step"] = thread_cpu[m, name]
            c["rounds_other_threads_cpu_ms_per_step"] = other_cpu[m, name]
            configurations.append(c)
            vs = (f"  x{c['vs_reference']['median']:.3f} ({c['vs_reference']['min']:.3f}-"
                  f"{c['vs_reference']['max']:.3f}) of the reference" if before else "")
            print(f"  {model} {name:40s} {statistics.median(rates[m, name]):7.2f} steps/s"
                  f"{vs}, efficiency {c['efficiency']['median']:.3f} "
                  f"({c['efficiency']['min']:.3f}-{c['efficiency']['max']:.3f})")
        same = {}
        for name, rounds in paired[model].items():
            same[name] = {"rounds": rounds,
                          "efficiency": _ratios([r["plain_s"] for r in rounds],
                                                [r["distributed_s"] for r in rounds])}
            if rounds and "floor_s" in rounds[0]:
                same[name]["floor_efficiency"] = _ratios([r["plain_s"] for r in rounds],
                                                         [r["floor_s"] for r in rounds])
            if before is not None:
                same[name]["vs_reference"] = _ratios(
                    [r["efficiency"] for r in rounds],
                    [r["efficiency"] for r in paired[model][before]])
            print(f"  {model} {name:40s} in the same processes: efficiency "
                  f"{same[name]['efficiency']['median']:.3f}"
                  + (f", floor {same[name]['floor_efficiency']['median']:.3f}"
                     if "floor_efficiency" in same[name] else ""))
        results[model] = {"description": MODELS[model], "configurations": configurations,
                          "same_processes": same}
    for name, rounds in steps.items():
        if not rounds:  # the one-process step is measured on the CNN only
            continue
        print(f"  {name}: one-process DistributedOptimizer step / plain step "
              f"x{statistics.median(r['ratio'] for r in rounds):.3f}")
    for what, why in skipped.items():
        print(f"skipped {what}: {why}")
    meta = describe(command_line(), ("numpy", "torch", "mpi4py")
                    + (() if args.no_tensorflow else ("tensorflow", "keras")))
    meta.update(batch_size=args.batch_size, warmup=args.warmup, steps=args.steps,
                step_pairs=args.step_pairs, rounds=args.rounds, processes=args.processes,
                malloc=MALLOC, skipped=skipped)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "training.json"
    path.write_text(json.dumps({"benchmark": "training", "meta": meta, "ours": OURS,
                                "flat": FLAT, "reference": before, "ddp": DDP, "limit": LIMIT,
                                "models": results, "one_process_step": steps}, indent=1) + "\n")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
