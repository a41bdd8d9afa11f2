"""``hpc-horovod run --min-np N --max-np M``: elastic training, restarted on what is left.

MPI cannot shrink a world in place. When a rank is lost (killed, out of memory, its node
failed), the other ranks end by themselves with a record that asks for a restart
(:mod:`hpc_horovod.common.elastic`), and this launcher starts the job's ranks again on what is
left: without the lost ranks (outside SLURM), or on the allocation's nodes without the lost
ranks' nodes (inside one, one ``srun`` step per attempt). The script resumes from the last
``state.commit()``, which rank 0 wrote to ``HOROVOD_ELASTIC_DIR``. The launcher stops with a
message naming what was lost when fewer than ``--min-np`` ranks could run, when
``--reset-limit`` restarts were made, or when a rank failed on an error of its own (a restart
would fail the same way).

``HOROVOD_ELASTIC_DIR`` must be seen by every node: by default
``$SLURM_SUBMIT_DIR/.hpc_horovod/elastic/$SLURM_JOB_ID`` inside a SLURM job (a requeued job
resumes from the same commit), a new temporary directory otherwise. A default directory is
removed once the training ended well, unless the run requeued its job (``requeue_job``, which
``requeue_on_signal`` calls, marks it): the next run of the job starts from it. One given by
the user is left as it is. A requeue is no elastic reset: the next run counts its resets
(``--reset-limit``) from zero.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import hostlist

from .common.elastic import COMMIT_FILE, RANKS_DIR, REQUEUED_FILE, WORLD_FILE
from .launch import Launch, _hosts, build_command, launcher_env

#: how long the ranks may take to end after one of them asked for a restart (Horovod's
#: ``--elastic-timeout`` default)
ELASTIC_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Elastic:
    """The elastic bounds: at least ``min_np`` ranks, at most ``max_np``, at most
    ``reset_limit`` restarts (None: no limit)."""

    min_np: int
    max_np: int
    reset_limit: int | None = None
    timeout_s: float = ELASTIC_TIMEOUT_S

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Elastic:
        min_np = args.min_np if args.min_np is not None else args.np
        max_np = args.max_np if args.max_np is not None else args.np
        timeout = args.elastic_timeout if args.elastic_timeout is not None else ELASTIC_TIMEOUT_S
        return cls(min_np, max_np, args.reset_limit, timeout)

    def check(self, np_: int) -> None:
        if not 1 <= self.min_np <= np_ <= self.max_np:
            raise ValueError(f"elastic training needs 1 <= --min-np <= -np <= --max-np, got "
                             f"--min-np {self.min_np}, -np {np_}, --max-np {self.max_np}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError(f"--reset-limit must be >= 0, got {self.reset_limit}")
        if self.timeout_s <= 0:
            raise ValueError(f"--elastic-timeout must be positive, got {self.timeout_s:g}")


@dataclass
class Outcome:
    """How one attempt ended, from the ranks' records."""

    hosts: list[str]  # by rank
    records: dict[int, dict]

    @property
    def lost(self) -> list[int]:
        return [r for r in range(len(self.hosts)) if r not in self.records]

    def with_status(self, status: str) -> list[int]:
        return sorted(r for r, rec in self.records.items() if rec.get("status") == status)


def _say(text: str) -> None:
    print(f"[hpc_horovod] elastic: {text}", file=sys.stderr, flush=True)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _in_allocation(launch: Launch, env) -> bool:
    return ("SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env and not launch.hosts
            and not launch.hostfile and not launch.no_srun and shutil.which("srun") is not None)


def elastic_directory(launch: Launch, env) -> tuple[Path, bool]:
    """``HOROVOD_ELASTIC_DIR`` and whether it is a default this launcher owns."""
    given = env.get("HOROVOD_ELASTIC_DIR")
    if given:
        return Path(given), False
    if "SLURM_JOB_ID" in env:
        base = Path(env.get("SLURM_SUBMIT_DIR") or os.getcwd())
        return base / ".hpc_horovod" / "elastic" / env["SLURM_JOB_ID"], True
    if launch.hosts or launch.hostfile:
        raise ValueError("elastic training on several hosts needs HOROVOD_ELASTIC_DIR: a "
                         "directory every host sees (the last commit is written there)")
    return Path(tempfile.mkdtemp(prefix="hpc_horovod-elastic-")), True


def allocation_nodes(env) -> list[str]:
    """The nodes of this SLURM allocation, expanded as topology.py expands a step's."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return hostlist.expand_hostlist(nodelist) if nodelist else []


def read_outcome(directory: Path) -> Outcome | None:
    """The attempt's records; None when no rank reached ``hvd.elastic.run``."""
    ranks = directory / RANKS_DIR
    try:
        hosts = json.loads((ranks / WORLD_FILE).read_text())["hosts"]
    except FileNotFoundError:
        return None
    records = {}
    for path in ranks.glob("*.json"):
        if path.stem.isdigit():
            records[int(path.stem)] = json.loads(path.read_text())
    return Outcome(hosts, records)


