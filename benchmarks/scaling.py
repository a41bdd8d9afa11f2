"""How the engine's fixed costs grow with the number of ranks, on one host.

    python benchmarks/scaling.py [--ranks 2,4,8,16,32,64] [--jobs 3]

For each number of ranks, ``--jobs`` separate jobs (``mpirun -np N --bind-to none``, the host
oversubscribed when N exceeds its cores; every number of ranks once per pass, so that load
from elsewhere hits them alike) each measure, every time on the slowest rank:

* ``init``: the wall time of ``hvd.init()`` (MPI is already initialized: the rank's imports
  and ``MPI_Init`` are not in it), after a barrier;
* rank 0's resident memory (``VmRSS``) and open files (``/proc/self/fd``) right after
  ``init``, and the most of any other rank (rank 0 alone holds a connection per rank: the
  side channel of ``common/watch.py``);
* a first step: ``--names`` named allreduces of one float32 each, never seen before, submitted
  asynchronously then synchronized: the full negotiation (every rank's pending
  ``(name, signature)`` list gathered at rank 0, ``negotiation.match`` there, its decision
  broadcast), then one fused allreduce. ``--rounds`` rounds per job, each with new names;
* steady steps: after each first step, ``--steps`` steps of the same names: the cheap phase
  only (one bitwise AND of ``2 + nwords`` 64-bit words), then the same allreduce;
* before ``init`` (no engine thread running), the two exchanges of the protocol on their own,
  on the same ranks: the full negotiation's exchange of one first step's list through the MPI
  backend's own ``agree`` (the sizes and the pickled lists gathered at rank 0, every list
  unpickled and ``negotiation.match`` run there, its decision broadcast), and one bitwise-AND
  ``Allreduce`` of three 64-bit words with mpi4py (the cheap phase across nodes; on one node
  the engine ANDs through the node's shared window instead). And ``negotiation.match`` over
  the gathered lists on rank 0 alone (CPU time, as below).

Then, in this process, the protocol's Python work at sizes one host cannot run: unpickling
``size`` lists of 20 and 200 names (its CPU time, and the memory the lists hold, traced) and
``negotiation.match`` over them (CPU time), at 2 .. 4,096 ranks, and the pickled bytes per
name.
``benchmarks/report.py`` projects the costs at 1,024 and 4,096 ranks from these constants
(``docs/architecture.md``, "Costs at scale", gives the formulas). Results go to
``benchmarks/results/scaling.json``, every job's own record to
``benchmarks/out/scaling_jobs.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
from machine import RAW, RESULTS, ROOT, command_line, describe

RESULT = re.compile(r"^RESULT (.*)$", re.M)
#: sizes of the protocol's Python work measured in this process
PYTHON_SIZES = (2, 4, 8, 16, 32, 64, 256, 1024, 4096)
PYTHON_NAMES = (20, 200)


def names_of(round_: int, count: int) -> list[str]:
    """Names as a model's gradients are named (``DistributedOptimizer``'s are the
    parameters' names): about 30 characters."""
    return [f"allreduce.r{round_}.encoder.layer{i:03d}.weight" for i in range(count)]


def pending_list(names: list[str]) -> list:
    """What a rank sends in the full negotiation for ``names``: (name, signature) pairs."""
    from hpc_horovod.common.request import allreduce_request
    from hpc_horovod.common.types import Sum

    one = np.ones(1, np.float32)
    return [(n, allreduce_request(one, name=n, op=Sum).signature) for n in names]


def _median_cpu(fn, reps: int) -> float:
    """The median CPU time of ``fn`` on this thread: Python work alone, which load from other
    processes on a shared machine stretches in wall time, not in CPU time."""
    times = []
    for _ in range(reps):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


# -- one job, on every rank ------------------------------------------------------------------

