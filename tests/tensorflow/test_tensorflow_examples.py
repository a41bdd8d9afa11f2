"""The TensorFlow examples on 2 processes under ``hpc-horovod run``, as a user runs them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import mpi_env

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.mpi
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
HPC_HOROVOD = Path(sys.executable).parent / "hpc-horovod"
# One intra- and one inter-op thread per process keep two processes on two cores.
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1",
          "TF_NUM_INTEROP_THREADS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}


def hpc_horovod_run(np_: int, script: str, *args, timeout: float = 240) -> str:
    cmd = [str(HPC_HOROVOD), "run", "-np", str(np_), sys.executable, str(EXAMPLES / script),
           *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=mpi_env(TF_ENV))
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def final_accuracy(output: str) -> float:
    found = re.findall(r"FINAL val_accuracy=(\S+)", output)
    assert len(found) == 1, f"rank 0 alone prints the result:\n{output}"
    return float(found[0])


def test_keras_digits_reaches_90_percent_with_rank0_checkpoints(tmp_path):
    out = hpc_horovod_run(2, "tensorflow2_keras_digits.py", "--epochs", 6,
                          "--checkpoint-dir", tmp_path)
    assert final_accuracy(out) >= 0.9, out
    assert "processes=2" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        [f"checkpoint-{epoch}.keras" for epoch in range(1, 7)]
    assert out.count("Epoch 1/6") == 1, "only rank 0 is verbose"


def test_gradient_tape_digits_reaches_90_percent():
    assert final_accuracy(hpc_horovod_run(2, "tensorflow2_digits_gradient_tape.py",
                                          "--epochs", 6)) >= 0.9


def test_tf1_monitored_session_script_checkpoints_on_rank0_only(tmp_path):
    out = hpc_horovod_run(2, "tensorflow1_monitored_session.py", "--steps", 300,
                          "--checkpoint-dir", tmp_path / "ckpt")
    finals = {rank: (float(accuracy), weights) for rank, accuracy, weights in re.findall(
        r"FINAL rank=(\d) val_accuracy=([\d.]+) weights=([\d.]+)", out)}
    assert set(finals) == {"0", "1"}, out
    assert finals["0"] == finals["1"], "the ranks must end with the same weights and accuracy"
    assert finals["0"][0] >= 0.9, out
    assert (tmp_path / "ckpt" / "checkpoint").is_file()
    assert any(p.name.startswith("model.ckpt-150") for p in (tmp_path / "ckpt").iterdir())


def test_synthetic_benchmark_reports_images_per_second():
    out = hpc_horovod_run(2, "tensorflow2_synthetic_benchmark.py", "--num-warmup-batches", 1,
                          "--num-batches-per-iter", 2, "--num-iters", 2, "--batch-size", 8,
                          "--image-size", 32, "--threads", 1)
    total = re.search(r"Total img/sec on 2 CPU process\(es\): (\S+)", out)
    assert total and float(total.group(1)) > 0, out


def test_jean_zay_keras_recipe_trains_checkpoints_on_rank0_and_validates(tmp_path):
    """The Jean Zay page's Keras example: fit, rank-0 checkpoints, then the distributed
    validation with ``hvd.allreduce(metric.result())`` used as a tensor."""
    out = hpc_horovod_run(2, "tensorflow2_keras_jean_zay.py", "--epochs", 3,
                          "--checkpoint-dir", tmp_path)
    assert final_accuracy(out) >= 0.85, out
    assert "processes=2" in out and float(re.search(r"val_loss=(\S+)", out).group(1)) < 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        [f"checkpoint-{epoch}.keras" for epoch in range(1, 4)]
    assert out.count("Epoch 1/3") == 1, "only rank 0 is verbose"
