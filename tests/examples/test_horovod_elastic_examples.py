"""Horovod's own elastic examples (``examples/elastic/pytorch/
pytorch_synthetic_benchmark_elastic.py``, ``examples/elastic/tensorflow2/
tensorflow2_synthetic_benchmark_elastic.py``), read from a Horovod checkout and run with only
their import line changed, under ``hpc-horovod run --min-np 1 --max-np 2 -np 2``.

The checkout is ``HOROVOD_SOURCE`` (default ``/work/hvdsuite``); the tests skip without one.
The PyTorch example takes its model from torchvision; where torchvision is missing, a stand-in
package on PYTHONPATH gives ``torchvision.models.<name>()`` as a small convolutional network of
the same interface (3x224x224 images in, 1000 classes out), so that the run stays short.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import ROOT, mpi_env

pytestmark = pytest.mark.mpi
SOURCE = Path(os.environ.get("HOROVOD_SOURCE", "/work/hvdsuite"))
TORCHVISION_STAND_IN = textwrap.dedent("""\
    import torch


    def _small(**kwargs):
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 8, stride=8), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                   torch.nn.Linear(4, 1000))


    def __getattr__(name):
        return _small
""")


def _example(tmp_path: Path, relative: str, module: str) -> Path:
    source = SOURCE / "examples" / "elastic" / relative
    if not source.is_file():
        pytest.skip(f"no Horovod checkout with {relative} at {SOURCE} (set HOROVOD_SOURCE)")
    text = source.read_text()
    line = f"import horovod.{module} as hvd"
    assert text.count(line) == 1, f"{source} no longer has the line {line!r}"
    script = tmp_path / source.name
    script.write_text(text.replace(line, f"import hpc_horovod.{module} as hvd"))
    return script


def _run(script: Path, *args: str, path: str = "") -> str:
    env = mpi_env({"PYTHONPATH": os.pathsep.join(
        p for p in (path, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)})
    proc = subprocess.run([sys.executable, "-m", "hpc_horovod.cli", "run", "--min-np", "1",
                           "--max-np", "2", "-np", "2", sys.executable, str(script), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_pytorch_synthetic_benchmark_elastic(tmp_path):
    pytest.importorskip("torch")
    script = _example(tmp_path, "pytorch/pytorch_synthetic_benchmark_elastic.py", "torch")
    path = ""
    if importlib.util.find_spec("torchvision") is None:
        (tmp_path / "stand_in" / "torchvision").mkdir(parents=True)
        (tmp_path / "stand_in" / "torchvision" / "__init__.py").write_text("")
        (tmp_path / "stand_in" / "torchvision" / "models.py").write_text(TORCHVISION_STAND_IN)
        path = str(tmp_path / "stand_in")
    out = _run(script, "--batch-size", "4", "--num-warmup-batches", "1",
               "--num-batches-per-iter", "2", "--num-iters", "2", "--num-batches-per-commit",
               "2", path=path)
    assert "Number of CPUs: 2" in out, out
    assert re.search(r"Iter #1: [\d.]+ img/sec per CPU", out), out
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", out), out


def test_tensorflow2_synthetic_benchmark_elastic(tmp_path):
    pytest.importorskip("tensorflow")
    script = _example(tmp_path, "tensorflow2/tensorflow2_synthetic_benchmark_elastic.py",
                      "tensorflow")
    out = _run(script, "--model", "MobileNetV3Small", "--batch-size", "2", "--no-cuda",
               "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2")
    assert "Number of CPUs: 2" in out, out
    assert re.search(r"Iter #1: [\d.]+ img/sec per CPU", out), out
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", out), out
