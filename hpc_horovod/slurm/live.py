"""What the SLURM of this machine says about its partitions, to check a job against.

A cluster profile describes a site offline (a script can be written on a laptop); where
``sinfo`` answers, the cluster itself is the authority: a partition it does not have, more GPUs
or CPUs per node than its nodes have, or a time over its MaxTime is refused before anything is
written, naming what the cluster has. :func:`plan_job <hpc_horovod.slurm.job.plan_job>` takes
the :class:`LiveCluster` that :func:`query` returns.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import validate

#: sinfo's fields: partition (``*`` after the default), CPUs per node, gres, time limit,
#: features; one line per partition and node configuration
SINFO_FORMAT = "%P|%c|%G|%l|%f"
SINFO_TIMEOUT_S = 15


@dataclass(frozen=True)
class Partition:
    """One partition as sinfo shows it; per-node figures are the largest of its nodes'."""

    name: str
    cpus_per_node: int
    gpus_per_node: int
    max_time: float
    features: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class LiveCluster:
    partitions: Mapping[str, Partition]
    default: str | None


def _gpus(gres: str) -> int:
    """``gpu:2``, ``gpu:a100:4(S:0-1)``, ``gpu:2,nvme:1``, ``(null)`` -> the GPU count."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _time(text: str) -> float:
    """sinfo's time limit (``infinite``, ``1-00:00:00``, ``2:00:00``, ``30:00``) in seconds."""
    text = text.strip()
    if text.lower() in ("infinite", "unlimited", "n/a", ""):
        return math.inf
    days, _, rest = text.rpartition("-")
    fields = [int(f) for f in rest.split(":")]
    while len(fields) < 3:
        fields.insert(0, 0)
    hours, minutes, seconds = fields
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def parse_sinfo(text: str) -> LiveCluster:
    """``sinfo -h -o SINFO_FORMAT``'s output -> a :class:`LiveCluster`."""
    rows: dict[str, Partition] = {}
    default = None
    for line in text.splitlines():
        if not line.strip():
            continue
        name, cpus, gres, limit, features = (line.split("|") + [""] * 5)[:5]
        if name.endswith("*"):
            name = name[:-1]
            default = name
        cpus_n = int(re.sub(r"\D.*", "", cpus) or 0)
        feats = frozenset(f for f in features.split(",") if f and f != "(null)")
        seen = rows.get(name)
        if seen is not None:
            cpus_n = max(cpus_n, seen.cpus_per_node)
            feats = feats | seen.features
        rows[name] = Partition(name, cpus_n, max(_gpus(gres), seen.gpus_per_node if seen else 0),
                               _time(limit), feats)
    return LiveCluster(rows, default)


def query(env: Mapping[str, str] | None = None) -> LiveCluster | None:
    """This machine's cluster from ``sinfo``; None where there is no SLURM to ask (the job is
    then checked against its profile only), with a line on stderr when sinfo fails."""
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return None
    try:
        proc = subprocess.run([sinfo, "-h", "-o", SINFO_FORMAT], capture_output=True, text=True,
                              timeout=SINFO_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        print(f"hpc_horovod: sinfo did not answer in {SINFO_TIMEOUT_S} s: the job is checked "
              "against its cluster profile only", file=sys.stderr)
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        # sinfo's last line says why (a machine with no cluster: "fatal: Could not establish a
        # configuration source", after lines of DNS lookups that add nothing)
        lines = proc.stderr.strip().splitlines()
        why = lines[-1].removeprefix("sinfo: ") if lines else "no partitions"
        print(f"hpc_horovod: sinfo found no cluster here ({why}): the job is checked against "
              "its cluster profile only", file=sys.stderr)
        return None
    return parse_sinfo(proc.stdout)


def check(live: LiveCluster, partition: str | None, constraint: str | None,
          gpus_per_node: int, tasks_per_node: int, cpus_per_task: int, seconds: float,
          gpus_asked: str | None = None) -> None:
    """Refuse, naming what the cluster has, a job this cluster cannot run; ``gpus_asked`` is
    the GPU option as the user gave it (``--gpus 2``), which a refusal names."""
    where = "on this cluster (sinfo)"
    if partition is None:
        if constraint is not None or live.default is None:
            return  # the site routes it (a constraint without a partition): nothing to check
        partition = live.default
    if partition not in live.partitions:
        raise ValueError(f"--partition {partition}: no such partition {where}; it has "
                         f"{', '.join(sorted(live.partitions))}")
    part = live.partitions[partition]
    if constraint is not None and part.features and constraint not in part.features:
        raise ValueError(f"--constraint {constraint}: no node of partition {partition} has "
                         f"that feature {where}; its features: {', '.join(sorted(part.features))}")
    if gpus_per_node > part.gpus_per_node:
        asked = gpus_asked or f"--gpus-per-node {gpus_per_node}"
        per_node = "" if asked.startswith("--gpus-per-node") else \
            f" ({gpus_per_node} per node)"
        raise ValueError(f"{asked}{per_node}: the nodes of partition {partition} "
                         f"have {part.gpus_per_node} GPU(s) {where}"
                         + (f"; ask at most {part.gpus_per_node} and more --nodes"
                            if part.gpus_per_node else "; leave GPUs out (a CPU job)"))
    cpus = tasks_per_node * cpus_per_task
    if part.cpus_per_node and cpus > part.cpus_per_node:
        raise ValueError(f"{tasks_per_node} task(s) per node x --cpus-per-task {cpus_per_task} "
                         f"= {cpus} CPUs per node, but the nodes of partition {partition} have "
                         f"{part.cpus_per_node} {where}: fewer tasks or CPUs per node, and "
                         "more --nodes")
    if seconds > part.max_time:
        raise ValueError(f"--time {validate.format_time(seconds)} is over the "
                         f"{validate.format_time(part.max_time)} MaxTime of partition "
                         f"{partition} {where}")
