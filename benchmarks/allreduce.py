"""Allreduce side by side: hpc_horovod against raw mpi4py, torch.distributed (gloo) and Horovod.

    hpc-horovod run -np 2 python benchmarks/allreduce.py [--max-bytes 256M] [--dtypes float32]

Measured on every rank, in the same processes:

* one buffer of 4 KiB .. ``--max-bytes``: ``hvd.allreduce`` (numpy), ``hvd.allreduce_``
  (in place), ``hpc_horovod.torch.allreduce`` (CPU tensors), mpi4py ``Allreduce`` in place and
  out of place, torch.distributed gloo ``all_reduce`` and Horovod's ``horovod.torch.allreduce``
  (the torch-based ones when they import; float16/bfloat16 go to mpi4py with the native sum);
* many small tensors: 200 x 16 KiB submitted asynchronously, then all synchronized (mpi4py: one
  Allreduce of the same bytes, and 200 Iallreduce; gloo: 200 async ops);
* float16 at 16 MiB: the native 16-bit MPI sum against what the package does without it
  (widen to float32 on the wire), and against what a user of mpi4py alone would write;
* the fusion buffer's pack and unpack of 200 x 16 KiB: numpy against ``_native.pack/unpack``.

With ``--device cuda`` (one rank per GPU: ``hpc-horovod run -np <GPUs> python
benchmarks/allreduce.py --device cuda``) the buffers are torch CUDA tensors of 1 MiB ..
``--max-bytes`` (default 1 GiB): ``hpc_horovod.torch.allreduce`` and ``allreduce_`` (NCCL
through the engine) against raw ``cupy.cuda.nccl`` ``allReduce`` on the same memory and stream,
each timed up to ``torch.cuda.synchronize()``; and the 200 x 16 KiB case against one raw NCCL
call on the same bytes and 200 raw calls in one NCCL group.

Every reduction is a Sum (MPI's op; hpc_horovod's default Average adds a scaling). The cases
of one size run interleaved, repetition by repetition, so load from elsewhere hits them alike.
Each timing starts after a barrier; a repetition lasts as long as its slowest rank; the median
over repetitions (after warm-up) is reported, with bus bandwidth in the nccl-tests convention
``busbw = bytes / time * 2 (n - 1) / n``. Results go to ``benchmarks/out/allreduce.json`` and
``allreduce.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from mpi4py import MPI

import hpc_horovod as hvd
from hpc_horovod.common import basics, fusion

try:
    from hpc_horovod import _native
except ImportError:
    _native = None

OUT = Path(__file__).resolve().parent / "out"
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}
SMALL_COUNT, SMALL_BYTES = 200, 16 * 1024
#: gloo's 0.4 s per batch would leave the time budget 10 repetitions of these cases, too few
#: for a median on this VM (run to run the ratios moved by 0.3)
SMALL_MIN_REPS = 30
BASELINE = "mpi4py in-place"


def parse_bytes(text: str) -> int:
    """'4K', '64M', '1G' (powers of 1024) or a plain number of bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4K, 64M, 1G)") from None


