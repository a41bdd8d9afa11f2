"""Collectives on torch tensors, with Horovod's torch API: ``*_async`` ops return an int handle
for :func:`poll` / :func:`synchronize`, ``*_`` ops work in place, and the synchronous ops are
autograd functions whose gradients are the matching collectives.

Every op turns its tensors into numpy views (``adapter``), builds the core's requests and hands
them to the engine; :func:`synchronize` waits and turns the engine's arrays back into tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..common import basics, ops
from ..common.basics import ProcessSet, global_process_set
from ..common.ops import synchronous
from ..common.request import (
    allgather_request,
    allreduce_request,
    alltoall_request,
    broadcast_request,
    group_names,
    reducescatter_request,
)
from ..common.types import Adasum, Average, Sum
from . import adapter
from .adapter import to_torch, write_back
from .compression import Compression

#: torch handle (the handle of the op's first engine request) -> (the op's engine handles, the
#: function turning their results into the op's output). The engine's requests hold the numpy
#: views, which keep the tensors' memory alive until the op finishes.
_handle_map: dict[int, tuple[list[int], Callable[[list], object]]] = {}


def init(comm=None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Start hpc_horovod (see :func:`hpc_horovod.init`)."""
    if not basics.is_initialized():
        _handle_map.clear()
    basics.init(comm, process_sets)


def shutdown() -> None:
    """Stop hpc_horovod on every rank; pending handles raise."""
    basics.shutdown()
    _handle_map.clear()


def engine_array(tensor: torch.Tensor, op_name: str, inplace: bool = False):
    """``adapter.engine_array``, with the input's memory kept for the engine's stream: a CUDA
    tensor handed over as a device view (or the contiguous copy made for it here) is marked as
    used by that stream (``record_stream``). Its block belongs to the stream that allocated it
    (a producer's side stream, or the current one for the copy), and torch's allocator would
    hand it out there again once the tensor is freed, while NCCL may still read it on the
    engine's stream; marked, torch waits for the engine's stream first. The request holds the
    view until the engine has queued its collective, so the mark covers every read of it."""
    if not getattr(tensor, "is_cuda", False):  # host tensors, and what adapter refuses
        return adapter.engine_array(tensor, op_name, inplace)
    if not inplace and not tensor.is_contiguous():
        tensor = tensor.detach().contiguous()  # the copy the view will be of
    array = adapter.engine_array(tensor, op_name, inplace)
    if not isinstance(array, np.ndarray):
        tensor.record_stream(_engine_stream(array.device.id))
    return array


#: device -> the engine's stream on it, as torch sees it
_engine_streams: dict[int, torch.cuda.ExternalStream] = {}


def _engine_stream(device: int) -> torch.cuda.ExternalStream:
    stream = _engine_streams.get(device)
    if stream is None:
        from ..common import gpu_stream

        with gpu_stream.on_device(device):  # the caller's device back afterwards
            ptr = gpu_stream.device_stream(device).stream.ptr
        stream = _engine_streams[device] = torch.cuda.ExternalStream(
            ptr, device=torch.device("cuda", device))
    return stream


def _submit(requests: list) -> list[int]:
    """Hand requests to the engine. GPU requests carry an event recorded on torch's current
    stream of their tensors' device (``adapter.ready_event``), so the engine's stream starts
    after the kernels that produced the tensors."""
    device = [req.tensor for req in requests if req.signature.device]
    if device:
        from .adapter import ready_event

        event = ready_event(device)
        for req in requests:
            req.ready_event = event
    return basics.engine().enqueue(requests)


def _submit_one(req) -> int:
    """:func:`_submit` of one request, the path every gradient takes."""
    if req.signature.device:
        return _submit([req])[0]
    return basics.engine().submit(req)


def _result_on(tensor: torch.Tensor) -> Callable[[list], torch.Tensor]:
    """How a one-tensor op turns its engine result back into a tensor on ``tensor``'s device."""
    if tensor.is_cpu:
        return _cpu_result
    device = tensor.device
    return lambda results: to_torch(results[0], device)


def _cpu_result(results: list) -> torch.Tensor:
    return to_torch(results[0])


def _register(engine_handles: list[int], finish: Callable[[list], object]) -> int:
    handle = engine_handles[0]
    _handle_map[handle] = (engine_handles, finish)
    return handle


def _op_name(kind: str, name: str | None) -> str | None:
    """A user's name for an op, prefixed with the op's kind as Horovod's torch binding does
    (``allreduce.loss``: the name timelines show; ops of different kinds may share a name)."""
    return name if name is None else f"{kind}.{name}"


def _nonempty(tensors: Sequence, op_name: str) -> list:
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{op_name} needs at least one tensor")
    return tensors


