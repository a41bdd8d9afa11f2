"""The agreed collectives other than a fused allreduce, on one rank's share (None when joined),
and the reduction rules every reduction shares: the scale factors in Horovod's order and the
dtype on the wire."""

from __future__ import annotations

import math

import numpy as np

from ..backends.scaling import scale_into
from .request import Request
from .types import HALF_DTYPES, Average, Signature, Sum

try:  # optional native fast path (src_native/); the package works without it
    from .. import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _native = None


def scale_factors(sig: Signature, size: int) -> tuple[float, float]:
    """(factor applied while packing, factor applied after the reduction), in Horovod's order:
    each rank's values are prescaled, summed, then postscaled and, for Average, divided by the
    size. Results are then Horovod's to the bit (a sum of equal values divided afterwards is
    exact where values divided first are not); the division rides on the copy out of the fusion
    buffer, or on the one pass an in-place tensor needs anyway."""
    return sig.prescale, sig.postscale / size if sig.op == Average else sig.postscale



def wire_dtype(dtype: np.dtype, op: int, device: bool = False) -> np.dtype:
    """The dtype that goes on the wire: half types are widened unless a native op exists
    (the extension's MPI op on the host; NCCL reduces float16 itself on the GPU)."""
    if dtype in HALF_DTYPES and not device:
        if _native is not None and op in (Sum, Average) and _native.has_half_sum():
            return dtype
        return np.dtype(np.float32)
    return dtype


def _rows(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:])


def array_module(sig: Signature):
    """numpy for host buffers, cupy for GPU buffers: where result buffers are allocated."""
    if not sig.device:
        return np
    import cupy

    return cupy


def allgather_group(backend, group: list[tuple[Signature, Request | None]]) -> None:
    """Gather along dim 0 (sizes may differ per rank); one count exchange for the group."""
    mine = np.array([req.tensor.shape[0] if req is not None else 0 for _, req in group],
                    dtype=np.int64)
    counts = backend.allgather_ints(mine)  # (size, len(group))
    for j, (sig, req) in enumerate(group):
        rest = sig.shape[1:]
        dtype = np.dtype(sig.dtype)
        xp = array_module(sig)
        per_rank = counts[:, j].tolist()
        out = xp.empty((sum(per_rank),) + rest, dtype=dtype)
        send = req.tensor if req is not None else xp.empty((0,) + rest, dtype=dtype)
        row = _rows(sig.shape)
        backend.allgatherv(send, out, [c * row for c in per_rank])
        if req is not None:
            req.result = out


def broadcast_one(backend, sig: Signature, req: Request | None) -> None:
    xp = array_module(sig)
    if req is None:
        buf = xp.empty(sig.shape, dtype=np.dtype(sig.dtype))
    elif req.output is not None:
        buf = req.output
        if buf is not req.tensor and backend.rank == sig.root:
            buf[...] = req.tensor
    else:
        buf = req.tensor.copy() if backend.rank == sig.root else xp.empty_like(req.tensor)
    backend.bcast(buf, sig.root)
    if req is not None:
        req.result = buf


