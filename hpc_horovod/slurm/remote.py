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

import json
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

from ..runner import PAYLOAD, collect, element_folder, rank_file, worker_command, write_payload
from . import live, validate
from . import options as sbatch_flags
from .job import plan_job
from .render import render_plan
from .submit import output_directories, sbatch

#: states after which a job runs no more (``scontrol show job``'s JobState)
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                      "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"})
OUTPUT = "output.log"
#: what a job folder says of its job, for :meth:`Job.attach` and :func:`jobs`
RECORD = "job.json"


def _client(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    program = shutil.which(args[0])
    if program is None:
        raise RuntimeError(f"{args[0]} is not on PATH: submit from a SLURM login node")
    return subprocess.run([program, *args[1:]], capture_output=True, text=True,
                          timeout=timeout)


def _job_folders(workdir: str | os.PathLike) -> list[Path]:
    """The folders under ``workdir``/.hpc_horovod/jobs that hold a job (an array's elements
    each hold one), oldest first."""
    root = Path(workdir).expanduser().absolute() / ".hpc_horovod" / "jobs"
    found = [*root.glob(f"*/{RECORD}"), *root.glob(f"*/*/{RECORD}")]
    return [path.parent for path in sorted(found, key=lambda path: path.stat().st_mtime)]


def jobs(workdir: str | os.PathLike = ".") -> list[Job]:
    """The jobs submitted from ``workdir`` (default: the current directory) whose folders are
    still there, oldest first: a new session finds its jobs here (``[(j.job_id, j.folder,
    j.state()) for j in jobs()]``) and goes on with them (``result()``, ``cancel()``,
    ``cleanup()``)."""
    return [Job.load(folder) for folder in _job_folders(workdir)]


class Job:
    """A submitted job: its ``state()``, ``result()``, ``cancel()`` and ``cleanup()``.

    :meth:`attach` finds a job again by its id from another session; :func:`jobs` lists them.
    """

    def __init__(self, job_id: str, folder: Path, size: int, output: Path | None = None):
        self.job_id = job_id
        self.folder = folder
        self.size = size
        #: the job's output file, every task's lines led by its rank
        self.output_file = folder / OUTPUT if output is None else output

    def __repr__(self) -> str:
        return f"Job({self.job_id!r}, {self.size} task(s), folder={str(self.folder)!r})"

    @property
    def id(self) -> str:
        """The job's id (``"123"``, ``"123_4"`` for an array element): ``job_id`` by SLURM's
        shorter name."""
        return self.job_id

    def save(self) -> None:
        """Write what :meth:`load` needs into the job's folder."""
        record = {"job_id": self.job_id, "size": self.size, "output": str(self.output_file)}
        (self.folder / RECORD).write_text(json.dumps(record), encoding="utf-8")

    @classmethod
    def load(cls, folder: str | os.PathLike) -> Job:
        """The job whose folder this is."""
        folder = Path(folder)
        try:
            record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{folder} holds no {RECORD}: not the folder of a job "
                                    "submitted by hpc_horovod.slurm") from None
        return cls(record["job_id"], folder, record["size"], Path(record["output"]))

    @classmethod
    def attach(cls, job_id: str | int, workdir: str | os.PathLike = ".") -> Job:
        """The job ``job_id`` (``"123"``, or ``"123_4"`` for an element of an array) that was
        submitted from ``workdir`` (default: the current directory), from its folder."""
        job_id = str(job_id)
        found = [folder for folder in _job_folders(workdir)
                 if json.loads((folder / RECORD).read_text(encoding="utf-8"))["job_id"] == job_id]
        if not found:
            known = ", ".join(job.job_id for job in jobs(workdir)) or "none"
            raise ValueError(f"no job {job_id!r} under {Path(workdir).absolute()}/.hpc_horovod/"
                             f"jobs (jobs there: {known}); give the workdir it was submitted "
                             "from")
        return cls.load(found[-1])

    def cleanup(self) -> None:
        """Remove the job's folder (its payload, results and, unless ``output`` named another
        file, its output); refused while the job may still run. An array's folder goes with
        its last element's."""
        state = self.state()
        if state not in FINISHED | {"UNKNOWN"}:
            raise RuntimeError(f"job {self.job_id} is {state}: cancel() it, or wait for its "
                               "result(), before cleanup()")
        shutil.rmtree(self.folder, ignore_errors=True)
        parent = self.folder.parent
        if (parent / PAYLOAD).exists() and not any(parent.glob(f"*/{RECORD}")):
            shutil.rmtree(parent, ignore_errors=True)  # the last element of an array

    def record(self, tries: int = 3) -> dict[str, str]:
        """``scontrol show job`` as a dict; empty once SLURM has forgotten the job. A failed
        ``scontrol`` (a busy controller) is asked again, ``tries`` times in all."""
        for attempt in range(tries):
            proc = _client("scontrol", "-o", "show", "job", self.job_id)
            if proc.returncode == 0:
                return dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)
            if "Invalid job id" in proc.stderr:
                return {}
            if attempt + 1 < tries:
                clock.sleep(1.0)
        raise RuntimeError(f"scontrol show job {self.job_id} failed {tries} times (exit status "
                           f"{proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")

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

        While it waits it shows (``progress``) the job's state and rank 0's new output lines,
        at most ``lines`` of them per look (``poll`` seconds apart), without repeating
        anything: in a notebook, one display updated in place; on a terminal, a status line
        that rewrites itself (state, nodes, elapsed time) under the output lines; on any other
        ``stream`` (default stderr), a line for each change of state and each new output line,
        so that a log stays short. An exception raised by a rank is re-raised here, the lowest
        rank's, with a note naming it; a job that ended without every result (cancelled, out of
        time, a node lost) is a RuntimeError with its state and the end of its output. An
        interrupt (Ctrl-C, a notebook's stop button) cancels the job.
        """
        validate.positive(lines, "lines", minimum=0)
        show = _Progress(stream, lines, self.output_file) if progress else None
        tail = _Tail(self.output_file)
        deadline = None if timeout is None else clock.monotonic() + timeout
        try:
            while True:
                record = self.record()
                state = record.get("JobState", "UNKNOWN")
                if show is not None:
                    show(*self._status(record), tail.new_lines())
                if state in FINISHED or state == "UNKNOWN":
                    break
                if deadline is not None and clock.monotonic() > deadline:
                    raise TimeoutError(f"job {self.job_id} still {state} after {timeout:g} s "
                                       "(it goes on; call result() again, or cancel())")
                clock.sleep(poll)
        except KeyboardInterrupt:
            self.cancel()
            if show is not None:
                show(f"job {self.job_id}: cancelled", f"job {self.job_id}: cancelled", [])
            raise
        finally:
            if show is not None:
                show.close()
        end = "\n".join(self.output(20, rank=None))
        if state == "COMPLETED":
            failure = None
        elif state == "UNKNOWN":  # SLURM forgot it (MinJobAge): the results say how it went
            failure = (f"job {self.job_id} is no longer in SLURM's records; the end of "
                       f"{self.output_file}:\n{end}") if self._missing() else None
        else:
            failure = (f"job {self.job_id} ended {state} (exit code "
                       f"{record.get('ExitCode', '?')}); the end of {self.output_file}:\n"
                       f"{end}")
        return collect(self.folder, self.size, failure)

    def _missing(self) -> list[int]:
        return [rank for rank in range(self.size) if not rank_file(self.folder, rank).exists()]

    def _status(self, record: Mapping[str, str]) -> tuple[str, str]:
        """The job's state and where (a change of it is news) and that with the elapsed time."""
        state = record.get("JobState", "UNKNOWN")
        elapsed = record.get("RunTime", "")
        where = record.get("NodeList", "") if state == "RUNNING" else record.get("Reason", "")
        extra = f" on {where}" if state == "RUNNING" and where else (
            f" ({where})" if where and where != "None" else "")
        head = f"job {self.job_id}: {state}{extra}"
        return head, f"{head}, elapsed {elapsed or '00:00:00'}"


class _Tail:
    """Rank 0's lines of an output file that came since the last look (whole lines only)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < self.offset:
                    self.offset = 0  # truncated: a requeued job's new run
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        data = data[:data.rfind(b"\n") + 1]
        self.offset += len(data)
        found = []
        for line in data.decode("utf-8", errors="replace").splitlines():
            rank, sep, text = line.lstrip().partition(": ")
            if sep and rank == "0":
                found.append(text)
        return found


class _Progress:
    """What :meth:`Job.result` shows while it waits: in place in a notebook, a self-rewriting
    status line on a terminal, else a line per change of state and per new output line."""

    def __init__(self, stream: TextIO | None, lines: int, output: Path):
        self.lines = lines
        self.output = output
        self.handle = None
        self.head = None
        self.shown = ""
        self.recent: list[str] = []
        self.stream = stream or sys.stderr
        if stream is None and _in_notebook():
            from IPython.display import display

            self.handle = display({"text/plain": ""}, raw=True, display_id=True)
        self.terminal = self.handle is None and _isatty(self.stream)

    def _bounded(self, new: Sequence[str]) -> list[str]:
        """At most ``lines`` new lines, after a note of how many were left out."""
        if len(new) <= self.lines:
            return list(new)
        skipped = f"... {len(new) - self.lines} more line(s) of rank 0 in {self.output}"
        return [skipped, *new[len(new) - self.lines:]] if self.lines else [skipped]

    def __call__(self, head: str, status: str, new: Sequence[str]) -> None:
        new = self._bounded(new)
        if self.handle is not None:
            self.recent = (self.recent + new)[-self.lines:] if self.lines else []
            text = "\n".join([status, *(f"  | {line}" for line in self.recent)])
            if text != self.shown:
                self.shown = text
                self.handle.update({"text/plain": text}, raw=True)
            return
        out = [f"  | {line}" for line in new]
        if self.terminal:
            width = shutil.get_terminal_size().columns - 1
            text = "".join(f"\r\x1b[K{line}\n" for line in out) + f"\r\x1b[K{status[:width]}"
            self.shown = status
        else:
            if head != self.head:
                out.insert(0, status)
            text = "".join(line + "\n" for line in out)
        self.head = head
        if text:
            self.stream.write(text)
            self.stream.flush()

    def close(self) -> None:
        """End the terminal's status line, so that what comes next starts on a line of its own."""
        if self.terminal and self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = ""


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def submit(fn: Callable, args: Sequence = (), kwargs: Mapping[str, Any] | None = None,
           **options) -> Job:
    """Submit ``fn(*args, **kwargs)`` as a SLURM job, one call per task; a :class:`Job`.

    The options are those of ``hpc-horovod sbatch``, by their Python names (``nodes``,
    ``ntasks``, ``ntasks_per_node``, ``gpus`` (for the whole job), ``gpus_per_node`` (default:
    every GPU of the node type), ``cpus_per_task``, ``time``, ``partition``, ``constraint``,
    ``account``, ``qos``, ``job_name``, ``requeue``, ``signal`` (``"USR2@300"``),
    ``open_mode``, ``modules``, ``env``, ``template``, ``profile_env``), and sbatch's other
    options as keywords written into the script as given (``mem="64G"``, ``exclusive=True``,
    ``dependency="afterok:12"``: the names of :data:`hpc_horovod.slurm.options.PASSTHROUGH`);
    everything is checked against the cluster profile, and against the cluster itself where
    ``sinfo`` answers, before anything is written, and errors name these arguments.
    ``output`` is the output file (``%j`` and ``%x`` allowed; default: ``output.log`` in the
    job's folder). The tasks run ``executable`` (default: this interpreter, which the compute
    nodes must see at the same path, as with a shared software environment) and import what
    the function needs from this interpreter's ``sys.path``. The job folder goes under
    ``workdir``/``.hpc_horovod/jobs`` (default: the current directory's); :meth:`Job.cleanup`
    removes it.
    """
    if "array" in options:
        raise ValueError(f"array={options['array']!r}: a job array is submit_array(fn, "
                         "[args0, args1, ...]), which gives each element its own arguments "
                         "and results")
    (job,) = _submit(fn, [args], kwargs, False, **options)
    return job


def submit_array(fn: Callable, calls: Sequence[Sequence], kwargs: Mapping[str, Any] | None = None,
                 *, parallel: int | None = None, **options) -> list[Job]:
    """Submit a SLURM job array: element ``i`` runs ``fn(*calls[i], **kwargs)`` as a job of its
    own, on every task of it; a :class:`Job` per element, in order.

    For sweeps and ensembles (many independent models): each element is a job of the size the
    options ask (those of :func:`submit`), data-parallel or not (one task), and
    ``jobs[i].result()`` is element ``i``'s list of per-rank results. ``parallel`` caps how many
    elements run at once (sbatch's ``--array=0-N%parallel``). Each element writes ``output.log``
    and its results in a folder of its own inside the array's folder, which holds the one
    payload they share.
    """
    if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence) or not calls:
        raise ValueError(f"calls must be a non-empty list of argument tuples, one per element "
                         f"(e.g. [(0.1,), (0.01,)]), got {calls!r}")
    for name in ("array", "output"):
        if name in options:
            raise ValueError(f"{name}={options[name]!r}: submit_array sets it (the elements "
                             "are the calls given; each writes its own output.log)")
    spec = f"0-{len(calls) - 1}"
    if parallel is not None:
        spec += f"%{validate.positive(parallel, 'parallel')}"
    return _submit(fn, calls, kwargs, True, array=spec, **options)


