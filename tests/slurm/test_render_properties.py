"""Property tests of the job-script generator: whatever options a user types, the result is a
script or a ValueError naming the problem, never another exception, and no user string ever
becomes shell code or a #SBATCH line of its own."""

from __future__ import annotations

import shlex
import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_horovod.slurm import render_job

NO_USER_PROFILES = {"HPC_HOROVOD_CLUSTERS": "/nonexistent/clusters.toml"}
TEXT = st.text(alphabet=string.printable + "é€\u2028", max_size=24)
NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,15}", fullmatch=True)


def sometimes_bad(good):
    """Mostly plausible values, sometimes arbitrary text."""
    return st.one_of(good, good, good, TEXT)


options = st.fixed_dictionaries({
    "cluster": st.sampled_from(["generic", "generic", "jean-zay", "oscar", "nope"]),
    "nodes": st.one_of(st.integers(min_value=1, max_value=8), st.integers(-2, 600)),
    "ntasks_per_node": st.one_of(st.none(), st.integers(min_value=-1, max_value=64)),
    "gpus_per_node": st.one_of(st.none(), st.integers(min_value=0, max_value=9)),
    "time": sometimes_bad(st.sampled_from([None, "30", "90:30", "00:30:00", "01:00:00",
                                           "20:00:00", "100:00:00", "2-00:00:00", "1-12",
                                           "3-4:30", "99:99:99"])),
    "account": sometimes_bad(st.one_of(st.none(), NAME)),
    "qos": sometimes_bad(st.sampled_from([None, None, "qos_gpu-t3", "qos_gpu-dev"])),
    "partition": sometimes_bad(st.sampled_from([None, None, "gpu_p13", "gpu_p2", "gpu"])),
    "job_name": sometimes_bad(NAME),
    "modules": st.one_of(st.none(), st.lists(sometimes_bad(NAME), max_size=3)),
    "env": st.lists(sometimes_bad(st.builds("{}={}".format, NAME.map(str.upper), TEXT)),
                    max_size=3),
    "requeue": st.booleans(),
    "output": sometimes_bad(st.sampled_from(["%x-%j.out", "logs/%j.out"])),
})
commands = st.lists(TEXT, min_size=0, max_size=4)


def _directive_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command=commands, opts=options)
def test_any_options_give_a_script_or_a_value_error(command, opts):
    kwargs = dict(opts, profile_env=NO_USER_PROFILES)
    try:
        script = render_job(command, **kwargs)
    except ValueError as exc:
        assert str(exc)  # a message, naming the problem
        return
    _check_script(script, command)


def _check_script(script: str, command: list[str]) -> None:
    assert script.startswith("#!")
    # every directive stays one line: no user text smuggled a newline into the header
    for line in _directive_lines(script):
        assert "\n" not in line and "\r" not in line
    # the command comes back intact, one shell word per argument
    assert shlex.join(command) in script or all(shlex.quote(a) in script for a in command)


@settings(max_examples=150, deadline=None)
@given(command=st.lists(TEXT, min_size=1, max_size=4), nodes=st.integers(1, 64),
       tasks=st.integers(1, 8), job_name=NAME, account=st.one_of(st.none(), NAME),
       env=st.dictionaries(NAME.map(lambda n: "X_" + n.upper().replace("-", "_")
                                    .replace(".", "_")), TEXT, max_size=3),
       requeue=st.booleans())
def test_valid_options_always_give_a_script_with_the_command_intact(command, nodes, tasks,
                                                                      job_name, account, env,
                                                                      requeue):
    script = render_job(command, cluster="generic", nodes=nodes, gpus_per_node=0,
                        ntasks_per_node=tasks, job_name=job_name, account=account,
                        env=env, requeue=requeue, profile_env=NO_USER_PROFILES)
    _check_script(script, command)
    assert f"--nodes={nodes}" in script and f"--ntasks-per-node={tasks}" in script
