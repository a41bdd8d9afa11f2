"""sbatch's options, as ``hpc-horovod sbatch`` and :func:`hpc_horovod.slurm.submit` take them.

One table for both spellings: the command line takes sbatch's flags (``--ntasks-per-node``,
``-p``), Python takes their names (``ntasks_per_node=``, ``partition=``). Three kinds:

- the options a job plan checks and lays out itself (:data:`PLANNED`: nodes, tasks, GPUs, CPUs,
  time, partition, ...);
- the options written into the script as given, their value checked for safety
  (:data:`PASSTHROUGH`: ``--mem``, ``--exclusive``, ``--array``, ``--dependency``, ...);
- sbatch options whose meaning contradicts one task per GPU, refused with the option to use
  instead (:data:`REFUSED`).

An option of sbatch that is in none of them is unknown here: the command line refuses it with
the nearest known spellings rather than guess.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

#: Python name -> the sbatch flag it is on the command line, for what a plan checks itself
PLANNED = {
    "nodes": "--nodes",
    "ntasks": "--ntasks",
    "ntasks_per_node": "--ntasks-per-node",
    "gpus": "--gpus",
    "gpus_per_node": "--gpus-per-node",
    "cpus_per_task": "--cpus-per-task",
    "time": "--time",
    "account": "--account",
    "qos": "--qos",
    "partition": "--partition",
    "constraint": "--constraint",
    "job_name": "--job-name",
    "output": "--output",
    "open_mode": "--open-mode",
    "requeue": "--requeue",
    "signal": "--signal",
    "modules": "--modules",
    "env": "--env",
    "template": "--template",
}

#: how many values a passed-through option takes
VALUE, OPTIONAL, FLAG = "value", "optional", "flag"


@dataclass(frozen=True)
class Passthrough:
    flags: tuple[str, ...]
    arity: str
    help: str

    @property
    def directive(self) -> str:
        return self.flags[-1]


#: sbatch options written into the job script as they are given (Python name -> option)
PASSTHROUGH = {
    "mem": Passthrough(("--mem",), VALUE, "memory per node, e.g. 64G"),
    "mem_per_cpu": Passthrough(("--mem-per-cpu",), VALUE, "memory per allocated CPU"),
    "mem_per_gpu": Passthrough(("--mem-per-gpu",), VALUE, "memory per allocated GPU"),
    "exclusive": Passthrough(("--exclusive",), OPTIONAL,
                             "nodes shared with no other job (=user, =mcs)"),
    "array": Passthrough(("-a", "--array"), VALUE, "job array indices, e.g. 0-15%4"),
    "dependency": Passthrough(("-d", "--dependency"), VALUE, "e.g. afterok:1234"),
    "error": Passthrough(("-e", "--error"), VALUE, "stderr file pattern (default: --output)"),
    "mail_user": Passthrough(("--mail-user",), VALUE, "where SLURM mails"),
    "mail_type": Passthrough(("--mail-type",), VALUE, "e.g. END,FAIL"),
    "gres": Passthrough(("--gres",), VALUE,
                        "generic resources per node other than GPUs (--gpus-per-node)"),
    "nodelist": Passthrough(("-w", "--nodelist"), VALUE, "nodes to run on"),
    "exclude": Passthrough(("-x", "--exclude"), VALUE, "nodes to avoid"),
    "begin": Passthrough(("-b", "--begin"), VALUE, "start no earlier, e.g. now+1hour"),
    "deadline": Passthrough(("--deadline",), VALUE, "remove the job if it cannot end by then"),
    "reservation": Passthrough(("--reservation",), VALUE, "run in a reservation"),
    "licenses": Passthrough(("-L", "--licenses"), VALUE, "licenses, e.g. scratch:1"),
    "chdir": Passthrough(("-D", "--chdir"), VALUE, "the job's working directory"),
    "comment": Passthrough(("--comment",), VALUE, "a comment (no spaces)"),
    "tmp": Passthrough(("--tmp",), VALUE, "temporary disk space per node"),
    "hold": Passthrough(("-H", "--hold"), FLAG, "submit held (scontrol release starts it)"),
    "nice": Passthrough(("--nice",), OPTIONAL, "lower the job's priority"),
    "wckey": Passthrough(("--wckey",), VALUE, "workload characterization key"),
    "time_min": Passthrough(("--time-min",), VALUE, "the least time the job accepts"),
    "switches": Passthrough(("--switches",), VALUE, "max switches, e.g. 1@10:00"),
    "threads_per_core": Passthrough(("--threads-per-core",), VALUE, "threads per core"),
    "kill_on_invalid_dep": Passthrough(("--kill-on-invalid-dep",), VALUE, "yes or no"),
    "propagate": Passthrough(("--propagate",), OPTIONAL, "resource limits to propagate"),
}

#: sbatch flags that contradict the layout (one task per GPU, every GPU of a node visible to
#: each of its tasks): the flag -> what to write instead
REFUSED = {
    "--gpus-per-task": "each task would see only its own GPU, and "
                       "torch.cuda.set_device(hvd.local_rank()) fails: use --gpus-per-node N "
                       "(one task per GPU, each picks its own)",
    "--ntasks-per-gpu": "use --gpus-per-node N: it runs one task per GPU",
    "--cpus-per-gpu": "use -c/--cpus-per-task: each task drives one GPU",
    "--gpus-per-socket": "use --gpus-per-node N",
    "--wrap": "the command goes after --: hpc-horovod sbatch ... -- python train.py",
    "--export": "the job inherits this environment (sbatch's default); add variables with "
                "--env NAME=VALUE",
}

#: what a passed-through value may hold: it is read by sbatch from an #SBATCH line
_VALUE = re.compile(r"[A-Za-z0-9._%/+@=,:~^*?\[\]-]+")


def passthrough(options: Mapping[str, object]) -> tuple[tuple[str, str | None], ...]:
    """``{"mem": "64G", "exclusive": True}`` -> ``(("--mem", "64G"), ("--exclusive", None))``,
    every name known and every value safe for an ``#SBATCH`` line; None and False leave an
    option out."""
    out = []
    for name, value in options.items():
        if name not in PASSTHROUGH:
            raise TypeError(f"unexpected keyword argument {name!r}: the sbatch options passed "
                            f"through as given are {', '.join(sorted(PASSTHROUGH))}")
        spec = PASSTHROUGH[name]
        if value is None or value is False:
            continue
        if value is True:
            if spec.arity == VALUE:
                raise ValueError(f"{spec.directive} needs a value ({spec.help})")
            out.append((spec.directive, None))
            continue
        if spec.arity == FLAG:
            raise ValueError(f"{spec.directive} takes no value (True to set it), got {value!r}")
        text = str(value)
        if _VALUE.fullmatch(text) is None:
            raise ValueError(f"{spec.directive} {text!r} may only contain letters, digits and "
                             "._%/+@=,:~^*?[]- (no spaces or quotes): it is written into an "
                             "#SBATCH line of the job script")
        if name == "gres" and any(item.split(":")[0] == "gpu" for item in text.split(",")):
            raise ValueError(f"--gres {text}: ask GPUs with --gpus-per-node N (per node) or "
                             "--gpus N (for the job), from which one task per GPU is laid out; "
                             "--gres passes other resources")
        out.append((spec.directive, text))
    return tuple(out)


_FLAG_WORD = re.compile(r"(?<![\w-])(--[a-z][a-z-]*)")
_PYTHON_NAMES = {flag: name for name, flag in PLANNED.items()} | {
    spec.directive: name for name, spec in PASSTHROUGH.items()}


def python_spelling(message: str) -> str:
    """A message that names command-line flags (``--time '20h' is not a SLURM time``), with
    each flag of this table named as the Python argument it is (``time '20h' ...``)."""
    return _FLAG_WORD.sub(lambda m: _PYTHON_NAMES.get(m.group(1), m.group(1)), message)
