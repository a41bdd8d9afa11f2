"""``hpc-horovod sbatch`` (write, or submit, a job script) and ``hpc-horovod doctor``.

The options are sbatch's own, long and short (``-N``, ``-n``, ``--ntasks-per-node``, ``-c``,
``-t``, ``-A``, ``-p``, ``-q``, ``-J``, ``-C``, ``-o``, ``--gpus-per-node``, ``--requeue``,
``--signal``), so a line of a job script a user already has works here.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import doctor, validate
from .profiles import load_profiles
from .render import render_job
from .submit import sbatch

SBATCH_EXAMPLE = """\
examples:
  hpc-horovod sbatch --cluster jean-zay -N 2 -t 20:00:00 -A abc --requeue \\
      --script train.slurm -- python train.py --epochs 90      # all 4 GPUs of gpu_p13 nodes
  sbatch train.slurm
  hpc-horovod sbatch -N 2 --ntasks-per-node 40 -p cpu -t 30 --submit -- python train.py
"""


def _sbatch(args) -> int:
    command = list(args.job_command)
    if command and command[0] == "--":
        command = command[1:]
    script = render_job(
        command,
        cluster=args.cluster,
        nodes=args.nodes,
        ntasks=args.ntasks,
        ntasks_per_node=args.ntasks_per_node,
        gpus_per_node=args.gpus_per_node,
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
        signal_seconds=None if args.signal is None else validate.signal_seconds(args.signal),
        output=args.output,
        template=args.template,
    )
    if args.script:
        path = Path(args.script)
        path.write_text(script, encoding="utf-8")
        job_id = sbatch(path=path) if args.submit else None
    else:
        job_id = sbatch(script=script) if args.submit else None
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
                    "GPUs per node and QoS limits. The options are sbatch's. Clusters: "
                    + _clusters_help(),
        epilog=SBATCH_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="generic", help="cluster profile (default: generic)")
    p.add_argument("-N", "--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("-n", "--ntasks", type=int,
                   help="tasks in all, spread evenly over the nodes")
    p.add_argument("--ntasks-per-node", "--tasks-per-node", dest="ntasks_per_node", type=int,
                   help="tasks per node (a GPU job runs one per GPU)")
    p.add_argument("--gpus-per-node", type=int,
                   help="GPUs (= tasks) per node (default: all GPUs of the node type; none on "
                        "CPU partitions)")
    p.add_argument("-c", "--cpus-per-task", type=int, help="CPUs per task (default: the "
                   "profile's)")
    p.add_argument("-t", "--time", help=f"time limit: {validate.TIME_FORMATS} (default: the "
                   "profile's)")
    p.add_argument("-A", "--account", help="account to charge (Jean Zay: abc or abc@v100)")
    p.add_argument("-q", "--qos", help="QoS (default: the node type's, or the next longer one)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-p", "--partition", help="partition (default: the profile's)")
    where.add_argument("-C", "--constraint", help="node constraint, e.g. a100 or h100 on Jean "
                       "Zay")
    p.add_argument("-J", "--job-name", default="hpc-horovod", help="job name")
    p.add_argument("-o", "--output", default="%x-%j.out",
                   help="the job's output file pattern (default %%x-%%j.out)")
    p.add_argument("--requeue", action="store_true",
                   help="requeue-able job, with SIGUSR2 before the limit (requeue_on_signal)")
    p.add_argument("--signal", metavar="USR2@SECONDS",
                   help="send SIGUSR2 to every task this long before the time limit")
    p.add_argument("--modules", help="comma-separated modules to load (default: the profile's; "
                   "'' for none)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="export NAME=VALUE in the job (repeatable)")
    p.add_argument("--template", metavar="FILE",
                   help="a site's job template ({%% extends \"base.sbatch.j2\" %%}; default: the "
                        "profile's)")
    p.add_argument("--script", metavar="FILE", help="write the job script to FILE, not stdout")
    p.add_argument("--submit", action="store_true", help="submit with sbatch; print the job id")
    p.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the command every task runs")
    p.set_defaults(func=_sbatch)

    d = sub.add_parser("doctor", help="how this launch sees ranks, nodes and GPUs (run it as "
                       "`srun hpc-horovod doctor`)", description=doctor.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    d.set_defaults(func=lambda args: doctor.run(os.environ))
