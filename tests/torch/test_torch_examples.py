"""The PyTorch examples as a user runs them: ``hpc-horovod run -np 2 python examples/...``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, mpi_env

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytestmark = pytest.mark.mpi
EPOCH = re.compile(r"epoch (\d+)/(\d+): train loss [\d.]+  val accuracy ([\d.]+) \((\d+) samples\)")


def run_example(script: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "hpc_horovod.cli", "run", "-np", "2", sys.executable,
           str(ROOT / "examples" / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=mpi_env(),
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def epochs(stdout: str) -> list[tuple[int, float]]:
    found = [(int(m.group(1)), float(m.group(3))) for m in EPOCH.finditer(stdout)]
    assert all(int(m.group(4)) == 360 for m in EPOCH.finditer(stdout)), stdout  # whole val set
    return found


def test_digits_trains_to_090_and_resumes_from_its_checkpoint(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "checkpoint-00000009.ckpt").write_bytes(b"an older run's")  # --no-resume drops it
    first = run_example("pytorch_digits.py", "--epochs", "4", "--checkpoint-dir", str(ckpt),
                        "--no-resume")
    assert [e for e, _ in epochs(first)] == [1, 2, 3, 4], first
    assert "[1,1]<stdout>:epoch" not in first, "only rank 0 prints"
    # the three newest, complete, no temporary file left
    assert sorted(p.name for p in ckpt.iterdir()) == [f"checkpoint-0000000{e}.ckpt"
                                                      for e in (2, 3, 4)]

    second = run_example("pytorch_digits.py", "--epochs", "5", "--checkpoint-dir", str(ckpt))
    assert f"resuming from {ckpt / 'checkpoint-00000004.ckpt'} (epoch 4" in second, second
    resumed = epochs(second)
    assert [e for e, _ in resumed] == [5], second
    # Epoch 5 continues from trained weights: one epoch from scratch stays far below this.
    assert resumed[-1][1] >= 0.9, second


def test_synthetic_benchmark_reports_images_per_second():
    out = run_example("pytorch_synthetic_benchmark.py", "--image-size", "16", "--width", "4",
                      "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
                      "--num-iters", "2", "--fp16-allreduce")
    assert "Number of CPUs: 2" in out, out
    assert re.search(r"Iter #1: [\d.]+ img/sec per CPU", out), out
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", out), out
