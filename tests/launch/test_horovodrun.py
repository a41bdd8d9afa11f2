"""``horovodrun``: Horovod's launcher flags mapped onto ``hpc-horovod run``, refused flags
explained, and a real two-process run (through ``python -m``, so that no reinstall of the
console scripts is needed)."""

from __future__ import annotations

import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import clean_env

from hpc_horovod import horovodrun

ROOT = Path(__file__).resolve().parents[2]
HOROVODRUN = [sys.executable, "-m", "hpc_horovod.horovodrun"]


def test_is_a_console_script():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    scripts = config["options.entry_points"]["console_scripts"].split("\n")
    assert "horovodrun = hpc_horovod.horovodrun:main" in scripts


def test_tuning_flags_become_horovod_variables():
    args = horovodrun.build_parser().parse_args([
        "-np", "4", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
        "--cache-capacity", "512", "--hierarchical-allreduce", "--timeline-filename", "t.json",
        "--timeline-mark-cycles", "--no-stall-check", "--stall-check-warning-time-seconds", "30",
        "--stall-check-shutdown-time-seconds", "90", "--log-level", "debug",
        "--log-without-timestamp", "python", "train.py"])
    assert horovodrun.horovod_env(args) == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "512", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_TIMELINE": "t.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90", "HOROVOD_LOG_LEVEL": "DEBUG",
        "HOROVOD_LOG_HIDE_TIME": "1"}
    assert args.command == ["python", "train.py"] and args.np == 4
    off = horovodrun.build_parser().parse_args(["-np", "1", "--disable-cache",
                                                "--no-hierarchical-allreduce", "x"])
    assert horovodrun.horovod_env(off) == {"HOROVOD_CACHE_CAPACITY": "0",
                                           "HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}


def test_hosts_reach_the_launcher():
    from hpc_horovod import launch

    args = horovodrun.build_parser().parse_args(["-np", "4", "-H", "a:2,b:2", "--mpi-args",
                                                 "--mca btl self,tcp", "python", "train.py"])
    cmd = launch.build_command(launch.Launch(np=args.np, command=tuple(args.command),
                                             hosts=args.hosts, mpi_args=args.mpi_args), {})
    assert cmd[cmd.index("-H") + 1] == "a:2,b:2"
    assert cmd[-5:] == ["--mca", "btl", "self,tcp", "python", "train.py"]


@pytest.mark.parametrize("argv, why", [
    (["--gloo"], "no Gloo controller"),
    (["--host-discovery-script", "d.sh"], "there is no discovery script"),
    (["--blacklist-cooldown-range", "5"], "left out for the rest of the job"),
    (["--autotune"], "no autotuner"),
    (["-p", "2222"], "ssh options are not used"),
    (["--network-interface", "ib0"], "btl_tcp_if_include"),
    (["--start-timeout", "30"], "wait for them themselves"),
    (["--slots", "4"], "-H host:slots"),
])
def test_flags_that_cannot_be_honoured_are_refused(argv, why, capsys):
    with pytest.raises(SystemExit) as info:
        horovodrun.main(["-np", "2", *argv, "python", "train.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"horovodrun: error: {argv[0]} is not supported: " in err and why in err


@pytest.mark.parametrize("flag, hide", [("--log-hide-timestamp", "1"),
                                        ("--log-without-timestamp", "1"),
                                        ("--log-with-timestamp", "0")])
def test_timestamp_flags_become_horovod_log_hide_time(flag, hide):
    args = horovodrun.build_parser().parse_args(["-np", "2", flag, "python", "train.py"])
    assert horovodrun.horovod_env(args) == {"HOROVOD_LOG_HIDE_TIME": hide}


def test_an_unknown_log_level_stops_the_launch_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "verbose")
    assert horovodrun.main(["-np", "2", "python", "train.py"]) == 2
    assert capsys.readouterr().err == (
        "horovodrun: error: HOROVOD_LOG_LEVEL='verbose' is not a log level: use one of trace, "
        "debug, info, warning, error, fatal (in any case)\n")


def test_np_is_required(capsys):
    with pytest.raises(SystemExit):
        horovodrun.main(["python", "train.py"])
    assert "-np/--num-proc is required" in capsys.readouterr().err


def test_two_processes_for_real(tmp_path):
    code = ("import json, os, numpy as np, hpc_horovod as hvd; hvd.init(); "
            "total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum); "
            "print('RANK ' + json.dumps([hvd.rank(), hvd.size(), float(total[0]), "
            "os.environ['HOROVOD_FUSION_THRESHOLD']]), flush=True)")  # one write: one line
    proc = subprocess.run([*HOROVODRUN, "-np", "2", "--fusion-threshold-mb", "1", "--verbose",
                           sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # mpirun may run two ranks' tagged lines together: find the records, not the lines
    ranks = sorted(json.loads(found) for found in re.findall(r"RANK (\[[^\]]*\])", proc.stdout))
    assert ranks == [[0, 2, 3.0, "1048576"], [1, 2, 3.0, "1048576"]], proc.stdout
    assert "-x HOROVOD_FUSION_THRESHOLD" in proc.stderr  # --verbose shows the launcher command


def test_check_build(capsys):
    assert horovodrun.main(["--check-build"]) == 0
    assert "Available Frameworks:" in capsys.readouterr().out
