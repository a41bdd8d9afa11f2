"""Execution: how the tensors a cycle agreed on run, identically on every rank.

A :class:`Plan` orders the agreed requests and cuts them into steps; each step names its runner
from :data:`RUNNERS`, a table keyed by the kind of op, chosen once when the plan is built.
:class:`Execution` runs a plan's steps: on the device's stream for GPU tensors, inside the
timeline's activity when one is written, and, when a step fails, failing its requests with an
error that ends the engine (the communicator cannot be trusted after a backend failed).

Allreduces are grouped here (:func:`group_allreduces`) and each group runs through one fusion
buffer and one backend call (:class:`FusedAllreduce`). Scaling is folded into the passes that
happen anyway: the prescale factor is applied while packing, the postscale factor (and
Average's 1/size) while unpacking; a tensor alone, or a group whose results are views of the
fusion buffer, has them applied by the backend (the hierarchical host backend folds them into
its one pass over the data). Results of out-of-place requests are views into the (fresh) fusion
buffer; in-place requests are written back. A tensor alone in its group (a large gradient, or a
bucket that is already one flat tensor) is reduced in its own memory, without the fusion
buffer. float16/bfloat16 are reduced in float32 unless the native extension provides MPI
operations for them. The other collectives' work is in ``collectives.py``.

Process-set creation and removal travel through the same negotiation, but are control steps of
the engine (its process-set registry changes), which it hands in as ``control``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import numpy as np

from ..backends.scaling import scale_inplace as _scale_inplace
from ..backends.scaling import scale_into as _scale_into
from .collectives import (
    adasum_one,
    allgather_group,
    alltoall_one,
    broadcast_one,
    reducescatter_one,
    scale_factors,
    wire_dtype,
)
from .errors import HorovodInternalError
from .request import Request
from .types import HALF_DTYPES, Adasum, Average, Signature, Sum
from .whereabouts import Whereabouts

try:  # optional native fast path (src_native/); the package works without it
    from .. import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _native = None

#: control steps: run by the engine itself (``Execution``'s ``control``)
CONTROL = ("process_set_add", "process_set_remove")


def _fused_allreduce(backend, sigs, group, fused) -> None:
    fused(backend, group)


def _allgather(backend, sigs, group, fused) -> None:
    allgather_group(backend, list(zip(sigs, group)))


def _one(collective):
    """A runner of one-request steps: ``collective(backend, sig, req)``."""
    def run(backend, sigs, group, fused) -> None:
        collective(backend, sigs[0], group[0])
    return run


def _barrier(backend, sigs, group, fused) -> None:
    backend.barrier()


#: the runner of each kind of step: ``runner(backend, sigs, requests, fused)``
RUNNERS: dict[str, Callable] = {
    "allreduce": _fused_allreduce,
    "adasum": _one(adasum_one),
    "allgather": _allgather,
    "broadcast": _one(broadcast_one),
    "alltoall": _one(alltoall_one),
    "reducescatter": _one(reducescatter_one),
    "barrier": _barrier,
}


class Plan:
    """How one set of agreed tensors executes, identically on every rank: their names and
    signatures in execution order, and the steps, each a slice of them:
    ``(kind, activity, start, stop, FusedAllreduce or None, bytes)``, ``kind`` a key of
    :data:`RUNNERS` or ``"control"``, ``bytes`` those of this rank's tensors (-1 where their
    first dimension may differ between ranks: counted when the step runs). Allreduces come
    first, fused per dtype/op/scales up to the fusion threshold, then allgathers (host, then
    device), then the other collectives one by one. ``order[i]`` is the position, in the
    lists the plan was built from, of its i-th tensor.

    A training step submits the same gradients every time, so plans of ready sets that came
    from the response cache are kept (``coordinator.ProcessSetState.cached_plan``): the
    grouping and the fusion layout are then computed once, not once per step.
    """

    __slots__ = ("names", "sigs", "steps", "order")

    def __init__(self, names: list[str], sigs: list[Signature], threshold: int):
        reductions, gathers, devices, others = [], [], [], []
        for i, sig in enumerate(sigs):
            if sig.kind == "allreduce" and sig.op != Adasum:
                reductions.append(i)
            elif sig.kind == "allgather":
                (devices if sig.device else gathers).append(i)
            else:
                others.append(i)
        groups = [("allreduce", g, True) for g in group_allreduces(sigs, reductions, threshold)]
        groups += [("allgather", g, False) for g in (gathers, devices) if g]
        groups += [(_step_kind(sigs[i]), [i], False) for i in others]
        self.order, self.steps = [], []
        for kind, indices, fuse in groups:
            start = len(self.order)
            self.order += indices
            fused = FusedAllreduce([sigs[i] for i in indices]) if fuse else None
            activity = sigs[indices[0]].kind.upper()
            nbytes = _step_bytes([sigs[i] for i in indices])
            self.steps.append((kind, activity, start, len(self.order), fused, nbytes))
        self.names = [names[i] for i in self.order]
        self.sigs = [sigs[i] for i in self.order]

    def describe(self) -> str:
        """The steps in one line, each its kind, its bytes (an allreduce's: its fusion
        buffer's) and its tensors' names, in execution order: the debug log's view of the
        plan."""
        steps = []
        for kind, _, start, stop, fused, nbytes in self.steps:
            size = "size known when it runs" if nbytes < 0 else f"{nbytes} B"
            what = f"{kind} fused ({size})" if fused is not None else f"{kind} ({size})"
            steps.append(f"{what}: {', '.join(self.names[start:stop])}")
        return "; ".join(steps)


def _step_bytes(sigs: list[Signature]) -> int:
    """The bytes of a step's tensors (none for a control step or a barrier), or -1 when a
    first dimension differs between ranks."""
    sigs = [sig for sig in sigs if isinstance(sig.dtype, np.dtype)]
    if any(-1 in sig.shape for sig in sigs):
        return -1
    return sum(math.prod(sig.shape) * sig.dtype.itemsize for sig in sigs)


def _step_kind(sig: Signature) -> str:
    if sig.kind in CONTROL:
        return "control"
    if sig.kind == "allreduce":
        return "adasum"
    if sig.kind not in RUNNERS:  # pragma: no cover - guarded at submission
        raise ValueError(f"unknown collective {sig.kind}")
    return sig.kind


class Execution:
    """Runs plans. ``control(ps, sig, req)``: the engine's control steps;
    ``complete(req, error)``: complete a request that failed; ``done(group)``: mark a group's
    requests done and free their names; ``whereabouts``: where the engine is, which each step
    updates before it calls the backend (the watch bounds the blocking call with its
    deadline; what runs after the last step says where it is next: the coordinator's next
    wait, or the engine's end of the cycle)."""

    def __init__(self, control: Callable, complete: Callable, done: Callable,
                 whereabouts: Whereabouts):
        self._control = control
        self._complete = complete
        self._done = done
        self._whereabouts = whereabouts

    def run(self, ps, plan: Plan, reqs: list[Request | None], timeline) -> None:
        """Run the plan's steps on ``ps`` (a ``coordinator.ProcessSetState``), in the same
        order on every rank."""
        backend, enter = ps.backend, self._whereabouts.enter
        for kind, activity, start, stop, fused, nbytes in plan.steps:
            sigs, group = plan.sigs[start:stop], reqs[start:stop]
            if kind == "control":
                def fn(sig=sigs[0], req=group[0]):
                    self._control(ps, sig, req)
            else:
                def fn(runner=RUNNERS[kind], sigs=sigs, group=group, fused=fused):
                    runner(backend, sigs, group, fused)
            if nbytes < 0:  # a gather's result: every rank's share
                nbytes = len(ps.ranks) * sum(r.tensor.nbytes for r in group if r is not None)
            enter(kind, plan.names, start, stop, nbytes, ps.id)
            self._run_group(backend, sigs[0].device, group, timeline, activity, fn)

    def _run_group(self, backend, device: bool, group: list[Request | None], tl,
                   activity: str, fn) -> None:
        if device:
            fn = _on_device_stream(backend, group, fn)
        if tl is not None:
            for req in group:
                if req is not None:
                    tl.negotiate_end(req.name)
                    tl.op_start(req.name, activity)
        try:
            if tl is not None:
                with tl.activity([r.name for r in group if r is not None], activity):
                    fn()
            else:
                fn()
        except Exception as exc:
            # Validated inputs make local failures impossible; what is left is the backend
            # failing, after which the communicator cannot be trusted: stop everywhere.
            error = exc if isinstance(exc, HorovodInternalError) else HorovodInternalError(
                f"{activity.lower()} failed: {type(exc).__name__}: {exc}")
            for req in group:
                if req is not None:
                    self._complete(req, error)
            raise error from exc
        if tl is not None:
            for req in group:
                if req is not None:
                    tl.op_end(req.name)
        self._done(group)


def _on_device_stream(backend, group, fn):
    """GPU groups run on the device's stream (``gpu_stream.DeviceStream``), after the
    producers' ready events, and leave a done event for the consumers: no host or device-wide
    synchronization. The thread works on the group's device meanwhile and gets its own current
    device back after (a caller blocked in ``wait`` runs cycles too). NCCL's asynchronous
    errors (a lost peer or link) surface here, before more work is queued behind a collective
    that will never end, and while the engine waits for peers (``RoutedBackend.negotiate``)."""

    def run() -> None:
        from .gpu_stream import device_stream, group_device, on_device

        backend.check_async_error()
        device = group_device(backend, [r.tensor for r in group if r is not None])
        stream = device_stream(device)
        with on_device(device), stream.activate():
            for req in group:
                if req is not None and req.ready_event is not None:
                    stream.wait_for(req.ready_event)
            fn()
            done = stream.done_event()
        for req in group:
            if req is not None:
                req.done_event = done

    return run


# -- allreduce groups -----------------------------------------------------------------------------
class BufferPool:
    """Large result buffers, reused once the caller has dropped every view of them.

    A fresh 16 MiB ``np.empty`` costs thousands of page faults on first touch, as much as the
    copy it holds. A pooled buffer is handed out again only when its reference count shows that
    nothing outside the pool (no result array, no view, no torch tensor sharing it) still holds
    it, so reuse is never observable.
    """

    MIN_BYTES = 1 << 20
    PER_SIZE = 4

    def __init__(self):
        self._buffers: dict[int, list[np.ndarray]] = {}

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES:
            return np.empty(shape, dtype=dtype)
        buffers = self._buffers.setdefault(nbytes, [])
        for buf in buffers:
            # References: the list, this loop variable and getrefcount's argument.
            if sys.getrefcount(buf) == 3:
                return buf.view(dtype).reshape(shape)
        buf = np.empty(nbytes, dtype=np.uint8)
        if len(buffers) < self.PER_SIZE:
            buffers.append(buf)
        return buf.view(dtype).reshape(shape)


pool = BufferPool()


class FusedAllreduce:
    """Allreduce of a group of agreed tensors (same dtype, op and scale factors) through one
    fusion buffer and one backend call.

    The per-tensor layout (shapes and offsets in the buffer) is computed once, when the engine
    first plans this set of tensors; a training step that submits the same gradients again
    reuses it, so what is left per tensor is handing its array to the native pack and taking
    its result view back.
    """

    __slots__ = ("sig", "shapes", "bounds", "sizes", "total", "flat", "_reduction")

    def __init__(self, sigs: list[Signature]):
        self.sig = sigs[0]
        self._reduction: tuple | None = None  # see reduction()
        self.shapes = [s.shape for s in sigs]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.bounds, offset = [], 0
        for n in self.sizes:
            self.bounds.append((offset, offset + n))
            offset += n
        self.total = offset
        self.flat = all(len(shape) == 1 for shape in self.shapes)

    def __call__(self, backend, reqs: list[Request | None]) -> None:
        """Reduce ``reqs`` (in this group's order). A ``None`` request is a joined rank's
        share: it contributes zeros."""
        sig = self.sig
        dtype, op, wire, pre, post = self.reduction(backend.size)
        if sig.device:
            _allreduce_device_group(backend, self, reqs, dtype, op, pre, post)
            return
        if len(reqs) == 1 and wire == dtype:
            _reduce_one(backend, reqs[0], self.shapes[0], dtype, op, pre, post)
            return
        if None in reqs:
            parts = [req.tensor if req is not None else np.zeros(n, dtype)
                     for req, n in zip(reqs, self.sizes)]
        else:
            parts = [req.tensor for req in reqs]
        # Results that are views of the fusion buffer need fresh memory; the others are copied
        # out, so the group packs into the backend's fusion memory, which it reduces fastest.
        as_views = wire == dtype and all(req is None or req.output is None for req in reqs)
        memory = None if as_views else backend.fusion_memory(self.total * wire.itemsize)
        buf = pool.empty((self.total,), wire) if memory is None else memory.view(wire)
        # One call packs the whole group, scaling and widening on the way.
        if _native is not None and (pre == 1.0 or dtype.kind == "f"):
            _native.pack(parts, buf, pre)
        else:
            np.concatenate([p.reshape(-1) for p in parts], out=buf, casting="unsafe")
            _scale_inplace(buf, pre)
        if not as_views:
            backend.allreduce(buf, op)
            self._unpack(reqs, buf, dtype, post)
            return
        # Views of the fusion buffer, fresh from the pool, scaled by the backend.
        backend.allreduce(buf, op, postscale=post)
        if self.flat:
            for req, (a, b) in zip(reqs, self.bounds):
                if req is not None:
                    req.result = buf[a:b]
        else:
            for req, (a, b), shape in zip(reqs, self.bounds, self.shapes):
                if req is not None:
                    req.result = buf[a:b].reshape(shape)

    def reduction(self, size: int) -> tuple[np.dtype, int, np.dtype, float, float]:
        """(dtype, op on the wire, wire dtype, pre factor, post factor) with ``size`` ranks;
        computed once per size, since a cached plan runs this group every step."""
        cached = self._reduction
        if cached is None or cached[0] != size:
            sig = self.sig
            dtype = np.dtype(sig.dtype)
            cached = self._reduction = (
                size, dtype, Sum if sig.op == Average else sig.op,
                wire_dtype(dtype, sig.op, sig.device), *scale_factors(sig, size))
        return cached[1:]

    def _unpack(self, reqs, reduced: np.ndarray, dtype, post: float) -> None:
        """Copy each request's part of ``reduced``, scaled by ``post``, into its output (a new
        array for out-of-place requests)."""
        outputs = []
        for req, n, shape in zip(reqs, self.sizes, self.shapes):
            if req is None:
                outputs.append(np.empty(n, dtype))  # a joined rank's share: discarded
            else:
                req.result = req.output if req.output is not None else np.empty(shape, dtype)
                outputs.append(req.result)
        if _native is not None and (post == 1.0 or dtype.kind == "f"):
            _native.unpack(reduced, outputs, post)
        else:
            for out, (a, b) in zip(outputs, self.bounds):
                _scale_into(reduced[a:b], post, out.reshape(-1))


def _allreduce_device_group(backend, fused: FusedAllreduce, reqs, dtype, op, pre, post) -> None:
    """The GPU version, on the device's stream (the engine makes it current), with as few
    passes over device memory as each case allows:

    - in place, a tensor alone or tensors laid end to end in one allocation (a bucket that is
      already one flat tensor): reduced in their own memory, no copy at all;
    - out of place: packed (and scaled) into one fresh buffer, which the results are views of;
    - otherwise (in place and scattered, or a joined rank's zeros): packed into the backend's
      reusable fusion buffer, and copied back into every output by one kernel.

    Fresh arrays come from the framework's allocator while the engine runs device work
    (``gpu_stream.use_framework_memory``), so the results handed to it are its own memory."""
    import cupy

    span = _device_span(reqs, fused.total, dtype)
    if span is not None:
        _scale_device(span, pre, span)
        backend.allreduce(span, op)
        _scale_device(span, post, span)
        for req in reqs:
            req.result = req.output
        return
    total = fused.total
    as_views = all(req is not None and req.output is None for req in reqs)
    if as_views:
        buf = cupy.empty(total, dtype=dtype)
    elif backend.device is not None:  # NCCL keeps one reusable buffer per dtype
        buf = backend.fusion_buffer(dtype, total)[:total]
    else:
        buf = cupy.empty(total, dtype=dtype)
    parts = [req.tensor.reshape(-1) if req is not None else cupy.zeros(n, dtype)
             for req, n in zip(reqs, fused.sizes)]
    if len(parts) == 1 and pre == 1.0:  # the backend reads the input, writes the result
        backend.allreduce(buf, op, send=parts[0])
    else:
        if len(parts) == 1:  # copied and scaled in one pass
            _scale_device(parts[0], pre, buf)
        else:
            cupy.concatenate(parts, out=buf)
            _scale_device(buf, pre, buf)
        backend.allreduce(buf, op)
    _scale_device(buf, post, buf)
    if as_views:
        for req, (a, b), shape in zip(reqs, fused.bounds, fused.shapes):
            req.result = buf[a:b].reshape(shape)
        return
    outs = []
    for req, shape in zip(reqs, fused.shapes):
        if req is not None:
            req.result = req.output if req.output is not None else cupy.empty(shape, dtype)
        outs.append(None if req is None else req.result)
    _unpack_device(buf, outs, [b for _, b in fused.bounds])


#: One kernel copies a reduced fusion buffer out into every output (instead of one copy kernel
#: per tensor): thread i finds its segment by a binary search over the segments' ends.
_UNPACK_SOURCE = r"""
typedef ITEM T;
extern "C" __global__ void hpc_horovod_unpack(const T* src, T* const* outs,
                                              const long long* ends, int n, long long total) {
    long long step = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += step) {
        int lo = 0, hi = n - 1;
        while (lo < hi) {  /* the first segment that ends after i */
            int mid = (lo + hi) >> 1;
            if (i < ends[mid]) hi = mid; else lo = mid + 1;
        }
        T* out = outs[lo];
        if (out != 0) out[i - (lo ? ends[lo - 1] : 0)] = src[i];
    }
}
"""
_UNPACK_ITEMS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int",
                 8: "unsigned long long"}
_UNPACK_KERNELS: dict[int, object] = {}


def _unpack_device(buf, outs: list, ends: list[int]) -> None:
    """Copy segment k of ``buf`` (up to ``ends[k]``) into ``outs[k]`` (contiguous; None: drop
    it), bit for bit, in one kernel on the current stream."""
    import cupy

    item = buf.dtype.itemsize
    kernel = _UNPACK_KERNELS.get(item)
    if kernel is None:
        kernel = _UNPACK_KERNELS[item] = cupy.RawKernel(
            _UNPACK_SOURCE.replace("ITEM", _UNPACK_ITEMS[item]), "hpc_horovod_unpack")
    pointers = cupy.asarray(np.array([0 if out is None else out.data.ptr for out in outs],
                                     dtype=np.uint64))
    bounds = cupy.asarray(np.array(ends, dtype=np.int64))
    total = int(buf.size)
    threads = 256
    blocks = max(1, min(-(-total // threads), 8192))
    kernel((blocks,), (threads,), (buf, pointers, bounds, np.int32(len(outs)), np.int64(total)))


def laid_end_to_end(addresses: list[int], nbytes: list[int]) -> bool:
    """True when each buffer starts where the previous one ends: together they are one flat
    buffer."""
    return all(addresses[i] + nbytes[i] == addresses[i + 1] for i in range(len(addresses) - 1))


def _device_span(reqs, total: int, dtype):
    """One device array over the group's own memory, when every request is in place (its
    output is its input) and the inputs are laid end to end; else None."""
    if any(req is None or req.output is not req.tensor for req in reqs):
        return None
    first = reqs[0].tensor
    if len(reqs) == 1:
        return first.reshape(-1)
    if not laid_end_to_end([req.tensor.data.ptr for req in reqs],
                           [req.tensor.nbytes for req in reqs]):
        return None
    import cupy

    return cupy.ndarray((total,), dtype=dtype, memptr=first.data)


def device_scale_dtype(dtype) -> np.dtype:
    """The dtype a device buffer of ``dtype`` is scaled in, the factor cast to it first: float32
    for float16/bfloat16, as on the host and in reducescatter (CuPy would cast a Python float
    to the buffer's own type: 1/3 becomes 0.33398 in bfloat16, and every average over 3, 5,
    6, 12 ... ranks would be off the same way), the buffer's own type for float32/float64,
    float64 for integers (numpy's rule for an integer array times a float)."""
    dtype = np.dtype(dtype)
    if dtype in HALF_DTYPES:
        return np.dtype(np.float32)
    return dtype if dtype.kind == "f" else np.dtype(np.float64)


def _scale_device(src, factor: float, out) -> None:
    """``out = src * factor``, computed in :func:`device_scale_dtype` (a copy when the factor
    is 1 and ``out`` is another array)."""
    import cupy

    if factor == 1.0:
        if out is not src:
            out[...] = src
        return
    wide = device_scale_dtype(src.dtype)
    cupy.multiply(src, wide.type(factor), out=out, dtype=wide, casting="unsafe")


def _reduce_one(backend, req: Request | None, shape: tuple[int, ...], dtype: np.dtype, op: int,
                pre: float, post: float) -> None:
    """A tensor alone, reduced from its own memory by the backend, which applies both scale
    factors (in place, or from the input into the result: no copy of ours)."""
    if req is None:  # a joined rank's share: zeros, and the result is dropped
        backend.allreduce(np.zeros(shape, dtype), op)
        return
    out = req.output if req.output is not None else pool.empty(req.tensor.shape,
                                                                 req.tensor.dtype)
    backend.allreduce(out, op, send=None if out is req.tensor else req.tensor, prescale=pre,
                      postscale=post)
    req.result = out


#: Tensors this large are reduced on their own, in their own memory: in place that skips both
#: copies through the fusion buffer, for the price of one more backend call.
SOLO_BYTES = 1 << 20


def group_allreduces(sigs: list[Signature], indices: list[int], threshold: int
                     ) -> list[list[int]]:
    """Split ready allreduces (``indices`` into ``sigs``) into fusable groups (same dtype, op,
    scales and device, at most ``threshold`` bytes each; tensors of ``SOLO_BYTES`` or more
    alone), keeping the agreed order inside each."""
    threshold = max(threshold, 1)
    open_groups: dict[tuple, list] = {}  # key -> [bytes, indices] of the group being filled
    order: list[list] = []
    for i in indices:
        sig = sigs[i]
        nbytes = math.prod(sig.shape) * sig.dtype.itemsize
        if nbytes >= SOLO_BYTES:
            order.append([nbytes, [i]])
            continue
        key = (sig.dtype, sig.op, sig.prescale, sig.postscale, sig.device)
        current = open_groups.get(key)
        if current is None or (current[0] + nbytes > threshold and current[1]):
            current = open_groups[key] = [0, []]
            order.append(current)
        current[0] += nbytes
        current[1].append(i)
    return [items for _, items in order]