def parse_dtypes(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown dtype(s) {bad}; choose from {list(DTYPES)}")
    return names


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


# -- timing ----------------------------------------------------------------------------------------

class Timer:
    """Collective timing of competing cases, interleaved repetition by repetition so that a
    burst of load from elsewhere on the machine hits every case alike, in an order shuffled at
    every repetition. Every case's setup
    rewrites its inputs (in-place cases need it; the others get it too), so that all of them
    start with their inputs in cache alike."""

    def __init__(self, comm: MPI.Comm, seconds_per_point: float, min_reps: int, max_reps: int):
        self.comm = comm
        self.seconds = seconds_per_point
        self.min_reps, self.max_reps = min_reps, max_reps

    def _once(self, fn: Callable[[], object], setup: Callable[[], object] | None) -> float:
        if setup is not None:
            setup()
        self.comm.Barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def compare(self, cases: dict[str, tuple], warmup: int = 2,
                min_reps: int | None = None) -> tuple[dict, dict]:
        """({case: (median seconds of the slowest rank, repetitions)}, {case: error}), with at
        least ``min_reps`` repetitions (default: the timer's).

        A case that raises while warming up (on every rank alike, e.g. a dtype gloo cannot
        reduce) is left out and reported.
        """
        first, errors = {}, {}
        for name, (fn, setup) in cases.items():
            try:
                first[name] = max(self._once(fn, setup) for _ in range(warmup))
            except Exception as e:  # noqa: BLE001
                errors[name] = f"{type(e).__name__}: {e}".splitlines()[0]
        names = list(first)
        slowest_first = self.comm.allreduce(sum(first.values()), op=MPI.MAX)
        budget = self.seconds * max(len(names), 1)
        least = self.min_reps if min_reps is None else max(min_reps, self.min_reps)
        reps = int(min(self.max_reps, max(least, budget / max(slowest_first, 1e-9))))
        local = np.empty((reps, len(names)))
        for r in range(reps):
            # A new order at every repetition, the same on every rank (the cases are
            # collective): the case that runs right after a slow one starts with cold caches,
            # and gloo's threads are still busy for a while after its 200 operations (0.79 ms
            # for the in-place batch with gloo out of the run, 1.05 ms right after it). A
            # rotation kept the same successor for gloo in all but one repetition in ten.
            for j in np.random.default_rng(r).permutation(len(names)):
                local[r, j] = self._once(*cases[names[j]])
        slowest = np.max(np.array(self.comm.allgather(local)), axis=0)
        return {name: (float(np.median(slowest[:, j])), reps)
                for j, name in enumerate(names)}, errors


# -- the contenders --------------------------------------------------------------------------------

class Contenders:
    """Allreduce implementations available in this process, each as buffer -> (fn, setup)."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.skipped: dict[str, str] = {}
        self.torch = self.hvd_torch = self.dist = self.horovod = None
        try:
            import torch

            torch.set_num_threads(1)
            self.torch = torch
        except ImportError as e:
            self.skipped["torch"] = str(e)
            return
        try:
            import hpc_horovod.torch as hvd_torch

            self.hvd_torch = hvd_torch
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            self.skipped["hvd.torch"] = f"{type(e).__name__}: {e}"
        self._init_gloo()
        try:
            import horovod.torch as horovod

            horovod.init()
            self.horovod = horovod
        except Exception as e:  # noqa: BLE001
            self.skipped["horovod"] = f"{type(e).__name__}: {e}"

    def _init_gloo(self) -> None:
        try:
            import torch.distributed as dist
        except ImportError as e:
            self.skipped["gloo"] = str(e)
            return
        one_host = hvd.local_size() == hvd.size()
        port = None
        if hvd.rank() == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        address = "127.0.0.1" if one_host else socket.gethostname()
        address, port = self.comm.bcast((address, port), root=0)
        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(hvd.rank()),
                          WORLD_SIZE=str(hvd.size()))
        try:
            dist.init_process_group("gloo", init_method="env://",
                                    timeout=datetime.timedelta(seconds=60))
        except Exception as e:  # noqa: BLE001 - e.g. the port was taken meanwhile
            self.skipped["gloo"] = f"{type(e).__name__}: {e}".splitlines()[0]
            return
        self.dist = dist

    def _tensor(self, x: np.ndarray):
        from hpc_horovod.torch.adapter import to_torch

        return to_torch(x)

    @staticmethod
    def _owning_tensors(xs: list[np.ndarray]) -> tuple[list, list[np.ndarray]]:
        """Tensors holding copies of ``xs`` in memory of their own, and numpy views of it."""

        from hpc_horovod.torch.adapter import engine_array, to_torch

        tensors = [to_torch(x).clone() for x in xs]
        return tensors, [engine_array(t, "allreduce") for t in tensors]

    @staticmethod
    def _mpi_buffer(x: np.ndarray):
        if x.dtype in (DTYPES["float16"], DTYPES["bfloat16"]):
            return [x.view(np.uint16), MPI.UINT16_T]
        return x

    def _mpi_sum(self, dtype: np.dtype) -> MPI.Op | None:
        """MPI.SUM, or the native 16-bit sum (MPI has none); None when unavailable."""
        if dtype == DTYPES["float32"]:
            return MPI.SUM
        if _native is None or not _native.has_half_sum():
            return None
        return MPI.Op.fromhandle(_native.half_sum_op(dtype.name))

    def one_buffer(self, x: np.ndarray, tag: str) -> dict[str, tuple]:
        """Allreduce of the whole of ``x`` (refilled before each in-place call)."""
        fill = x.copy()

        def refill():
            np.copyto(x, fill)

        cases = {
            "hvd numpy": (lambda: hvd.allreduce(x, op=hvd.Sum, name=f"np.{tag}"), refill),
            "hvd numpy in-place": (lambda: hvd.allreduce_(x, op=hvd.Sum, name=f"ip.{tag}"),
                                   refill),
        }
        if self.hvd_torch is not None:
            t = self._tensor(x)
            cases["hvd torch"] = (
                lambda: self.hvd_torch.allreduce(t, op=hvd.Sum, name=f"t.{tag}"), refill)
        op = self._mpi_sum(x.dtype)
        if op is not None:
            out = np.empty_like(x)
            send, recv = self._mpi_buffer(x), self._mpi_buffer(out)
            cases[BASELINE] = (lambda: self.comm.Allreduce(MPI.IN_PLACE, send, op=op), refill)
            cases["mpi4py out-of-place"] = (lambda: self.comm.Allreduce(send, recv, op=op),
                                            refill)
        if self.dist is not None:
            t = self._tensor(x)
            cases["gloo"] = (lambda: self.dist.all_reduce(t), refill)
        if self.horovod is not None:
            t = self._tensor(x)
            cases["horovod"] = (
                lambda: self.horovod.allreduce(t, op=self.horovod.Sum, name=f"h.{tag}"), refill)
        return cases

    def small_tensors(self, xs: list[np.ndarray], tag: str) -> dict[str, tuple]:
        """200 small allreduces submitted at once, then all waited for."""
        names = [f"{tag}.{i}" for i in range(len(xs))]
        fills = [x.copy() for x in xs]

        def refill():
            for x, f in zip(xs, fills):
                np.copyto(x, f)

        def ours(submit, prefix: str, tensors=xs, synchronize=hvd.synchronize):
            # names made once, as a training loop's are: the loop measures the library
            tagged = [prefix + name for name in names]

            def run():
                for h in [submit(t, name) for t, name in zip(tensors, tagged)]:
                    synchronize(h)
            return run

        backend = basics._require().engine.backend

        def without(run, **attributes):
            # the same op with parts of the node's shared memory off: fusion_capacity=None is
            # what HOROVOD_SHM_DISABLE=1 gives (MPI only); sums_in_window=False stages the group
            # in the window and sums it with numpy (as a build without src_native does); both
            # take the window from the engine (window=None), which otherwise sums it whole in C
            def run_without():
                saved = {name: getattr(backend, name) for name in attributes}
                for name, value in attributes.items():
                    setattr(backend, name, value)
                try:
                    run()
                finally:
                    for name, value in saved.items():
                        setattr(backend, name, value)
            return run_without

        cases = {
            "hvd numpy": (ours(lambda x, n: hvd.allreduce_async(x, op=hvd.Sum, name=n), "np"),
                          refill),
            "hvd numpy in-place": (
                ours(lambda x, n: hvd.allreduce_async_(x, op=hvd.Sum, name=n), "ip"), refill),
        }
        in_place = cases["hvd numpy in-place"][0]
        if getattr(backend, "sums_in_window", None) is not None:
            cases["hvd numpy in-place, window without the native sum"] = (
                without(in_place, sums_in_window=lambda dtype: False, window=None), refill)
        if getattr(backend, "fusion_capacity", None):
            cases["hvd numpy in-place, no shared memory"] = (
                without(in_place, fusion_capacity=None, window=None), refill)
        if self.hvd_torch is not None:
            # tensors that own their memory, as gradients do (to_torch's bfloat16 is a view)
            ts, views = self._owning_tensors(xs)

            def torch_refill():
                for v, f in zip(views, fills):
                    np.copyto(v, f)

            def torch_run(submit, prefix: str):
                return ours(lambda t, n: submit(t, op=hvd.Sum, name=n), prefix, ts,
                            self.hvd_torch.synchronize)
            cases["hvd torch"] = (torch_run(self.hvd_torch.allreduce_async, "t"), torch_refill)
            # what DistributedOptimizer does with each gradient
            cases["hvd torch in-place"] = (torch_run(self.hvd_torch.allreduce_async_, "ti"),
                                           torch_refill)
        op = self._mpi_sum(xs[0].dtype)
        if op is not None:
            flat = np.concatenate(xs)
            flat_fill = flat.copy()
            bufs = [self._mpi_buffer(x) for x in xs]
            cases[BASELINE + " (1 call, same bytes)"] = (
                lambda: self.comm.Allreduce(MPI.IN_PLACE, self._mpi_buffer(flat), op=op),
                lambda: np.copyto(flat, flat_fill))
            cases[f"mpi4py {len(xs)} Iallreduce"] = (
                lambda: MPI.Request.Waitall(
                    [self.comm.Iallreduce(MPI.IN_PLACE, b, op=op) for b in bufs]), refill)
        if self.dist is not None:
            ts = [self._tensor(x) for x in xs]

            def gloo_run():
                for work in [self.dist.all_reduce(t, async_op=True) for t in ts]:
                    work.wait()
            cases[f"gloo {len(xs)} async"] = (gloo_run, refill)
        if self.horovod is not None:
            ts = [self._tensor(x) for x in xs]
            horovod_names = ["h" + n for n in names]

            def horovod_run():
                handles = [self.horovod.allreduce_async(t, op=self.horovod.Sum, name=n)
                           for t, n in zip(ts, horovod_names)]
                for h in handles:
                    self.horovod.synchronize(h)
            cases["horovod"] = (horovod_run, refill)
        return cases

    def close(self) -> None:
        if self.dist is not None:
            self.dist.destroy_process_group()
        if self.horovod is not None:
            self.horovod.shutdown()


# -- sections --------------------------------------------------------------------------------------

def busbw(nbytes: int, seconds: float, size: int) -> float:
    return nbytes / seconds * 2 * (size - 1) / size


def run_cases(timer: Timer, cases: dict[str, tuple], nbytes: int, size: int,
              min_reps: int | None = None, **labels) -> list:
    timings, errors = timer.compare(cases, min_reps=min_reps)
    rows = [dict(labels, method=method, bytes=nbytes, time_s=seconds, reps=reps,
                 algbw=nbytes / seconds, busbw=busbw(nbytes, seconds, size))
            for method, (seconds, reps) in timings.items()]
    return rows + [dict(labels, method=method, bytes=nbytes, error=error)
                   for method, error in errors.items()]


def sweep(timer: Timer, contenders: Contenders, dtype: np.dtype, sizes: list[int]) -> list:
    rows = []
    for nbytes in sizes:
        x = np.ones(nbytes // dtype.itemsize, dtype=dtype)
        cases = contenders.one_buffer(x, f"{dtype.name}.{nbytes}")
        rows += run_cases(timer, cases, nbytes, hvd.size(), dtype=dtype.name)
        if hvd.rank() == 0:
            print(f"  {dtype.name:>8} {human(nbytes):>9} done", file=sys.stderr, flush=True)
    return rows


def small(timer: Timer, contenders: Contenders, dtype: np.dtype) -> list:
    xs = [np.ones(SMALL_BYTES // dtype.itemsize, dtype=dtype) for _ in range(SMALL_COUNT)]
    cases = contenders.small_tensors(xs, f"small.{dtype.name}")
    return run_cases(timer, cases, SMALL_COUNT * SMALL_BYTES, hvd.size(),
                     min_reps=SMALL_MIN_REPS, dtype=dtype.name)


def half_paths(timer: Timer, comm: MPI.Comm, nbytes: int) -> list:
    """float16 sum of one buffer: with the native op, and the ways of doing without it."""
    x = np.random.default_rng(hvd.rank()).standard_normal(nbytes // 2).astype(np.float16)
    y = x.copy()  # in-place MPI calls work on y, refilled from x before each

    def refill():
        np.copyto(y, x)

    cases = {}
    if _native is not None and _native.has_half_sum():
        native = MPI.Op.fromhandle(_native.half_sum_op("float16"))
        cases["hvd.allreduce, native 16-bit sum"] = (
            lambda: hvd.allreduce(x, op=hvd.Sum, name="half.native"), None)
        cases["mpi4py + native op"] = (
            lambda: comm.Allreduce(MPI.IN_PLACE, [y.view(np.uint16), MPI.UINT16_T], op=native),
            refill)

    def widened():
        # the package without src_native: fusion.wire_dtype sees no _native and widens, and
        # no group is summed through the window or the peers' memory (native kernels too)
        backend = basics._require().engine.backend
        saved = fusion._native, backend.reduces_through_peers, backend.sums_in_window
        fusion._native = None
        backend.reduces_through_peers = backend.sums_in_window = lambda dtype: False
        try:
            return hvd.allreduce(x, op=hvd.Sum, name="half.widened")
        finally:
            fusion._native, backend.reduces_through_peers, backend.sums_in_window = saved

    cases["hvd.allreduce, widened to float32 (no _native)"] = (widened, None)

    def by_hand():
        wide = x.astype(np.float32)
        comm.Allreduce(MPI.IN_PLACE, wide, op=MPI.SUM)
        return wide.astype(np.float16)

    cases["mpi4py, astype(float32) by hand"] = (by_hand, None)

    def python_sum(a, b, datatype):
        inout = np.frombuffer(b, dtype=np.float16)
        np.add(np.frombuffer(a, dtype=np.float16), inout, out=inout)

    python_op = MPI.Op.Create(python_sum, commute=True)
    cases["mpi4py + Python-level op"] = (
        lambda: comm.Allreduce(MPI.IN_PLACE, [y.view(np.uint16), MPI.UINT16_T], op=python_op),
        refill)
    try:
        return run_cases(timer, cases, nbytes, hvd.size(), dtype="float16")
    finally:
        python_op.Free()


def _unpack_numpy(buf: np.ndarray, outputs: list[np.ndarray]) -> None:
    offset = 0
    for o in outputs:
        o[...] = buf[offset:offset + o.size]
        offset += o.size


def pack_numpy_loop(arrays, buf, outputs, factor) -> None:
    """One numpy call per tensor each way, as a plain fusion buffer does."""
    compute = np.float32 if buf.dtype.itemsize < 4 else buf.dtype
    offset = 0
    for a in arrays:
        np.multiply(a, factor, out=buf[offset:offset + a.size], dtype=compute, casting="unsafe")
        offset += a.size
    _unpack_numpy(buf, outputs)


def pack_numpy_concatenate(arrays, buf, outputs, factor) -> None:
    """One concatenate and one scaling pass, then one numpy call per tensor back."""
    compute = np.float32 if buf.dtype.itemsize < 4 else buf.dtype
    np.concatenate(arrays, out=buf, casting="unsafe")
    np.multiply(buf, factor, out=buf, dtype=compute, casting="unsafe")
    _unpack_numpy(buf, outputs)


def pack_native(arrays, buf, outputs, factor) -> None:
    _native.pack(arrays, buf, factor)
    _native.unpack(buf, outputs)


def pack_unpack(reps: int) -> list:
    """Fusion buffer copies of 200 x 16 KiB, local to each rank (rank 0's numbers are kept)."""
    rows = []
    if _native is None:
        return rows
    factor = 0.5  # Average over 2 ranks, folded into the pack
    for src, wire in (("float32", "float32"), ("float16", "float16"), ("float16", "float32"),
                      ("bfloat16", "bfloat16")):
        sd, wd = DTYPES[src], DTYPES[wire]
        arrays = [np.random.default_rng(i).standard_normal(SMALL_BYTES // sd.itemsize).astype(sd)
                  for i in range(SMALL_COUNT)]
        outputs = [np.empty_like(a) for a in arrays]
        buf = np.empty(sum(a.size for a in arrays), wd)
        methods = {"numpy loop": pack_numpy_loop, "numpy concatenate": pack_numpy_concatenate,
                   "native pack/unpack": pack_native}
        times = {method: [] for method in methods}
        for rep in range(reps + 3):  # interleaved, the first 3 rounds are warm-up
            for method, fn in methods.items():
                start = time.perf_counter()
                fn(arrays, buf, outputs, factor)
                if rep >= 3:
                    times[method].append(time.perf_counter() - start)
        rows += [dict(src=src, wire=wire, method=method, time_s=float(statistics.median(t)))
                 for method, t in times.items()]
    return rows


# -- GPU ------------------------------------------------------------------------------------------

CUDA_BASELINE = "raw cupy.cuda.nccl"


class CudaContenders:
    """torch CUDA tensors: hpc_horovod.torch (NCCL through the engine) against raw
    ``cupy.cuda.nccl`` on the same memory, on torch's current stream. Every case ends with
    ``torch.cuda.synchronize()``: the engine's handles complete once the work is queued."""

    def __init__(self, comm: MPI.Comm):
        try:
            import cupy
            import torch
            from cupy.cuda import nccl
        except ImportError as e:
            raise SystemExit(f"--device cuda needs torch with CUDA and cupy with NCCL: {e}") \
                from None
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
        import hpc_horovod.torch as hvd_torch

        self.torch, self.cupy, self.nccl, self.hvd_torch = torch, cupy, nccl, hvd_torch
        self.comm = comm
        self.device = hvd_torch.pin_gpu("torch")
        if self.device is None:
            raise SystemExit("--device cuda: no GPU for this rank (see hpc-horovod doctor)")
        self.transport = basics.device_transport()
        unique_id = nccl.get_unique_id() if comm.Get_rank() == 0 else None
        unique_id = comm.bcast(unique_id, root=0)
        with cupy.cuda.Device(self.device):
            self.raw = nccl.NcclCommunicator(comm.Get_size(), unique_id, comm.Get_rank())
        self.types = {"float32": nccl.NCCL_FLOAT32, "float16": nccl.NCCL_FLOAT16}
        if hasattr(nccl, "NCCL_BFLOAT16"):
            self.types["bfloat16"] = nccl.NCCL_BFLOAT16

    def tensor(self, x: np.ndarray):
        from hpc_horovod.torch.adapter import to_torch

        return to_torch(x, self.torch.device("cuda", self.device))

    def _raw_allreduce(self, t) -> None:
        self.raw.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), self.types[_dtype_name(t)],
                           self.nccl.NCCL_SUM, self.torch.cuda.current_stream().cuda_stream)

    def one_buffer(self, x: np.ndarray, tag: str) -> dict[str, tuple]:
        t, fill = self.tensor(x), self.tensor(x)
        sync = self.torch.cuda.synchronize

        def refill():
            t.copy_(fill)
            sync()

        def ours_out():
            self.hvd_torch.allreduce(t, op=hvd.Sum, name=f"cuda.{tag}")
            sync()

        def ours_in():
            self.hvd_torch.allreduce_(t, op=hvd.Sum, name=f"cuda_.{tag}")
            sync()

        def raw():
            self._raw_allreduce(t)
            sync()

        cases = {"hvd torch cuda": (ours_out, refill),
                 "hvd torch cuda in-place": (ours_in, refill)}
        if _dtype_name(t) in self.types:
            cases[CUDA_BASELINE] = (raw, refill)
        return cases

    def small_tensors(self, xs: list[np.ndarray], tag: str) -> dict[str, tuple]:
        ts = [self.tensor(x) for x in xs]
        fills = [self.tensor(x) for x in xs]
        flat = self.torch.cat(fills)
        sync = self.torch.cuda.synchronize

        def refill():
            for t, f in zip(ts, fills):
                t.copy_(f)
            sync()

        def ours():
            handles = [self.hvd_torch.allreduce_async_(t, op=hvd.Sum, name=f"cs.{tag}.{i}")
                       for i, t in enumerate(ts)]
            for h in handles:
                self.hvd_torch.synchronize(h)
            sync()

        def raw_one():
            self._raw_allreduce(flat)
            sync()

        def raw_group():
            self.nccl.groupStart()
            for t in ts:
                self._raw_allreduce(t)
            self.nccl.groupEnd()
            sync()

        cases = {"hvd torch cuda in-place": (ours, refill)}
        if _dtype_name(ts[0]) in self.types:
            cases[CUDA_BASELINE + " (1 call, same bytes)"] = (raw_one, refill)
            cases[f"raw nccl {len(ts)} calls in one group"] = (raw_group, refill)
        return cases


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def cuda_main(args, timer: Timer, comm: MPI.Comm) -> dict:
    contenders = CudaContenders(comm)
    result = {"meta": {"device": "cuda", "transport": contenders.transport,
                       "gpu": contenders.torch.cuda.get_device_name(contenders.device)},
              "sweep": [], "small_tensors": []}
    sizes, nbytes = [], max(args.min_bytes, 1 << 20)
    while nbytes <= args.max_bytes:
        sizes.append(nbytes)
        nbytes *= 2
    for name in args.dtypes:
        dtype = DTYPES[name]
        for nbytes in sizes:
            x = np.ones(nbytes // dtype.itemsize, dtype=dtype)
            result["sweep"] += run_cases(timer, contenders.one_buffer(x, f"{name}.{nbytes}"),
                                         nbytes, hvd.size(), dtype=name)
        xs = [np.ones(SMALL_BYTES // dtype.itemsize, dtype=dtype) for _ in range(SMALL_COUNT)]
        result["small_tensors"] += run_cases(timer, contenders.small_tensors(xs, name),
                                             SMALL_COUNT * SMALL_BYTES, hvd.size(), dtype=name)
    return result


# -- report ----------------------------------------------------------------------------------------

def print_sweep(rows: list, dtype: str, baseline: str = BASELINE) -> None:
    mine = [r for r in rows if r["dtype"] == dtype and "time_s" in r]
    methods = list(dict.fromkeys(r["method"] for r in mine))
    sizes = sorted({r["bytes"] for r in mine})
    cell = {(r["bytes"], r["method"]): r for r in mine}
    width = max(16, *(len(m) + 2 for m in methods))
    print(f"\n{dtype}: time (x ratio to {baseline}) and bus bandwidth GB/s")
    print(f"{'size':>10}" + "".join(f"{m:>{width}}" for m in methods))
    for nbytes in sizes:
        base = cell.get((nbytes, baseline))
        line = f"{human(nbytes):>10}"
        for m in methods:
            r = cell.get((nbytes, m))
            ratio = f" x{r['time_s'] / base['time_s']:.2f}" if r and base else ""
            line += f"{fmt_time(r['time_s']) + ratio if r else '-':>{width}}"
        print(line)
        print(f"{'':>10}" + "".join(
            f"{cell[(nbytes, m)]['busbw'] / 1e9:>{width}.3f}" if (nbytes, m) in cell
            else f"{'-':>{width}}" for m in methods))


def print_rows(title: str, rows: list, baseline: str | None = None) -> None:
    print(f"\n{title}")
    rows = [r for r in rows if "time_s" in r]
    base = next((r for r in rows if r["method"].startswith(baseline)), None) if baseline else None
    for r in rows:
        ratio = f"  x{r['time_s'] / base['time_s']:.2f}" if base else ""
        bw = f"  busbw {r['busbw'] / 1e9:.3f} GB/s" if "busbw" in r else ""
        print(f"  {r['method']:<48}{fmt_time(r['time_s']):>10}{ratio}{bw}")


def plot(result: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    timed = [r for r in result["sweep"] if "time_s" in r]
    dtypes = list(dict.fromkeys(r["dtype"] for r in timed))
    fig, axes = plt.subplots(1, len(dtypes) + 1, figsize=(6 * (len(dtypes) + 1), 4.5))
    for ax, dtype in zip(axes, dtypes):
        rows = [r for r in timed if r["dtype"] == dtype]
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["bytes"], r["busbw"] / 1e9) for r in rows if r["method"] == method)
            ax.plot(*zip(*pts), marker="o", ms=3, label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"allreduce {dtype}, {result['meta']['ranks']} ranks")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    rows = [r for r in result["small_tensors"] if r["dtype"] == dtypes[0] and "time_s" in r]
    ax.barh([r["method"] for r in rows], [r["time_s"] * 1e3 for r in rows])
    ax.set_xlabel("ms")
    ax.set_title(f"{SMALL_COUNT} x {human(SMALL_BYTES)} {dtypes[0]}, async then synchronized")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: {path}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=parse_bytes, default=4 << 10)
    p.add_argument("--max-bytes", type=parse_bytes, default=None,
                   help="largest buffer per rank (default 64M, 1G with --device cuda; the "
                        "full host sweep is 256M)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: torch CUDA tensors, NCCL against raw cupy.cuda.nccl")
    p.add_argument("--dtypes", type=parse_dtypes, default=parse_dtypes("float32,float16"),
                   help="comma-separated: float32, float16, bfloat16 (default float32,float16)")
    p.add_argument("--half-bytes", type=parse_bytes, default=16 << 20,
                   help="buffer of the native-vs-widened float16 comparison (default 16M)")
    p.add_argument("--seconds-per-point", type=float, default=0.5)
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=200)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.max_bytes is None:
        args.max_bytes = (1 << 30) if args.device == "cuda" else (64 << 20)
    if args.min_bytes > args.max_bytes:
        p.error(f"--min-bytes ({human(args.min_bytes)}) is above --max-bytes")

    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    timer = Timer(comm, args.seconds_per_point, args.min_reps, args.max_reps)
    if args.device == "cuda":
        report_cuda(args, cuda_main(args, timer, comm))
        hvd.shutdown()
        return
    contenders = Contenders(comm)
    sizes = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        sizes.append(nbytes)
        nbytes *= 2
    result = {
        "meta": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": socket.gethostname(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "ranks": hvd.size(), "command": " ".join(sys.argv),
            "mpi": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
            "native": None if _native is None else _native.kernels(),
            "half_on_wire": str(fusion.wire_dtype(DTYPES["float16"], hvd.Sum)),
            "loadavg_start": os.getloadavg(), "skipped": contenders.skipped,
        },
        "sweep": [], "small_tensors": [],
    }
    for name in args.dtypes:
        result["sweep"] += sweep(timer, contenders, DTYPES[name], sizes)
        result["small_tensors"] += small(timer, contenders, DTYPES[name])
    result["half_16mib"] = half_paths(timer, comm, args.half_bytes)
    result["pack_unpack"] = pack_unpack(reps=50)
    result["meta"]["loadavg_end"] = os.getloadavg()
    contenders.close()
    hvd.shutdown()
    if MPI.COMM_WORLD.Get_rank() != 0:
        return

    meta = result["meta"]
    print(f"{meta['date']}  {meta['host']}  {meta['cpus']} cpus  {meta['ranks']} ranks  "
          f"{meta['mpi']}  native: {meta['native']}  load {meta['loadavg_start']}")
    for what, why in meta["skipped"].items():
        print(f"skipped {what}: {why}")
    for name in args.dtypes:
        print_sweep(result["sweep"], name)
        print_rows(f"{SMALL_COUNT} x {human(SMALL_BYTES)} {name}, submitted then synchronized",
                   [r for r in result["small_tensors"] if r["dtype"] == name], BASELINE)
    print_rows(f"float16 sum of {human(args.half_bytes)} (x: ratio to the native path)",
               result["half_16mib"], "hvd.allreduce, native")
    for src, wire in dict.fromkeys((r["src"], r["wire"]) for r in result["pack_unpack"]):
        print_rows(f"fusion pack+unpack, {SMALL_COUNT} x {human(SMALL_BYTES)} {src} "
                   f"(wire {wire}, scaled by 0.5), rank 0",
                   [r for r in result["pack_unpack"] if (r["src"], r["wire"]) == (src, wire)],
                   "numpy loop")
    failed = [r for section in ("sweep", "small_tensors", "half_16mib") for r in result[section]
              if "error" in r]
    for r in {(r["method"], r.get("dtype"), r["error"]) for r in failed}:
        print(f"\nnot measured: {r[0]} ({r[1]}): {r[2]}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "allreduce.json").write_text(json.dumps(result, indent=1))
    print(f"\nresults: {args.out / 'allreduce.json'}")
    print(plot(result, args.out / "allreduce.png"))


def report_cuda(args, result: dict) -> None:
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    meta = result["meta"]
    meta.update(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                host=socket.gethostname(), ranks=hvd.size(), command=" ".join(sys.argv))
    print(f"{meta['date']}  {meta['host']}  {meta['gpu']}  {meta['ranks']} ranks  "
          f"GPU tensors move by: {meta['transport']}")
    for name in args.dtypes:
        print_sweep(result["sweep"], name, CUDA_BASELINE)
        print_rows(f"{SMALL_COUNT} x {human(SMALL_BYTES)} {name} on the GPU, submitted then "
                   "synchronized", [r for r in result["small_tensors"] if r["dtype"] == name],
                   CUDA_BASELINE)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "allreduce_cuda.json").write_text(json.dumps(result, indent=1))
    print(f"\nresults: {args.out / 'allreduce_cuda.json'}")
    print(plot(result, args.out / "allreduce_cuda.png"))


if __name__ == "__main__":
    main()
