"""``hpc_horovod.run(fn, args, kwargs, np=N)``: a Python function on N ranks, from Python.

The function and its arguments travel by cloudpickle (a function defined in a notebook cell
too) through a folder every rank can read. Each rank, started by ``hpc-horovod run``'s launcher
(``mpirun`` here, ``srun`` inside a SLURM allocation) with :func:`worker_command`, loads them,
calls ``fn(*args, **kwargs)`` and writes what it returned, or the exception it raised, to
``FOLDER/rank-<r>.pkl``. The caller gets the list of return values in rank order, or the first
failing rank's exception, re-raised with a note naming the rank and showing that rank's
traceback. :func:`hpc_horovod.slurm.submit` uses the same folder layout for a batch job.

The function calls ``hvd.init()`` itself (``run`` does not), as a script run by
``horovodrun`` does. A rank whose function raises stops its peers as a script's uncaught
exception does: they learn its error, not a bare shutdown.

cloudpickle ships a function's code without its file name (``<dynamic-code>``); the payload
carries the names of the files its functions come from, so that a rank's traceback names the
file and line of each frame.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import cloudpickle

from .checkpoint import atomic_write
from .launch import Launch, build_command, launcher_env

PAYLOAD = "payload.pkl"


def worker_command(folder: Path, executable: str | None = None) -> tuple[str, ...]:
    """The command of one rank: it imports the caller's hpc_horovod (its directory goes on
    ``sys.path`` when it is not there) and runs :func:`main` (no ``-m`` module: the package
    imports this one)."""
    code = (f"import sys; root = {package_root()!r}; "
            "sys.path.insert(0, root) if root not in sys.path else None; "
            "from hpc_horovod.runner import main; sys.exit(main(sys.argv[1:]))")
    return (executable or sys.executable, "-c", code, str(folder))


def package_root() -> str:
    """The directory holding the ``hpc_horovod`` package that runs here."""
    return str(Path(__file__).resolve().parents[1])


def write_payload(folder: Path, fn: Callable, args: Sequence = (),
                  kwargs: Mapping[str, Any] | None = None) -> Path:
    """Pickle ``fn``, its arguments and this interpreter's ``sys.path`` into ``folder``."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list of arguments, got {args!r}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict, got {kwargs!r}")
    payload = (fn, tuple(args), dict(kwargs or {}), list(sys.path), code_files(fn))
    try:
        data = cloudpickle.dumps(payload)
    except Exception as exc:
        raise TypeError(f"{getattr(fn, '__name__', fn)!r} or its arguments cannot be pickled "
                        f"to reach the ranks: {exc}") from exc
    return atomic_write(folder / PAYLOAD, lambda fh: fh.write(data))


def _functions(fn: Callable):
    """``fn`` and the functions it closes over or calls by global name, transitively (what
    cloudpickle may ship by value with it)."""
    seen: set[int] = set()
    pending: list = [fn]
    while pending:
        item = pending.pop()
        if isinstance(item, types.MethodType):
            item = item.__func__
        if not isinstance(item, types.FunctionType) or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        pending.extend(cell.cell_contents for cell in item.__closure__ or () if _filled(cell))
        pending.extend(item.__globals__.get(name) for name in item.__code__.co_names)


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def code_files(fn: Callable) -> dict[str, str]:
    """Function name -> the file it was written in, for the code that travels with ``fn``
    (a name found in two files is left out)."""
    found: dict[str, set[str]] = {}
    for function in _functions(fn):
        for code in _codes(function.__code__):
            found.setdefault(code.co_name, set()).add(code.co_filename)
    return {name: files.pop() for name, files in found.items() if len(files) == 1}


