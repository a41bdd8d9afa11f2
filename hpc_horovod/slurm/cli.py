"""``hpc-horovod sbatch`` (write, or submit, a job script) and ``hpc-horovod doctor``.

The options are sbatch's own, long and short, with sbatch's meanings (``-N``, ``-n``,
``--ntasks-per-node``, ``-G/--gpus`` for the whole job, ``--gpus-per-node``, ``-c``, ``-t``,
``-A``, ``-p``, ``-q``, ``-J``, ``-C``, ``-o``, ``--open-mode``, ``--requeue``, ``--signal``),
and the others of :data:`~hpc_horovod.slurm.options.PASSTHROUGH` (``--mem``, ``--exclusive``,
``--array``, ...) go into the script as given, so a line of a job script a user already has
works here. sbatch options that contradict one task per GPU are refused, naming the one to use.
Each refusal is one line that names the option as the user typed it (``-G 8``, not
``--gpus 8``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

from . import doctor, live, options, validate
from .profiles import load_profiles
from .render import render_job
from .submit import output_directories, sbatch

SBATCH_EXAMPLE = """\
examples:
  hpc-horovod sbatch --cluster jean-zay -N 2 -t 20:00:00 -A abc --requeue \\
      --script train.slurm -- python train.py --epochs 90      # all 4 GPUs of gpu_p13 nodes
  sbatch train.slurm
  hpc-horovod sbatch -N 2 --ntasks-per-node 40 -p cpu -t 30 --mem 64G --submit -- python train.py