def _submit(fn: Callable, calls: Sequence[Sequence], kwargs: Mapping[str, Any] | None,
             as_array: bool, *, cluster: str = "generic", nodes: int = 1,
             ntasks: int | None = None, ntasks_per_node: int | None = None, gpus: int | None = None,
            gpus_per_node: int | None = None, cpus_per_task: int | None = None,
            time: str | None = None, account: str | None = None, qos: str | None = None,
            partition: str | None = None, constraint: str | None = None,
            job_name: str = "hpc-horovod", output: str | None = None,
            open_mode: str | None = None, requeue: bool = False, signal: str | None = None,
            modules: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
            template: str | os.PathLike | None = None, workdir: str | os.PathLike = ".",
            executable: str | None = None, profile_env: Mapping[str, str] | None = None,
            min_nodes: int | None = None, **sbatch_options) -> list[Job]:
    """What :func:`submit` and :func:`submit_array` do: one job, or an array of
    ``len(calls)`` elements, written, checked and submitted; a :class:`Job` per element."""
    if min_nodes is not None:
        raise ValueError("min_nodes: elastic training restarts the ranks on fewer nodes, and a "
                         "submitted function returns one result per rank of the job it asked "
                         "for; write a script with hvd.elastic.run and submit it with "
                         "hpc-horovod sbatch --min-nodes")
    if output is not None and _OTHER_PATTERNS.search(validate.output_pattern(output)):
        raise ValueError(f"output {output!r}: result() reads one file, so only %j, %x, %u and "
                         "%% may be used")
    workdir = Path(workdir).expanduser().absolute()
    try:
        name = validate.token(job_name, "--job-name")
        folder = workdir / ".hpc_horovod" / "jobs" / (
            f"{name}-{clock.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")
        out = (str(folder / "%a" / OUTPUT) if as_array else
               str(folder / OUTPUT) if output is None else str(workdir / output))
        plan = plan_job(
            worker_command(folder, executable), cluster=cluster, nodes=nodes, ntasks=ntasks,
            ntasks_per_node=ntasks_per_node, gpus=gpus, gpus_per_node=gpus_per_node,
            time=time, partition=partition, constraint=constraint, account=account, qos=qos,
            cpus_per_task=cpus_per_task, job_name=name, modules=modules, env=env or {},
            requeue=requeue,
            signal_seconds=None if signal is None else validate.signal_seconds(signal),
            output=out, open_mode=open_mode, template=template, profile_env=profile_env,
            sbatch=sbatch_options, live=live.query())
        # the job's folder holds the default output; a given one, or -e, may need a directory
        output_directories((("--output", None if output is None else out),
                            ("--error", sbatch_options.get("error"))),
                           Path(sbatch_options.get("chdir") or ".").expanduser().absolute())
    except ValueError as exc:
        raise ValueError(sbatch_flags.python_spelling(str(exc))) from None
    folder.mkdir(parents=True)
    try:
        if as_array:
            write_payload(folder, fn, kwargs=kwargs, calls=calls)
            for index in range(len(calls)):  # SLURM opens the output there, it makes no folder
                element_folder(folder, index).mkdir()
        else:
            write_payload(folder, fn, calls[0], kwargs)
        path = folder / "job.sh"
        path.write_text(render_plan(plan), encoding="utf-8")
        job_id = sbatch(path=path)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if as_array:
        found = [Job(f"{job_id}_{index}", element_folder(folder, index), plan.total_tasks)
                 for index in range(len(calls))]
    else:
        found = [Job(job_id, folder, plan.total_tasks, output=_output_path(out, job_id, name))]
    for job in found:
        job.save()
    return found


#: SLURM filename patterns other than %j (job id), %x (job name), %u (user) and %%
_OTHER_PATTERNS = re.compile(r"%(?![jxu%])")


def _output_path(pattern: str, job_id: str, name: str) -> Path:
    """The file SLURM writes for an output ``pattern`` with only ``%j``, ``%x``, ``%u``."""
    import getpass

    fields = {"j": job_id, "x": name, "u": getpass.getuser(), "%": "%"}
    return Path(re.sub(r"%([jxu%])", lambda m: fields[m.group(1)], pattern))
