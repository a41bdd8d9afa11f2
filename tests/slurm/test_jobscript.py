"""Job scripts from the templates, and every refusal, without SLURM."""

import re
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
    script = render(nodes=2, gpus_per_node=0, ntasks_per_node=3, partition="debug")
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
    (dict(gpus_per_node=4, time="20h"), "--time '20h' is not a SLURM time: write MM, MM:SS"),
    (dict(gpus_per_node=4, env=["BAD-NAME=1"]), "environment variable name"),
    (dict(gpus_per_node=0), "GPU partition"),
    (dict(gpus_per_node=4, ntasks_per_node=2), "one task per GPU"),
    (dict(gpus_per_node=4, account="abc@h100"), "--account abc@v100"),
    (dict(gpus_per_node=4, constraint="h100", partition="gpu_p13"), "not both"),
    (dict(gpus_per_node=4, signal_seconds=7200), "--signal USR2@7200: the signal must come"),
    (dict(nodes=2, ntasks=3), "--ntasks 3 does not split evenly over --nodes 2"),
    (dict(nodes=2, ntasks=4, ntasks_per_node=1), "disagree"),
    (dict(ntasks_per_node=0), "--ntasks-per-node must be at least 1, got 0"),
    (dict(ntasks_per_node=8), "--ntasks-per-node 8 on partition gpu_p13, which has 4 GPUs"),
    (dict(gpus_per_node=4, template="/nonexistent/site.sbatch.j2"), "no such file"),
    (dict(gpus_per_node=4, template="/etc/hostname"), "must end in .j2"),
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
                 "--env", "A=1", "--script", str(out), "--", "python", "train.py", "a b"]) == 0
    assert srun_line(out.read_text())[3:] == ["python", "train.py", "a b"]
    assert main(["sbatch", "--gpus-per-node", "1", "--modules", "", "--", "python", "t.py"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("#!/bin/bash\n") and "module" not in printed

    bad = tmp_path / "bad.sh"
    assert main(["sbatch", "--cluster", "jean-zay", "-J", "x; rm -rf ~", "--script", str(bad),
                 "--", "python", "t.py"]) == 2
    assert not bad.exists()
    assert "--job-name 'x; rm -rf ~' may only contain" in capsys.readouterr().err


def cli_directives(capsys, *argv: str) -> dict[str, str]:
    assert main(["sbatch", *argv, "--", "python", "t.py"]) == 0, capsys.readouterr().err
    return directives(capsys.readouterr().out)


def test_cli_speaks_slurm(capsys, monkeypatch):
    """sbatch's own spellings, short and long, on a CPU partition."""
    monkeypatch.setenv("HPC_HOROVOD_CLUSTERS", "/nonexistent/clusters.toml")
    d = cli_directives(capsys, "-N", "2", "--ntasks-per-node", "40", "-p", "cpu", "-t", "30",
                       "-J", "sim", "-A", "proj", "-q", "normal", "-c", "2", "-o", "logs/%j.out",
                       "--signal", "USR2@120", "--requeue")
    assert d["--nodes"] == "2" and d["--ntasks-per-node"] == "40" and "--gres" not in d
    assert d["--partition"] == "cpu" and d["--time"] == "00:30:00" and d["--job-name"] == "sim"
    assert d["--account"] == "proj" and d["--qos"] == "normal" and d["--cpus-per-task"] == "2"
    assert d["--output"] == "logs/%j.out" and d["--signal"] == "USR2@120"
    long = cli_directives(capsys, "--nodes=2", "--tasks-per-node=3", "--time=1-12",
                          "--constraint=skylake", "--job-name=sim")
    assert long["--ntasks-per-node"] == "3" and long["--time"] == "36:00:00"
    assert long["--constraint"] == "skylake"
    assert cli_directives(capsys, "-N", "2", "-n", "8")["--ntasks-per-node"] == "4"


def test_the_issue_command_is_a_cpu_job(capsys, monkeypatch):
    monkeypatch.setenv("HPC_HOROVOD_CLUSTERS", "/nonexistent/clusters.toml")
    d = cli_directives(capsys, "--cluster", "generic", "--nodes", "2", "--ntasks-per-node", "2")
    assert d["--nodes"] == "2" and d["--ntasks-per-node"] == "2" and "--gres" not in d


@pytest.mark.parametrize("cluster, options, gpus, tasks", [
    ("jean-zay", {}, 4, 4),                                 # every GPU of a gpu_p13 node
    ("jean-zay", {"constraint": "a100"}, 8, 8),
    ("jean-zay", {"ntasks_per_node": 2}, 2, 2),             # one GPU per asked task
    ("oscar", {"partition": "gpu-he"}, 4, 4),
    ("oscar", {"partition": "batch", "ntasks_per_node": 32}, 0, 32),  # a CPU partition
    ("oscar", {}, 0, 1),                                    # GPUs per node unknown: CPU job
    ("generic", {"ntasks_per_node": 40}, 0, 40),
])
def test_gpus_per_node_defaults_to_the_node_type(cluster, options, gpus, tasks):
    d = directives(render(cluster, **options))
    assert d["--ntasks-per-node"] == str(tasks)
    assert d.get("--gres") == (f"gpu:{gpus}" if gpus else None)


SITE_TEMPLATE = """\
{% extends "base.sbatch.j2" %}
{% block setup %}
{{ super() }}
echo "mysite: job {{ job.job_name }}"
{% endblock %}
"""


def test_site_template_extends_the_base(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HPC_HOROVOD_CLUSTERS", "/nonexistent/clusters.toml")
    site = tmp_path / "mysite.sbatch.j2"
    site.write_text(SITE_TEMPLATE)
    # a file named like a packaged template next to it does not replace the packaged one
    (tmp_path / "base.sbatch.j2").write_text("#!/bin/sh\necho hijacked\n")
    assert main(["sbatch", "-N", "2", "-J", "sitejob", "--template", str(site), "--", "python",
                 "t.py"]) == 0
    script = capsys.readouterr().out
    assert 'echo "mysite: job sitejob"' in script and "hijacked" not in script
    assert directives(script)["--nodes"] == "2" and srun_line(script)[3:] == ["python", "t.py"]


@pytest.mark.parametrize("text, error", [
    ("#!/bin/bash\nsrun {{ job.command | shjoin }}\n", "must start with {% extends"),
    ('{% extends "nowhere.sbatch.j2" %}\n', "must start with {% extends"),
    ('{% extends "base.sbatch.j2" %}\n{% block setup %}\n', "line 2"),
    ('{% extends "base.sbatch.j2" %}\n{% block setup %}{{ job.nothing }}{% endblock %}\n',
     "nothing"),
])
def test_bad_site_templates_are_explained(tmp_path, text, error):
    site = tmp_path / "mysite.sbatch.j2"
    site.write_text(text)
    with pytest.raises(ValueError, match=re.escape(error)) as info:
        render(template=str(site))
    assert str(site) in str(info.value)
