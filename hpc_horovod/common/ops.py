"""Collectives on numpy arrays: the framework-neutral API (``hpc_horovod.allreduce``, ...), a
binding like the torch and TensorFlow ones over the builders of ``request.py`` and the engine;
and what every binding shares around them: ``synchronous``, ``poll``, ``synchronize``, and the
object collectives."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import cloudpickle
import numpy as np

from . import basics
from .basics import global_process_set
from .request import (
    Request,
    allgather_request,
    allreduce_request,
    alltoall_request,
    broadcast_request,
    control_signature,
    group_names,
    process_set_id,
    reducescatter_request,
)


def _array(tensor, kind: str) -> np.ndarray:
    array = np.asarray(tensor)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def synchronous(op: Callable) -> Callable:
    """Decorator of the ops that wait for what they submit (``allreduce``, not
    ``allreduce_async``): inside them the engine thread is left asleep, the caller running
    the cycles itself (see ``Engine.synchronous``)."""
    @functools.wraps(op)
    def run(*args, **kwargs):
        if not basics.is_initialized():
            return op(*args, **kwargs)  # which raises the op's own error
        with basics.engine().synchronous():
            return op(*args, **kwargs)
    return run


def submit(requests: list[Request]) -> list[int]:
    return basics.engine().enqueue(requests)


def submit_one(request: Request) -> int:
    return basics.engine().submit(request)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start an allreduce; returns a handle for ``poll``/``synchronize``. Default op: Average."""
    if type(tensor) is not np.ndarray or not tensor.flags.c_contiguous:
        tensor = _array(tensor, "allreduce")
    return submit_one(allreduce_request(
        tensor, name=name, op=op, average=average, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, process_set=process_set))


@synchronous
def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> np.ndarray:
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor,
                                       postscale_factor, process_set))


def allreduce_async_(tensor: np.ndarray, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """In-place allreduce of a writable C-contiguous array."""
    if not isinstance(tensor, np.ndarray) or not tensor.flags.c_contiguous or \
            not tensor.flags.writeable:
        raise ValueError("in-place allreduce needs a writable C-contiguous numpy array")
    return submit_one(allreduce_request(
        tensor, name=name, op=op, average=average, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, process_set=process_set, output=tensor))


@synchronous
def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set) -> np.ndarray:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors: Sequence, average=None, name=None, op=None,
                            prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> list[int]:
    names = group_names(name, len(tensors), process_set_id(process_set), "allreduce")
    reqs = [allreduce_request(_array(t, "allreduce"), name=n, op=op, average=average,
                              prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                              process_set=process_set) for t, n in zip(tensors, names)]
    return submit(reqs)


@synchronous
def grouped_allreduce(tensors: Sequence, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> list[np.ndarray]:
    handles = grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                      postscale_factor, process_set)
    return [synchronize(h) for h in handles]


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Concatenate every rank's tensor along dim 0 (dim 0 may differ between ranks)."""
    return submit_one(allgather_request(_array(tensor, "allgather"), name=name,
                                        process_set=process_set))


@synchronous
def allgather(tensor, name=None, process_set=global_process_set) -> np.ndarray:
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors: Sequence, name=None,
                            process_set=global_process_set) -> list[int]:
    names = group_names(name, len(tensors), process_set_id(process_set), "allgather")
    return submit([allgather_request(_array(t, "allgather"), name=n, process_set=process_set)
                   for t, n in zip(tensors, names)])


@synchronous
def grouped_allgather(tensors: Sequence, name=None, process_set=global_process_set):
    return [synchronize(h) for h in grouped_allgather_async(tensors, name, process_set)]


def broadcast_async(tensor, root_rank: int, name=None, process_set=global_process_set) -> int:
    return submit_one(broadcast_request(_array(tensor, "broadcast"), root_rank, name=name,
                                        process_set=process_set))


