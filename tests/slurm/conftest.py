"""A real SLURM for the tests: munged + slurmctld + two slurmd ("nodes" n1 and n2) on loopback.

Nothing is installed and nothing global is touched: the cluster lives in a temporary directory
with its own ``slurm.conf`` (clients find it through ``SLURM_CONF``), its own munge key and socket
(``AuthInfo=socket=...``: a system munged and /etc/munge are neither needed nor touched), ports
picked free at start, and pid files through which only the daemons started here are stopped.
Both nodes run on this host: they share its hostname, so a TaskProlog makes Open MPI use TCP
between ranks (its shared-memory transport keys on the hostname). Each node advertises two fake
GPUs, device files standing in for ``/dev/nvidia*`` (there is no GPU here; they carry /dev/null's
device numbers), so that SLURM's own ``--gres=gpu`` bookkeeping and the ``CUDA_VISIBLE_DEVICES``
it sets are real.

The fixture skips the tests, with the reason, only when the SLURM or munge binaries are missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODES = ("n1", "n2")
CPUS_PER_NODE = 4
GPUS_PER_NODE = 2
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin")


@dataclass
class SlurmCluster:
    """A running test cluster. ``env()`` is the environment every client call must use."""

    root: Path
    conf: Path
    pids: dict[str, Path] = field(default_factory=dict)

    def env(self, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SRUN_", "SBATCH_", "OMPI_COMM_WORLD", "PMI_",
                                    "PMIX_", "HOROVOD_"))}
        env.update({
            "SLURM_CONF": str(self.conf),
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_mpi_yield_when_idle": "1",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        })
        env.update(extra or {})
        return env

    def run(self, args: list[str], timeout: float = 60, check: bool = False,
            env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run a SLURM client (or any command) against this cluster, bounded in time."""
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                                  env=self.env(env), cwd=cwd or self.root)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{args} did not finish in {timeout} s\n{exc.stdout}\n{exc.stderr}\n"
                        f"{self.logs()}")
        if check and proc.returncode != 0:
            pytest.fail(f"{args} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout}\n"
                        f"--- stderr ---\n{proc.stderr}")
        return proc

    def job_state(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, RestartCnt, ExitCode, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=True).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_job(self, job_id: str, timeout: float, until=("COMPLETED", "FAILED", "CANCELLED",
                                                             "TIMEOUT", "NODE_FAIL")) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job_id)
            if state.get("JobState") in until:
                return state
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id} still {state.get('JobState')} after {timeout} s: "
                            f"{state}\n{self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        parts = []
        for log in sorted(self.root.glob("log/*.log")):
            parts.append(f"--- {log.name} ---\n" + "\n".join(log.read_text().splitlines()[-15:]))
        return "\n".join(parts)

    def submit_and_wait(self, script: Path, timeout: float = 60, env: dict | None = None
                        ) -> tuple[int, dict[str, str]]:
        """``sbatch`` a job script from its directory, wait for the job to end; return its exit
        status and final ``scontrol`` record.

        The same as ``sbatch --wait``, with a short poll instead of its back-off (up to 10 s).
        """
        proc = self.run(["sbatch", "--parsable", str(script)], cwd=script.parent, check=True,
                        env=env)
        record = self.wait_job(proc.stdout.strip().split(";")[0], timeout)
        return int(record["ExitCode"].split(":")[0]), record

    def stop(self) -> None:
        """Stop what this cluster started: its jobs, its daemons (by pid file), and any job-step
        daemon (slurmstepd) of its slurmd that outlives them."""
        self._drain()
        pids = []
        for path in self.pids.values():
            try:
                pid = int(path.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            pids.append(pid)
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if _alive(pid)]
            time.sleep(0.05)
        for pid in pids + self._stray_stepds():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _drain(self, timeout: float = 15) -> None:
        """Cancel this cluster's jobs and wait (bounded) until no node is busy with one."""
        def client(*args) -> str:
            try:
                return subprocess.run(args, capture_output=True, text=True, env=self.env(),
                                      timeout=30).stdout
            except (OSError, subprocess.TimeoutExpired):
                return ""
        jobs = client("squeue", "-h", "-o", "%i").split()
        if jobs:
            client("scancel", *jobs)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = client("sinfo", "-h", "-N", "-o", "%t").split()
            if not client("squeue", "-h").strip() and all(s == "idle" for s in states):
                return
            time.sleep(0.2)

    def _stray_stepds(self) -> list[int]:
        """slurmstepd processes spawned by this cluster's slurmd (their SLURM_CONF is ours)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if (proc / "cmdline").read_bytes().startswith(b"slurmstepd") and \
                        mark in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
        return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _write_config(root: Path, host: str) -> Path:
    for sub in ("state", "log", "run", "dev", *(f"spool/{n}" for n in NODES),
                *(f"tmp/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for i in range(GPUS_PER_NODE):
        # SLURM only accepts device nodes: give each fake GPU /dev/null's numbers.
        os.mknod(root / "dev" / f"nvidia{i}", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    prolog = root / "task_prolog.sh"
    prolog.write_text(textwrap.dedent("""\
        #!/bin/sh
        # Both fake nodes share one hostname: keep Open MPI off its shared-memory transport.
        echo "export OMPI_MCA_btl=self,tcp"
        """))
    prolog.chmod(0o755)
    ctld_port = _free_port()
    node_lines = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
        f"CPUs={CPUS_PER_NODE} RealMemory=4000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
        for n in NODES)
    conf = root / "slurm.conf"
    conf.write_text(textwrap.dedent(f"""\
        ClusterName=hvdtest
        SlurmctldHost={host}(127.0.0.1)
        SlurmctldPort={ctld_port}
        SlurmUser=root
        AuthType=auth/munge
        CredType=cred/munge
        # cred_expire: a requeued job waits this long before it may start (default 120 s)
        AuthInfo=socket={root}/munge/munge.sock,cred_expire=10
        MpiDefault=pmix
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        TaskProlog={prolog}
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        SlurmdParameters=config_overrides
        EnforcePartLimits=ALL
        GresTypes=gpu
        ReturnToService=2
        KillWait=5
        MinJobAge=600
        StateSaveLocation={root}/state
        SlurmdSpoolDir={root}/spool/%n
        SlurmctldPidFile={root}/run/slurmctld.pid
        SlurmdPidFile={root}/run/slurmd-%n.pid
        SlurmctldLogFile={root}/log/slurmctld.log
        SlurmdLogFile={root}/log/slurmd-%n.log
        TmpFS={root}/tmp/%n
        SchedulerParameters=sched_interval=1
        {node_lines}
        PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
        """))
    (root / "gres.conf").write_text(
        f"Name=gpu File={root}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n")
    return conf


def _start(cmd: list[str], env: dict, what: str, root: Path) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"could not start {what}: {proc.stdout}{proc.stderr}\n"
                           + SlurmCluster(root, root / "slurm.conf").logs())


def start_cluster() -> SlurmCluster:
    """Start munged, slurmctld and one slurmd per node; return once every node is idle."""
    root = Path(tempfile.mkdtemp(prefix="hvd-slurm-"))
    root.chmod(0o755)
    host = socket.gethostname()
    conf = _write_config(root, host)
    cluster = SlurmCluster(root, conf)
    munge_dir = root / "munge"
    munge_dir.mkdir(mode=0o755)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    env = cluster.env()
    try:
        cluster.pids["munged"] = munge_dir / "munged.pid"
        _start(["munged", f"--socket={munge_dir}/munge.sock", f"--key-file={key}",
                f"--pid-file={munge_dir}/munged.pid", f"--log-file={root}/log/munged.log",
                f"--seed-file={munge_dir}/munged.seed"], env, "munged", root)
        cluster.pids["slurmctld"] = root / "run" / "slurmctld.pid"
        _start(["slurmctld", "-f", str(conf)], env, "slurmctld", root)
        for node in NODES:
            cluster.pids[f"slurmd-{node}"] = root / "run" / f"slurmd-{node}.pid"
            _start(["slurmd", "-f", str(conf), "-N", node], env, f"slurmd {node}", root)
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                                 text=True, env=env, timeout=30).stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            if all(states.get(n) == "idle" for n in NODES):
                return cluster
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM nodes not idle after 30 s: {states}\n{cluster.logs()}")
            time.sleep(0.2)
    except BaseException:
        cluster.stop()
        raise


@pytest.fixture(scope="session")
def slurm():
    missing = [name for name in DAEMONS + CLIENTS if _binary(name) is None]
    if missing:
        pytest.skip(f"SLURM/munge binaries not installed: {', '.join(missing)} "
                    "(`make sysdeps` installs slurmctld slurmd slurm-client munge)")
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