def alltoall_one(backend, sig: Signature, req: Request) -> None:
    """Rank i sends ``splits[j]`` rows to rank j; returns (received tensor, received splits)."""
    tensor = req.tensor
    size = backend.size
    d0 = tensor.shape[0] if tensor.ndim else 0
    if req.splits is None:  # request.alltoall_request checked that the ranks divide d0
        splits = np.full(size, d0 // size, dtype=np.int64)
    else:
        splits = np.asarray(req.splits, dtype=np.int64).reshape(-1)
    recv_splits = backend.alltoall_ints(splits)
    row = _rows(tensor.shape)
    xp = array_module(sig)
    out = xp.empty((int(recv_splits.sum()),) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    backend.alltoallv(xp.ascontiguousarray(tensor), (splits * row).tolist(), out,
                      (recv_splits * row).tolist())
    req.result = (out, recv_splits)


def reducescatter_one(backend, sig: Signature, req: Request) -> None:
    """Reduce then scatter along dim 0; with uneven sizes the first ranks get one more row."""
    tensor = req.tensor
    size = backend.size
    d0 = tensor.shape[0]
    base, extra = divmod(d0, size)
    rows = [base + (1 if r < extra else 0) for r in range(size)]
    row = _rows(tensor.shape)
    dtype = tensor.dtype
    xp = array_module(sig)
    wire = wire_dtype(dtype, sig.op, sig.device)
    pre, post = scale_factors(sig, size)  # Horovod's order, as an allreduce's
    send = xp.empty(tensor.size, dtype=wire)
    scale_into(tensor.reshape(-1), pre, send, xp)
    recv = xp.empty(rows[backend.rank] * row, dtype=wire)
    op = Sum if sig.op == Average else sig.op
    backend.reduce_scatter(send, recv, [r * row for r in rows], op)
    if post != 1.0:
        scale_into(recv, post, recv, xp)
    req.result = recv.astype(dtype, copy=False).reshape((rows[backend.rank],) + tensor.shape[1:])


def adasum_one(backend, sig: Signature, req: Request | None) -> None:
    """Adasum (Maleki et al.): pairwise combination ``(1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b``
    applied as a binary tree over ranks in order, computed identically on every rank from the
    gathered vectors (in float64). Device tensors are staged through host memory
    (:func:`adasum_host_input`): the combination is numpy code, and the gather then goes over
    MPI with the host buffers on both sides.

    On GPUs spread over several nodes it is Horovod's GPU Adasum: the ranks of a node first
    average their tensors with NCCL (:func:`node_average`), and Adasum combines the nodes'
    averages only (Horovod's ``adasum_gpu_operations.cc``, which starts the Adasum tree at the
    level ``local_size``). The device backend's ``node_levels`` gives the node and the
    cross-node backends, None where the ranks lie on one node or nodes differ in size."""
    dtype = np.dtype(sig.dtype)
    n = math.prod(sig.shape)
    tensor, prescale = (req.tensor if req is not None else None), sig.prescale
    levels = backend.node_levels() if sig.device else None
    if levels is not None:
        node, backend = levels
        tensor, prescale = node_average(node, tensor, n, prescale, array_module(sig)), 1.0
    local = adasum_host_input(tensor, n, prescale)
    gathered = np.empty(n * backend.size, dtype=np.float64)
    backend.allgatherv(local, gathered, [n] * backend.size)
    vectors = list(gathered.reshape(backend.size, n))
    while len(vectors) > 1:
        paired = [_adasum_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors) - 1, 2)]
        if len(vectors) % 2:
            paired.append(vectors[-1])
        vectors = paired
    if req is not None:
        result = (vectors[0] * sig.postscale).astype(dtype).reshape(sig.shape)
        if sig.device:  # back to the device, on the engine's stream
            if req.output is not None:
                req.output.set(result)
                result = req.output
            else:
                result = array_module(sig).asarray(result)
        elif req.output is not None:
            req.output[...] = result
            result = req.output
        req.result = result


def node_average(node, tensor, n: int, prescale: float, xp):
    """The average over ``node``'s ranks of this rank's tensor times ``prescale``, in float64
    on the device (a joined rank contributes zeros): the input of the cross-node Adasum."""
    if tensor is None:
        wide = xp.zeros(n, dtype=np.float64)
    else:
        wide = tensor.reshape(-1).astype(np.float64) * prescale
    node.allreduce(wide, Sum)
    wide *= 1.0 / node.size
    return wide


def adasum_host_input(tensor, n: int, prescale: float) -> np.ndarray:
    """This rank's Adasum vector as a host float64 array: a device array is copied to the host
    first (``get`` waits for the engine's stream, which has waited for the producer), a joined
    rank contributes zeros."""
    if tensor is None:
        return np.zeros(n)
    host = tensor if isinstance(tensor, np.ndarray) else tensor.get()
    return host.reshape(-1).astype(np.float64) * prescale


def _adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = float(a @ b)
    na, nb = float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2 * na) if na > 0 else 1.0
    cb = 1.0 - dot / (2 * nb) if nb > 0 else 1.0
    return ca * a + cb * b
