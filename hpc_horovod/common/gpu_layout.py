"""Which GPU each rank uses, read from SLURM's and CUDA's variables, and the layouts that
cannot work.

Pinning follows Horovod's rule, device = local rank modulo the devices this process sees, with
the devices read from ``CUDA_VISIBLE_DEVICES`` when it is set (so that no CUDA context is created
just to count them) and from the framework's runtime otherwise. A SLURM step started with
``--gpus-per-task=1`` shows each task exactly one device, which the same rule maps to index 0.
The layouts that cannot work (two ranks on one GPU, which NCCL refuses; no GPU although the job
asked for some) raise :class:`GpuLayoutError` naming the ``srun`` options that fix them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from .errors import TopologyError
from .gpu_probe import nccl_version_tuple

#: Variables by which SLURM says that the job or step holds GPUs on this node.
_SLURM_GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS",
                        "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_NODE", "SLURM_GPUS")


class GpuLayoutError(TopologyError):
    """The ranks of a node cannot each get a GPU of their own; the message says how to fix it."""


def parse_visible_devices(value: str) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, as the CUDA runtime reads them.

    Entries are indices or ``GPU-``/``MIG-`` UUIDs; the runtime stops at the first entry that is
    neither (SLURM's ``NoDevFiles``, ``-1``), which hides that entry and all that follow.
    """
    entries = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.startswith(("GPU-", "MIG-")) or entry.isdigit():
            entries.append(entry)
        else:
            break
    return entries


def visible_device_count(env: Mapping[str, str], runtime_count: int | None = None) -> int | None:
    """How many devices this process sees: the runtime's count when one was asked, else the
    length of ``CUDA_VISIBLE_DEVICES``; None when neither is known."""
    if runtime_count is not None:
        return runtime_count
    if "CUDA_VISIBLE_DEVICES" in env:
        return len(parse_visible_devices(env["CUDA_VISIBLE_DEVICES"]))
    return None


def gpus_requested(env: Mapping[str, str]) -> str | None:
    """The SLURM variable (as ``NAME=value``) that shows the job holds GPUs here, else None."""
    for name in _SLURM_GPU_VARIABLES:
        value = env.get(name, "").strip()
        if value and value not in ("0", "(null)"):
            return f"{name}={value}"
    return None


def per_task_binding(env: Mapping[str, str]) -> bool:
    """True when SLURM gives each task its own GPUs (``--gpus-per-task`` or ``--gpu-bind``),
    so that the devices one task sees are not shared with the other tasks of the node."""
    if env.get("SLURM_GPUS_PER_TASK", "").strip():
        return True
    bind = env.get("SLURM_GPU_BIND", "").strip().lower()
    return bool(bind) and bind.split(",")[-1] != "none"


def same_devices_on_node(env: Mapping[str, str]) -> bool:
    """True when every rank of the node certainly sees the same devices as this one: no
    ``CUDA_VISIBLE_DEVICES`` (all the node's devices), or SLURM set it for the whole step
    (GPUs held, no per-task binding). A launcher may also set ``CUDA_VISIBLE_DEVICES`` per rank
    (one device each): only comparing the ranks' devices tells then (:func:`shared_gpus`)."""
    if "CUDA_VISIBLE_DEVICES" not in env:
        return True
    return gpus_requested(env) is not None and not per_task_binding(env)


