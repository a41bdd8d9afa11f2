"""What ``hpc-horovod sbatch`` refuses, and how: one line naming what the user wrote, the values
of sbatch's own options checked as sbatch reads them, the directories of the output files
made before the job needs them; without SLURM."""

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpc_horovod.cli import main
from hpc_horovod.common.topology import Topology
from hpc_horovod.slurm import live, options, preflight
from hpc_horovod.slurm.remote import Job

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_job_dir(tmp_path, monkeypatch):
    """A job directory with t.py, the current directory; no user profile, no live cluster."""
    monkeypatch.setenv("HPC_HOROVOD_CLUSTERS", "/nonexistent/clusters.toml")
    monkeypatch.setattr(live, "query", lambda env=None: None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("print('hi')\n")
    return tmp_path


def refusal(capsys, *argv: str) -> str:
    """The one line ``hpc-horovod sbatch ARGV -- python t.py`` refuses with (exit status 2)."""
    try:
        status = main(["sbatch", *argv, "--script", "job.sh", "--", "python", "t.py"])
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    (line,) = [line for line in err.splitlines() if line.startswith("hpc-horovod sbatch: error: ")]
    return line[len("hpc-horovod sbatch: error: "):]


@pytest.mark.parametrize("argv, error", [
    # -G/--gpus named as typed, with the fix in the user's terms
    (["--cluster", "jean-zay", "-A", "abc", "-G", "8"],
     "-G 8 on 1 node(s) is 8 GPUs per node, but partition gpu_p13 has 4: ask --nodes 2"),
    (["--cluster", "jean-zay", "-A", "abc", "--gpus", "8"], "--gpus 8 on 1 node(s)"),
    (["--cluster", "oscar", "-p", "batch", "-N", "2", "-G", "2"],
     "partition batch of cluster oscar has no GPUs: leave -G 2 out"),
    (["--cluster", "oscar", "-p", "gpu-he", "-G", "2", "--ntasks-per-node", "1"],
     "--ntasks-per-node 1 with -G 2 (2 per node): a GPU job runs one task per GPU"),
    (["--cluster", "jean-zay", "-A", "abc", "-N", "2", "-G", "3"],
     "-G 3 (GPUs for the whole job, as in sbatch) does not split evenly over -N 2"),
    (["--tasks-per-node", "0"], "--tasks-per-node must be at least 1"),
    # Oscar's default partition has GPUs whose number the profile does not know: it asks
    (["--cluster", "oscar", "-N", "2"], "partition gpu of cluster oscar has GPUs, a number per "
     "node the profile does not know: ask --gpus-per-node N"),
    # sbatch's own options, their syntax checked as sbatch reads it
    (["--mem", "lots"], "--mem 'lots' is not a size"),
    (["--mem-per-cpu", "2X"], "--mem-per-cpu '2X' is not a size"),
    (["-d", "bogus"], "-d 'bogus' is not a dependency list"),
    (["--dependency", "afterok:12,afterany:13?singleton"], "is not a dependency list"),
    (["-a", "0-3%x"], "-a '0-3%x' is not an array of indices"),
    (["--mail-type", "END,NEVER"], "NEVER is not a mail type"),
    (["-w", "h[1-"], "-w 'h[1-' is not a node list"),
    (["--time-min", "20h"], "--time-min '20h' is not a SLURM time"),
    (["--kill-on-invalid-dep", "maybe"], "--kill-on-invalid-dep 'maybe': yes or no"),
    (["-t", "20h"], "-t '20h' is not a SLURM time"),
    # the output's directory cannot be made once for every job
    (["-o", "logs/%x/%j.out"], "-o logs/%x/%j.out: SLURM makes no directory"),
])
def test_each_refusal_is_one_line_naming_what_was_typed(in_job_dir, capsys, argv, error):
    assert error in refusal(capsys, *argv)
    assert not (in_job_dir / "job.sh").exists()


def test_command_line_errors_print_no_usage_block(in_job_dir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["sbatch", "-G", "x", "--", "python", "t.py"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "usage:" not in err, err
    assert err.splitlines() == ["hpc-horovod sbatch: error: argument -G/--gpus: invalid int "
                                "value: 'x'", "(hpc-horovod sbatch --help lists the options)"]


@pytest.mark.parametrize("argv", [
    ["--mem", "64G", "--mem-per-gpu", "8000", "--tmp", "100g"],
    ["-d", "afterok:12:13_4,afterany:14+5", "-a", "0-15:4,20,30-31%4"],
    ["--dependency", "singleton?afternotok:9", "--array", "7"],
    ["--mail-type", "END,fail,TIME_LIMIT_90", "-w", "h[1-2],g7", "-x", "node[01-04,07]"],
    ["--time-min", "1-12", "--nice", "-5", "--kill-on-invalid-dep", "yes"],
])
def test_sbatch_values_that_sbatch_reads_pass(in_job_dir, capsys, argv):
    assert main(["sbatch", *argv, "--", "python", "t.py"]) == 0, capsys.readouterr().err


def test_a_nodelist_file_must_exist(in_job_dir):
    with pytest.raises(ValueError, match="no such file"):
        options.passthrough({"nodelist": "./nodes.txt"})
    (in_job_dir / "nodes.txt").write_text("h1\n")
    assert options.passthrough({"nodelist": "./nodes.txt"}) == (("--nodelist", "./nodes.txt"),)


def test_time_zero_is_no_limit_as_in_sbatch(in_job_dir, capsys):
    assert main(["sbatch", "-t", "0", "--", "python", "t.py"]) == 0
    assert "#SBATCH --time=UNLIMITED\n" in capsys.readouterr().out
    assert "over the" in refusal(capsys, "--cluster", "jean-zay", "-A", "abc", "-t", "0")


@pytest.mark.parametrize("command", [["python"], ["python", "-u"], ["python3", "-", "x"]])
def test_python_without_a_script_is_refused(in_job_dir, capsys, command):
    assert main(["sbatch", "--script", "job.sh", "--", *command]) == 2
    assert f"{' '.join(command)} runs no script" in capsys.readouterr().err
    assert not (in_job_dir / "job.sh").exists()


def test_output_directories_are_made_for_a_written_script(in_job_dir, capsys):
    assert main(["sbatch", "-o", "logs/%x-%j.out", "-e", "errors/%j.err", "--script", "job.sh",
                 "--", "python", "t.py"]) == 0
    assert (in_job_dir / "logs").is_dir() and (in_job_dir / "errors").is_dir()
    assert f"made {in_job_dir / 'logs'} for the job's output" in capsys.readouterr().err
    assert main(["sbatch", "-o", "printed/%j.out", "--", "python", "t.py"]) == 0  # to stdout
    assert not (in_job_dir / "printed").exists()


def test_sinfo_without_a_cluster_says_one_line(capsys):
    if live.shutil.which("sinfo") is None:
        pytest.skip("no sinfo here")
    # no slurm.conf and no DNS record of a controller: sinfo prints four lines of lookups
    assert live.query({"PATH": "/usr/bin:/bin"}) is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("hpc_horovod: sinfo found no cluster here ("), err


def test_live_refusals_name_the_gpu_option_as_given():
    cluster = live.LiveCluster({"cpu": live.Partition("cpu", 8, 0, 3600.0)}, "cpu")
    with pytest.raises(ValueError, match=r"^--gpus 2 \(1 per node\): the nodes of partition cpu "
                                         r"have 0 GPU\(s\)"):
        live.check(cluster, None, None, 1, 1, 1, 60, "--gpus 2")


def test_job_has_an_id():
    job = Job("123_4", folder=Path("/nonexistent"), size=2)
    assert job.id == job.job_id == "123_4"


def test_thread_warning_is_a_whole_sentence(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    topo = Topology(rank=0, size=2, local_rank=0, local_size=2, cross_rank=0, cross_size=1,
                    hostname="h1", launcher="slurm")
    text = preflight.thread_warning({"OMP_NUM_THREADS": "4", "SLURM_CPUS_ON_NODE": "2"}, topo)
    assert text.endswith("srun hpc-horovod doctor shows every rank's threads against its CPUs")


LINES = textwrap.dedent("""\
    import sys
    from hpc_horovod.common.streams import line_buffered
    line_buffered(sys.argv[1])
    print(sys.stdout.line_buffering, sys.stderr.line_buffering)
""")


@pytest.mark.parametrize("launcher, buffered", [("slurm", "True"), ("single", "False")])
def test_output_is_line_buffered_under_a_launcher(launcher, buffered):
    proc = subprocess.run([sys.executable, "-c", LINES, launcher], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                      "PYTHONPATH": str(ROOT)})
    # stdout into a pipe; stderr is line-buffered by Python itself
    assert proc.stdout.split() == [buffered, "True"], proc.stdout + proc.stderr


def test_a_stream_that_cannot_be_reconfigured_is_left_alone(monkeypatch):
    from hpc_horovod.common.streams import line_buffered

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    line_buffered("slurm")  # no error
