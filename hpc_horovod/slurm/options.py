"""sbatch's options, as ``hpc-horovod sbatch`` and :func:`hpc_horovod.slurm.submit` take them.

One table for both spellings: the command line takes sbatch's flags (``--ntasks-per-node``,
``-p``), Python takes their names (``ntasks_per_node=``, ``partition=``). Three kinds:

- the options a job plan checks and lays out itself (:data:`PLANNED`: nodes, tasks, GPUs, CPUs,
  time, partition, ...);
- the options written into the script as given (:data:`PASSTHROUGH`: ``--mem``,
  ``--exclusive``, ``--array``, ``--dependency``, ...): every value is checked for the
  characters an ``#SBATCH`` line may hold, and the common ones (sizes, dependencies, arrays,
  node lists, mail types, times, integers) for their syntax, as sbatch reads them; sbatch
  checks the others' at submission;
- sbatch options whose meaning contradicts one task per GPU, refused with the option to use
  instead (:data:`REFUSED`).

An option of sbatch that is in none of them is unknown here: the command line refuses it with
the nearest known spellings rather than guess.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import validate

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


#: a size as sbatch reads it: a number, then an optional unit (M when none)
_SIZE = re.compile(r"[0-9]+[KMGTkmgt]?")
_JOB_ID = r"[0-9]+(?:_[0-9]+)?"
#: one dependency: ``singleton``, or ``TYPE:JOB[+MINUTES][:JOB[+MINUTES]...]``
_DEPENDENCY = re.compile(rf"singleton|(?:after|afterany|afterburstbuffer|aftercorr|afternotok|"
                         rf"afterok):{_JOB_ID}(?:\+[0-9]+)?(?::{_JOB_ID}(?:\+[0-9]+)?)*")
#: array indices: ``0-15``, ``1,3,5``, ``0-15:4``, each list optionally ``%LIMIT``
_ARRAY = re.compile(r"[0-9]+(?:-[0-9]+(?::[0-9]+)?)?(?:,[0-9]+(?:-[0-9]+(?::[0-9]+)?)?)*"
                    r"(?:%[0-9]+)?")
MAIL_TYPES = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT",
              "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")


def _size(flag: str, text: str) -> None:
    if _SIZE.fullmatch(text) is None:
        raise ValueError(f"{flag} {text!r} is not a size: a number with an optional unit K, M, "
                         "G or T (e.g. 64G; without a unit, sbatch reads megabytes)")


def _dependency(flag: str, text: str) -> None:
    items = text.split("?") if "?" in text else text.split(",")
    bad = [item for item in items if _DEPENDENCY.fullmatch(item) is None]
    if bad or ("?" in text and "," in text):
        raise ValueError(f"{flag} {text!r} is not a dependency list: TYPE:JOBID[:JOBID...] "
                         "with TYPE after, afterany, afterok, afternotok, aftercorr or "
                         "afterburstbuffer (e.g. afterok:1234), or singleton; several joined "
                         "by , (all) or ? (any)")


def _array(flag: str, text: str) -> None:
    if _ARRAY.fullmatch(text) is None:
        raise ValueError(f"{flag} {text!r} is not an array of indices: N-M, N-M:STEP or "
                         "N,M,... with an optional %LIMIT of tasks at once (e.g. 0-15%4)")


def _mail_type(flag: str, text: str) -> None:
    bad = [item for item in text.split(",") if item.upper() not in MAIL_TYPES]
    if bad:
        raise ValueError(f"{flag} {text!r}: {', '.join(bad)} is not a mail type; valid: "
                         f"{', '.join(MAIL_TYPES)}")


def _nodes(flag: str, text: str) -> None:
    """A host list (``h[1-4],g7``), or sbatch's other form, a file of names (with a ``/``)."""
    import hostlist

    if "/" in text:
        if not Path(text).expanduser().is_file():
            raise ValueError(f"{flag} {text!r}: no such file (a value with / names a file of "
                             "node names)")
        return
    try:
        hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as exc:
        raise ValueError(f"{flag} {text!r} is not a node list ({exc}): names and ranges such "
                         "as node[01-04,07],gpu3") from None


