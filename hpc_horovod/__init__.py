"""hpc_horovod: Horovod-style data-parallel training, native to SLURM clusters.

This module is the framework-neutral API on numpy arrays; ``hpc_horovod.torch``,
``hpc_horovod.tensorflow`` and ``hpc_horovod.tensorflow.keras`` offer the same names on their
tensors::

    import hpc_horovod as hvd
    hvd.init()
    total = hvd.allreduce(np.ones(4), op=hvd.Sum)
"""

from .common.basics import (
    ProcessSet,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    pin_gpu,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from .common.errors import HorovodInternalError, HostsUpdatedInterrupt, TopologyError
from .common.gpu_layout import GpuLayoutError
from .common.ops import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from .common.types import Adasum, Average, Max, Min, Product, Sum
from .runner import run
from .version import __version__

__all__ = [name for name in dir() if not name.startswith("_")] + ["__version__"]
