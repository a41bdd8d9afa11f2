"""Jobs across the test cluster's two real hosts, h1 and h2 (network namespaces with their own
hostname and address: conftest.py, hosts.py), two ranks on each, under ``srun --mpi=pmix`` (and
the collectives also under ``mpirun`` inside a batch job).

What only distinct hosts show: the topology from the hosts' names, every collective and a
DistributedOptimizer step with ranks on both sides of the network and side by side on one host
(Open MPI's shared memory), process sets that span the hosts, a long run, and what happens to
the job when a host is lost, or when a rank is only slow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slurm

WORKERS = Path(__file__).resolve().parent / "workers"
LONG_RUN = Path(__file__).resolve().parents[1] / "torch" / "long_run.py"
SRUN_2X2 = ["srun", "-N", "2", "--ntasks-per-node=2", "--mpi=pmix", "--label"]
#: seconds from the loss of a host to the end of the job, at most
LOST_HOST_LIMIT_S = 10.0
#: seconds a job that overran that limit may still take before it is cancelled (so that the
#: failure reports how late it was, within reason)
GRACE_S = 3.0


def _by_task(out: str) -> list[str]:
    """The lines of ``srun --label`` output, ordered by task."""
    lines = [line.split(": ", 1) for line in out.splitlines() if re.match(r"\d+: ", line)]
    return [text for _, text in sorted(lines, key=lambda item: int(item[0]))]


def test_each_host_has_its_own_name_address_and_network(slurm):
    proc = slurm.run(["srun", "-l", "-N", "2", "-n", "4", "--ntasks-per-node=2", "hostname"],
                     check=True)
    assert _by_task(proc.stdout) == ["h1", "h1", "h2", "h2"], proc.stdout

    show = "echo $(readlink /proc/self/ns/net) $(ip -4 -o addr show dev eth0)"
    proc = slurm.run([*SRUN_2X2, "sh", "-c", show], check=True)
    rows = [line.split() for line in _by_task(proc.stdout)]
    namespaces = [row[0] for row in rows]
    addresses = [row[4].split("/")[0] for row in rows]
    hosts = slurm.network.hosts
    assert addresses == [hosts["h1"].address] * 2 + [hosts["h2"].address] * 2, proc.stdout
    assert namespaces[0] == namespaces[1] != namespaces[2] == namespaces[3], namespaces
    assert os.readlink("/proc/self/ns/net") not in namespaces


def test_each_host_reaches_the_controller(slurm):
    # srun's own tasks start on both hosts, so slurmctld and munge reach each slurmd; here
    # each host's own clients reach slurmctld, through munge, across the bridge
    proc = slurm.run(["srun", "-l", "-N", "2", "--ntasks-per-node=1", "scontrol", "ping"],
                     check=True)
    lines = _by_task(proc.stdout)
    assert len(lines) == 2 and all(re.search(r"Slurmctld\(primary\) at \S+ is UP", line)
                                   for line in lines), proc.stdout


def test_ranks_of_one_host_talk_through_shared_memory(slurm):
    # Open MPI's shared-memory transport alone (no TCP) joins the two ranks of one host
    code = ("import numpy as np, hpc_horovod as hvd; hvd.init(); "
            "t = hvd.allreduce(np.ones(1 << 20, np.float32), op=hvd.Sum); "
            "print('sum', int(t.min()), int(t.max()), 'local size', hvd.local_size())")
    proc = slurm.run(["srun", "-l", "-N", "1", "-n", "2", "-w", "h2", "--mpi=pmix",
                      sys.executable, "-c", code], env={"OMPI_MCA_btl": "self,vader"},
                     timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _by_task(proc.stdout) == ["sum 2 2 local size 2"] * 2, proc.stdout + proc.stderr


#: what two_hosts.py checks, in its order
CHECKS = ["topology", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
          "barrier", "join", "optimizer", "process sets", "shutdown"]


@pytest.fixture(scope="module", params=["srun", "mpirun"])
def two_hosts_job(request, slurm, tmp_path_factory) -> tuple[int, str]:
    """One run of two_hosts.py on 2 hosts x 2 ranks (its checks follow one another): its exit
    status and output. Under srun the topology comes from SLURM's variables; under mpirun,
    inside a batch job, from the MPI processes that share a host's memory."""
    worker = [sys.executable, str(WORKERS / "two_hosts.py")]
    if request.param == "srun":
        proc = slurm.run([*SRUN_2X2, *worker], timeout=300)
        return proc.returncode, proc.stdout + proc.stderr
    folder = tmp_path_factory.mktemp("mpirun")
    script = folder / "job.sh"
    script.write_text("#!/bin/sh\n#SBATCH -N 2 --ntasks-per-node=2 -o out.txt\n"
                      "mpirun -np 4 --map-by ppr:2:node --bind-to none --tag-output "
                      + " ".join(worker) + "\n")
    status, _ = slurm.submit_and_wait(script, timeout=300)
    out = re.sub(r"\[1,\d+\]<std(?:out|err)>:", "", (folder / "out.txt").read_text())
    return status, out