def _named(code: types.CodeType, files: Mapping[str, str]) -> types.CodeType:
    consts = tuple(_named(c, files) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    filename = files.get(code.co_name, code.co_filename) \
        if code.co_filename == "<dynamic-code>" else code.co_filename
    return code.replace(co_filename=filename, co_consts=consts)


def restore_files(fn: Callable, files: Mapping[str, str]) -> None:
    """Give the code cloudpickle shipped (file name ``<dynamic-code>``) its file back, so that
    tracebacks name each frame's file and line (and show it, where the file is readable)."""
    for function in _functions(fn):
        function.__code__ = _named(function.__code__, files)


def rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.pkl"


def _outcome_bytes(rank: int, ok: bool, value: Any, trace: str) -> bytes:
    """What a rank leaves behind, pickled; what cannot be pickled becomes a RuntimeError."""
    try:
        return cloudpickle.dumps((ok, value, trace))
    except Exception as exc:
        what = "return value" if ok else f"exception {type(value).__name__}: {value}"
        return cloudpickle.dumps((False, RuntimeError(
            f"rank {rank}'s {what} cannot be pickled back: {exc}"), trace))


def worker(folder: Path) -> int:
    """One rank: run the pickled function and write its outcome; 0 when it returned, its
    exception raised again when it raised."""
    from .common import topology

    rank = topology.detect().rank
    with open(folder / PAYLOAD, "rb") as fh:
        data = fh.read()
    fn, args, kwargs, paths, files = _load(data, folder / PAYLOAD)
    sys.path.extend(p for p in paths if p not in sys.path)
    restore_files(fn, files)
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: B036 (a SystemExit or interrupt is an outcome too)
        data = _outcome_bytes(rank, False, exc, traceback.format_exc())
        atomic_write(rank_file(folder, rank), lambda fh: fh.write(data))
        # As a script's uncaught exception: printed here, then the peers learn why this rank
        # stops (hvd's excepthook) and the process ends, non-zero.
        raise
    data = _outcome_bytes(rank, True, value, "")
    atomic_write(rank_file(folder, rank), lambda fh: fh.write(data))
    return 0


def _load(data: bytes, where: Path):
    try:
        return cloudpickle.loads(data)
    except Exception as exc:
        raise RuntimeError(f"{where} cannot be unpickled here ({type(exc).__name__}: {exc}): "
                           "the ranks need the modules the function uses") from exc


def collect(folder: Path, size: int, failure: str | None = None) -> list:
    """The return values of ranks 0..size-1, or the first failing rank's exception re-raised
    with a note naming the rank and showing its traceback.

    "First" is the lowest rank among those whose exception is their own: a
    ``HorovodInternalError`` is what the other ranks get once one has failed, so it counts only
    when no rank raised anything else. ``failure`` says how the launch ended when it did not end
    well; ranks without a result then make a RuntimeError that says it.
    """
    from .common.errors import HorovodInternalError

    outcomes: dict[int, tuple[bool, Any, str]] = {}
    for rank in range(size):
        path = rank_file(folder, rank)
        if path.exists():
            outcomes[rank] = _load(path.read_bytes(), path)
    failed = sorted((isinstance(value, HorovodInternalError), rank)
                    for rank, (ok, value, _) in outcomes.items() if not ok)
    if failed:
        rank = failed[0][1]
        _, value, trace = outcomes[rank]
        if not isinstance(value, BaseException):
            value = RuntimeError(repr(value))
        others = ", ".join(f"{r} ({type(outcomes[r][1]).__name__})" for _, r in failed[1:])
        value.add_note(f"raised on rank {rank} of {size}"
                       + (f" (ranks that failed too: {others})" if others else "")
                       + "; that rank's traceback:\n" + trace.rstrip())
        raise value
    missing = [rank for rank in range(size) if rank not in outcomes]
    if missing or failure:
        listing = ", ".join(map(str, missing)) or "none"
        raise RuntimeError(f"{failure or 'the ranks ended'}; ranks without a result: {listing}")
    return [outcomes[rank][1] for rank in range(size)]


def _pump(source: IO[str], sink: IO[str]) -> None:
    for line in source:
        sink.write(line)
        sink.flush()


def run(fn: Callable, args: Sequence = (), kwargs: Mapping[str, Any] | None = None, np: int = 1,
        *, hosts: str | None = None, hostfile: str | None = None, mpi_args: str | None = None,
        env: Mapping[str, str] | None = None, executable: str | None = None,
        workdir: str | os.PathLike | None = None, verbose: bool = False) -> list:
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks; the list of their return values, by rank.

    The ranks start as ``hpc-horovod run -np N`` starts them (``mpirun`` on this machine or the
    ``hosts``/``hostfile`` given, ``srun`` inside a SLURM allocation), with ``env`` added to
    their environment and ``executable`` (default: this interpreter) as their Python; their
    output is printed here as it comes. An exception in a rank is re-raised here, the lowest
    failing rank's, with a note naming the rank and its traceback; a rank that ends without a
    result (killed, or stopped by another's failure) is a RuntimeError.

    The function and results pass through a temporary folder in ``workdir``: by default the
    system's temporary directory on one machine, the current directory (which must be shared
    with the other nodes) when the ranks run elsewhere.
    """
    run_env = launcher_env(env)
    elsewhere = bool(hosts or hostfile or "SLURM_JOB_ID" in run_env)
    folder = Path(tempfile.mkdtemp(prefix="hpc_horovod-run-",
                                   dir=workdir or (os.getcwd() if elsewhere else None)))
    try:
        write_payload(folder, fn, args, kwargs)
        launch = Launch(np=np, command=worker_command(folder, executable), hosts=hosts,
                        hostfile=hostfile, mpi_args=mpi_args)
        cmd = build_command(launch, run_env)
        if verbose:
            print("+ " + subprocess.list2cmdline(cmd), file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd, env=run_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace")
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr, sys.stderr), daemon=True)]
        for pump in pumps:
            pump.start()
        try:
            code = proc.wait()
        except BaseException:
            proc.terminate()  # mpirun and srun pass it on to the ranks
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        finally:
            for pump in pumps:
                pump.join(timeout=10)
        return collect(folder, np, None if code == 0 else f"{cmd[0]} exited with status {code}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: Sequence[str]) -> int:
    """A rank's entry point: ``main([FOLDER])``."""
    if len(argv) != 1 or not (Path(argv[0]) / PAYLOAD).is_file():
        print(f"hpc_horovod.runner: expected the folder of a {PAYLOAD}, got {list(argv)}",
              file=sys.stderr)
        return 2
    return worker(Path(argv[0]))