def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(args) -> None:
    from mpi4py import MPI

    import hpc_horovod as hvd
    from hpc_horovod.backends.mpi import MpiBackend
    from hpc_horovod.common.negotiation import match

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.rank, comm.size

    def slowest(seconds: float) -> float:
        return comm.allreduce(seconds, op=MPI.MAX)

    def timed(fn) -> float:
        comm.Barrier()
        start = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - start)

    # The protocol's two exchanges alone, before the engine exists: the full negotiation's
    # through the MPI backend's own ``agree`` (every list gathered at rank 0, ``match`` there,
    # its decision broadcast), the cheap phase's as one AND allreduce.
    mine = pending_list(names_of(0, args.names))
    payload = pickle.dumps((mine, False, False), pickle.HIGHEST_PROTOCOL)
    exchanger = MpiBackend(comm.Dup())
    gathered = []

    def decide(lists):
        gathered[:] = lists
        return match([g[0] for g in lists], set(), list(range(size)))

    def exchange() -> None:
        exchanger.agree((mine, False, False), decide)

    words = np.zeros(3, np.uint64)
    exchange_s = [timed(exchange) for _ in range(args.reps)]
    band_s = [timed(lambda: comm.Allreduce(MPI.IN_PLACE, words, op=MPI.BAND))
              for _ in range(args.reps)]
    match_s = _median_cpu(lambda: match([g[0] for g in gathered], set(), list(range(size))),
                           args.reps) if rank == 0 else 0.0

    comm.Barrier()
    start = time.perf_counter()
    hvd.init()
    init_s = slowest(time.perf_counter() - start)
    usage = comm.gather((_rss_bytes(), _open_files()), root=0)
    from hpc_horovod.common import basics

    backend = basics._runtime.engine.backend.name

    one = np.ones(1, np.float32)

    def step(names: list[str]) -> None:
        handles = [hvd.allreduce_async(one, name=n, op=hvd.Sum) for n in names]
        for h in handles:
            hvd.synchronize(h)

    first_s, steady_s = [], []
    for r in range(args.rounds):
        names = names_of(r + 1, args.names)
        first_s.append(timed(lambda names=names: step(names)))
        steady_s += [timed(lambda names=names: step(names)) for _ in range(args.steps)]
    hvd.shutdown()
    exchanger.free()
    if rank == 0:
        print("RESULT " + json.dumps({
            "ranks": size, "backend": backend, "init_s": init_s,
            "rank0_rss_bytes": usage[0][0], "rank0_open_files": usage[0][1],
            "others_max_rss_bytes": max((u[0] for u in usage[1:]), default=None),
            "others_max_open_files": max((u[1] for u in usage[1:]), default=None),
            "first_step_s": first_s, "steady_step_s": steady_s,
            "exchange_s": exchange_s, "band_allreduce_s": band_s, "match_s": match_s,
            "payload_bytes": len(payload)}), flush=True)


# -- the driver ------------------------------------------------------------------------------

