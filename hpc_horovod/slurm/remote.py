"""From a notebook on a login node to the cluster and back: :func:`submit` runs a Python
function on every task of a SLURM job and returns a :class:`Job` whose ``result()`` waits for
the per-rank return values.

The job is written from a cluster profile like ``hpc-horovod sbatch`` writes it (same options,
same checks); its tasks run the function the way :func:`hpc_horovod.run` runs it, through a job
folder that the compute nodes must see (by default under the current directory, which on a
cluster is a shared file system): ``payload.pkl`` (the function, by cloudpickle), the job
script, ``output.log`` (every task's output, each line led by its rank) and ``rank-<r>.pkl``
(what each rank returned or raised)::

    job = hpc_horovod.slurm.submit(train, args=(config,), cluster="jean-zay", nodes=2,
                                   time="1:00:00", account="abc")
    accuracies = job.result()     # progress while it waits; Ctrl-C cancels the job
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time as clock
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from ..runner import collect, rank_file, worker_command, write_payload
from . import live, validate
from . import options as sbatch_flags
from .job import plan_job
from .render import render_plan
from .submit import sbatch

#: states after which a job runs no more (``scontrol show job``'s JobState)
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                      "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"})
OUTPUT = "output.log"


def _client(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    program = shutil.which(args[0])
    if program is None:
        raise RuntimeError(f"{args[0]} is not on PATH: submit from a SLURM login node")
    return subprocess.run([program, *args[1:]], capture_output=True, text=True,
                          timeout=timeout)


class Job:
    """A submitted job: its ``state()``, ``result()`` and ``cancel()``."""

    def __init__(self, job_id: str, folder: Path, size: int, output: Path | None = None):
        self.job_id = job_id
        self.folder = folder
        self.size = size
        #: the job's output file, every task's lines led by its rank
        self.output_file = folder / OUTPUT if output is None else output

    def __repr__(self) -> str:
        return f"Job({self.job_id!r}, {self.size} task(s), folder={str(self.folder)!r})"

    def record(self) -> dict[str, str]:
        """``scontrol show job`` as a dict; empty once SLURM has forgotten the job."""
        proc = _client("scontrol", "-o", "show", "job", self.job_id)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                return {}
            raise RuntimeError(f"scontrol show job {self.job_id}: {proc.stderr.strip()}")
        return dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)

    def state(self) -> str:
        """PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...; UNKNOWN once SLURM forgot it."""
        return self.record().get("JobState", "UNKNOWN")

    def output(self, lines: int = 5, rank: int | None = 0) -> list[str]:
        """The last ``lines`` lines of ``rank``'s output (``None``: every rank's, labelled)."""
        try:
            text = self.output_file.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return []
        found = text.splitlines()
        if rank is not None:
            prefix = f"{rank}: "
            found = [line[len(prefix):] for line in found if line.lstrip().startswith(prefix)]
        return found[-lines:] if lines else found

    def cancel(self, timeout: float = 60) -> None:
        """``scancel`` the job and wait (bounded) until SLURM no longer runs it."""
        _client("scancel", self.job_id)
        deadline = clock.monotonic() + timeout
        while self.state() not in FINISHED | {"UNKNOWN"}:
            if clock.monotonic() > deadline:
                raise RuntimeError(f"job {self.job_id} still {self.state()} {timeout:g} s after "
                                   "scancel")
            clock.sleep(0.2)

    def result(self, *, progress: bool = True, poll: float = 2.0, lines: int = 3,
               stream: TextIO | None = None, timeout: float | None = None) -> list:
        """Wait for the job; the list of what each rank returned, by rank.

        While it waits it shows the job's state, its elapsed time and the last ``lines`` lines
        of rank 0's output (``progress``; updated in place in a notebook, else printed to
        ``stream``, default stderr, when they change). An exception raised by a rank is
        re-raised here, the lowest rank's, with a note naming it; a job that ended without every
        result (cancelled, out of time, a node lost) is a RuntimeError with its state and the
        end of its output. An interrupt (Ctrl-C, a notebook's stop button) cancels the job.
        """
        show = _Progress(stream) if progress else None
        deadline = None if timeout is None else clock.monotonic() + timeout
        try:
            while True:
                record = self.record()
                state = record.get("JobState", "UNKNOWN")
                if show is not None:
                    show(self._status(record), self.output(lines))
                if state in FINISHED or state == "UNKNOWN":
                    break
                if deadline is not None and clock.monotonic() > deadline:
                    raise TimeoutError(f"job {self.job_id} still {state} after {timeout:g} s "
                                       "(it goes on; call result() again, or cancel())")
                clock.sleep(poll)
        except KeyboardInterrupt:
            self.cancel()
            if show is not None:
                show(f"job {self.job_id}: cancelled", [])
            raise
        tail = "\n".join(self.output(20, rank=None))
        if state == "COMPLETED":
            failure = None
        elif state == "UNKNOWN":  # SLURM forgot it (MinJobAge): the results say how it went
            failure = (f"job {self.job_id} is no longer in SLURM's records; the end of "
                       f"{self.output_file}:\n{tail}") if self._missing() else None
        else:
            failure = (f"job {self.job_id} ended {state} (exit code "
                       f"{record.get('ExitCode', '?')}); the end of {self.output_file}:\n"
                       f"{tail}")
        return collect(self.folder, self.size, failure)

    def _missing(self) -> list[int]:
        return [rank for rank in range(self.size) if not rank_file(self.folder, rank).exists()]

    def _status(self, record: Mapping[str, str]) -> str:
        state = record.get("JobState", "UNKNOWN")
        elapsed = record.get("RunTime", "")
        where = record.get("NodeList", "") if state == "RUNNING" else record.get("Reason", "")
        extra = f" on {where}" if state == "RUNNING" and where else (
            f" ({where})" if where and where != "None" else "")
        return f"job {self.job_id}: {state}{extra}, elapsed {elapsed or '00:00:00'}"


class _Progress:
    """Show a status line and output lines: in place in a notebook, else on a stream when they
    change."""

    def __init__(self, stream: TextIO | None):
        self.stream = stream
        self.handle = None
        self.last = None
        if stream is None and _in_notebook():
            from IPython.display import display

            self.handle = display({"text/plain": ""}, raw=True, display_id=True)

    def __call__(self, status: str, lines: Sequence[str]) -> None:
        text = "\n".join([status, *(f"  | {line}" for line in lines)])
        if text == self.last:
            return
        self.last = text
        if self.handle is not None:
            self.handle.update({"text/plain": text}, raw=True)
        else:
            stream = self.stream or sys.stderr
            stream.write(text + "\n")
            stream.flush()


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def submit(fn: Callable, args: Sequence = (), kwargs: Mapping[str, Any] | None = None, *,
           cluster: str = "generic", nodes: int = 1, ntasks: int | None = None,
           ntasks_per_node: int | None = None, gpus: int | None = None,
           gpus_per_node: int | None = None, cpus_per_task: int | None = None,
           time: str | None = None, account: str | None = None, qos: str | None = None,
           partition: str | None = None, constraint: str | None = None,
           job_name: str = "hpc-horovod", output: str | None = None,
           open_mode: str | None = None, requeue: bool = False, signal: str | None = None,
           modules: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
           template: str | os.PathLike | None = None, workdir: str | os.PathLike = ".",
           executable: str | None = None, profile_env: Mapping[str, str] | None = None,
           **sbatch_options) -> Job:
    """Submit ``fn(*args, **kwargs)`` as a SLURM job, one call per task; a :class:`Job`.

    The options are those of ``hpc-horovod sbatch``, by their Python names (``nodes``,
    ``ntasks``, ``ntasks_per_node``, ``gpus`` (for the whole job), ``gpus_per_node`` (default:
    every GPU of the node type), ``time``, ``partition``, ``account``, ``requeue``, ``signal``
    (``"USR2@300"``), ...), and sbatch's other options as keywords written into the script as
    given (``mem="64G"``, ``exclusive=True``, ``dependency="afterok:12"``: the names of
    :data:`hpc_horovod.slurm.options.PASSTHROUGH`); everything is checked against the cluster
    profile, and against the cluster itself where ``sinfo`` answers, before anything is
    written, and errors name these arguments. ``output`` is the
    output file (``%j`` and ``%x`` allowed; default: ``output.log`` in the job's folder). The
    tasks run ``executable`` (default: this interpreter, which the compute nodes must see at
    the same path, as with a shared software environment) and import what the function needs
    from this interpreter's ``sys.path``. The job folder goes under
    ``workdir``/``.hpc_horovod/jobs`` (default: the current directory's).
    """
    if "array" in sbatch_options:
        raise ValueError("array: every task of a job array would run the same call and write "
                         "the same results; submit one job per configuration")
    if output is not None and _OTHER_PATTERNS.search(validate.output_pattern(output)):
        raise ValueError(f"output {output!r}: result() reads one file, so only %j, %x, %u and "
                         "%% may be used")
    workdir = Path(workdir).expanduser().absolute()
    try:
        name = validate.token(job_name, "--job-name")
        folder = workdir / ".hpc_horovod" / "jobs" / (
            f"{name}-{clock.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")
        out = str(folder / OUTPUT) if output is None else str(workdir / output)
        plan = plan_job(
            worker_command(folder, executable), cluster=cluster, nodes=nodes, ntasks=ntasks,
            ntasks_per_node=ntasks_per_node, gpus=gpus, gpus_per_node=gpus_per_node,
            time=time, partition=partition, constraint=constraint, account=account, qos=qos,
            cpus_per_task=cpus_per_task, job_name=name, modules=modules, env=env or {},
            requeue=requeue,
            signal_seconds=None if signal is None else validate.signal_seconds(signal),
            output=out, open_mode=open_mode, template=template, profile_env=profile_env,
            sbatch=sbatch_options, live=live.query())
    except ValueError as exc:
        raise ValueError(sbatch_flags.python_spelling(str(exc))) from None
    folder.mkdir(parents=True)
    try:
        write_payload(folder, fn, args, kwargs)
        path = folder / "job.sh"
        path.write_text(render_plan(plan), encoding="utf-8")
        job_id = sbatch(path=path)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return Job(job_id, folder, plan.total_tasks, output=_output_path(out, job_id, name))


#: SLURM filename patterns other than %j (job id), %x (job name), %u (user) and %%
_OTHER_PATTERNS = re.compile(r"%(?![jxu%])")


def _output_path(pattern: str, job_id: str, name: str) -> Path:
    """The file SLURM writes for an output ``pattern`` with only ``%j``, ``%x``, ``%u``."""
    import getpass

    fields = {"j": job_id, "x": name, "u": getpass.getuser(), "%": "%"}
    return Path(re.sub(r"%([jxu%])", lambda m: fields[m.group(1)], pattern))
