"""What a benchmark result needs to be read later: the machine, the versions, the command and
the date, recorded in every JSON under ``benchmarks/results/``."""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: per-repetition timings (not committed)
RAW = ROOT / "benchmarks" / "out"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    """The installed version of ``module``'s distribution, read without importing it (which
    takes seconds for TensorFlow); None when it is not installed."""
    for dist in importlib.metadata.packages_distributions().get(module, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - any import failure means "not installed here"
        return None


def _mpi_library() -> str | None:
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()


def _module_dir(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    return str(Path(spec.origin).parent) if spec and spec.origin else None


def _commit(path: Path) -> str | None:
    proc = subprocess.run(["git", "-C", str(path), "describe", "--always", "--dirty"],
                          capture_output=True, text=True)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def describe(command: str, modules: tuple[str, ...] = ("numpy", "torch", "mpi4py")) -> dict:
    """The machine, the software and ``command``, as the ``meta`` of a result."""
    try:
        from hpc_horovod import _native

        kernels = _native.kernels()
    except ImportError:
        kernels = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "command": command,
        "commit": _commit(ROOT),
        "versions": {"python": platform.python_version(),
                     **{m: _version(m) for m in modules},
                     "mpi": _mpi_library(),
                     "hpc_horovod": _version("hpc_horovod"),
                     "hpc_horovod from": _module_dir("hpc_horovod"),
                     "hpc_horovod._native": kernels},
    }


def command_line(prefix: str = "python") -> str:
    """This process's command, with the script relative to the checkout."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return " ".join([prefix, str(script), *sys.argv[1:]])
