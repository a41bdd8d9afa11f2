"""Job scripts from the templates, and every refusal, without SLURM."""

import re
import shlex
import subprocess
import sys

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
    """The launch command (it may span lines when an argument does): the script's last, or,
    in a job that asks for SIGUSR2, the one it runs in the background before it waits."""
    assert script.count("\nsrun ") == 1
    words = shlex.split(script[script.index("\nsrun ") + 1:])
    return words[:words.index("&")] if "&" in words else words


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
    assert srun_line(script) == ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "--label", *CMD]
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
    (dict(gpus_per_node=4, time="3", signal_seconds=90),
     "SLURM may send it up to 60 s early, while the tasks still start .60 s.: ask at most "
     "USR2@60"),
    (dict(gpus_per_node=4, time="2", requeue=True), "a requeue-able job needs more than 00:02"),
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
    assert srun_line(script)[4:] == ["python", "train.py", *nasty]
    probe = script.replace("srun --mpi=pmix --kill-on-bad-exit=1 --label ", "printf '<%s>\\n' ")
    probe = probe + 'printf "<%s>\\n" "$NOTE" "$DATA"\n'
    proc = subprocess.run(["bash", "-c", probe.split("\n", 1)[1]], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.iterdir()) == []
    words = proc.stdout.split(">\n<")
    assert words[2:7] == nasty
    assert proc.stdout.endswith("<$(touch pwned) ; echo hi>\n<a b>\n")


@pytest.fixture
def in_job_dir(tmp_path, monkeypatch):
    """A directory with the scripts the job commands name, as the current directory."""
    monkeypatch.setenv("HPC_HOROVOD_CLUSTERS", "/nonexistent/clusters.toml")
    monkeypatch.chdir(tmp_path)
    for name in ("train.py", "t.py"):
        (tmp_path / name).write_text("print('hi')\n")
    return tmp_path