"""

#: a Python interpreter named by its bare name, as a job command's first word
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
#: Python options that take a value in the next word (``-W error``, ``-X dev``)
_PYTHON_VALUE_OPTIONS = ("-W", "-X", "--check-hash-based-pycs")


def job_command(command: list[str], workdir: Path, modules: bool) -> tuple[list[str], str]:
    """The command the tasks run, with a bare ``python`` resolved to this interpreter (the one
    that has hpc_horovod; the tasks would otherwise run whatever ``python`` their PATH has, or
    fail once the job starts), and what was resolved, to say; refused when its script is not
    in ``workdir`` (where the job runs) or, without modules to provide it, its program is not
    on PATH."""
    if not command:
        raise ValueError("no command to run: hpc-horovod sbatch ... -- python train.py ARGS")
    program, note = command[0], ""
    if "/" not in program and _PYTHON.fullmatch(program):
        command = [sys.executable, *command[1:]]
        note = (f"the tasks run {program} as {sys.executable} (the interpreter of this "
                "hpc-horovod); give a path to choose another")
    elif "/" not in program and shutil.which(program) is None and not modules:
        raise ValueError(f"{program!r} is not on PATH here, nor will it be in the job, which "
                         "inherits this environment and loads no module: give its path")
    elif "/" in program and not (workdir / program).exists():
        raise ValueError(f"{program}: no such file in {workdir} (where the job runs)")
    if "/" in command[0] and _PYTHON.fullmatch(Path(command[0]).name):
        script = _python_script(command[1:])
        if script == "":
            raise ValueError(f"{shlex.join([program, *command[1:]])} runs no script: Python would "
                             "read its program from the job's input, which is empty (give "
                             "it: -- python train.py ARGS, or -m MODULE)")
        if script is not None and not (workdir / script).is_file():
            raise ValueError(f"{script}: no such file in {workdir}, where the job runs "
                             "(submit from the script's directory, or give -D/--chdir)")
    return command, note


def _python_script(args: list[str]) -> str | None:
    """The script a Python command line runs, None for ``-m`` and ``-c``, and ``""`` when it
    names none (Python then reads its program from stdin: ``python``, ``python -u -``)."""
    words = iter(args)
    for word in words:
        if word == "-":
            return ""
        if word in ("-m", "-c") or word.startswith(("-m", "-c")):
            return None
        if word in _PYTHON_VALUE_OPTIONS:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return ""


#: a command-line flag in a message (``--gpus``, not the ``--gpus`` of ``--gpus-per-node``)
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*(?![\w-])")


def as_typed(message: str, argv: list[str], parser: argparse.ArgumentParser) -> str:
    """``message``, whose flags are named by their long spelling (``--gpus 8 ...``), with each
    flag the user typed otherwise named as typed (``-G 8 ...``), so that a refusal names what
    the user wrote."""
    typed = {}
    for word in argv:
        if word == "--":
            break
        if not word.startswith("-") or word == "-":
            continue
        flag = word.split("=", 1)[0] if word.startswith("--") else word[:2]
        action = parser._option_string_actions.get(flag)
        if action is not None:
            long = next((o for o in action.option_strings if o.startswith("--")), flag)
            if long != flag:
                typed[long] = flag
    return _FLAG.sub(lambda m: typed.get(m.group(0), m.group(0)), message)


def _sbatch(args, parser: argparse.ArgumentParser) -> int:
    try:
        return _write_job(args)
    except ValueError as exc:
        words = list(getattr(args, "argv", ()))
        if args.job_command:
            words = words[:len(words) - len(args.job_command)]
        raise ValueError(as_typed(str(exc), words, parser)) from None


def _write_job(args) -> int:
    for flag in options.REFUSED:
        if getattr(args, "refused_" + flag[2:].replace("-", "_"), None) is not None:
            raise ValueError(f"{flag}: {options.REFUSED[flag]}")
    path = None if args.script is None else Path(args.script)
    if path is not None and path.exists() and not args.force:
        raise FileExistsError(f"{path} exists: not overwriting it (pass --force to replace it, "
                              "or choose another --script)")
    command = list(args.job_command)
    if command and command[0] == "--":
        command = command[1:]
    extra = {name: getattr(args, name) for name in options.PASSTHROUGH}
    workdir = Path(extra["chdir"] or ".").expanduser().absolute()
    modules = None if args.modules is None else args.modules.split(",")
    command, note = job_command(command, workdir, modules is None or any(modules))
    script = render_job(
        command,
        cluster=args.cluster,
        nodes=args.nodes,
        ntasks=args.ntasks,
        ntasks_per_node=args.ntasks_per_node,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        account=args.account,
        qos=args.qos,
        partition=args.partition,
        constraint=args.constraint,
        job_name=args.job_name,
        modules=modules,
        env=args.env,
        requeue=args.requeue,
        signal_seconds=None if args.signal is None else validate.signal_seconds(args.signal),
        output=args.output,
        open_mode=args.open_mode,
        template=args.template,
        sbatch=extra,
        live=live.query(),
        min_nodes=args.min_nodes,
    )
    if note:
        print(f"hpc-horovod sbatch: {note}", file=sys.stderr)
    if path is not None or args.submit:
        for made in output_directories((("--output", args.output), ("--error", extra["error"])),
                                       workdir):
            print(f"hpc-horovod sbatch: made {made} for the job's output (SLURM makes no "
                  "directory)", file=sys.stderr)
    if path is not None:
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
    p.add_argument("--min-nodes", type=int, metavar="K",
                   help="elastic training (hvd.elastic.run): survive lost nodes, restarting on "
                        "the nodes left while at least K remain")
    p.add_argument("-n", "--ntasks", type=int,
                   help="tasks in all, spread evenly over the nodes")
    p.add_argument("--ntasks-per-node", "--tasks-per-node", dest="ntasks_per_node", type=int,
                   help="tasks per node (a GPU job runs one per GPU)")
    gpus = p.add_mutually_exclusive_group()
    gpus.add_argument("-G", "--gpus", type=int,
                      help="GPUs for the whole job, as in sbatch, split evenly over the nodes "
                           "(one task per GPU)")
    gpus.add_argument("--gpus-per-node", type=int,
                      help="GPUs (= tasks) per node (default: all GPUs of the node type; none "
                           "on CPU partitions)")
    p.add_argument("-c", "--cpus-per-task", type=int, help="CPUs per task (default: the "
                   "profile's)")
    p.add_argument("-t", "--time", help=f"time limit: {validate.TIME_FORMATS}; 0 is no limit, "
                   "as in sbatch (default: the profile's)")
    p.add_argument("-A", "--account", help="account to charge (Jean Zay: abc or abc@v100)")
    p.add_argument("-q", "--qos", help="QoS (default: the node type's, or the next longer one)")
    p.add_argument("-p", "--partition", help="partition (default: the profile's)")
    p.add_argument("-C", "--constraint", help="node features, e.g. a100 or h100 on Jean Zay")
    p.add_argument("-J", "--job-name", default="hpc-horovod", help="job name")
    p.add_argument("-o", "--output", default="%x-%j.out",
                   help="the job's output file pattern (default %%x-%%j.out); its directory is "
                        "made with the script, since SLURM makes none")
    p.add_argument("--open-mode", choices=("append", "truncate"),
                   help="output file mode (default: append with --requeue, else SLURM's)")
    p.add_argument("--requeue", action="store_true",
                   help="requeue-able job, with SIGUSR2 before the limit (requeue_on_signal)")
    p.add_argument("--signal", metavar="[B:]USR2@SECONDS",
                   help="send SIGUSR2 to every task this long before the time limit (with or "
                        "without B:, every task gets it)")
    p.add_argument("--modules", help="comma-separated modules to load (default: the profile's; "
                   "'' for none)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="export NAME=VALUE in the job (repeatable)")
    p.add_argument("--template", metavar="FILE",
                   help="a site's job template ({%% extends \"base.sbatch.j2\" %%}; default: the "
                        "profile's)")
    p.add_argument("--script", metavar="FILE", help="write the job script to FILE, not stdout")
    p.add_argument("--force", action="store_true", help="replace an existing --script FILE")
    p.add_argument("--submit", action="store_true", help="submit with sbatch; print the job id")
    passed = p.add_argument_group("sbatch options written into the script as given")
    for name, spec in options.PASSTHROUGH.items():
        kind = {options.VALUE: {}, options.OPTIONAL: {"nargs": "?", "const": True},
                options.FLAG: {"action": "store_true", "default": None}}[spec.arity]
        passed.add_argument(*spec.flags, dest=name, help=spec.help.replace("%", "%%"), **kind)
    refused = p.add_argument_group("sbatch options refused here (each says what to use)")
    for flag in options.REFUSED:
        refused.add_argument(flag, dest="refused_" + flag[2:].replace("-", "_"), metavar="X",
                             help=options.REFUSED[flag].replace("%", "%%"))
    p.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the command every task runs")
    p.set_defaults(func=lambda args: _sbatch(args, p))

    d = sub.add_parser("doctor", help="how this launch sees ranks, nodes and GPUs (run it as "
                       "`srun hpc-horovod doctor`)", description=doctor.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    d.set_defaults(func=lambda args: doctor.run(os.environ))