def _reduction(op: int | None, average: bool | None, prescale_factor: float,
               postscale_factor: float) -> dict:
    return {"op": op, "average": average, "prescale_factor": prescale_factor,
            "postscale_factor": postscale_factor}


# -- allreduce ------------------------------------------------------------------------------------

def allreduce_async(tensor: torch.Tensor, average=None, name: str | None = None, op=None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce of ``tensor`` (not modified); default op: Average. Returns a handle."""
    req = allreduce_request(engine_array(tensor, "allreduce"),
                            name=_op_name("allreduce", name), op=op, average=average,
                            prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, process_set=process_set)
    return _register([_submit_one(req)], _result_on(tensor))


def allreduce_async_(tensor: torch.Tensor, average=None, name: str | None = None, op=None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce: the engine writes the result into ``tensor``'s memory."""
    array = engine_array(tensor, "allreduce_", inplace=True)
    req = allreduce_request(array, name=_op_name("allreduce", name), op=op, average=average,
                            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                            process_set=process_set, output=array)
    return _register([_submit_one(req)], _InPlace(tensor, array))


class _InPlace:
    """The finish of an in-place op: ``write_back`` of its one result into the tensor."""

    __slots__ = ("tensor", "array")

    def __init__(self, tensor: torch.Tensor, array):
        self.tensor, self.array = tensor, array

    def __call__(self, results: list) -> torch.Tensor:
        return write_back(results[0], self.tensor, self.array)


@synchronous
def allreduce_(tensor: torch.Tensor, average=None, name: str | None = None, op=None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce whose gradient is the same allreduce of the incoming gradient."""

    @staticmethod
    @synchronous
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, average, name, op, prescale_factor,
                                           postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        average, op, prescale, postscale, process_set = ctx.args
        grad = allreduce(grad_output, average=average, op=op, prescale_factor=prescale,
                         postscale_factor=postscale, process_set=process_set)
        return grad, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average=None, name: str | None = None,
              compression=Compression.none, op=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Average (default) or reduce ``tensor`` over all ranks; differentiable."""
    compressed, ctx = compression.compress(tensor)
    reduced = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor,
                                     postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average=None,
                            name: str | None = None, op=None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start one allreduce for a list of tensors (reduced together); one handle for the list."""
    tensors = _nonempty(tensors, "grouped_allreduce")
    names = group_names(name, len(tensors), process_set.process_set_id, "allreduce")
    reqs = [allreduce_request(engine_array(t, "grouped_allreduce"), name=n,
                              process_set=process_set,
                              **_reduction(op, average, prescale_factor, postscale_factor))
            for t, n in zip(tensors, names)]
    devices = [t.device for t in tensors]
    return _register(_submit(reqs),
                     lambda results: [to_torch(r, d) for r, d in zip(results, devices)])


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average=None,
                             name: str | None = None, op=None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    tensors = _nonempty(tensors, "grouped_allreduce_")
    names = group_names(name, len(tensors), process_set.process_set_id, "allreduce")
    reqs = []
    for tensor, tensor_name in zip(tensors, names):
        array = engine_array(tensor, "grouped_allreduce_", inplace=True)
        reqs.append(allreduce_request(array, name=tensor_name, process_set=process_set,
                                      output=array,
                                      **_reduction(op, average, prescale_factor,
                                                   postscale_factor)))
    views = [req.output for req in reqs]
    return _register(_submit(reqs), lambda results: [
        write_back(r, t, v) for r, t, v in zip(results, tensors, views)])


@synchronous
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average=None, name: str | None = None,
                       op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    @synchronous
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set,
                *tensors):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        average, op, prescale, postscale, process_set = ctx.args
        grads = grouped_allreduce(list(grad_outputs), average=average, op=op,
                                  prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=process_set)
        return (None,) * 6 + tuple(grads)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average=None, name: str | None = None,
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    tensors = _nonempty(tensors, "grouped_allreduce")
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    reduced = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor,
                                            postscale_factor, process_set, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, ctxs)]


class SparseHandle:
    """The handle of :func:`sparse_allreduce_async`: calling it waits for the reduced sparse
    tensor (as Horovod's handle does); :func:`poll` and :func:`synchronize` take it too."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __call__(self) -> torch.Tensor:
        return synchronize(self)

    def __repr__(self) -> str:
        return f"SparseHandle({self.handle})"


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op=Average,
                           process_set: ProcessSet = global_process_set) -> SparseHandle:
    """Reduce a sparse COO tensor by gathering every rank's indices and values (duplicates add
    up when the result is used); Average divides the values by the number of ranks. Returns a
    callable handle: ``handle()`` is the reduced sparse tensor."""
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async needs a sparse COO tensor; use allreduce_async "
                         "for dense tensors")
    if op not in (Average, Sum):
        raise ValueError("sparse_allreduce_async supports op=Average or op=Sum")
    coalesced = tensor.coalesce()
    base = name if name is not None else basics.next_name(process_set.process_set_id,
                                                          "sparse_allreduce")
    indices = engine_array(coalesced.indices().t().contiguous(), "sparse_allreduce_async")
    values = engine_array(coalesced.values(), "sparse_allreduce_async")
    reqs = [allgather_request(indices, name=f"allgather.{base}.indices",
                              process_set=process_set),
            allgather_request(values, name=f"allgather.{base}.values",
                              process_set=process_set)]
    device, shape = tensor.device, tensor.shape

    def finish(results):
        all_indices = to_torch(results[0], device)
        all_values = to_torch(results[1], device)
        if op == Average:
            all_values = all_values / process_set.size()
        return torch.sparse_coo_tensor(all_indices.t(), all_values, shape,
                                       check_invariants=False)

    return SparseHandle(_register(_submit(reqs), finish))


# -- allgather ------------------------------------------------------------------------------------

def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dim 0 (dim 0 may differ per rank)."""
    req = allgather_request(engine_array(tensor, "allgather"), name=_op_name("allgather", name),
                            process_set=process_set)
    return _register([_submit_one(req)], _result_on(tensor))


def _own_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """This rank's slice of a gradient over the gathered tensor (dim 0 differs per rank)."""
    counts = allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    offset = int(counts[:process_set.rank()].sum())
    return grad.narrow(0, offset, rows)


class HorovodAllgather(torch.autograd.Function):
    """Allgather whose gradient is the averaged gradient, sliced to this rank's rows."""

    @staticmethod
    @synchronous
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        grad = _own_rows(reduced, ctx.rows, ctx.process_set)
        return (grad.reshape(()) if ctx.scalar else grad), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0; differentiable."""
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    tensors = _nonempty(tensors, "grouped_allgather")
    names = group_names(name, len(tensors), process_set.process_set_id, "allgather")
    reqs = [allgather_request(engine_array(t, "grouped_allgather"), name=n,
                              process_set=process_set) for t, n in zip(tensors, names)]
    devices = [t.device for t in tensors]
    return _register(_submit(reqs),
                     lambda results: [to_torch(r, d) for r, d in zip(results, devices)])


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    @synchronous
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.scalars = [t.dim() == 0 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        process_set = ctx.process_set
        reduced = grouped_allreduce(list(grad_outputs), op=Average, process_set=process_set)
        counts = allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=process_set)
        offsets = counts[:process_set.rank()].sum(dim=0).tolist()
        grads = []
        for grad, offset, rows, scalar in zip(reduced, offsets, ctx.rows, ctx.scalars):
            mine = grad.narrow(0, offset, rows)
            grads.append(mine.reshape(()) if scalar else mine)
        return (None, None, *grads)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    tensors = _nonempty(tensors, "grouped_allgather")
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast ------------------------------------------------------------------------------------

def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast of ``root_rank``'s tensor (``tensor`` is not modified)."""
    req = broadcast_request(engine_array(tensor, "broadcast"), root_rank,
                            name=_op_name("broadcast", name),
                            process_set=process_set)
    return _register([_submit_one(req)], _result_on(tensor))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place broadcast into ``tensor``."""
    array = engine_array(tensor, "broadcast_", inplace=True)
    req = broadcast_request(array, root_rank, name=_op_name("broadcast", name),
                            process_set=process_set,
                            output=array)
    return _register([_submit_one(req)], lambda results: write_back(results[0], tensor, array))


@synchronous
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast whose gradient is the averaged gradient on the root and zero elsewhere."""

    @staticmethod
    @synchronous
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if basics.rank() != ctx.root_rank:  # root ranks are global ranks
            grad = torch.zeros_like(grad)
        return grad, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s tensor on every rank; differentiable."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall -------------------------------------------------------------------------------------

def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().numpy()
    req = alltoall_request(engine_array(tensor, "alltoall"), splits,
                           name=_op_name("alltoall", name),
                           process_set=process_set)
    device = tensor.device

    def finish(results):
        output, received = results[0]
        return to_torch(output, device), torch.from_numpy(received.astype(np.int32))

    return _register([_submit_one(req)], finish)


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall whose gradient is the alltoall sending the gradient's rows back."""

    @staticmethod
    @synchronous
    def forward(ctx, tensor, splits, name, process_set):
        output, received_splits = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received_splits = received_splits
        ctx.process_set = process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = alltoall(grad_output, splits=ctx.received_splits,
                           process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Send ``splits[j]`` rows (default: equal parts) of ``tensor`` to rank j.

    Returns the rows received from every rank, concatenated in rank order; when ``splits`` is
    given, returns ``(output, received_splits)`` as Horovod does. Differentiable.
    """
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


# -- reducescatter --------------------------------------------------------------------------------

def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op=Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start a reduction whose result rows are split over the ranks (first ranks get one more
    row when dim 0 does not divide)."""
    _check_reducescatter_op(op)
    req = reducescatter_request(engine_array(tensor, "reducescatter"),
                                name=_op_name("reducescatter", name), op=op,
                                process_set=process_set, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor)
    return _register([_submit_one(req)], _result_on(tensor))


def _check_reducescatter_op(op) -> None:
    """Adasum has no reduce-scatter form; Horovod reports it as a RuntimeError."""
    if op == Adasum:
        raise RuntimeError("reducescatter does not support Adasum: use op=Sum or op=Average")


def _reducescatter_grad(grad: torch.Tensor, op, prescale: float, postscale: float,
                        process_set: ProcessSet) -> torch.Tensor:
    """Horovod's convention, the same as allreduce's gradient: the gathered gradient, times the
    set's size for Sum (each rank's loss counts the sum over every rank) and as it is for
    Average, then the scale factors."""
    gathered = allgather(grad, process_set=process_set)
    factor = prescale * postscale * (process_set.size() if op == Sum else 1)
    return gathered * factor if factor != 1.0 else gathered


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter whose gradient is the allgather of the incoming gradient (scaled)."""

    @staticmethod
    @synchronous
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        return _reducescatter_grad(grad_output, *ctx.args), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=Compression.none,
                  op=Average, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    compressed, ctx = compression.compress(tensor)
    reduced = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                         postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op=Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    tensors = _nonempty(tensors, "grouped_reducescatter")
    _check_reducescatter_op(op)
    names = group_names(name, len(tensors), process_set.process_set_id, "reducescatter")
    reqs = [reducescatter_request(engine_array(t, "grouped_reducescatter"), name=n, op=op,
                                  process_set=process_set, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor)
            for t, n in zip(tensors, names)]
    devices = [t.device for t in tensors]
    return _register(_submit(reqs),
                     lambda results: [to_torch(r, d) for r, d in zip(results, devices)])


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    @synchronous
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_reducescatter_async(
            tensors, name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None,) * 5 + tuple(_reducescatter_grad(g, *ctx.args) for g in grad_outputs)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression=Compression.none, op=Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    tensors = _nonempty(tensors, "grouped_reducescatter")
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    reduced = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                                postscale_factor, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, ctxs)]


# -- handles and synchronization ------------------------------------------------------------------

def _entry(handle: int | SparseHandle) -> tuple[list[int], Callable[[list], object]]:
    if isinstance(handle, SparseHandle):
        handle = handle.handle
    try:
        return _handle_map[handle]
    except (KeyError, TypeError):
        raise ValueError(f"handle {handle!r} was not returned by an async op of "
                         "hpc_horovod.torch, or it was already synchronized") from None


def poll(handle: int) -> bool:
    """True when the op behind ``handle`` has finished; ``synchronize`` then does not block."""
    engine_handles, _ = _entry(handle)
    return all(ops.poll(h) for h in engine_handles)


def synchronize(handle: int):
    """Wait for ``handle``; return its output tensor (a list for grouped ops, a tuple
    ``(output, received_splits)`` for alltoall). Raises ``HorovodInternalError`` on failure."""
    entry = _handle_map.pop(handle, None) if type(handle) is int else None
    if entry is None:
        entry = _entry(handle)
        del _handle_map[entry[0][0]]
    engine_handles, finish = entry
    engine = basics.engine()
    if len(engine_handles) == 1:  # the common case, kept short
        req = engine.wait(engine_handles[0])
        return finish([req.result if req.done_event is None else _result(req)])
    results, error = [], None
    for engine_handle in engine_handles:
        try:
            results.append(_result(engine.wait(engine_handle)))
        except BaseException as exc:  # wait for the whole group before raising
            error = error or exc
    if error is not None:
        raise error
    return finish(results)


def _result(req):
    if req.done_event is not None:  # GPU result: order torch's stream after the engine's
        from .adapter import take_device_result

        take_device_result(req)
    return req.result


def join(device: int = -1) -> int:
    """Say this rank has no more data; meanwhile it contributes zeros to the other ranks'
    allreduces. Blocks until every rank joined; returns the rank that joined last."""
    return ops.join(device)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` reaches the barrier."""
    ops.barrier(process_set)
