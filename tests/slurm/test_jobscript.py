"""Job scripts from the templates, and every refusal, without SLURM."""

import shlex
import subprocess

import pytest

from hpc_horovod.cli import main
from hpc_horovod.slurm import render_job
from hpc_horovod.slurm.profiles import get_profile

NO_USER_FILE = {"HPC_HOROVOD_CLUSTERS": "/nonexistent/clusters.toml"}
CMD = ["python", "train.py", "--epochs", "3"]


def render(cluster="generic", command=CMD, **options):
    return render_job(command, cluster=get_profile(cluster, NO_USER_FILE), **options)


def directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].partition("=")
            out[key] = value
    return out


def srun_line(script: str) -> list[str]:
    """The launch command, the script's last (it may span lines when an argument does)."""
    assert script.count("\nsrun ") == 1
    return shlex.split(script[script.index("\nsrun ") + 1:])


def test_jean_zay_gpu_job():
    script = render("jean-zay", nodes=2, gpus_per_node=4, time="20:00:00", account="abc",
                    job_name="train", requeue=True)
    d = directives(script)
    assert d["--nodes"] == "2" and d["--ntasks-per-node"] == "4" and d["--gres"] == "gpu:4"
    assert d["--cpus-per-task"] == "10" and "--hint" in d and d["--hint"] == "nomultithread"
    assert d["--partition"] == "gpu_p13" and d["--qos"] == "qos_gpu-t3"
    assert d["--account"] == "abc@v100" and d["--time"] == "20:00:00"
    assert d["--open-mode"] == "append" and "--requeue" in d and d["--signal"] == "USR2@300"
    assert "export SRUN_CPUS_PER_TASK=10\n" in script and "export OMP_NUM_THREADS=10\n" in script
    assert "module purge\nmodule load horovod " in script
    assert srun_line(script) == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", *CMD]
    assert "set -x" in script  # the Jean Zay template's own block
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_constraints_bring_their_qos_account_and_arch_module():
    script = render("jean-zay", gpus_per_node=8, constraint="a100", account="abc",
                    modules=["pytorch-gpu/py3/2.3.0"])
    d = directives(script)
    assert d["--constraint"] == "a100" and "--partition" not in d
    assert d["--cpus-per-task"] == "8" and d["--qos"] == "qos_gpu_a100-t3"
    assert d["--account"] == "abc@a100"
    assert "module load arch/a100 pytorch-gpu/py3/2.3.0 " in script
    h100 = directives(render("jean-zay", gpus_per_node=4, constraint="h100", time="50:00:00"))
    assert h100["--qos"] == "qos_gpu_h100-t4" and h100["--cpus-per-task"] == "24"
    dev = directives(render("jean-zay", gpus_per_node=1, qos="qos_gpu-dev", time="01:00:00"))
    assert dev["--qos"] == "qos_gpu-dev"


def test_long_jobs_get_the_longer_qos():
    assert directives(render("jean-zay", gpus_per_node=4, time="30:00:00"))["--qos"] == \
        "qos_gpu-t4"


def test_generic_cpu_job():
    script = render(nodes=2, gpus_per_node=0, tasks_per_node=3, partition="debug")
    d = directives(script)
    assert d["--ntasks-per-node"] == "3" and "--gres" not in d and "--hint" not in d
    assert d["--partition"] == "debug" and d["--cpus-per-task"] == "1"
    assert "module" not in script  # the generic profile loads none by default
    assert "SRUN_CPUS_PER_TASK=1" in script


def test_oscar_partition_with_feature_constraint():
    d = directives(render("oscar", gpus_per_node=2, constraint="v100", time="10:00:00"))
    assert d["--partition"] == "gpu" and d["--constraint"] == "v100"
    assert "--qos" not in d and "--hint" not in d and d["--cpus-per-task"] == "4"