@pytest.mark.parametrize("check", CHECKS)
def test_across_two_hosts(two_hosts_job, check):
    status, out = two_hosts_job
    passed = [rank for rank in range(4) if f"rank {rank}: {check} ok" in out]
    assert passed == [0, 1, 2, 3], f"{check!r} passed only on ranks {passed}:\n{out}"
    if check == "shutdown":
        assert status == 0, out


def _lose_h2(slurm, tmp_path: Path, *srun_flags: str, worker_args: tuple = (),
             wait_s: float = LOST_HOST_LIMIT_S + GRACE_S) -> tuple[float | None, int, str]:
    """Run lose_host.py, whose ranks on h2 kill themselves at step 5 (under
    ``--kill-on-bad-exit`` SLURM may kill the second before it does). Returns the seconds from
    the first of those deaths to the end of srun (None: srun still ran ``LOST_HOST_LIMIT_S +
    GRACE_S`` after it, and its job was cancelled then), srun's exit status and its output."""
    mark, log = tmp_path / "killed_at", tmp_path / "srun.out"
    name = f"lose-h2-{os.getpid()}-{tmp_path.name}"
    cmd = [*SRUN_2X2, "-J", name, *srun_flags, sys.executable, str(WORKERS / "lose_host.py"),
           "h2", str(mark), *worker_args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=slurm.env(),
                                cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        marks = []
        while not marks and proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks on h2 did not reach step 5 in 120 s:\n"
                            f"{log.read_text()}\n{slurm.logs()}")
            time.sleep(0.05)
            marks = list(tmp_path.glob("killed_at.*"))
        if not marks:
            pytest.fail(f"no rank on h2 reached step 5:\n{log.read_text()}")
        killed_at = min(float(m.read_text()) for m in marks)
        try:
            proc.wait(timeout=max(0.0, killed_at + wait_s - time.time()))
            took = time.time() - killed_at
            (tmp_path / "killed_at").write_text(repr(killed_at))
        except subprocess.TimeoutExpired:
            took = None
    finally:
        if proc.poll() is None:
            slurm.run(["scancel", "-n", name])
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return took, proc.returncode, log.read_text()


def _names_the_loss(text: str) -> bool:
    """``text`` names host h2 and its ranks, 2 and 3 ("2-3", "2, 3", "[2, 3]", "2 and 3")."""
    return "h2" in text and re.search(r"\b2\b\D{0,5}\b3\b", text) is not None


def _check_lost_host(took: float | None, returncode: int, out: str, text_naming_it: str) -> None:
    assert took is not None, (
        f"the job still ran {LOST_HOST_LIMIT_S + GRACE_S:.0f} s after the ranks on h2 were killed "
        f"(cancelled then):\n{out}")
    assert took < LOST_HOST_LIMIT_S, f"the job ended {took:.1f} s after the kill:\n{out}"
    assert returncode != 0, out
    assert "survived" not in out, out
    assert _names_the_loss(text_naming_it), f"h2 and its ranks 2, 3 are not named:\n{out}"


