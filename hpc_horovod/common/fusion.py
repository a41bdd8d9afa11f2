"""Allreduce of groups of agreed tensors through one fusion buffer and one backend call each.

Scaling is folded into the passes that happen anyway: the prescale factor is applied while
packing, the postscale factor (and Average's 1/size) while unpacking; a tensor alone, or a group
whose results are views of the fusion buffer, has them applied by the backend (the hierarchical
host backend folds them into its one pass over the data). Results of out-of-place
requests are views into the (fresh) fusion buffer; in-place requests are written back. A tensor
alone in its group (a large gradient, or a bucket that is already one flat tensor) is reduced in
its own memory, without the fusion buffer. float16/bfloat16 are reduced in float32 unless the
native extension provides MPI operations for them.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from ..backends.scaling import scale_inplace as _scale_inplace
from ..backends.scaling import scale_into as _scale_into
from .request import Request
from .types import HALF_DTYPES, Average, Signature, Sum

try:  # optional native fast path (src_native/); the package works without it
    from .. import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _native = None


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
        buf = pool.empty((self.total,), wire)
        # One call packs the whole group, scaling and widening on the way.
        if _native is not None and (pre == 1.0 or dtype.kind == "f"):
            _native.pack(parts, buf, pre)
        else:
            np.concatenate([p.reshape(-1) for p in parts], out=buf, casting="unsafe")
            _scale_inplace(buf, pre)
        as_views = wire == dtype and all(req is None or req.output is None for req in reqs)
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
