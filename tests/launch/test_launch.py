"""``hpc-horovod run`` (the command line it builds, and a real two-process run) and
``hpc-horovod check-build``."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import clean_env

from hpc_horovod import cli, launch
from hpc_horovod.version import __version__

ROOT = Path(__file__).resolve().parents[2]
HPC_HOROVOD = [str(Path(sys.executable).with_name("hpc-horovod"))]  # the installed entry point
MPIRUN = shutil.which("mpirun")


def parse(*argv: str):
    return cli.build_parser().parse_args(["run", *argv])


def command(*argv: str, env: dict | None = None, cores: int | None = None) -> list[str]:
    return launch.build_command(launch.Launch.from_args(parse(*argv)),
                                {} if env is None else env, cores)


def test_this_machine_has_open_mpi():
    assert MPIRUN and launch.mpi_flavour(MPIRUN) == "openmpi"


def test_mpi_flavour_of_something_that_is_not_a_launcher():
    assert launch.mpi_flavour("/nonexistent/mpirun") == "unknown"
    assert launch.mpi_flavour(shutil.which("true")) == "unknown"


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_local_ranks_get_equal_shares_of_the_cores():
    cmd = command("-np", "2", "python", "train.py", "--epochs", "3", cores=8)
    assert cmd[:3] == [MPIRUN, "-np", "2"]
    assert flag(cmd, "--map-by") == "slot:PE=4" and flag(cmd, "--bind-to") == "core"
    assert "--tag-output" in cmd and "--oversubscribe" not in cmd
    assert cmd[-4:] == ["python", "train.py", "--epochs", "3"]
    assert flag(command("-np", "3", "x.py", cores=8), "--map-by") == "slot:PE=2"
    assert flag(command("-np", "2", "x.py", cores=2), "--map-by") == "slot:PE=1"


def test_more_ranks_than_cores_oversubscribe_unbound():
    cmd = command("-np", "5", "python", "train.py", cores=4)
    assert "--oversubscribe" in cmd and flag(cmd, "--bind-to") == "none"
    assert flag(cmd, "--map-by") == "slot"
    # ranks that share cores yield in MPI's waits (set on the launch, not by the library)
    assert flag(cmd, "mpi_yield_when_idle") == "1" and cmd[cmd.index("mpi_yield_when_idle") - 1] \
        == "--mca"
    assert "mpi_yield_when_idle" not in command("-np", "2", "x.py", cores=8)
    # one core per rank: the engine's thread and the training's share it
    assert "mpi_yield_when_idle" in command("-np", "2", "x.py", cores=2)


def test_other_hosts_are_not_bound():
    cmd = command("-np", "4", "-H", "a:2,b:2", "python", "train.py", cores=64)
    assert flag(cmd, "--bind-to") == "none" and "--oversubscribe" not in cmd
    assert "--oversubscribe" in command("-np", "5", "-H", "a:2,b:2", "x.py", cores=64)


def test_one_host_leaves_out_the_ucx_one_sided_component():
    # shared memory serves a host's windows; several hosts keep what the MPI chooses
    for cmd in (command("-np", "2", "x.py", cores=8), command("-np", "5", "x.py", cores=4)):
        assert flag(cmd, "osc") == "^ucx" and cmd[cmd.index("osc") - 1] == "--mca"
    assert "osc" not in command("-np", "4", "-H", "a:2,b:2", "x.py", cores=64)


def test_physical_cores_counts_this_machine():
    assert 1 <= launch.physical_cores() <= (os.cpu_count() or 1)


@pytest.mark.skipif(os.geteuid() != 0, reason="the root flag is only added for root")
def test_root_gets_the_root_flag():
    assert "--allow-run-as-root" in command("-np", "1", "python", "x.py")


def test_hosts_flag():
    cmd = command("-np", "4", "-H", "node1:2,node2:2", "python", "x.py")
    i = cmd.index("-H")
    assert cmd[i + 1] == "node1:2,node2:2"
    assert "--oversubscribe" not in cmd  # 4 ranks on 4 announced slots


def test_hosts_without_slots_count_one_and_oversubscribe_when_short():
    cmd = command("-np", "3", "-H", "node1,node2", "python", "x.py")
    assert cmd[cmd.index("-H") + 1] == "node1:1,node2:1"
    assert "--oversubscribe" in cmd


@pytest.mark.parametrize("hosts", ["node1:two", ":2", "node1:2,,node2"])
def test_bad_hosts_are_value_errors(hosts):
    with pytest.raises(ValueError, match="-H expects host:slots"):
        command("-np", "2", "-H", hosts, "python", "x.py")


def test_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(textwrap.dedent("""\
        # the nodes of this job
        node1 slots=4
        node2 slots=2   # the small one

        node3
    """))
    cmd = command("-np", "7", "--hostfile", str(hostfile), "python", "x.py")
    assert cmd[cmd.index("-H") + 1] == "node1:4,node2:2,node3:1"
    assert "--oversubscribe" not in cmd


def test_hostfile_with_max_slots(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2 max_slots=4\n")
    cmd = command("-np", "2", "--hostfile", str(hostfile), "python", "x.py")
    assert cmd[cmd.index("-H") + 1] == "node1:2"


def test_variables_are_forwarded_by_name():
    env = {"HOROVOD_FUSION_THRESHOLD": "0", "NCCL_DEBUG": "INFO", "PYTHONPATH": "/src",
           "PATH": "/usr/bin", "LD_LIBRARY_PATH": "/lib", "SECRET_TOKEN": "x", "HOME": "/root"}
    cmd = command("-np", "2", "python", "x.py", env=env)
    forwarded = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "-x"]
    assert forwarded == ["HOROVOD_FUSION_THRESHOLD", "LD_LIBRARY_PATH", "NCCL_DEBUG", "PATH",
                         "PYTHONPATH"]
    assert "x" not in forwarded and all("=" not in name for name in forwarded)


def test_extra_launcher_arguments_come_before_the_command():
    cmd = command("-np", "2", "--mpi-args", "--mca btl self,tcp --report-bindings",
                  "python", "x.py")
    assert cmd[-6:] == ["--mca", "btl", "self,tcp", "--report-bindings", "python", "x.py"]


def test_inside_an_allocation_srun_is_used():
    assert shutil.which("srun"), "slurm-client is installed on this machine"
    env = {"SLURM_JOB_ID": "12", "SLURM_NTASKS": "8"}
    cmd = command("-np", "4", "python", "x.py", env=env)
    assert cmd == ["srun", "--ntasks=4", "--mpi=pmix", "--kill-on-bad-exit=1", "--label",
                   "python", "x.py"]
    cmd = command("-np", "4", "--srun-mpi", "pmi2", "python", "x.py", env=env)
    assert "--mpi=pmi2" in cmd


@pytest.mark.parametrize("argv,env", [
    (["--no-srun"], {"SLURM_JOB_ID": "12"}),
    (["-H", "node1:4"], {"SLURM_JOB_ID": "12"}),
    ([], {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0"}),  # already inside a step
])
def test_mpirun_inside_an_allocation_when_asked_or_already_in_a_step(argv, env):
    cmd = command("-np", "2", *argv, "python", "x.py", env=env)
    assert cmd[0] == MPIRUN


def test_no_srun_on_path_falls_back_to_mpirun(monkeypatch, tmp_path):
    (tmp_path / "mpirun").symlink_to(MPIRUN)
    monkeypatch.setenv("PATH", str(tmp_path))
    cmd = command("-np", "2", "python", "x.py", env={"SLURM_JOB_ID": "12"})
    assert cmd[0] == str(tmp_path / "mpirun")


def test_no_launcher_on_path_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="module load openmpi"):
        command("-np", "2", "python", "x.py")


@pytest.mark.parametrize("argv,fragment", [
    (["-np", "0", "python", "x.py"], "-np must be at least 1, got 0"),
    (["-np", "2"], "no command given"),
])
def test_bad_arguments_are_value_errors(argv, fragment):
    with pytest.raises(ValueError, match=fragment):
        command(*argv)


def test_cli_reports_errors_without_a_traceback(capsys):
    assert cli.main(["run", "-np", "0", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "error: -np must be at least 1, got 0" in err
    assert "Traceback" not in err


def test_cli_error_names_the_sub_command(capsys):
    cli.main(["run", "-np", "0", "python", "x.py"])
    assert capsys.readouterr().err.startswith("hpc-horovod run: error: -np must be at least 1")


def test_cli_requires_np():
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "python", "x.py"])
    assert info.value.code == 2


WORKER = textwrap.dedent("""
    import os

    import numpy as np
    import hpc_horovod as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
    print(f"RESULT rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()} "
          f"sum={total[0]:g} threshold={os.environ['HOROVOD_FUSION_THRESHOLD']}", flush=True)
    hvd.shutdown()