def _integer(flag: str, text: str) -> None:
    if re.fullmatch(r"-?[0-9]+", text) is None:
        raise ValueError(f"{flag} {text!r} is not an integer")


def _yes_no(flag: str, text: str) -> None:
    if text.lower() not in ("yes", "no"):
        raise ValueError(f"{flag} {text!r}: yes or no")


def _time(flag: str, text: str) -> None:
    try:
        validate.parse_time(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a SLURM time ({validate.TIME_FORMATS})"
                         ) from None


@dataclass(frozen=True)
class Passthrough:
    flags: tuple[str, ...]
    arity: str
    help: str
    #: checks a value's syntax as sbatch reads it (``check(flag, value)`` raises ValueError);
    #: None: sbatch checks it at submission
    check: Callable[[str, str], None] | None = None

    @property
    def directive(self) -> str:
        return self.flags[-1]


#: sbatch options written into the job script as they are given (Python name -> option)
PASSTHROUGH = {
    "mem": Passthrough(("--mem",), VALUE, "memory per node, e.g. 64G", _size),
    "mem_per_cpu": Passthrough(("--mem-per-cpu",), VALUE, "memory per allocated CPU", _size),
    "mem_per_gpu": Passthrough(("--mem-per-gpu",), VALUE, "memory per allocated GPU", _size),
    "exclusive": Passthrough(("--exclusive",), OPTIONAL,
                             "nodes shared with no other job (=user, =mcs)"),
    "array": Passthrough(("-a", "--array"), VALUE, "job array indices, e.g. 0-15%4", _array),
    "dependency": Passthrough(("-d", "--dependency"), VALUE, "e.g. afterok:1234", _dependency),
    "error": Passthrough(("-e", "--error"), VALUE, "stderr file pattern (default: --output)"),
    "mail_user": Passthrough(("--mail-user",), VALUE, "where SLURM mails"),
    "mail_type": Passthrough(("--mail-type",), VALUE, "e.g. END,FAIL", _mail_type),
    "gres": Passthrough(("--gres",), VALUE,
                        "generic resources per node other than GPUs (--gpus-per-node)"),
    "nodelist": Passthrough(("-w", "--nodelist"), VALUE, "nodes to run on", _nodes),
    "exclude": Passthrough(("-x", "--exclude"), VALUE, "nodes to avoid", _nodes),
    "begin": Passthrough(("-b", "--begin"), VALUE, "start no earlier, e.g. now+1hour"),
    "deadline": Passthrough(("--deadline",), VALUE, "remove the job if it cannot end by then"),
    "reservation": Passthrough(("--reservation",), VALUE, "run in a reservation"),
    "licenses": Passthrough(("-L", "--licenses"), VALUE, "licenses, e.g. scratch:1"),
    "chdir": Passthrough(("-D", "--chdir"), VALUE, "the job's working directory"),
    "comment": Passthrough(("--comment",), VALUE, "a comment (no spaces)"),
    "tmp": Passthrough(("--tmp",), VALUE, "temporary disk space per node", _size),
    "hold": Passthrough(("-H", "--hold"), FLAG, "submit held (scontrol release starts it)"),
    "nice": Passthrough(("--nice",), OPTIONAL, "lower the job's priority", _integer),
    "wckey": Passthrough(("--wckey",), VALUE, "workload characterization key"),
    "time_min": Passthrough(("--time-min",), VALUE, "the least time the job accepts",
                          _time),
    "switches": Passthrough(("--switches",), VALUE, "max switches, e.g. 1@10:00"),
    "threads_per_core": Passthrough(("--threads-per-core",), VALUE, "threads per core",
                                  _integer),
    "kill_on_invalid_dep": Passthrough(("--kill-on-invalid-dep",), VALUE, "yes or no",
                                     _yes_no),
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
        if spec.check is not None:
            spec.check(spec.directive, text)
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