@pytest.mark.parametrize("options, error", [
    (dict(gpus_per_node=8), "has 4 GPUs per node.*gpu_p2"),
    (dict(gpus_per_node=4, partition="gpu_p5"), "valid partitions: gpu_p13, gpu_p2"),
    (dict(gpus_per_node=4, partition="a100"), "use --constraint a100"),
    (dict(gpus_per_node=4, qos="qos_gpu-t5"), "valid: qos_gpu-t3 .max 20:00:00., qos_gpu-t4"),
    (dict(gpus_per_node=4, qos="qos_gpu_a100-t3"), "qos_gpu_a100-t3 is for a100"),
    (dict(gpus_per_node=4, qos="qos_gpu-t3", time="21:00:00"),
     "over the 20:00:00 limit of QoS qos_gpu-t3; use --qos qos_gpu-t4"),
    (dict(gpus_per_node=4, time="101:00:00"), "over the 100:00:00 limit of partition gpu_p13"),
    (dict(gpus_per_node=8, constraint="a100", time="21:00:00"), "20:00:00 limit of constraint"),
    (dict(gpus_per_node=4, nodes=0), "--nodes must be at least 1"),
    (dict(gpus_per_node=4, time="20h"), "HH:MM:SS"),
    (dict(gpus_per_node=4, env=["BAD-NAME=1"]), "environment variable name"),
    (dict(gpus_per_node=0), "GPU partition"),
    (dict(gpus_per_node=4, tasks_per_node=2), "one task per GPU"),
    (dict(gpus_per_node=4, account="abc@h100"), "--account abc@v100"),
    (dict(gpus_per_node=4, constraint="h100", partition="gpu_p13"), "not both"),
    (dict(gpus_per_node=4, signal_seconds=7200), "--signal-seconds"),
    (dict(gpus_per_node=4, job_name="x; rm -rf ~"), "--job-name"),
    (dict(gpus_per_node=4, job_name="x\n#SBATCH --uid=0"), "--job-name"),
    (dict(gpus_per_node=4, modules=["m;rm"]), "module name"),
])
def test_refusals_name_the_fix(options, error):
    with pytest.raises(ValueError, match=error):
        render("jean-zay", **options)


def test_cpu_partition_refuses_gpus_and_no_command_is_refused():
    with pytest.raises(ValueError, match="no GPUs"):
        render("oscar", gpus_per_node=1, partition="batch")
    with pytest.raises(ValueError, match="no command"):
        render(command=[], gpus_per_node=1)
    with pytest.raises(TypeError, match="list of arguments"):
        render(command="python train.py", gpus_per_node=1)


def test_user_strings_cannot_become_commands(tmp_path):
    """Arguments and --env values are quoted: bash sees them as single words, no expansion."""
    nasty = ["x; rm -rf ~", "$(touch pwned)", "`id`", "a'b\nc", "--flag=*"]
    script = render(command=["python", "train.py", *nasty], gpus_per_node=1,
                    env={"NOTE": "$(touch pwned) ; echo hi", "DATA": "a b"})
    assert srun_line(script)[3:] == ["python", "train.py", *nasty]
    probe = script.replace("srun --mpi=pmix --kill-on-bad-exit=1 ", "printf '<%s>\\n' ")
    probe = probe + 'printf "<%s>\\n" "$NOTE" "$DATA"\n'
    proc = subprocess.run(["bash", "-c", probe.split("\n", 1)[1]], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.iterdir()) == []
    words = proc.stdout.split(">\n<")
    assert words[2:7] == nasty
    assert proc.stdout.endswith("<$(touch pwned) ; echo hi>\n<a b>\n")


def test_cli_writes_the_script_or_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HPC_HOROVOD_CLUSTERS", "/nonexistent/clusters.toml")
    out = tmp_path / "job.sh"
    assert main(["sbatch", "--cluster", "jean-zay", "--nodes", "2", "--gpus-per-node", "4",
                 "--env", "A=1", "-o", str(out), "--", "python", "train.py", "a b"]) == 0
    assert srun_line(out.read_text())[3:] == ["python", "train.py", "a b"]
    assert main(["sbatch", "--gpus-per-node", "1", "--modules", "", "--", "python", "t.py"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("#!/bin/bash\n") and "module" not in printed

    bad = tmp_path / "bad.sh"
    assert main(["sbatch", "--cluster", "jean-zay", "--gpus-per-node", "4", "--job-name",
                 "x; rm -rf ~", "-o", str(bad), "--", "python", "t.py"]) == 2
    assert not bad.exists()
    assert "--job-name 'x; rm -rf ~' may only contain" in capsys.readouterr().err