def select_gpu(local_rank: int, local_size: int, env: Mapping[str, str],
               runtime_count: int | None = None, *, exclusive: bool = True) -> int | None:
    """The device index (within the visible devices) for this rank, or None for a CPU rank.

    ``exclusive`` (what NCCL needs) makes two ranks on one GPU an error where this process
    alone can tell (:func:`same_devices_on_node`); pass False when the ranks may share devices
    (MPI transport only). ``init`` compares the ranks' devices themselves (:func:`shared_gpus`).
    """
    count = visible_device_count(env, runtime_count)
    shown = env.get("CUDA_VISIBLE_DEVICES")
    where = ("CUDA_VISIBLE_DEVICES is not set" if shown is None
             else f"CUDA_VISIBLE_DEVICES={shown!r}")
    if count is None:
        return local_rank
    if count == 0:
        requested = gpus_requested(env)
        if requested is None:
            return None
        raise GpuLayoutError(
            f"the job holds GPUs on this node ({requested}) but this process sees none "
            f"({where}). Ask for GPUs on the step itself (`srun --gpus-per-task=1 ...`, or "
            "`--gres=gpu:N` on the srun line when the step does not inherit the job's GPUs), "
            "and check that the CUDA driver works on the node (`srun nvidia-smi`)."
        )
    if exclusive and local_size > count and same_devices_on_node(env) \
            and not sharing_allowed(-(-local_size // count), _nccl_version(), env):
        raise GpuLayoutError(
            f"{local_size} ranks run on this node but they see only {count} GPU(s) ({where}): "
            "ranks would share a GPU, which NCCL refuses. Start one rank per GPU: "
            f"`--ntasks-per-node={count}` (the number of GPUs per node), or give each task its "
            "own GPU with `srun --gpus-per-task=1`. NCCL 2.30 or newer accepts up to "
            f"{MAX_RANKS_PER_GPU} ranks per GPU with NCCL_MULTI_RANK_GPU_ENABLE=1."
        )
    return local_rank % count


def runtime_count(framework: str | None) -> int | None:
    """The device count reported by an already-loaded framework (no import, no CUDA init for
    frameworks that count through NVML)."""
    if framework in (None, "torch") and "torch" in sys.modules:
        torch = sys.modules["torch"]
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    if framework in (None, "cupy") and "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        try:
            return int(cupy.cuda.runtime.getDeviceCount())
        except cupy.cuda.runtime.CUDARuntimeError:
            return 0
    if framework in (None, "tensorflow") and "tensorflow" in sys.modules:
        return len(sys.modules["tensorflow"].config.list_physical_devices("GPU"))
    return None


#: NCCL >= 2.30 runs up to this many ranks on one GPU; more may hang (NCCL's documentation of
#: NCCL_MULTI_RANK_GPU_ENABLE: "up to 2 ranks per GPU").
MAX_RANKS_PER_GPU = 2


def _nccl_version() -> int:
    from .gpu_probe import nccl_built

    return nccl_built()


def multi_rank_flag(env: Mapping[str, str]) -> bool:
    """Whether ``NCCL_MULTI_RANK_GPU_ENABLE=1`` is set in ``env``."""
    return env.get("NCCL_MULTI_RANK_GPU_ENABLE", "").strip() == "1"


def multi_rank_gpu_allowed(nccl_version: int, env: Mapping[str, str]) -> bool:
    """NCCL accepts several ranks on one GPU only from 2.30, and only with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (older releases fail: "Duplicate GPU detected")."""
    return (bool(nccl_version) and nccl_version_tuple(nccl_version) >= (2, 30, 0)
            and multi_rank_flag(env))


def sharing_allowed(ranks_per_gpu: int, nccl_version: int, env: Mapping[str, str]) -> bool:
    """Whether NCCL runs ``ranks_per_gpu`` ranks on one GPU: always one; two (at most
    :data:`MAX_RANKS_PER_GPU`) where :func:`multi_rank_gpu_allowed`."""
    return ranks_per_gpu <= 1 or (ranks_per_gpu <= MAX_RANKS_PER_GPU
                                  and multi_rank_gpu_allowed(nccl_version, env))


def shared_gpus(entries: Sequence[tuple[object, str | None]]) -> list[list[int]]:
    """The groups of ranks that would share one GPU: ``entries[rank]`` is (the rank's node
    index, the PCI bus id of its GPU, or None for a rank without one). The node is the
    topology's index, not the hostname: containers and fake nodes may share a hostname."""
    owners: dict[tuple[object, str], list[int]] = {}
    for rank, (node, bus_id) in enumerate(entries):
        if bus_id is not None:
            owners.setdefault((node, bus_id.lower()), []).append(rank)
    return [ranks for ranks in owners.values() if len(ranks) > 1]


def sharing_message(groups: list[list[int]], entries: Sequence[tuple[object, str | None]]
                    ) -> str:
    """Why NCCL cannot run on this layout, naming the ranks and GPUs concerned and the fixes."""
    shown = "; ".join(f"ranks {', '.join(map(str, ranks))} on GPU {entries[ranks[0]][1]}"
                      for ranks in groups[:4])
    more = f" (and {len(groups) - 4} more)" if len(groups) > 4 else ""
    return (f"several ranks would use one GPU ({shown}{more}), which NCCL refuses "
            "(\"Duplicate GPU detected\"). Start one rank per GPU: `--ntasks-per-node` = GPUs "
            "per node, or `srun --gpus-per-task=1`; a launcher that sets CUDA_VISIBLE_DEVICES "
            "per rank must give each rank of a node a different GPU. NCCL 2.30 or newer "
            f"accepts up to {MAX_RANKS_PER_GPU} ranks per GPU with "
            "NCCL_MULTI_RANK_GPU_ENABLE=1 (set on rank 0).")


def device_bus_id(device: int) -> str:
    """The PCI bus id of visible device ``device``: the same physical GPU has the same id in
    every process of the node, whatever its ``CUDA_VISIBLE_DEVICES``. Creates no context."""
    import cupy

    return cupy.cuda.runtime.deviceGetPCIBusId(device)


def check_tensor_device(index: int, rank_device: int, op_name: str) -> None:
    """Raise ValueError when a CUDA tensor is on another GPU than this rank's: the collective
    runs on the rank's GPU, and reading another device's memory there would race with that
    device's streams."""
    if index != rank_device:
        raise ValueError(
            f"{op_name}: the tensor is on cuda:{index} but this rank's GPU is "
            f"cuda:{rank_device} (one process: the GPU of its first CUDA tensor). Move it "
            f"there (tensor.to('cuda:{rank_device}')), or use that GPU for all of the rank's "
            "tensors: `torch.cuda.set_device(hvd.local_rank())` (or hvd.pin_gpu()) at the "
            "start, and tensors on 'cuda'.")
