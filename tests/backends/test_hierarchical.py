"""The hierarchical host backend over real MPI processes: ``mpi_hierarchical.py`` runs under
``mpirun -np N`` for N = 2, 3, 4 (once per N), and every check it holds is one test here, which
passes when it passed on every rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from support import ROOT, clean_env, mpi_env, run_mpi

HERE = Path(__file__).parent
CHECKS = HERE / "mpi_hierarchical.py"
RANKS = (2, 3, 4)


def _check_ids() -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", str(CHECKS)], capture_output=True,
                          text=True, cwd=ROOT, env=clean_env(), timeout=300)
    ids = [line.split("::", 1)[1] for line in proc.stdout.splitlines() if "::" in line]
    if not ids:
        raise RuntimeError(f"no checks collected from {CHECKS}:\n{proc.stdout}\n{proc.stderr}")
    return ids


_IDS = _check_ids()
_runs: dict[int, dict[str, list[str]]] = {}


def _run(n: int, tmp: Path, select: str = "") -> dict[str, list[str]]:
    """Every check's failures on the ranks of one ``mpirun -np n`` (empty: passed everywhere),
    of the checks ``select`` names (pytest's ``-k``; empty: all)."""
    if n not in _runs:
        program = (f"exec {sys.executable} -m pytest -q -p no:cacheprovider {CHECKS} "
                   f"{'-k ' + select if select else ''} "
                   f"--junitxml={tmp}/rank-$OMPI_COMM_WORLD_RANK.xml")
        proc = subprocess.run(["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none",
                               "sh", "-c", program], capture_output=True, text=True,
                              timeout=900, env=mpi_env(), cwd=ROOT)
        tail = (proc.stdout + proc.stderr)[-4000:]
        outcomes: dict[str, list[str]] = {}
        for rank in range(n):
            path = tmp / f"rank-{rank}.xml"
            if not path.exists():
                outcomes.setdefault("<report>", []).append(f"rank {rank}: no report\n{tail}")
                continue
            for case in ET.parse(path).iter("testcase"):
                problems = [c.get("message", c.tag) for c in case
                            if c.tag in ("failure", "error", "skipped")]
                outcomes.setdefault(case.get("name"), [])
                outcomes[case.get("name")] += [f"rank {rank}: {p}" for p in problems]
        _runs[n] = outcomes
    return _runs[n]


@pytest.mark.mpi
@pytest.mark.parametrize("check", _IDS)
@pytest.mark.parametrize("ranks", RANKS)
def test_check(ranks, check, tmp_path_factory):
    outcomes = _run(ranks, tmp_path_factory.mktemp(f"np{ranks}"))
    assert "<report>" not in outcomes, outcomes["<report>"][0]
    assert check in outcomes, f"{check} did not run under mpirun -np {ranks}"
    assert outcomes[check] == [], "\n".join(outcomes[check])


@pytest.mark.mpi
def test_layouts_at_five_ranks(tmp_path_factory):
    """3 + 2, 2 + 3 and 2 + 2 + 1 ranks per node (only the layout check runs at 5)."""
    check = "test_layouts_bit_identical_to_flat"
    outcomes = _run(5, tmp_path_factory.mktemp("np5"), select=check)
    assert "<report>" not in outcomes, outcomes["<report>"][0]
    assert check in outcomes, f"{check} did not run under mpirun -np 5"
    assert outcomes[check] == [], "\n".join(outcomes[check])


@pytest.mark.mpi
def test_killed_rank_ends_the_job_named_and_leaves_no_segment():
    directory = "/dev/shm"
    before = set(os.listdir(directory))
    proc = run_mpi(3, HERE / "killed_rank_worker.py", timeout=300, check=False,
                   env={"HOROVOD_PEER_TIMEOUT_SECONDS": "20"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished an allreduce without rank 1" not in out, out
    assert re.search(r"rank 1 with PID \d+ .*(signal 9|Killed)", out, re.S), out
    left = [n for n in set(os.listdir(directory)) - before if n.startswith("osc_sm")]
    assert left == [], left