def test_a_lost_host_ends_the_job_under_kill_on_bad_exit(slurm, tmp_path):
    took, returncode, out = _lose_h2(slurm, tmp_path, "--kill-on-bad-exit=1")
    # SLURM ends the step at the first task's death, and srun names that task and its host
    _check_lost_host(took, returncode, out, out)
    print(f"--kill-on-bad-exit=1: the job ended {took:.1f} s after the ranks on h2 died")


def test_a_lost_host_ends_the_job_under_plain_srun(slurm, tmp_path):
    # SLURM's default (KillOnBadExit=0) leaves the survivors running: they must notice the
    # loss themselves, and say which ranks and which host are gone (srun's own line about the
    # dead tasks does not count)
    took, returncode, out = _lose_h2(slurm, tmp_path)
    survivors = "\n".join(line for line in out.splitlines() if line.startswith(("0: ", "1: ")))
    _check_lost_host(took, returncode, out, survivors)
    print(f"plain srun: the job ended {took:.1f} s after the ranks on h2 died")


def test_a_child_of_a_lost_rank_does_not_hide_its_death(slurm, tmp_path):
    # each rank forked a child (a data loader's worker) that outlives it; the ones on h2 live
    # 15 s longer: the survivors must still stop within the limit, naming the loss (the step
    # itself ends only once those children are gone)
    took, returncode, out = _lose_h2(slurm, tmp_path, worker_args=("fork",), wait_s=60)
    assert took is not None and returncode != 0, out
    killed_at = float((tmp_path / "killed_at").read_text())
    stops = [float(m) for m in re.findall(r"^[01]: rank [01]: stopped at ([0-9.]+)$", out, re.M)]
    assert len(stops) == 2, out
    assert max(stops) - killed_at < LOST_HOST_LIMIT_S, out
    survivors = "\n".join(line for line in out.splitlines() if line.startswith(("0: ", "1: ")))
    assert _names_the_loss(survivors), out
    print(f"with forked children: the survivors stopped {max(stops) - killed_at:.1f} s after "
          "the ranks on h2 died")


