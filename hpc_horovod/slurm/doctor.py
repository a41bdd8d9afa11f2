"""``hpc-horovod doctor``: what each process of a launch sees, gathered on rank 0.

Run it exactly as the training will run (``srun hpc-horovod doctor`` in the job script or an
allocation) before the real job: rank 0 prints the launcher, one line per rank (rank, host,
SLURM node, local rank, node index, visible GPUs, compute threads against the CPUs SLURM
allocated to the task) and the preflight verdict. When a process
cannot even start MPI (a batch script without srun, ``--mpi=none``), each process prints its own
diagnosis instead, since they cannot be gathered.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from ..common.topology import Topology
from . import preflight


def describe(report: preflight.Report, topo: Topology, env: Mapping[str, str]) -> dict:
    """This process's line of the table (``topo``: after ``hvd.init()``), with its findings."""
    return {
        "rank": topo.rank,
        "host": socket.gethostname(),
        "node": env.get("SLURMD_NODENAME", "-"),
        "local": f"{topo.local_rank}/{topo.local_size}",
        "cross": f"{topo.cross_rank}/{topo.cross_size}",
        "launcher": topo.launcher,
        "gpus": "-" if report.visible_gpus is None else (",".join(report.visible_gpus) or "none"),
        "threads": _threads(env, topo),
        "findings": [(f.level, f.message) for f in report.findings],
    }


def _threads(env: Mapping[str, str], topo: Topology) -> str:
    """``threads/allocated CPUs`` of this rank (``-`` where unknown)."""
    count = preflight.threads(env)[0]
    cpus = preflight.allocated_cpus(env, topo)
    return f"{'-' if count is None else count}/{'-' if cpus is None else cpus}"


def _ranges(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def format_table(rows: Sequence[dict], env: Mapping[str, str]) -> str:
    """The report rank 0 prints: header, one line per rank, grouped findings, verdict."""
    rows = sorted(rows, key=lambda r: r["rank"])
    nodes = len({(r["node"], r["cross"].split("/")[0]) for r in rows})
    job = env.get("SLURM_JOB_ID")
    where = f" (SLURM job {job}, step {env.get('SLURM_STEP_ID', '-')})" if job else ""
    lines = [f"hpc_horovod doctor: {rows[0]['launcher']} launch, {len(rows)} process(es) on "
             f"{nodes} node(s){where}",
             f"{'rank':>4}  {'host':<16} {'node':<10} {'local':>7} {'cross':>7} "
             f"{'threads/CPUs':>12}  visible GPUs"]
    for r in rows:
        lines.append(f"{r['rank']:>4}  {r['host']:<16} {r['node']:<10} {r['local']:>7} "
                     f"{r['cross']:>7} {r.get('threads', '-'):>12}  {r['gpus']}")
    grouped: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        for level, message in r["findings"]:
            grouped.setdefault((level, message), []).append(r["rank"])
    order = {preflight.ERROR: 0, preflight.WARNING: 1, preflight.OK: 2}
    for (level, message), ranks in sorted(grouped.items(), key=lambda kv: order[kv[0][0]]):
        lines.append(f"{level} (rank {_ranges(ranks)}): {message}")
    errors = sum(len(ranks) for (level, _), ranks in grouped.items() if level == preflight.ERROR)
    warnings = sum(1 for (level, _) in grouped if level == preflight.WARNING)
    verdict = (f"NOT READY: errors on {errors} rank(s)" if errors
               else f"ready, with {warnings} warning(s)" if warnings else "ready")
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)


def run(env: Mapping[str, str] | None = None, out: TextIO = sys.stdout) -> int:
    """Check this launch; 0 when every rank is ready, 1 otherwise."""
    env = dict(os.environ if env is None else env)
    report = preflight.check(env)
    if report.blocking:
        rank = env.get("SLURM_PROCID") or env.get("OMPI_COMM_WORLD_RANK") or "?"
        print(f"hpc_horovod doctor (process {rank} on {socket.gethostname()}): "
              f"{report.verdict()}", file=out)
        for finding in report.findings:
            print(f"  {finding.level}: {finding.message}", file=out)
        return 1
    import hpc_horovod as hvd
    from hpc_horovod.common.basics import topology

    hvd.init()
    try:
        rows = hvd.allgather_object(describe(report, topology(), env))
        ok = not any(level == preflight.ERROR for row in rows for level, _ in row["findings"])
        if hvd.rank() == 0:
            print(format_table(rows, env), file=out, flush=True)
    finally:
        hvd.shutdown()
    return 0 if ok else 1

