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
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import cloudpickle

from .checkpoint import atomic_write
from .launch import Launch, build_command, launcher_env

PAYLOAD = "payload.pkl"
#: a payload above this many bytes is worth a warning: every job writes it, every rank reads it
PAYLOAD_WARN_BYTES = 64 * 2**20


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
                  kwargs: Mapping[str, Any] | None = None, *,
                  calls: Sequence[Sequence] | None = None) -> Path:
    """Pickle ``fn``, its arguments and this interpreter's ``sys.path`` into ``folder``.

    ``calls``: the arguments of each element of a job array, instead of ``args``; element ``i``
    (``SLURM_ARRAY_TASK_ID``) calls ``fn(*calls[i], **kwargs)`` and writes its results in
    ``folder/<i>``. A payload above :data:`PAYLOAD_WARN_BYTES` is written with a warning that
    says what it holds.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    array = calls is not None
    for what, value in ([(f"calls[{i}]", c) for i, c in enumerate(calls)] if array
                        else [("args", args)]):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(f"{what} must be a tuple or list of arguments, got {value!r}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a dict, got {kwargs!r}")
    arguments = [tuple(c) for c in calls] if array else [tuple(args)]
    payload = (fn, arguments, dict(kwargs or {}), list(sys.path), code_files(fn), array)
    try:
        data = cloudpickle.dumps(payload)
    except Exception as exc:
        raise TypeError(f"{getattr(fn, '__name__', fn)!r} or its arguments cannot be pickled "
                        f"to reach the ranks: {exc}") from exc
    if len(data) > PAYLOAD_WARN_BYTES:
        warnings.warn(payload_warning(len(data), folder, fn, arguments, kwargs or {}),
                      stacklevel=3)
    return atomic_write(folder / PAYLOAD, lambda fh: fh.write(data))


def _mb(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


def captured(fn: Callable, calls: Sequence[tuple], kwargs: Mapping[str, Any]
             ) -> list[tuple[str, int]]:
    """What a payload carries, each with its pickled size, largest first: the arguments, and
    the closure variables and globals of the functions that travel by value (those of
    ``__main__``, a notebook's, or of a module the ranks could not import)."""
    items: dict[str, Any] = {}
    for i, args in enumerate(calls):
        prefix = f"calls[{i}]" if len(calls) > 1 else "args"
        items.update((f"{prefix}[{j}]", value) for j, value in enumerate(args))
    items.update((f"kwargs[{key!r}]", value) for key, value in kwargs.items())
    for function in _functions(fn):
        if function.__module__ != "__main__" and function.__module__ in sys.modules:
            continue
        code = function.__code__
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            if _filled(cell) and not callable(cell.cell_contents):
                items[f"{name} (closed over by {function.__name__})"] = cell.cell_contents
        for name in code.co_names:
            value = function.__globals__.get(name)
            if value is not None and not callable(value) and not isinstance(value,
                                                                             types.ModuleType):
                items[f"global {name} (used by {function.__name__})"] = value
    sizes = []
    for label, value in items.items():
        try:
            sizes.append((label, len(cloudpickle.dumps(value))))
        except Exception:  # noqa: BLE001 - what cannot be measured is left out of the list
            continue
    return sorted(sizes, key=lambda item: item[1], reverse=True)


def payload_warning(size: int, folder: Path, fn: Callable, calls: Sequence[tuple],
                    kwargs: Mapping[str, Any]) -> str:
    """The warning for a large payload: its size, its largest parts, and the way out."""
    largest = [f"{label} {_mb(n)}" for label, n in captured(fn, calls, kwargs)[:3]
               if n >= size // 100]
    return (f"the payload of {getattr(fn, '__name__', fn)!r} is {_mb(size)} "
            f"({folder / PAYLOAD}, written for every job and read by every rank)"
            + (f"; it carries {', '.join(largest)}" if largest else "")
            + ": load large data inside the function (from a file the nodes see) instead of "
              "capturing it")


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


def element_folder(folder: Path, index: int) -> Path:
    """Where element ``index`` of a job array writes its results."""
    return folder / str(index)


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
    fn, calls, kwargs, paths, files, array = _load(data, folder / PAYLOAD)
    if array:  # an element of a job array: its own arguments, its own results
        index = int(os.environ["SLURM_ARRAY_TASK_ID"])
        args, folder = calls[index], element_folder(folder, index)
    else:
        (args,) = calls
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
