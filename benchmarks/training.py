"""Training throughput and scaling: hpc_horovod (torch and TensorFlow) against torch
DistributedDataParallel and, when it is importable, Horovod.

One run measures the same model (a small CNN, built in torch and in Keras with the same layers)
on the same synthetic data with 1 and 2 processes, for:

* ``hpc_horovod.torch.DistributedOptimizer`` (launched with ``hpc-horovod run``);
* ``hpc_horovod.tensorflow.DistributedGradientTape`` in a ``tf.function`` step (same launcher);
* torch's ``DistributedDataParallel`` over gloo (env:// rendezvous on 127.0.0.1);
* ``horovod.torch.DistributedOptimizer``, the same script as ours with ``horovod.torch`` in
  place of ``hpc_horovod.torch``, when Horovod is importable (skipped, and said so, when not).

Every process uses one compute thread. The script prints images/s per process, in total, and
the scaling efficiency (total with N processes / (N x one process)). Each configuration runs
``--rounds`` times, interleaved with the others; the table shows the best round (the fairest
number on a machine shared with other work) and the JSON keeps every round.

    python benchmarks/training.py            # table on stdout, JSON in benchmarks/out/
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "out"
RESULT = re.compile(r"RESULT (\[[^\]]*\])")


# -- the workload (runs inside each worker process) --------------------------------------------

def build_model():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def measure(model, optimizer, batch_size: int, warmup: int, steps: int, rank: int) -> float:
    """Images per second of this process over ``steps`` timed training steps."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(rank)
    data = torch.randn(batch_size, 3, 32, 32, generator=g)
    target = torch.randint(0, 10, (batch_size,), generator=g)

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch_size * steps / (time.perf_counter() - start)


def torch_worker(args, module: str) -> None:
    """``module``: ``hpc_horovod.torch`` or ``horovod.torch``, which share one API."""
    import importlib

    import torch

    hvd = importlib.import_module(module)
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = build_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01,
                                                         momentum=0.9),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rate = measure(model, optimizer, args.batch_size, args.warmup, args.steps, hvd.rank())
    rates = hvd.allgather(torch.tensor([rate], dtype=torch.float64)).tolist()
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(rates), flush=True)
    hvd.shutdown()


def build_keras_model():
    """:func:`build_model`'s layers in Keras (channels last)."""
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
    for _ in range(args.warmup):
        train_step()
    start = time.perf_counter()
    for _ in range(args.steps):
        train_step()
    rate = args.batch_size * args.steps / (time.perf_counter() - start)
    rates = hvd.allgather(tf.constant([rate], dtype=tf.float64)).numpy().tolist()
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(rates), flush=True)
    hvd.shutdown()


def ddp_worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rate = measure(model, optimizer, args.batch_size, args.warmup, args.steps, rank)
    rates = [None] * dist.get_world_size()
    dist.all_gather_object(rates, rate)
    if rank == 0:
        print("RESULT " + json.dumps(rates), flush=True)
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_args(args) -> list[str]:
    return [str(Path(__file__).resolve()), "--batch-size", str(args.batch_size),
            "--warmup", str(args.warmup), "--steps", str(args.steps)]


def _env() -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep +
                env.get("PYTHONPATH", ""),
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return env


def _result(stdout: str, what: str) -> list[float]:
    match = RESULT.search(stdout)  # launchers may tag and interleave the workers' lines
    if match is None:
        raise RuntimeError(f"{what} printed no result:\n{stdout}")
    return json.loads(match.group(1))


def _launched(worker: str):
    """A runner starting ``--worker worker`` on n ranks with ``hpc-horovod run``."""
    def run(args, n: int) -> list[float]:
        cmd = [sys.executable, "-m", "hpc_horovod.cli", "run", "-np", str(n), sys.executable,
               *_worker_args(args), "--worker", worker]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        return _result(proc.stdout, worker)
    return run


def _importable(module: str) -> str | None:
    """None when ``module`` imports in a fresh interpreter, else why not (one line)."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, env=_env(), timeout=300)
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def run_ddp(args, n: int) -> list[float]:
    env = _env()
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                "WORLD_SIZE": str(n)})
    procs = []
    for rank in range(n):
        procs.append(subprocess.Popen([sys.executable, *_worker_args(args), "--worker", "ddp"],
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=600) for p in procs]
    rates = _result(outputs[0][0], "DDP")
    for p, (_, err) in zip(procs, outputs):
        if p.returncode:  # after the measurement: report it, keep the numbers
            print(f"warning: a DDP worker exited with {p.returncode} after measuring: "
                  f"{err.strip()[-300:]}", file=sys.stderr)
    return rates


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="images per process")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2, help="the scaled configuration")
    parser.add_argument("--no-tensorflow", action="store_true",
                        help="skip hpc_horovod.tensorflow")
    parser.add_argument("--worker", choices=["hvd", "tf", "ddp", "horovod"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    workers = {"hvd": lambda: torch_worker(args, "hpc_horovod.torch"),
               "horovod": lambda: torch_worker(args, "horovod.torch"),
               "tf": lambda: tf_worker(args), "ddp": lambda: ddp_worker(args)}
    if args.worker:
        return workers[args.worker]()

    runners = {"hpc_horovod.torch": _launched("hvd")}
    if not args.no_tensorflow:
        runners["hpc_horovod.tensorflow"] = _launched("tf")
    runners["torch DDP (gloo)"] = run_ddp
    skipped = {}
    why = _importable("horovod.torch")
    if why is None:
        runners["horovod.torch"] = _launched("horovod")
    else:
        skipped["horovod.torch"] = why
        print(f"horovod.torch skipped: {why}", file=sys.stderr)
    totals: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for name, runner in runners.items():
            for n in (1, args.processes):
                total = sum(runner(args, n))
                totals.setdefault((name, n), []).append(total)
                print(f"round {round_ + 1}/{args.rounds}: {name:22s} {n} process(es): "
                      f"{total:8.1f} img/s", file=sys.stderr, flush=True)

    rows = []
    for name in runners:
        single = max(totals[(name, 1)])
        for n in (1, args.processes):
            best = max(totals[(name, n)])
            rows.append({"framework": name, "processes": n,
                         "img_per_sec_per_process": best / n, "img_per_sec_total": best,
                         "median_img_per_sec_total": statistics.median(totals[(name, n)]),
                         "scaling_efficiency": best / (n * single),
                         "rounds_img_per_sec_total": totals[(name, n)]})
    header = f"{'framework':22s} {'procs':>5s} {'img/s/proc':>11s} {'img/s total':>12s} " \
             f"{'(median)':>9s} {'efficiency':>10s}"
    print(f"model: small CNN, batch {args.batch_size}/process, 3x32x32 images, 1 thread per "
          f"process, {os.cpu_count()} cores")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['framework']:22s} {row['processes']:5d} "
              f"{row['img_per_sec_per_process']:11.1f} {row['img_per_sec_total']:12.1f} "
              f"{row['median_img_per_sec_total']:9.1f} {row['scaling_efficiency']:10.1%}")
    OUT.mkdir(exist_ok=True)
    path = OUT / "training.json"
    path.write_text(json.dumps({"batch_size": args.batch_size, "steps": args.steps,
                                "rounds": args.rounds, "cores": os.cpu_count(),
                                "skipped": skipped, "results": rows}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
