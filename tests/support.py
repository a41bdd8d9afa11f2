"""Helpers shared by the test packages. Parallel tests run real MPI processes:
``run_mpi(n, script)`` starts ``mpirun -np n python script`` and fails the test with every
rank's output when any rank fails or the job does not finish in time."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: variables that make ``init`` join a launcher's job instead of starting one of size 1
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "HOROVOD_", "TORCHELASTIC_")


def clean_env(extra: dict | None = None) -> dict:
    """This environment without any launcher's variables, with this checkout first on
    PYTHONPATH, and ``extra`` on top: a subprocess started with it runs as a job of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def leave_launchers(monkeypatch) -> None:
    """Remove every launcher's variables for this test: ``init`` starts a job of size 1."""
    for key in [k for k in os.environ if k.startswith(LAUNCHER_PREFIXES)]:
        monkeypatch.delenv(key)


@contextlib.contextmanager
def single_process_job(hvd, monkeypatch):
    """``hvd`` initialized as a job of size 1 (no MPI), shut down afterwards whatever the test
    did."""
    leave_launchers(monkeypatch)
    hvd.shutdown()
    hvd.init()
    try:
        yield hvd
    finally:
        hvd.shutdown()


def without_letting_go_of_the_gil(fn: Callable):
    """``fn()``, failing the test if it lets another Python thread run: a submission that
    releases the GIL lets the engine thread run a cycle in the middle of a batch of gradients.
    The switch interval is raised so that no forced switch happens meanwhile, and the garbage
    collector is off: a collection may finalize what earlier tests left (a torch tensor's
    deallocation can let go of the GIL), which is not the call's doing."""
    turns, stop = [0], threading.Event()

    def other_thread() -> None:
        while not stop.is_set():
            turns[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    thread = threading.Thread(target=other_thread)
    try:
        thread.start()
        time.sleep(0.001)  # the control: a call that lets go of the GIL lets the thread run
        before = turns[0]
        assert before > 0
        gc.disable()
        result = fn()
        assert turns[0] == before, "the call let another thread run: it released the GIL"
    finally:
        gc.enable()
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    return result


def mpi_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        # Two cores: keep MPI from spinning on shared memory while ranks share a core.
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    })
    # Unbuffered output makes print() two writes, and --tag-output then glues the next line's
    # tag to the text ("1.0e-03[1,0]<stdout>:"): workers flush whole lines instead.
    for key in [k for k in env if k.startswith(("SLURM_", "OMPI_COMM_WORLD", "PMI_"))
                or k == "PYTHONUNBUFFERED"]:
        env.pop(key)
    if extra:
        env.update(extra)
    return env


def native_or_skip():
    """hpc_horovod._native, for a test module that needs it: its module is skipped where no
    compiler could build it, and fails where one could but it was not built."""
    import shutil

    try:
        from hpc_horovod import _native
    except ImportError:
        if shutil.which("mpicc"):
            pytest.fail("hpc_horovod._native is not built although mpicc is here: run "
                        "`pip install -e .` or `python setup.py build_ext --inplace`",
                        pytrace=False)
        pytest.skip("no mpicc: the native extension cannot be built on this machine",
                    allow_module_level=True)
    return _native