def test_a_slow_rank_is_not_taken_for_a_lost_one(slurm):
    # plain srun, as above: rank 0 stops 20 s in a step while the others wait for it
    start = time.monotonic()
    proc = slurm.run([*SRUN_2X2, sys.executable, str(WORKERS / "slow_rank.py"), "20"],
                     timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "rank 0: checkpoint for 20 s" in out, out
    assert all(f"rank {r}: done" in out for r in range(4)), out
    assert time.monotonic() - start > 20


def test_long_run_across_two_hosts(slurm):
    """A long run at the size of a test: 300 steps of 4 ranks on 2 hosts (long_run.py)."""
    proc = slurm.run([*SRUN_2X2, sys.executable, str(LONG_RUN), "300"],
                     timeout=400, env={"HOROVOD_BUCKET_BYTES": "2048"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rank in range(4):
        assert f"rank {rank}: long run ok ({300 + 3 * rank} steps)" in out, out



#: what hierarchical_vs_flat.py compares, in its order
PATH_CHECKS = ["path", "below in place", "below out of place", "above in place",
               "above out of place", "optimizer", "shutdown"]
#: the layouts: 2 + 2 ranks and 3 + 3 (slices reduced across nodes, three of them uneven at
#: 3 + 3), and 2 + 1 (through the nodes' leaders)
LAYOUTS = {"2+2": (4, ["-N", "2", "--ntasks-per-node=2"]),
           "3+3": (6, ["-N", "2", "--ntasks-per-node=3"]),
           "2+1": (3, ["-N", "2", "-n", "3"])}
PATHS = {"hierarchical": "1", "flat": "0"}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def both_paths(request, slurm, tmp_path_factory) -> tuple[int, dict, dict]:
    """hierarchical_vs_flat.py under srun at one layout, with the hierarchical path on and off
    (windows of 16 MiB: several chunks above the threshold): the ranks, each path's output and
    its saved results by rank (None where a rank saved none)."""
    folder = tmp_path_factory.mktemp("paths")
    ranks, layout = LAYOUTS[request.param]
    outputs, results = {}, {}
    for label, flag in PATHS.items():
        proc = slurm.run(["srun", *layout, "--mpi=pmix", "--label", sys.executable,
                          str(WORKERS / "hierarchical_vs_flat.py"), str(folder), label],
                         timeout=300, env={"HOROVOD_HIERARCHICAL_ALLREDUCE": flag,
                                           "HOROVOD_FUSION_THRESHOLD": str(16 << 20)})
        outputs[label] = f"exit status {proc.returncode}\n{proc.stdout}{proc.stderr}"
        files = [folder / f"{label}.{r}.npz" for r in range(ranks)]
        results[label] = [dict(np.load(f)) if f.exists() else None for f in files]
    return ranks, outputs, results


def _within(name: str, hier: np.ndarray, flat: np.ndarray, bound) -> None:
    """Integers bit-identical; floats apart by at most ``bound`` (elementwise)."""
    assert hier.dtype == flat.dtype and hier.shape == flat.shape, (name, hier.dtype, flat.dtype)
    if hier.dtype.kind in "iu":
        assert hier.tobytes() == flat.tobytes(), name
        return
    beyond = np.abs(hier.astype(np.float64) - flat) - bound
    assert beyond.max() <= 0, f"{name}: {int((beyond > 0).sum())} elements apart by more than " \
                              f"the bound, the worst by {beyond.max()}"


@pytest.mark.parametrize("check", PATH_CHECKS)
def test_hierarchical_and_flat_paths_agree_across_two_hosts(both_paths, check):
    """Across h1 and h2 the hierarchical path gives what the flat one (MPI alone) gives:
    integer sums bit-identical, float sums within one rounding per reduction step (as
    tests/backends/mpi_hierarchical.py), at 2 + 2, 3 + 3 and 2 + 1 ranks."""
    ranks, outputs, results = both_paths
    for label, out in outputs.items():
        done = [r for r in range(ranks) if f"{r}: rank {r}: {check} done" in out]
        assert done == list(range(ranks)), f"{label}: {check!r} done only on {done}:\n{out}"
    if check in ("path", "shutdown"):
        return
    hier, flat = results["hierarchical"], results["flat"]
    steps = ranks  # one rounding per reduction step, and one for the scaling
    if check != "optimizer":
        prefix = check.replace(" in place", ".ip.").replace(" out of place", ".oop.")
        for r in range(ranks):
            for key in [k for k in flat[r] if k.startswith(prefix)]:
                value = flat[r][key]  # positive floats: the sum is the sum of the magnitudes
                bound = steps * np.finfo(value.dtype).eps * np.abs(value) \
                    if value.dtype.kind == "f" else 0
                _within(f"rank {r}: {key}", hier[r][key], flat[r][key], bound)
        return
    names = [k.removeprefix("grad.") for k in flat[0] if k.startswith("grad.")]
    assert names, list(flat[0])
    for name in names:
        magnitude = sum(np.abs(flat[r][f"local.{name}"]) for r in range(ranks)) / ranks
        bound = steps * np.finfo(np.float32).eps * magnitude
        for r in range(ranks):  # the averaged gradients, then SGD's step with lr 0.1
            _within(f"rank {r}: grad.{name}", hier[r][f"grad.{name}"], flat[r][f"grad.{name}"],
                    bound)
            param = flat[r][f"param.{name}"]
            _within(f"rank {r}: param.{name}", hier[r][f"param.{name}"], param,
                    0.1 * bound + 2 * np.finfo(np.float32).eps * np.abs(param))
            for path in (hier, flat):  # every rank ends with the same parameters
                assert path[r][f"param.{name}"].tobytes() == path[0][f"param.{name}"].tobytes()