@synchronous
def broadcast(tensor, root_rank: int, name=None, process_set=global_process_set) -> np.ndarray:
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor: np.ndarray, root_rank: int, name=None,
                     process_set=global_process_set) -> int:
    """In-place broadcast of a writable C-contiguous array (checked here, on every rank: a
    read-only array would otherwise only fail inside the engine, on the receiving ranks)."""
    if not isinstance(tensor, np.ndarray) or not tensor.flags.c_contiguous or \
            not tensor.flags.writeable:
        raise ValueError("in-place broadcast needs a writable C-contiguous numpy array")
    return submit_one(broadcast_request(tensor, root_rank, name=name, process_set=process_set,
                                        output=tensor))


@synchronous
def broadcast_(tensor, root_rank: int, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    return submit_one(alltoall_request(_array(tensor, "alltoall"), splits, name=name,
                                       process_set=process_set))


@synchronous
def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[j]`` rows to rank j; returns ``(received, received_splits)``."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def reducescatter_async(tensor, name=None, op=None, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    return submit_one(reducescatter_request(_array(tensor, "reducescatter"), name=name, op=op,
                                            process_set=process_set,
                                            prescale_factor=prescale_factor,
                                            postscale_factor=postscale_factor))


@synchronous
def reducescatter(tensor, name=None, op=None, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> np.ndarray:
    """Reduce over ranks, then give rank i the i-th block of rows (first ranks one more row
    when dim 0 does not divide evenly)."""
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                           postscale_factor))


def grouped_reducescatter_async(tensors: Sequence, name=None, op=None,
                                process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> list[int]:
    names = group_names(name, len(tensors), process_set_id(process_set), "reducescatter")
    return submit([reducescatter_request(_array(t, "reducescatter"), name=n, op=op,
                                         process_set=process_set,
                                         prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor)
                   for t, n in zip(tensors, names)])


@synchronous
def grouped_reducescatter(tensors: Sequence, name=None, op=None, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    return [synchronize(h) for h in grouped_reducescatter_async(
        tensors, name, op, process_set, prescale_factor, postscale_factor)]


@synchronous
def barrier(process_set=global_process_set) -> None:
    ps_id = process_set_id(process_set)
    synchronize(submit_one(Request(basics.next_name(ps_id, "barrier"), None,
                                   control_signature("barrier"), ps_id)))


@synchronous
def join(device: int = -1, process_set=global_process_set) -> int:
    """Wait until every rank has joined; meanwhile this rank contributes zeros to allreduces.

    Returns the rank that joined last (for uneven data: ranks with fewer batches join early).
    """
    ps_id = process_set_id(process_set)
    return synchronize(submit_one(Request("join", None, control_signature("join"), ps_id)))


def poll(handle: int) -> bool:
    """True when the operation behind ``handle`` has completed (successfully or not). A
    device op is complete once its work on the GPU has finished, not when it is queued
    there: its done event has passed."""
    req = basics.engine().request(handle)
    return req.done and (req.done_event is None or bool(req.done_event.done))


def synchronize(handle: int):
    """Wait for ``handle`` and return its output; raise ``HorovodInternalError`` on failure."""
    return basics.engine().wait(handle).result


def broadcast_object(obj=None, root_rank: int = 0, name=None, process_set=global_process_set):
    """Broadcast any picklable object (cloudpickle) from ``root_rank`` (a global rank)."""
    ps = process_set
    name = name or basics.next_name(process_set_id(ps), "broadcast_object")
    if basics.rank() == root_rank:
        payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
        length = np.array([payload.size], dtype=np.int64)
    else:
        payload, length = None, np.zeros(1, dtype=np.int64)
    length = broadcast(length, root_rank, name=f"{name}.sz", process_set=ps)
    if payload is None:
        payload = np.empty(int(length[0]), dtype=np.uint8)
    data = broadcast(payload, root_rank, name=f"{name}.t", process_set=ps)
    return cloudpickle.loads(data.tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Gather any picklable object from every rank, in rank order."""
    name = name or basics.next_name(process_set_id(process_set), "allgather_object")
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
    sizes = allgather(np.array([payload.size], dtype=np.int64), name=f"{name}.sz",
                      process_set=process_set)
    data = allgather(payload, name=f"{name}.t", process_set=process_set)
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(cloudpickle.loads(data[offset:offset + n].tobytes()))
        offset += n
    return out
