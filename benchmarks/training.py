"""Training throughput and scaling: hpc_horovod (torch and TensorFlow) against torch
DistributedDataParallel and, when it is importable, Horovod.

    python benchmarks/training.py [--rounds 5] [--compare-with ../before]

One run measures the same model (a small CNN, built in torch and in Keras with the same layers)
on the same synthetic data with 1 and ``--processes`` processes, for:

* ``hpc_horovod.torch.DistributedOptimizer`` (launched with ``hpc-horovod run``);
* with ``--compare-with DIR``, the same torch worker importing ``hpc_horovod`` from ``DIR``
  (another checkout of this project with its native extension built in place, e.g. the code
  before a change): a before/after comparison in one run;
* ``hpc_horovod.tensorflow.DistributedGradientTape`` in a ``tf.function`` step (same launcher);
* torch's ``DistributedDataParallel`` over gloo (the baseline; env:// rendezvous on 127.0.0.1);
* ``horovod.torch.DistributedOptimizer`` when Horovod is importable (skipped, and said so, when
  not).

It also times, in one process, a training step with ``DistributedOptimizer`` against the same
step with the plain optimizer it wraps (two copies of one model, steps alternated), which
shows what the wrapper costs when there is nothing to reduce.

Every process uses one compute thread. Each configuration runs ``--rounds`` times, interleaved
with the others, so that load from elsewhere hits them alike; the ratios are taken round by
round. Results go to ``benchmarks/results/training.json``; ``benchmarks/report.py`` turns them
into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import RESULTS, ROOT, command_line, describe

RESULT = re.compile(r"RESULT (\{.*\})")
BASELINE = "torch DDP (gloo)"
OURS = "hpc_horovod.torch"


# -- the workload (runs inside each worker process) --------------------------------------------

def build_model():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def _batch(batch_size: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    return (torch.randn(batch_size, 3, 32, 32, generator=g),
            torch.randint(0, 10, (batch_size,), generator=g))


def _step(model, optimizer, data, target) -> None:
    import torch.nn.functional as F

    optimizer.zero_grad()
    F.cross_entropy(model(data), target).backward()
    optimizer.step()


def measure(model, optimizer, args, rank: int) -> float:
    """Images per second of this process over ``args.steps`` timed training steps."""
    data, target = _batch(args.batch_size, rank)
    for _ in range(args.warmup):
        _step(model, optimizer, data, target)
    start = time.perf_counter()
    for _ in range(args.steps):
        _step(model, optimizer, data, target)
    return args.batch_size * args.steps / (time.perf_counter() - start)


def _report(**result) -> None:
    print("RESULT " + json.dumps(result), flush=True)


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
    rate = measure(model, optimizer, args, hvd.rank())
    rates = hvd.allgather(torch.tensor([rate], dtype=torch.float64)).tolist()
    if hvd.rank() == 0:
        _report(rates=rates, module=hvd.__file__)
    hvd.shutdown()


def step_worker(args) -> None:
    """One process: DistributedOptimizer's step against the plain optimizer's, alternated
    step by step (which one goes first alternates too), on two copies of one model."""
    import torch

    import hpc_horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    plain_model = build_model()
    wrapped_model = copy.deepcopy(plain_model)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9)
    wrapped = hvd.DistributedOptimizer(
        torch.optim.SGD(wrapped_model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=wrapped_model.named_parameters())
    data, target = _batch(args.batch_size, 0)
    times = {"plain": [], "distributed": []}
    pair = [("plain", plain_model, plain), ("distributed", wrapped_model, wrapped)]
    for i in range(args.warmup + args.step_pairs):
        for name, model, optimizer in (pair if i % 2 == 0 else pair[::-1]):
            start = time.perf_counter()
            _step(model, optimizer, data, target)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    _report(plain_s=times["plain"], distributed_s=times["distributed"], module=hvd.__file__)
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
        _report(rates=rates, module=hvd.__file__)
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
    rate = measure(model, optimizer, args, rank)
    rates = [None] * dist.get_world_size()
    dist.all_gather_object(rates, rate)
    if rank == 0:
        _report(rates=rates, module=torch.__file__)
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_args(args, worker: str) -> list[str]:
    return [str(Path(__file__).resolve()), "--batch-size", str(args.batch_size),
            "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--step-pairs", str(args.step_pairs), "--worker", worker]


def _env(package_dir: Path = ROOT) -> dict:
    """The workers' environment: ``hpc_horovod`` imported from ``package_dir``."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
                    [str(package_dir)] + [p for p in [env.get("PYTHONPATH")] if p]),
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return env


def _result(stdout: str, what: str) -> dict:
    # mpirun tags every chunk it reads, and may cut a long line into tagged pieces
    stdout = re.sub(r"\[\d+,\d+\]<std(?:out|err)>:", "", stdout)
    match = RESULT.search(stdout)
    if match is None:
        raise RuntimeError(f"{what} printed no result:\n{stdout}")
    return json.loads(match.group(1))


def _launched(worker: str, package_dir: Path = ROOT):
    """A runner starting ``--worker worker`` on n ranks with ``hpc-horovod run``, importing
    ``hpc_horovod`` (launcher included) from ``package_dir``."""
    def run(args, n: int) -> dict:
        cmd = [sys.executable, "-m", "hpc_horovod.cli", "run", "-np", str(n), sys.executable,
               *_worker_args(args, worker)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(package_dir),
                              timeout=900)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        result = _result(proc.stdout, worker)
        if worker != "horovod" and not Path(result["module"]).resolve().is_relative_to(package_dir):
            raise RuntimeError(f"{worker} imported {result['module']}, not from {package_dir}")
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


