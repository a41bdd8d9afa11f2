"""``hpc-horovod sbatch`` (write, or submit, a job script) and ``hpc-horovod doctor``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import doctor
from .profiles import load_profiles
from .render import render_job
from .submit import submit

SBATCH_EXAMPLE = """\
example:
  hpc-horovod sbatch --cluster jean-zay --nodes 2 --gpus-per-node 4 --time 20:00:00 \\
      --account abc --requeue -o train.slurm -- python train.py --epochs 90
  sbatch train.slurm
"""


def _sbatch(args) -> int:
    command = list(args.job_command)
    if command and command[0] == "--":
        command = command[1:]
    script = render_job(
        command,
        cluster=args.cluster,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        account=args.account,
        qos=args.qos,
        partition=args.partition,
        constraint=args.constraint,
        job_name=args.job_name,
        modules=None if args.modules is None else args.modules.split(","),
        env=args.env,
        requeue=args.requeue,
        signal_seconds=args.signal_seconds,
        output=args.output,
    )
    if args.out:
        path = Path(args.out)
        path.write_text(script, encoding="utf-8")
        job_id = submit(path=path) if args.submit else None
    else:
        job_id = submit(script=script) if args.submit else None
        if not args.submit:
            sys.stdout.write(script)
    if job_id is not None:
        print(job_id)
    return 0


def _clusters_help() -> str:
    try:
        return "; ".join(f"{name}: {p.description}" for name, p in load_profiles().items())
    except (OSError, ValueError) as exc:
        return f"(cluster profiles unreadable: {exc})"


def register(sub) -> None:
    p = sub.add_parser(
        "sbatch", help="write (or submit) a SLURM job script: one task per GPU, srun, modules",
        description="Write a job script for a cluster profile, checked against its partitions, "
                    "GPUs per node and QoS limits. Clusters: " + _clusters_help(),
        epilog=SBATCH_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="generic", help="cluster profile (default: generic)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, required=True,
                   help="GPUs (= tasks) per node; 0 for a CPU job with --tasks-per-node")
    p.add_argument("--tasks-per-node", type=int, help="tasks per node of a CPU job")
    p.add_argument("--cpus-per-task", type=int, help="override the profile's CPUs per task")
    p.add_argument("--time", help="wall time HH:MM:SS (default: the profile's)")
    p.add_argument("--account", help="account to charge (Jean Zay: abc or abc@v100)")
    p.add_argument("--qos", help="QoS (default: the node type's, or the next longer one)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--partition", help="partition (default: the profile's)")
    where.add_argument("--constraint", help="node constraint, e.g. a100 or h100 on Jean Zay")
    p.add_argument("--job-name", default="hpc-horovod", help="job name")
    p.add_argument("--modules", help="comma-separated modules to load (default: the profile's; "
                   "'' for none)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="export NAME=VALUE in the job (repeatable)")
    p.add_argument("--requeue", action="store_true",
                   help="requeue-able job, with SIGUSR2 before the limit (requeue_on_signal)")
    p.add_argument("--signal-seconds", type=int,
                   help="send SIGUSR2 this many seconds before the time limit")
    p.add_argument("--output", default="%x-%j.out", help="output file pattern (%%x-%%j.out)")
    p.add_argument("--submit", action="store_true", help="submit with sbatch; print the job id")
    p.add_argument("-o", dest="out", metavar="FILE", help="write the script to FILE, not stdout")
    p.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the command every task runs")
    p.set_defaults(func=_sbatch)

    d = sub.add_parser("doctor", help="how this launch sees ranks, nodes and GPUs (run it as "
                       "`srun hpc-horovod doctor`)", description=doctor.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    d.set_defaults(func=lambda args: doctor.run(os.environ))
