"""Elastic training for PyTorch (``hvd.elastic``): Horovod's ``run``, ``TorchState`` and
``ElasticSampler`` over the restart protocol of :mod:`hpc_horovod.common.elastic`."""

from ...common.basics import rank
from ...common.elastic import ObjectState as _ObjectState
from ...common.elastic import run_fn
from ..functions import broadcast_object
from ..mpi_ops import init, shutdown
from .sampler import ElasticSampler
from .state import TorchState


class ObjectState(_ObjectState):
    """A state of plain Python objects (keyword arguments, kept as attributes), synced with
    ``hvd.broadcast_object``."""

    def __init__(self, **kwargs):
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)


def run(func):
    """Decorate the training function ``func(state, ...)`` for elastic training: the state is
    synced from rank 0 (from the last durable commit after a restart) before ``func`` runs, and
    a lost rank ends the process for a restart on the ranks that are left (see
    :func:`hpc_horovod.common.elastic.run_fn`). Collectives belong inside ``func``, not in
    its arguments."""
    return run_fn(func, _reset)


def _reset():
    shutdown()
    init()


__all__ = ["ElasticSampler", "ObjectState", "TorchState", "run"]