def test_cli_writes_the_script_or_nothing(in_job_dir, capsys):
    out = in_job_dir / "job.sh"
    assert main(["sbatch", "--cluster", "jean-zay", "--nodes", "2", "--gpus-per-node", "4",
                 "--env", "A=1", "--script", str(out), "--", "python", "train.py", "a b"]) == 0
    assert srun_line(out.read_text())[4:] == [sys.executable, "train.py", "a b"]
    assert main(["sbatch", "--gpus-per-node", "1", "--modules", "", "--", "python", "t.py"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("#!/bin/bash\n") and "module" not in printed

    bad = in_job_dir / "bad.sh"
    assert main(["sbatch", "--cluster", "jean-zay", "-J", "x; rm -rf ~", "--script", str(bad),
                 "--", "python", "t.py"]) == 2
    assert not bad.exists()
    assert "-J 'x; rm -rf ~' may only contain" in capsys.readouterr().err  # as typed


def test_script_file_is_never_overwritten_without_force(in_job_dir, capsys):
    out = in_job_dir / "job.sh"
    out.write_text("my own job\n")
    assert main(["sbatch", "--script", str(out), "--", "python", "t.py"]) == 2
    assert out.read_text() == "my own job\n"
    assert f"{out} exists: not overwriting it (pass --force" in capsys.readouterr().err
    assert main(["sbatch", "--script", str(out), "--force", "--", "python", "t.py"]) == 0
    assert out.read_text().startswith("#!/bin/bash\n")


def test_bare_python_is_this_interpreter_and_the_script_must_exist(in_job_dir, capsys):
    """A bare python would be the job's PATH's (none, or one without hpc_horovod): the tasks
    run this interpreter, and say so; a missing script or program is refused before anything
    is written."""
    assert main(["sbatch", "--", "python3", "-u", "t.py"]) == 0
    captured = capsys.readouterr()
    assert srun_line(captured.out)[4:] == [sys.executable, "-u", "t.py"]
    assert f"the tasks run python3 as {sys.executable}" in captured.err
    assert main(["sbatch", "--", "python", "-m", "some.module"]) == 0  # nothing to check
    capsys.readouterr()
    for command, error in [(["python", "missing.py"], "missing.py: no such file in "),
                           (["./run.sh"], "./run.sh: no such file in "),
                           (["no-such-program-x"], "'no-such-program-x' is not on PATH")]:
        out = in_job_dir / "never.sh"
        assert main(["sbatch", "--modules", "", "--script", str(out), "--", *command]) == 2
        assert error in capsys.readouterr().err and not out.exists()
    (in_job_dir / "sub").mkdir()
    (in_job_dir / "sub" / "other.py").write_text("")
    assert main(["sbatch", "-D", "sub", "--", "python", "other.py"]) == 0
    assert "#SBATCH --chdir=sub" in capsys.readouterr().out


def cli_directives(capsys, *argv: str) -> dict[str, str]:
    assert main(["sbatch", *argv, "--", "python", "t.py"]) == 0, capsys.readouterr().err
    return directives(capsys.readouterr().out)


def test_cli_speaks_slurm(in_job_dir, capsys):
    """sbatch's own spellings, short and long, on a CPU partition."""
    d = cli_directives(capsys, "-N", "2", "--ntasks-per-node", "40", "-p", "cpu", "-t", "30",
                       "-J", "sim", "-A", "proj", "-q", "normal", "-c", "2", "-o", "logs/%j.out",
                       "--signal", "USR2@120", "--requeue")
    assert d["--nodes"] == "2" and d["--ntasks-per-node"] == "40" and "--gres" not in d
    assert d["--partition"] == "cpu" and d["--time"] == "00:30:00" and d["--job-name"] == "sim"
    assert d["--account"] == "proj" and d["--qos"] == "normal" and d["--cpus-per-task"] == "2"
    assert d["--output"] == "logs/%j.out" and d["--signal"] == "USR2@120"
    assert d["--open-mode"] == "append"  # a requeued run goes on in the same file
    long = cli_directives(capsys, "--nodes=2", "--tasks-per-node=3", "--time=1-12",
                          "--constraint=skylake", "--job-name=sim", "-p", "cpu")
    assert long["--ntasks-per-node"] == "3" and long["--time"] == "36:00:00"
    assert long["--constraint"] == "skylake" and long["--partition"] == "cpu"
    assert "--open-mode" not in long  # SLURM's default: one job's file is its own
    assert cli_directives(capsys, "-N", "2", "-n", "8")["--ntasks-per-node"] == "4"
    assert cli_directives(capsys, "-t", "UNLIMITED")["--time"] == "UNLIMITED"


def test_gpus_is_for_the_whole_job_as_in_sbatch(in_job_dir, capsys):
    d = cli_directives(capsys, "-N", "2", "--gpus", "2")
    assert d["--gres"] == "gpu:1" and d["--ntasks-per-node"] == "1"
    assert cli_directives(capsys, "-N", "2", "-G", "8")["--gres"] == "gpu:4"
    assert main(["sbatch", "-N", "2", "--gpus", "3", "--", "python", "t.py"]) == 2
    assert "--gpus 3 (GPUs for the whole job, as in sbatch) does not split evenly over " \
        "-N 2" in capsys.readouterr().err


@pytest.mark.parametrize("argv, hint", [
    (["--gpu", "2"], "--gpu: did you mean --gpus or --gpus-per-node"),
    (["--cpus", "2"], "--cpus: did you mean --cpus-per-gpu or --cpus-per-task"),
    (["--tasks", "2"], "--tasks: did you mean --tasks-per-node"),
    (["--gpus-per", "2"], "--gpus-per: did you mean --gpus-per-node"),
    (["--mem-per-gp", "2G"], "--mem-per-gp: did you mean --mem-per-gpu"),
])
def test_no_abbreviations_and_a_hint(in_job_dir, capsys, argv, hint):
    with pytest.raises(SystemExit) as info:
        main(["sbatch", *argv, "--script", "x.sh", "--", "python", "t.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {argv[0]}" in err and hint in err, err
    assert not (in_job_dir / "x.sh").exists()


def test_no_sub_command_takes_abbreviations(in_job_dir, capsys):
    for argv in (["notebooks", "copy", "--forc"], ["run", "-np", "1", "--verbos", "true"],
                 ["module", "install", "--prefix", "x", "--forc"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("flag, fix", [("--gpus-per-task", "use --gpus-per-node N"),
                                       ("--ntasks-per-gpu", "use --gpus-per-node N"),
                                       ("--cpus-per-gpu", "use -c/--cpus-per-task"),
                                       ("--wrap", "the command goes after --")])
def test_sbatch_options_against_one_task_per_gpu_name_the_fix(in_job_dir, capsys, flag, fix):
    assert main(["sbatch", flag, "1", "--", "python", "t.py"]) == 2
    assert f"{flag}: " in (err := capsys.readouterr().err) and fix in err


def test_other_sbatch_options_pass_through(in_job_dir, capsys):
    d = cli_directives(capsys, "--mem", "64G", "--exclusive", "-a", "0-15%4", "-d",
                       "afterok:12:13", "-e", "err-%j.txt", "--mail-user=a@b.org",
                       "--mail-type", "END,FAIL", "--gres", "nvme:1", "-H", "--nice")
    assert d["--mem"] == "64G" and d["--exclusive"] == "" and d["--array"] == "0-15%4"
    assert d["--dependency"] == "afterok:12:13" and d["--error"] == "err-%j.txt"
    assert d["--mail-user"] == "a@b.org" and d["--mail-type"] == "END,FAIL"
    assert d["--gres"] == "nvme:1" and "--hold" in d and "--nice" in d
    assert cli_directives(capsys, "--exclusive=user")["--exclusive"] == "user"
    for argv, error in [(["--comment", "a b"], "--comment 'a b' may only contain"),
                        (["--mem", "4G\n#SBATCH --uid=0"], "--mem '4G\\n#SBATCH"),
                        (["--gres", "gpu:2"], "ask GPUs with --gpus-per-node N")]:
        assert main(["sbatch", *argv, "--", "python", "t.py"]) == 2
        assert error in capsys.readouterr().err


def test_submit_takes_the_cli_options_by_their_python_names(tmp_path):
    """Every option of `hpc-horovod sbatch` that describes the job is an argument of submit()
    (sbatch's other options by keyword), and its errors name those arguments."""
    import argparse
    import inspect

    from hpc_horovod.cli import build_parser
    from hpc_horovod.slurm import options, remote, submit

    parser = build_parser()
    sbatch_parser = next(a for a in parser._actions
                         if isinstance(a, argparse._SubParsersAction)).choices["sbatch"]
    cli = {a.dest for a in sbatch_parser._actions} - {"help", "script", "force", "submit",
                                                      "job_command"}
    cli = {d for d in cli if not d.startswith("refused_")}
    # submit() and submit_array() take them through to the one function that has them all
    assert inspect.Parameter.VAR_KEYWORD in {
        p.kind for p in inspect.signature(submit).parameters.values()}
    params = inspect.signature(remote._submit).parameters
    assert cli - set(options.PASSTHROUGH) <= set(params), cli - set(params)
    assert set(options.PLANNED) <= set(params)
    assert inspect.Parameter.VAR_KEYWORD in {p.kind for p in params.values()}
    for kwargs, error in [(dict(ntasks_per_node=0), "^ntasks_per_node must be at least 1"),
                          (dict(nodes=2, gpus=3), "^gpus 3 .* over nodes 2"),
                          (dict(mem="a b"), "^mem 'a b' may only contain"),
                          (dict(signal="USR1@9"), "^signal 'USR1@9'")]:
        with pytest.raises(ValueError, match=error):
            submit(print, workdir=tmp_path, **kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'memx'"):
        submit(print, workdir=tmp_path, memx="1G")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_issue_command_is_a_cpu_job(in_job_dir, capsys):
    d = cli_directives(capsys, "--cluster", "generic", "--nodes", "2", "--ntasks-per-node", "2")
    assert d["--nodes"] == "2" and d["--ntasks-per-node"] == "2" and "--gres" not in d


@pytest.mark.parametrize("cluster, options, gpus, tasks", [
    ("jean-zay", {}, 4, 4),                                 # every GPU of a gpu_p13 node
    ("jean-zay", {"constraint": "a100"}, 8, 8),
    ("jean-zay", {"ntasks_per_node": 2}, 2, 2),             # one GPU per asked task
    ("oscar", {"partition": "gpu-he"}, 4, 4),
    ("oscar", {"partition": "batch", "ntasks_per_node": 32}, 0, 32),  # a CPU partition
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


def test_site_template_extends_the_base(in_job_dir, capsys):
    tmp_path = in_job_dir
    site = tmp_path / "mysite.sbatch.j2"
    site.write_text(SITE_TEMPLATE)
    # a file named like a packaged template next to it does not replace the packaged one
    (tmp_path / "base.sbatch.j2").write_text("#!/bin/sh\necho hijacked\n")
    assert main(["sbatch", "-N", "2", "-J", "sitejob", "--template", str(site), "--", "python",
                 "t.py"]) == 0
    script = capsys.readouterr().out
    assert 'echo "mysite: job sitejob"' in script and "hijacked" not in script
    assert directives(script)["--nodes"] == "2"
    assert srun_line(script)[4:] == [sys.executable, "t.py"]


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