def _wait(proc: subprocess.Popen, directory: Path, timeout_s: float) -> int:
    """Wait for the attempt; once a rank asked for a restart, ``timeout_s`` more at most."""
    asked = None
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if asked is None:
            if any(p.stem.isdigit() for p in (directory / RANKS_DIR).glob("*.json")):
                asked = time.monotonic()
        elif time.monotonic() - asked > timeout_s:
            _say(f"the ranks did not end within {timeout_s:g} s of the first one's record "
                 "(--elastic-timeout): ending them")
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                return proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                return proc.wait()


def run_elastic(launch: Launch, elastic: Elastic, extra_env=None, verbose: bool = False) -> int:
    """Run ``launch`` elastically (see the module's docstring), with ``extra_env`` in the
    ranks' environment; the exit status."""
    elastic.check(launch.np)
    env = launcher_env(extra_env)
    directory, owned = elastic_directory(launch, env)
    env["HOROVOD_ELASTIC_DIR"] = str(directory)
    in_allocation = _in_allocation(launch, env)
    nodes = allocation_nodes(env) if in_allocation else []
    hosts = _hosts(launch)
    attempt = replace(launch, elastic=True, np=min(launch.np, elastic.max_np))
    lost_hosts: list[str] = []
    lost_count = resets = 0
    (directory / REQUEUED_FILE).unlink(missing_ok=True)  # a mark of the job's previous run

    def stop(text: str, status: int) -> int:
        """The end of a training that did not finish: say why, and where its commit is."""
        if (directory / COMMIT_FILE).exists():
            text += f". The last commit stays in {directory}"
        elif owned:
            shutil.rmtree(directory, ignore_errors=True)
        _say(text)
        return status or 1
    while True:
        shutil.rmtree(directory / RANKS_DIR, ignore_errors=True)
        (directory / RANKS_DIR).mkdir(parents=True, exist_ok=True)
        cmd = build_command(attempt, env)
        if verbose:
            print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            status = _wait(proc, directory, elastic.timeout_s)
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        outcome = read_outcome(directory)
        if outcome is None:
            return stop("no rank reached hvd.elastic.run (see the ranks' output above): elastic "
                        "training needs the training in a function decorated with "
                        "hvd.elastic.run", status)
        if not outcome.lost and len(outcome.with_status("done")) == len(outcome.hosts):
            if (directory / REQUEUED_FILE).exists():
                _say(f"the job was requeued: its next run resumes from the last commit, which "
                     f"stays in {directory}")
                return 0
            if owned:
                shutil.rmtree(directory, ignore_errors=True)
            return 0
        failed = outcome.with_status("failed")
        if failed:
            reason = outcome.records[failed[0]].get("reason", "")
            return stop(f"rank(s) {_ranks(failed)} failed on an error of the script ({reason}); "
                        "no restart: it would fail the same way", status)
        restart = outcome.with_status("restart")
        lost = outcome.lost
        if not restart:
            return stop(f"rank(s) {_ranks(lost)} ended without a record (lost, or killed by the "
                        "launcher) and no rank asked for a restart: stopping", status)
        new_lost_hosts = sorted({outcome.hosts[r] for r in lost} - set(lost_hosts))
        lost_hosts += new_lost_hosts
        lost_count += len(lost)
        where = f" on host(s) {', '.join(new_lost_hosts)}" if new_lost_hosts else ""
        what = f"lost rank(s) {_ranks(lost)}{where}" if lost else "hosts updated"
        if in_allocation:
            left = [n for n in nodes if n not in lost_hosts]
            per_node = max(outcome.hosts.count(h) for h in set(outcome.hosts))
            np_ = min(elastic.max_np, per_node * len(left))
            attempt = replace(attempt, np=np_, exclude=tuple(sorted(set(nodes) - set(left))),
                              nodes=len(left) or None)
        elif hosts:
            left = [(h, s) for h, s in hosts if h not in lost_hosts]
            np_ = min(elastic.max_np, attempt.np - len(lost), sum(s for _, s in left))
            attempt = replace(attempt, np=np_, hosts=",".join(f"{h}:{s}" for h, s in left),
                              hostfile=None)
        else:
            np_ = min(elastic.max_np, attempt.np - len(lost))
            attempt = replace(attempt, np=np_)
        everything = (f"{lost_count} rank(s) lost in all"
                      + (f", host(s) {', '.join(lost_hosts)}" if lost_hosts else ""))
        if np_ < elastic.min_np:
            return stop(f"{what}; only {np_} process(es) could run, fewer than --min-np "
                        f"{elastic.min_np}: stopping ({everything})", status)
        if elastic.reset_limit is not None and resets >= elastic.reset_limit:
            return stop(f"{what}; the reset limit ({elastic.reset_limit}) is reached: stopping "
                        f"({everything})", status)
        resets += 1
        _say(f"{what}; restarting {np_} process(es) from the last commit (reset {resets}"
             + (f" of at most {elastic.reset_limit}" if elastic.reset_limit is not None else "")
             + ")")