def python_costs(reps: int) -> list[dict]:
    """Unpickling every rank's list and ``negotiation.match`` over them, in this process, at
    sizes from 2 to 4,096 ranks (what one rank does in a full negotiation)."""
    from hpc_horovod.common.negotiation import match

    rows = []
    for count in PYTHON_NAMES:
        mine = pending_list(names_of(0, count))
        blob = pickle.dumps((mine, False, False), pickle.HIGHEST_PROTOCOL)
        for size in PYTHON_SIZES:
            blobs = [blob] * size
            lists = [pickle.loads(b)[0] for b in blobs]
            n = max(1, min(reps, int(3e5 // (size * count))))  # a few seconds at most
            tracemalloc.start()
            kept = [pickle.loads(b) for b in blobs]
            held = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            del kept
            rows.append({"ranks": size, "names": count, "bytes_per_rank": len(blob),
                         "unpickled_bytes": held,
                         "unpickle_s": _median_cpu(
                             lambda blobs=blobs: [pickle.loads(b) for b in blobs], n),
                         "match_s": _median_cpu(lambda lists=lists: match(lists, set(), None),
                                                 n),
                         "reps": n})
    return rows


def run_job(args, n: int) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONPATH=str(ROOT),
               # 64 ranks on a few cores import for a minute before their peers
               HOROVOD_PEER_TIMEOUT_SECONDS="600")
    cmd = ["mpirun", "-np", str(n), "--bind-to", "none", sys.executable, __file__, "--worker",
           "--names", str(args.names), "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--reps", str(args.reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    stdout = re.sub(r"\[\d+,\d+\]<std(?:out|err)>:", "", proc.stdout)
    found = RESULT.search(stdout)
    if proc.returncode or found is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(found.group(1))


def summarize(jobs: list[dict]) -> dict:
    """One row per number of ranks: medians over jobs (one value per job) or over every
    repetition of every job (the timed steps and exchanges)."""
    def pooled(key: str) -> float:
        return statistics.median(v for j in jobs for v in j[key])

    def per_job(key: str) -> float:
        return statistics.median(j[key] for j in jobs)

    first = jobs[0]
    return {"ranks": first["ranks"], "backend": first["backend"], "jobs": len(jobs),
            "init_s": per_job("init_s"), "init_s_jobs": [j["init_s"] for j in jobs],
            "rank0_rss_bytes": per_job("rank0_rss_bytes"),
            "rank0_open_files": per_job("rank0_open_files"),
            "others_max_rss_bytes": per_job("others_max_rss_bytes"),
            "others_max_open_files": per_job("others_max_open_files"),
            "first_step_s": pooled("first_step_s"), "steady_step_s": pooled("steady_step_s"),
            "exchange_s": pooled("exchange_s"), "band_allreduce_s": pooled("band_allreduce_s"),
            "match_s": per_job("match_s"), "payload_bytes": first["payload_bytes"],
            "samples": {"first_step": sum(len(j["first_step_s"]) for j in jobs),
                        "steady_step": sum(len(j["steady_step_s"]) for j in jobs),
                        "exchange": sum(len(j["exchange_s"]) for j in jobs)}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4,8,16,32,64",
                   help="comma-separated numbers of ranks (default 2,4,8,16,32,64)")
    p.add_argument("--jobs", type=int, default=3, help="jobs per number of ranks (default 3)")
    p.add_argument("--names", type=int, default=20, help="allreduces per step (default 20)")
    p.add_argument("--rounds", type=int, default=3,
                   help="first steps per job, each with new names (default 3)")
    p.add_argument("--steps", type=int, default=10,
                   help="steady steps after each first step (default 10)")
    p.add_argument("--reps", type=int, default=10,
                   help="repetitions of each exchange alone, and of match (default 10)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    ranks = [int(x) for x in args.ranks.split(",")]
    meta = describe(command_line())
    meta.update(names=args.names, rounds=args.rounds, steps=args.steps, reps=args.reps,
                jobs_per_point=args.jobs, shared_machine=True)
    # The Python work (CPU time, in a thread that the jobs' waits leave the interpreter to)
    # goes in with the first results written after it is done.
    python = concurrent.futures.ThreadPoolExecutor(1).submit(python_costs, args.reps)
    RESULTS.mkdir(parents=True, exist_ok=True)
    RAW.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "scaling.json"
    jobs: dict[int, list] = {n: [] for n in ranks}
    # Every number of ranks once per pass, so that load from elsewhere, which changes over the
    # run, hits them alike; the results are written after every job (``jobs`` says how many
    # each point has).
    for j in range(args.jobs):
        for n in ranks:
            start = time.perf_counter()
            jobs[n].append(run_job(args, n))
            print(f"pass {j + 1}/{args.jobs}, {n} ranks: {time.perf_counter() - start:.0f} s",
                  flush=True)
            meta.update(jobs_per_point=j + 1,
                        loadavg_end=[round(x, 2) for x in os.getloadavg()])
            write(path, meta, [summarize(jobs[m]) for m in ranks if jobs[m]],
                  python.result() if python.done() else [])
            (RAW / "scaling_jobs.json").write_text(json.dumps(jobs) + "\n")
    write(path, meta, [summarize(jobs[m]) for m in ranks if jobs[m]], python.result())
    print(f"wrote {path}", flush=True)


def write(path: Path, meta: dict, rows: list, python: list) -> None:
    path.write_text(json.dumps({"benchmark": "scaling", "meta": meta, "rows": rows,
                                "python": python}, indent=1) + "\n")


if __name__ == "__main__":
    main()