""")


def test_run_two_processes_for_real(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run(
        [*HPC_HOROVOD, "run", "-np", "2", "-v", sys.executable, str(script)],
        capture_output=True, text=True, timeout=120,
        env=clean_env({"HOROVOD_FUSION_THRESHOLD": "1234"}), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.startswith("+ " + MPIRUN + " -np 2")
    for rank in (0, 1):
        # HOROVOD_* reached every rank; output is tagged with the rank
        assert f"[1,{rank}]<stdout>:RESULT rank={rank} size=2 local={rank} sum=3 " \
               "threshold=1234" in proc.stdout, proc.stdout


def test_run_returns_the_failing_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    proc = subprocess.run([*HPC_HOROVOD, "run", "-np", "2", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120, env=clean_env(),
                          cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr


# -- check-build ----------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_check_build_output():
    proc = subprocess.run([*HPC_HOROVOD, "check-build"], capture_output=True, text=True,
                          timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"hpc_horovod v{__version__}:"
    assert lines[2] == "Available Frameworks:"
    assert "Available Controllers:" in lines and "Available Tensor Operations:" in lines
    torch_version = _version("torch")
    expected = f"    [X] PyTorch ({torch_version})" if torch_version else "    [ ] PyTorch"
    assert expected in lines
    tf_version = _version("tensorflow") or _version("tensorflow-cpu")
    expected = f"    [X] TensorFlow ({tf_version})" if tf_version else "    [ ] TensorFlow"
    assert expected in lines
    mpi = [line for line in lines if line.startswith("    [X] MPI (")]
    # the library mpi4py really loads, by its own banner
    assert len(mpi) == 1 and re.match(r"    \[X\] MPI \((Open MPI|MPICH|Intel)", mpi[0]), mpi
    assert "    [ ] Gloo" in lines
    assert "    [ ] NCCL" in lines or any(line.startswith("    [X] NCCL (") for line in lines)
    native = [line for line in lines if "native reductions" in line]
    assert len(native) == 1


def test_check_build_does_not_initialize_mpi():
    # a report must not start MPI (it runs on login nodes, outside any launcher)
    code = ("from hpc_horovod import check_build; check_build.report(); "
            "from mpi4py import MPI; print('INIT', MPI.Is_initialized())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "INIT False" in proc.stdout


def test_version_flag():
    proc = subprocess.run([*HPC_HOROVOD, "--version"], capture_output=True, text=True,
                          timeout=60, env=clean_env())
    assert proc.stdout.strip() == f"hpc_horovod {__version__}"


def test_python_dash_m_is_the_command():
    """``sys.executable -m hpc_horovod``: the command without a PATH lookup (notebook kernels)."""
    proc = subprocess.run([sys.executable, "-m", "hpc_horovod", "--version"], capture_output=True,
                          text=True, timeout=60, env=clean_env({"PATH": "/usr/bin:/bin"}))
    assert proc.returncode == 0 and proc.stdout.strip() == f"hpc_horovod {__version__}"
