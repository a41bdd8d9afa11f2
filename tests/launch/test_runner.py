"""``hpc_horovod.run``: a function on two real ranks (mpirun), the per-rank results back, an
exception raised with its rank, a rank that dies without a result."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hpc_horovod
from hpc_horovod import runner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_launcher(monkeypatch):
    """No outer SLURM job or MPI rank: the ranks start with mpirun on this machine."""
    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_",
                                                       "HOROVOD_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_results_by_rank(no_launcher, capfd):
    offset = 100  # a closure: the function travels by value, as one from a notebook cell

    def allreduce_rank(scale, *, tag):
        import numpy as np

        import hpc_horovod as hvd

        hvd.init()
        print(f"hello from rank {hvd.rank()}", flush=True)
        total = hvd.allreduce(np.array([float(hvd.rank() + 1)]), op=hvd.Sum)
        return (tag, hvd.rank(), hvd.size(), float(total[0]) * scale + offset)

    assert hpc_horovod.run(allreduce_rank, args=(2.0,), kwargs={"tag": "t"}, np=2) == [
        ("t", 0, 2, 106.0), ("t", 1, 2, 106.0)]
    out = capfd.readouterr().out
    assert "[1,0]<stdout>:hello from rank 0" in out and "[1,1]<stdout>:hello from rank 1" in out


def test_the_failing_rank_is_named(no_launcher, capfd):
    def fails_on_rank_1():
        import hpc_horovod as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise KeyError("no such shard")
        hvd.barrier()  # rank 0 waits for rank 1, which never comes
        return "unreachable"

    with pytest.raises(KeyError, match="no such shard") as info:
        hpc_horovod.run(fails_on_rank_1, np=2)
    note = "\n".join(info.value.__notes__)
    assert note.startswith("raised on rank 1 of 2"), note
    assert "in fails_on_rank_1" in note and note.endswith("KeyError: 'no such shard'")
    # the frame names this file and shows its line, not cloudpickle's <dynamic-code>
    assert f'File "{__file__}", line ' in note and "<dynamic-code>" not in note, note
    assert 'raise KeyError("no such shard")' in note, note
    # rank 0, waiting in the barrier, learns rank 1's error, not a bare shutdown
    err = capfd.readouterr().err
    assert "called shutdown" not in err, err
    assert "rank 1 failed first: KeyError" in err or "Rank 1 stopped first, with: KeyError" \
        in err, err


def test_a_rank_without_result(no_launcher):
    def dies():
        import os

        from hpc_horovod.common import topology

        if topology.detect().rank == 0:
            os._exit(7)
        return "fine"

    with pytest.raises(RuntimeError, match=r"exited with status 7; ranks without a result: 0$"):
        hpc_horovod.run(dies, np=2)


def test_bad_arguments_fail_before_launching():
    with pytest.raises(TypeError, match="fn must be callable"):
        hpc_horovod.run(42, np=2)
    with pytest.raises(TypeError, match="args must be a tuple"):
        hpc_horovod.run(print, args="abc", np=2)
    with pytest.raises(ValueError, match="-np must be at least 1, got 0"):
        hpc_horovod.run(print, np=0)


def test_collect_orders_ranks_and_prefers_the_cause(tmp_path):
    from hpc_horovod.common.errors import HorovodInternalError

    runner.atomic_write(runner.rank_file(tmp_path, 0), lambda fh: fh.write(
        runner._outcome_bytes(0, False, HorovodInternalError("peer failed"), "tb0")))
    runner.atomic_write(runner.rank_file(tmp_path, 2), lambda fh: fh.write(
        runner._outcome_bytes(2, False, ZeroDivisionError("x"), "tb2")))
    runner.atomic_write(runner.rank_file(tmp_path, 1), lambda fh: fh.write(
        runner._outcome_bytes(1, True, lambda: 1, "")))  # not picklable by pickle: cloudpickle
    with pytest.raises(ZeroDivisionError) as info:
        runner.collect(tmp_path, 3)
    assert info.value.__notes__[0].startswith(
        "raised on rank 2 of 3 (ranks that failed too: 0 (HorovodInternalError))")


def test_worker_command_finds_this_package_without_pythonpath(tmp_path):
    """A kernel whose hpc_horovod is not on the ranks' default path (a checkout): the worker
    command puts the caller's package first."""
    runner.write_payload(tmp_path, lambda: __import__("hpc_horovod").__file__)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([*runner.worker_command(tmp_path)], env=env, cwd="/",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert runner.collect(tmp_path, 1) == [str(ROOT / "hpc_horovod" / "__init__.py")]


def test_rank_entry_point_refuses_a_folder_without_payload(tmp_path):
    code = textwrap.dedent("""\
        import sys
        from hpc_horovod.runner import main
        sys.exit(main(sys.argv[1:]))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "expected the folder of a payload.pkl" in proc.stderr
