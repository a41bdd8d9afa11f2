"""TensorFlow GPU tensors go through host memory (``tensorflow/staging.py`` says why): rank 0
says once what it costs, where TensorFlow sees a GPU; the collectives run as before. The GPU is
a stand-in here (``tf.config.list_logical_devices``)."""

from __future__ import annotations

import warnings

import pytest

tf = pytest.importorskip("tensorflow")

from support import single_process_job  # noqa: E402

import hpc_horovod.tensorflow as hvd  # noqa: E402
from hpc_horovod.tensorflow import staging  # noqa: E402


@pytest.fixture
def single(monkeypatch):
    with single_process_job(hvd, monkeypatch) as job:
        yield job


@pytest.fixture
def a_gpu(monkeypatch):
    """TensorFlow sees one GPU, and nothing was said yet in this process."""
    real = tf.config.list_logical_devices
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: ["GPU:0"] if kind == "GPU" else real(kind))
    monkeypatch.setattr(staging, "_NOTED", [])


def test_rank_0_says_once_what_staging_gpu_tensors_costs(single, a_gpu):
    x = tf.ones([4, 8], dtype=tf.float32)
    with pytest.warns(RuntimeWarning, match="through host memory over MPI, not NCCL") as said:
        out = hvd.allreduce(x, op=hvd.Sum)
    assert "128 bytes each way" in str(said[0].message)
    assert "__dlpack__" in str(said[0].message)
    assert out.numpy().tolist() == x.numpy().tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only: graph mode says nothing more
        tf.function(lambda: hvd.allreduce(x, op=hvd.Sum))()


def test_other_ranks_and_cpu_jobs_say_nothing(monkeypatch, a_gpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        staging.note_gpu_staging([tf.ones([2])], lambda: 1)
    monkeypatch.setattr(staging, "_NOTED", [])
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        staging.note_gpu_staging([tf.ones([2])], lambda: 0)
