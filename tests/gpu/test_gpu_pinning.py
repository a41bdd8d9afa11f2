"""GPU pinning: device = local rank modulo the visible devices, and clear errors for layouts that
cannot work. Pure functions over environment mappings as SLURM and CUDA write them."""

from __future__ import annotations

import pytest

import hpc_horovod as hvd
from hpc_horovod.common.basics import pin_gpu
from hpc_horovod.common.errors import TopologyError
from hpc_horovod.common.gpu_layout import (
    GpuLayoutError,
    gpus_requested,
    parse_visible_devices,
    per_task_binding,
    select_gpu,
    visible_device_count,
)

UUIDS = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6,GPU-00f1b4c5-1a7e-4c55-9a0b-6f2d2f1c3e21"


@pytest.mark.parametrize("value, expected", [
    ("0,1,2,3", ["0", "1", "2", "3"]),
    ("3", ["3"]),
    (" 1 , 0 ", ["1", "0"]),
    ("", []),
    ("NoDevFiles", []),
    ("-1", []),
    ("0,-1,2", ["0"]),  # CUDA stops at the first invalid entry
    (UUIDS, UUIDS.split(",")),
    ("MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0", ["MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0"]),  # noqa: E501
])
def test_parse_visible_devices(value, expected):
    assert parse_visible_devices(value) == expected


def test_visible_count_prefers_the_runtime_then_the_variable():
    assert visible_device_count({"CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert visible_device_count({"CUDA_VISIBLE_DEVICES": "0,1"}, runtime_count=1) == 1
    assert visible_device_count({}, runtime_count=4) == 4
    assert visible_device_count({}) is None


def test_one_rank_per_gpu_on_a_four_gpu_node():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4"}
    assert [select_gpu(r, 4, env) for r in range(4)] == [0, 1, 2, 3]


def test_uuid_entries_count_as_devices():
    env = {"CUDA_VISIBLE_DEVICES": UUIDS}
    assert [select_gpu(r, 2, env) for r in range(2)] == [0, 1]


def test_fewer_ranks_than_gpus_is_fine():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert [select_gpu(r, 3, env) for r in range(3)] == [0, 1, 2]


def test_gpus_per_task_shows_each_task_one_device():
    # srun --ntasks-per-node=4 --gpus-per-task=1: every task sees exactly its own GPU.
    for local_rank, visible in enumerate(["0", "1", "2", "3"]):
        env = {"CUDA_VISIBLE_DEVICES": visible, "SLURM_GPUS_PER_TASK": "1",
               "SLURM_GPUS_ON_NODE": "4"}
        assert select_gpu(local_rank, 4, env) == 0


def test_two_ranks_on_one_gpu_names_the_srun_fix():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4"}
    with pytest.raises(GpuLayoutError) as info:
        select_gpu(5, 8, env)
    message = str(info.value)
    assert "8 ranks" in message and "4 GPU(s)" in message
    assert "--ntasks-per-node=4" in message and "--gpus-per-task=1" in message
    assert "NCCL" in message
    assert isinstance(info.value, TopologyError)


def test_sharing_is_allowed_when_not_exclusive():
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    assert [select_gpu(r, 3, env, exclusive=False) for r in range(3)] == [0, 0, 0]


def test_no_gpu_visible_while_slurm_allocated_some():
    env = {"CUDA_VISIBLE_DEVICES": "", "SLURM_GPUS_ON_NODE": "4", "SLURM_STEP_GPUS": "0,1,2,3"}
    with pytest.raises(GpuLayoutError) as info:
        select_gpu(0, 4, env)
    message = str(info.value)
    assert "SLURM_GPUS_ON_NODE=4" in message and "--gpus-per-task=1" in message
    assert "nvidia-smi" in message


def test_no_gpu_reported_by_the_runtime_while_requested():
    env = {"SLURM_JOB_GPUS": "0,1"}
    with pytest.raises(GpuLayoutError, match="SLURM_JOB_GPUS=0,1"):
        select_gpu(0, 1, env, runtime_count=0)


def test_cpu_job_without_gpus_gets_no_device():
    assert select_gpu(0, 2, {"CUDA_VISIBLE_DEVICES": ""}) is None
    assert select_gpu(1, 2, {}, runtime_count=0) is None


def test_unknown_count_falls_back_to_the_local_rank():
    assert select_gpu(3, 4, {}) == 3


def test_gpus_requested_and_per_task_binding():
    assert gpus_requested({}) is None
    assert gpus_requested({"SLURM_GPUS_ON_NODE": "0"}) is None
    assert gpus_requested({"SLURM_GPUS_PER_NODE": "a100:4"}) == "SLURM_GPUS_PER_NODE=a100:4"
    assert per_task_binding({"SLURM_GPUS_PER_TASK": "1"})
    assert per_task_binding({"SLURM_GPU_BIND": "closest"})
    assert per_task_binding({"SLURM_GPU_BIND": "map_gpu:0,1"})
    assert not per_task_binding({"SLURM_GPU_BIND": "verbose,none"})
    assert not per_task_binding({})


@pytest.fixture
def single_process(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith(("SLURM_", "OMPI_", "PMI_"))]:
        monkeypatch.delenv(key)
    hvd.init()
    yield
    hvd.shutdown()


def test_pin_gpu_on_a_cpu_rank_returns_none(single_process, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert pin_gpu() is None


def test_pin_gpu_raises_when_the_job_holds_gpus_it_cannot_see(single_process, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "NoDevFiles")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    with pytest.raises(GpuLayoutError, match="sees none"):
        pin_gpu()


def test_pin_gpu_rejects_an_unknown_framework(single_process):
    with pytest.raises(ValueError, match="unknown framework 'jax'"):
        pin_gpu("jax")
