"""A real SLURM for the tests: munged and slurmctld in this namespace, and one slurmd on each of
two hosts, ``h1`` and ``h2``: network namespaces with their own hostname and address on a
private bridge (hosts.py).

Nothing is installed and nothing global is touched: the cluster lives in a temporary directory
with its own ``slurm.conf`` (clients find it through ``SLURM_CONF``), its own munge key and socket
(``AuthInfo=socket=...``: a system munged and /etc/munge are neither needed nor touched), a
slurmctld port picked free at start, and pid files through which only the daemons started here
are stopped; whatever still runs on the hosts then is ended with them. Each slurmd listens on
SLURM's default port at its host's own address. Since the hosts are distinct, Open MPI needs no
tweak: its shared-memory transport joins the ranks of one host, TCP those of two. Each node
advertises two fake GPUs, device files standing in for ``/dev/nvidia*`` (there is no GPU here;
they carry /dev/null's device numbers), so that SLURM's own ``--gres=gpu`` bookkeeping and the
``CUDA_VISIBLE_DEVICES`` it sets are real.

The clients (``srun``, ``sbatch``, ...) run in this namespace and reach the daemons at their
addresses on the bridge; a batch script runs on its first host, and its ``srun`` from there.

The fixture skips the tests, with the reason, only when the SLURM, munge or namespace tools are
missing or namespaces cannot be created (not root, no kernel support).
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
from hosts import NamespaceError, Network, missing_tools

ROOT = Path(__file__).resolve().parents[2]
#: the hosts, each its own network namespace; also their SLURM node names
NODES = ("h1", "h2")
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
    network: Network
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
        return _logs(self.root)

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
        """Stop what this cluster started: its jobs, its daemons (by pid file), then whatever
        still runs on its hosts (job-step daemons, tasks) and the hosts themselves."""
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
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.network.stop()

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


def _logs(root: Path) -> str:
    """The last lines of every daemon's log."""
    parts = []
    for log in sorted(root.glob("log/*.log")):
        parts.append(f"--- {log.name} ---\n" + "\n".join(log.read_text().splitlines()[-15:]))
    return "\n".join(parts)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _write_config(root: Path, host: str, network: Network) -> Path:
    nodes = list(network.hosts)
    for sub in ("state", "log", "run", "dev", *(f"spool/{n}" for n in nodes),
                *(f"tmp/{n}" for n in nodes)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for i in range(GPUS_PER_NODE):
        # SLURM only accepts device nodes: give each fake GPU /dev/null's numbers.
        os.mknod(root / "dev" / f"nvidia{i}", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    ctld_port = _free_port()
    node_lines = "\n".join(
        f"NodeName={h.name} NodeAddr={h.address} "
        f"CPUs={CPUS_PER_NODE} RealMemory=4000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
        for h in network.hosts.values())
    conf = root / "slurm.conf"
    conf.write_text(textwrap.dedent(f"""\
        ClusterName=hvdtest
        SlurmctldHost={host}({network.gateway})
        SlurmctldPort={ctld_port}
        SlurmUser=root
        AuthType=auth/munge
        CredType=cred/munge
        # cred_expire: a requeued job waits this long before it may start (default 120 s)
        AuthInfo=socket={root}/munge/munge.sock,cred_expire=10
        MpiDefault=pmix
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
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
                           + _logs(root))


def start_cluster(nodes: tuple[str, ...] = NODES) -> SlurmCluster:
    """Start the hosts (``nodes``, also their names), munged, slurmctld and one slurmd per
    host; return once every node is idle. Raises NamespaceError when the hosts cannot be
    created."""
    root = Path(tempfile.mkdtemp(prefix="hvd-slurm-"))
    root.chmod(0o755)
    network = Network(nodes, root)
    try:
        network.start(socket.gethostname())
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    conf = _write_config(root, socket.gethostname(), network)
    cluster = SlurmCluster(root, conf, network)
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
        for host in network.hosts.values():
            # no -N: slurmd finds its node by the host's own name
            cluster.pids[f"slurmd-{host.name}"] = root / "run" / f"slurmd-{host.name}.pid"
            _start([*host.enter(), "slurmd", "-f", str(conf)], env, f"slurmd on {host.name}",
                   root)
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                                 text=True, env=env, timeout=30).stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            if all(states.get(n) == "idle" for n in nodes):
                return cluster
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM nodes not idle after 30 s: {states}\n{cluster.logs()}")
            time.sleep(0.2)
    except BaseException:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        raise


def _interrupt_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def slurm():
    missing = [name for name in DAEMONS + CLIENTS if _binary(name) is None]
    if missing:
        pytest.skip(f"SLURM/munge binaries not installed: {', '.join(missing)} "
                    "(`make sysdeps` installs slurmctld slurmd slurm-client munge)")
    if missing_tools():
        pytest.skip(f"namespace tools not installed: {', '.join(missing_tools())} "
                    "(iproute2, util-linux)")
    # A SIGTERM to pytest (a CI timeout) then ends the session through its teardown, which
    # stops the daemons and removes the hosts, instead of leaving them behind.
    previous = signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    try:
        try:
            cluster = start_cluster()
        except NamespaceError as exc:
            pytest.skip(f"cannot create the test cluster's hosts (network namespaces, "
                        f"needs root): {exc}")
        try:
            yield cluster
        finally:
            cluster.stop()
            shutil.rmtree(cluster.root, ignore_errors=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