def run_mpi(n: int, script, *args, timeout: float = 180, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` (a path) on ``n`` MPI ranks; return the finished process."""
    cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", "--tag-output",
           sys.executable, "-X", "faulthandler", str(script), *map(str, args)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=mpi_env(env), cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"mpirun -np {n} {script} did not finish in {timeout} s\n{out}\n{err}")
    if check and proc.returncode != 0:
        pytest.fail(f"mpirun -np {n} {script} exited with {proc.returncode}\n"
                    f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    return proc


# -- parallel checks as pytest modules --------------------------------------------------------
# A module of checks (``mpi_*.py``, not collected by the outer run) runs as
# ``mpirun -np N python -m pytest -p mpi_plugin <module>``: every rank runs the same checks in
# the same order, each rank writes one JSON line per test phase (mpi_plugin.py), and
# ``mpi_checks`` turns every (check, N) into a test of the outer run, which passes when the
# check passed on every rank.

#: per check, on each rank: a SIGALRM ends it (pytest-timeout, stacks of every thread printed)
CHECK_TIMEOUT_S = 120
#: the test of a run's exit status: 0 when every check passed, pytest's 1 when some failed; a
#: crash (a segmentation fault: 139), a rank killed, or a job stopped for a hang is none of these
EXIT = "exit_status"
_collected: dict[Path, list[str]] = {}
_runs: dict[tuple, dict] = {}


def _collect(module: Path) -> list[str]:
    """The checks of ``module``. Every ``mpi_*.py`` of its directory is collected at once, in
    one process of size 1 (a process that imports torch or TensorFlow takes seconds)."""
    if module not in _collected:
        modules = sorted(module.parent.glob("mpi_*.py"))
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                               "-p", "no:cacheprovider", *map(str, modules)],
                              capture_output=True, text=True, cwd=ROOT, env=clean_env(),
                              timeout=300)
        for path in modules:
            _collected[path] = []
        for line in proc.stdout.splitlines():
            if "::" in line:
                path, check = line.split("::", 1)
                _collected.setdefault((ROOT / path).resolve(), []).append(check)
        if not _collected.get(module):
            raise RuntimeError(f"no checks collected from {module}:\n{proc.stdout}\n"
                               f"{proc.stderr}")
    return _collected[module]


def _stacks(text: str) -> str:
    """The stack dumps in one rank's output: pytest-timeout's (between "+++ Timeout +++"
    lines) and faulthandler's watchdog ("Timeout (0:..)!" to the next blank line)."""
    found, inside = [], False
    for line in text.splitlines():
        if re.search(r"\++ Timeout \++$", line):
            inside = not inside
            found.append(line)
        elif inside or line.startswith(("Timeout (", "Fatal Python error")) or (found and (
                line.startswith(("Thread 0x", "Current thread 0x", "  File ")))):
            found.append(line)
        elif found and found[-1] != "":
            found.append("")
    return "\n".join(found)


def _run_checks(module: Path, n: int, env: dict | None, select: list[str], timeout: float,
                tmp: Path) -> dict:
    """One ``mpirun -np n`` of ``module`` (only the checks in ``select``, or all when empty):
    {"checks": {check: {rank: (status, text)}}, "out": {rank: output}, "tail": mpirun's}."""
    rank_var = "$OMPI_COMM_WORLD_RANK"
    targets = " ".join(f"'{module}::{c}'" for c in select) if select else f"'{module}'"
    program = (f"exec {sys.executable} -X faulthandler -m pytest -q -p no:cacheprovider "
               f"-p mpi_plugin --timeout={CHECK_TIMEOUT_S} --timeout-method=signal "
               f"-o timeout_func_only=true {targets} > {tmp}/out-{rank_var}.txt 2>&1")
    extra = {"HVD_CHECKS_REPORT": str(tmp / "report-{rank}.jsonl"),
             "PYTHONPATH": str(ROOT / "tests") + os.pathsep + str(ROOT)}
    proc = subprocess.Popen(["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none",
                             "sh", "-c", program], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=mpi_env({**(env or {}), **extra}), cwd=ROOT)
    try:
        tail, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # mpirun passes it on to the ranks
        try:
            tail, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            tail, _ = proc.communicate()
        tail = f"(mpirun stopped after {timeout} s)\n{tail}"
    checks: dict[str, dict[int, tuple[str, str]]] = {}
    out: dict[int, str] = {}
    for rank in range(n):
        path = tmp / f"out-{rank}.txt"
        out[rank] = path.read_text(errors="replace") if path.exists() else ""
        report = tmp / f"report-{rank}.jsonl"
        stacks = tmp / f"report-{rank}.jsonl.stacks"
        if stacks.exists() and stacks.stat().st_size:  # the watchdog ended this rank
            out[rank] += "\n" + stacks.read_text(errors="replace")
        for line in (report.read_text().splitlines() if report.exists() else []):
            try:
                phase = json.loads(line)
            except ValueError:  # a line cut short by a killed rank
                continue
            # a check has run once its call has a report, or its setup failed or skipped it
            status, text = checks.setdefault(phase["id"], {}).get(rank, ("unfinished", ""))
            if phase["when"] == "call" and phase["outcome"] == "passed" and status == "unfinished":
                status = "passed"
            if phase["outcome"] == "failed":
                status, text = "failed", f"{text}\n[{phase['when']}] {phase['text']}".strip()
            elif phase["outcome"] == "skipped" and status in ("passed", "unfinished"):
                status = "xfailed" if phase["xfail"] is not None else "skipped"
                text = phase["xfail"] or phase["text"]
            checks[phase["id"]][rank] = (status, text)
    return {"checks": checks, "out": out, "tail": (tail or "")[-4000:],
            "returncode": proc.returncode}


def mpi_checks(module, ranks=(2, 3, 4), *, env: dict | None = None, timeout: float = 900,
               only: list[str] | None = None):
    """A test function for the outer run: one test per (N in ``ranks``, check of ``module``),
    with ``module`` run once per N under ``mpirun -np N`` (``env`` on top of mpi_env's; the
    whole job stopped after ``timeout`` s). A check passes when it passed on every rank; a check
    that failed shows every rank's failure (and, after a timeout, every rank's stacks); an
    expected failure (``xfail(strict=True)``) on every rank is one here too. Assign it to a
    ``test_*`` name: ``test_ops = mpi_checks(HERE / "mpi_ops.py")``. ``only``: these checks
    of the module, not all."""
    module = Path(module).resolve()
    ids = _collect(module)
    if only is not None:
        assert set(only) <= set(ids), set(only) - set(ids)
        ids = [c for c in ids if c in only]
    key_env = tuple(sorted((env or {}).items())) + (tuple(only or ()),)

    @pytest.mark.mpi
    @pytest.mark.parametrize("check", [*ids, EXIT])
    @pytest.mark.parametrize("ranks", ranks, ids=lambda n: f"np{n}")
    def test(ranks, check, request, tmp_path_factory):
        key = (module, ranks, key_env)
        if key not in _runs:
            # only the checks this session selected at this N (all of them, normally)
            wanted = {item.callspec.params["check"] for item in request.session.items
                      if getattr(item, "function", None) is request.function
                      and item.callspec.params["ranks"] == ranks}
            select = ([] if wanted >= set(ids) and only is None
                      else [c for c in ids if c in wanted])
            _runs[key] = _run_checks(module, ranks, env, select, timeout,
                                     tmp_path_factory.mktemp(f"{module.stem}-np{ranks}"))
        run = _runs[key]
        if check == EXIT:
            failed = any(status == "failed" for outcome in run["checks"].values()
                         for status, _ in outcome.values())
            assert run["returncode"] == (1 if failed else 0), (
                f"mpirun -np {ranks} {module.name} ended with exit status {run['returncode']} "
                f"(its checks {'failed' if failed else 'passed'}): a rank crashed, hung or "
                f"ended badly\n{run['tail']}")
            return
        by_rank = run["checks"].get(check, {})
        where = f"{module.name}::{check} under mpirun -np {ranks}"
        missing = [r for r in range(ranks) if by_rank.get(r, ("unfinished",))[0] == "unfinished"]
        problems = [f"rank {r} did not run it or did not finish it" for r in missing]
        problems += [f"--- rank {r}: {status}\n{text}" for r, (status, text) in
                     sorted(by_rank.items()) if status == "failed"]
        statuses = {status for status, _ in by_rank.values()}
        if not problems and len(statuses) > 1:
            problems = [f"the ranks disagree: {sorted(by_rank.items())}"]
        if problems:
            stacks = [f"--- rank {r}'s stacks\n{s}" for r in range(ranks)
                      if (s := _stacks(run["out"][r]))]
            tail = [f"--- mpirun (exit {run['returncode']})\n{run['tail']}"] if missing else []
            pytest.fail(f"{where}\n" + "\n".join(problems + stacks + tail), pytrace=False)
        if statuses == {"xfailed"}:
            pytest.xfail(by_rank[0][1])
        if statuses == {"skipped"}:
            pytest.skip(by_rank[0][1])

    return test