def run_ddp(args, n: int) -> dict:
    env = _env()
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                "WORLD_SIZE": str(n)})
    procs = [subprocess.Popen([sys.executable, *_worker_args(args, "ddp")],
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(n)]
    outputs = [p.communicate(timeout=900) for p in procs]
    result = _result(outputs[0][0], "DDP")
    for p, (_, err) in zip(procs, outputs):
        if p.returncode:  # after the measurement: report it, keep the numbers
            print(f"warning: a DDP worker exited with {p.returncode} after measuring: "
                  f"{err.strip()[-300:]}", file=sys.stderr)
    return result


def _package_dir(text: str) -> Path:
    path = Path(text).resolve()
    if not (path / "hpc_horovod" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text}: no hpc_horovod/ package in this folder "
                                         "(give the root of a checkout of this project)")
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="images per process")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--step-pairs", type=int, default=100,
                        help="alternated plain/DistributedOptimizer steps in one process")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2, help="the scaled configuration")
    parser.add_argument("--compare-with", type=_package_dir, metavar="DIR",
                        help="also run the torch worker with hpc_horovod from DIR")
    parser.add_argument("--no-tensorflow", action="store_true",
                        help="skip hpc_horovod.tensorflow")
    parser.add_argument("--worker", choices=["hvd", "step", "tf", "ddp", "horovod"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.batch_size, args.steps, args.step_pairs, args.rounds, args.processes) < 1:
        parser.error("sizes and counts must be positive")
    workers = {"hvd": lambda: torch_worker(args, "hpc_horovod.torch"),
               "horovod": lambda: torch_worker(args, "horovod.torch"),
               "step": lambda: step_worker(args),
               "tf": lambda: tf_worker(args), "ddp": lambda: ddp_worker(args)}
    if args.worker:
        return workers[args.worker]()

    runners = {OURS: _launched("hvd")}
    steppers = {OURS: _launched("step")}
    if args.compare_with:
        label = f"hpc_horovod ({args.compare_with})"
        runners[label] = _launched("hvd", args.compare_with)
        steppers[label] = _launched("step", args.compare_with)
    if not args.no_tensorflow:
        runners["hpc_horovod.tensorflow"] = _launched("tf")
    runners[BASELINE] = run_ddp
    skipped = {}
    why = _importable("horovod.torch")
    if why is None:
        runners["horovod.torch"] = _launched("horovod")
    else:
        skipped["horovod.torch"] = why
    counts = sorted({1, args.processes})
    totals: dict[str, dict[int, list[float]]] = {name: {n: [] for n in counts} for name in runners}
    modules: dict[str, str] = {}
    steps: dict[str, list[dict]] = {name: [] for name in steppers}
    for round_ in range(args.rounds):
        for name, runner in runners.items():
            for n in counts:
                result = runner(args, n)
                totals[name][n].append(sum(result["rates"]))
                modules[name] = result["module"]
                print(f"round {round_ + 1}/{args.rounds}: {name:24s} {n} process(es): "
                      f"{totals[name][n][-1]:8.1f} img/s", file=sys.stderr, flush=True)
        for name, stepper in steppers.items():
            result = stepper(args, 1)
            plain, wrapped = (statistics.median(result[k]) for k in ("plain_s", "distributed_s"))
            steps[name].append({"plain_median_s": plain, "distributed_median_s": wrapped,
                                "ratio": wrapped / plain})
            print(f"round {round_ + 1}/{args.rounds}: {name:24s} one-process step: "
                  f"DistributedOptimizer {wrapped * 1e3:.2f} ms, plain {plain * 1e3:.2f} ms, "
                  f"x{wrapped / plain:.3f}", file=sys.stderr, flush=True)

    configurations = [{"name": name, "processes": n, "module": modules[name],
                       "rounds_img_per_sec_total": totals[name][n]}
                      for name in runners for n in counts]
    print(f"small CNN, batch {args.batch_size}/process, 1 thread per process, "
          f"{os.cpu_count()} cores; median of {args.rounds} rounds, ratio to {BASELINE} "
          "taken round by round")
    for c in configurations:
        base = totals[BASELINE][c["processes"]]
        ratio = statistics.median(a / b for a, b in zip(c["rounds_img_per_sec_total"], base))
        print(f"  {c['name']:36s} {c['processes']} process(es) "
              f"{statistics.median(c['rounds_img_per_sec_total']):9.1f} img/s  x{ratio:.3f}")
    for name, rounds in steps.items():
        print(f"  {name}: one-process DistributedOptimizer step / plain step "
              f"x{statistics.median(r['ratio'] for r in rounds):.3f}")
    for what, why in skipped.items():
        print(f"skipped {what}: {why}")
    meta = describe(command_line(), ("numpy", "torch", "mpi4py")
                    + (() if args.no_tensorflow else ("tensorflow", "keras")))
    meta.update(batch_size=args.batch_size, warmup=args.warmup, steps=args.steps,
                step_pairs=args.step_pairs, rounds=args.rounds, skipped=skipped)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "training.json"
    path.write_text(json.dumps({"benchmark": "training", "meta": meta, "baseline": BASELINE,
                                "ours": OURS, "configurations": configurations,
                                "one_process_step": steps}, indent=1) + "\n")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
