"""Allreduce as users feel it: hpc_horovod against raw mpi4py and torch.distributed (gloo).

    hpc-horovod run -np 2 python benchmarks/allreduce.py [--max-bytes 256M]
    hpc-horovod run -np <GPUs> python benchmarks/allreduce.py --device cuda

On the host, in the same processes:

* one float32 buffer of 4 KiB .. ``--max-bytes``: ``hvd.allreduce`` and ``hvd.allreduce_``
  (numpy), ``hpc_horovod.torch.allreduce_`` (CPU tensor), mpi4py ``Allreduce`` in place (the
  baseline) and torch.distributed gloo ``all_reduce`` (when it starts); and two bounds with no
  communication, on every rank at once: one pass over the buffer in place (``x * 1`` into
  ``x``: the least memory traffic of an in-place allreduce of private buffers) and
  ``x.copy()`` (the least of an out-of-place one, which returns a new array);
* 200 x 16 KiB float32 submitted asynchronously, then all synchronized (numpy and torch; gloo
  with 200 async ops), against one mpi4py ``Allreduce`` of the same bytes;
* float16 at 16 MiB: ``hvd.allreduce`` with the native 16-bit MPI sum against the same values
  widened to float32 around ``hvd.allreduce`` (what the package does without the native sum),
  and mpi4py ``Allreduce`` in place with the native sum.

With ``--device cuda`` (one rank per GPU) the buffers are torch CUDA tensors of 1 MiB ..
``--max-bytes`` (default 1 GiB): ``hpc_horovod.torch.allreduce_`` against raw
``cupy.cuda.nccl`` ``allReduce`` on the same memory and stream, each timed up to
``torch.cuda.synchronize()``, and the 200 x 16 KiB case against one raw NCCL call.

Every reduction is a Sum. The cases of one point run interleaved, repetition by repetition in
an order shuffled at every repetition (the same on every rank), each after a barrier and with its
input rewritten, so that load from elsewhere hits them alike; a repetition lasts as long as its
slowest rank. Reported: median and quartiles over repetitions, bus bandwidth in the nccl-tests
convention (``bytes / time * 2 (n - 1) / n``) and the ratio of times to the baseline. Results go
to ``benchmarks/results/allreduce.json`` (``allreduce_cuda.json``), every repetition to
``benchmarks/out/``; ``benchmarks/report.py`` turns them into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import time
from collections.abc import Callable

import numpy as np
from machine import RAW, RESULTS, command_line, describe
from mpi4py import MPI

import hpc_horovod as hvd

try:
    from hpc_horovod import _native
except ImportError:
    _native = None

SMALL_COUNT, SMALL_BYTES = 200, 16 << 10
BASELINE = "mpi4py Allreduce in place"
#: bounds, no communication: one read and one write of the buffer in place (an in-place
#: allreduce cannot do less), and a copy into a new array (an out-of-place one cannot)
PASS_IN_PLACE, PASS_COPY = "bound: one pass in place", "bound: copy to a new array"
CUDA_BASELINE = "raw cupy.cuda.nccl allReduce"
Case = tuple[Callable[[], object], Callable[[], object]]  # (timed call, untimed refill)


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


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


class Timer:
    """Times competing collective cases, interleaved; see the module's docstring."""

    def __init__(self, comm: MPI.Comm, args):
        self.comm, self.args = comm, args
        self.raw: list[dict] = []  # every repetition, for benchmarks/out/

    def _once(self, case: Case) -> float:
        fn, refill = case
        refill()
        self.comm.Barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def compare(self, point: str, cases: dict[str, Case], nbytes: int, baseline: str) -> list:
        """One row per case: median and quartiles of the slowest rank, ratio to ``baseline``."""
        names = list(cases)
        warm = [max(self._once(cases[n]) for _ in range(2)) for n in names]
        slowest = self.comm.allreduce(sum(warm), op=MPI.MAX)
        reps = int(min(self.args.max_reps, max(self.args.min_reps, self.args.seconds_per_point
                                               * len(names) / max(slowest, 1e-9))))
        local = np.empty((reps, len(names)))
        for r in range(reps):
            for j in np.random.default_rng(r).permutation(len(names)):
                local[r, j] = self._once(cases[names[j]])
        times = np.max(np.array(self.comm.allgather(local)), axis=0)
        rows = []
        for j, name in enumerate(names):
            p25, median, p75 = np.percentile(times[:, j], [25, 50, 75])
            rows.append({"case": name, "bytes": nbytes, "median_s": float(median),
                         "p25_s": float(p25), "p75_s": float(p75), "reps": reps,
                         "busbw_GBps": nbytes / median * 2 * (self.comm.size - 1)
                         / self.comm.size / 1e9})
            self.raw.append({"point": point, "case": name, "bytes": nbytes,
                             "seconds": times[:, j].tolist()})
        base = next((r["median_s"] for r in rows if r["case"] == baseline), None)
        for row in rows:
            row["ratio"] = row["median_s"] / base if base else None
        if self.comm.rank == 0:
            print(f"{point}: " + ", ".join(f"{r['case']} {r['median_s'] * 1e3:.3f} ms"
                                           for r in rows), file=sys.stderr, flush=True)
        return rows


def _refill(arrays: list, fills: list) -> Callable[[], None]:
    def refill():
        for a, f in zip(arrays, fills):
            a[...] = f
    return refill


class Host:
    """The host contenders in this process: numpy and torch APIs, mpi4py, gloo."""

    def __init__(self, comm: MPI.Comm):
        self.comm, self.skipped = comm, {}
        self.torch = self.hvd_torch = self.dist = None
        try:
            import torch

            import hpc_horovod.torch as hvd_torch

            torch.set_num_threads(1)
            self.torch, self.hvd_torch = torch, hvd_torch
        except ImportError as e:
            self.skipped["torch"] = str(e)
            return
        try:  # gloo inside these processes, rendezvous on rank 0's host
            import torch.distributed as dist

            port = None
            if comm.rank == 0:
                with socket.socket() as s:
                    s.bind(("", 0))
                    port = s.getsockname()[1]
            host = "127.0.0.1" if hvd.local_size() == hvd.size() else socket.gethostname()
            host, port = comm.bcast((host, port), root=0)
            dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.rank,
                                    world_size=comm.size, timeout=datetime.timedelta(seconds=60))
            self.dist = dist
        except Exception as e:  # noqa: BLE001 - e.g. the port was taken meanwhile
            self.skipped["gloo"] = f"{type(e).__name__}: {e}".splitlines()[0]

    def one_buffer(self, x: np.ndarray, tag: str) -> dict[str, Case]:
        refill = _refill([x], [x.copy()])
        cases = {
            "hvd.allreduce": (lambda: hvd.allreduce(x, op=hvd.Sum, name=f"np.{tag}"), refill),
            "hvd.allreduce_": (lambda: hvd.allreduce_(x, op=hvd.Sum, name=f"ip.{tag}"), refill),
        }
        if self.hvd_torch is not None:
            t = self.torch.from_numpy(x)
            cases["hvd.torch.allreduce_"] = (
                lambda: self.hvd_torch.allreduce_(t, op=hvd.Sum, name=f"t.{tag}"), refill)
        cases[BASELINE] = (lambda: self.comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM), refill)
        if self.dist is not None:
            t = self.torch.from_numpy(x)
            cases["gloo all_reduce"] = (lambda: self.dist.all_reduce(t), refill)
        # No communication: the memory traffic any allreduce of private buffers pays at least,
        # every rank at once (the same caches and memory bus as the contenders).
        cases[PASS_IN_PLACE] = (lambda: np.multiply(x, 1, out=x), refill)
        cases[PASS_COPY] = (lambda: x.copy(), refill)
        return cases

    def small(self, xs: list[np.ndarray]) -> dict[str, Case]:
        refill = _refill(xs, [x.copy() for x in xs])
        names = [f"small.{i}" for i in range(len(xs))]

        def numpy_async():
            handles = [hvd.allreduce_async_(x, op=hvd.Sum, name=n) for x, n in zip(xs, names)]
            for h in handles:
                hvd.synchronize(h)

        cases = {"hvd.allreduce_async_ (numpy)": (numpy_async, refill)}
        if self.hvd_torch is not None:
            ts = [self.torch.from_numpy(x) for x in xs]
            tnames = ["t" + n for n in names]

            def torch_async():
                handles = [self.hvd_torch.allreduce_async_(t, op=hvd.Sum, name=n)
                           for t, n in zip(ts, tnames)]
                for h in handles:
                    self.hvd_torch.synchronize(h)
            cases["hvd.torch.allreduce_async_"] = (torch_async, refill)
        flat = np.concatenate(xs)
        cases[BASELINE + ", one call"] = (
            lambda: self.comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM),
            _refill([flat], [flat.copy()]))
        if self.dist is not None:
            ts = [self.torch.from_numpy(x) for x in xs]

            def gloo_async():
                for work in [self.dist.all_reduce(t, async_op=True) for t in ts]:
                    work.wait()
            cases[f"gloo {len(xs)} async all_reduce"] = (gloo_async, refill)
        return cases

    def half(self, nbytes: int) -> dict[str, Case]:
        x = np.random.default_rng(self.comm.rank).standard_normal(nbytes // 2).astype(np.float16)
        refill = _refill([x], [x.copy()])
        cases = {
            "hvd.allreduce float16": (lambda: hvd.allreduce(x, op=hvd.Sum, name="half"), refill),
            "hvd.allreduce widened to float32": (
                lambda: hvd.allreduce(x.astype(np.float32), op=hvd.Sum,
                                      name="half.wide").astype(np.float16), refill),
        }
        if _native is not None and _native.has_half_sum():  # MPI's own call with the same op
            op = MPI.Op.fromhandle(_native.half_sum_op("float16"))
            cases["mpi4py Allreduce in place, native op"] = (
                lambda: self.comm.Allreduce(MPI.IN_PLACE, [x.view(np.uint16), MPI.UINT16_T],
                                            op=op), refill)
        return cases

    def close(self) -> None:
        if self.dist is not None:
            self.dist.destroy_process_group()


class Cuda:
    """torch CUDA tensors: hpc_horovod.torch (NCCL through the engine) against raw
    ``cupy.cuda.nccl`` on the same memory and torch's current stream."""

    def __init__(self, comm: MPI.Comm):
        try:
            import cupy
            import torch
            from cupy.cuda import nccl

            import hpc_horovod.torch as hvd_torch
        except ImportError as e:
            raise SystemExit(f"--device cuda needs torch with CUDA and cupy with NCCL: {e}") \
                from None
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
        self.torch, self.nccl, self.hvd_torch, self.skipped = torch, nccl, hvd_torch, {}
        self.device = hvd_torch.pin_gpu("torch")
        if self.device is None:
            raise SystemExit("--device cuda: no GPU for this rank (see hpc-horovod doctor)")
        unique_id = comm.bcast(nccl.get_unique_id() if comm.rank == 0 else None, root=0)
        with cupy.cuda.Device(self.device):
            self.raw = nccl.NcclCommunicator(comm.size, unique_id, comm.rank)

    def _tensor(self, x: np.ndarray):
        return self.torch.from_numpy(x).to(f"cuda:{self.device}")

    def _case(self, fn, tensors, fills) -> Case:
        sync = self.torch.cuda.synchronize

        def run():
            fn()
            sync()

        def refill():
            for t, f in zip(tensors, fills):
                t.copy_(f)
            sync()
        return run, refill

    def _raw(self, t) -> None:
        self.raw.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), self.nccl.NCCL_FLOAT32,
                           self.nccl.NCCL_SUM, self.torch.cuda.current_stream().cuda_stream)

    def one_buffer(self, x: np.ndarray, tag: str) -> dict[str, Case]:
        t, fill = self._tensor(x), self._tensor(x)
        return {"hvd.torch.allreduce_ (cuda)": self._case(
                    lambda: self.hvd_torch.allreduce_(t, op=hvd.Sum, name=f"c.{tag}"), [t], [fill]),
                CUDA_BASELINE: self._case(lambda: self._raw(t), [t], [fill])}

    def small(self, xs: list[np.ndarray]) -> dict[str, Case]:
        ts, fills = [self._tensor(x) for x in xs], [self._tensor(x) for x in xs]
        flat, flat_fill = self.torch.cat(fills), self.torch.cat(fills)

        def ours():
            handles = [self.hvd_torch.allreduce_async_(t, op=hvd.Sum, name=f"cs.{i}")
                       for i, t in enumerate(ts)]
            for h in handles:
                self.hvd_torch.synchronize(h)
        return {"hvd.torch.allreduce_async_ (cuda)": self._case(ours, ts, fills),
                CUDA_BASELINE + ", one call": self._case(lambda: self._raw(flat), [flat],
                                                         [flat_fill])}

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--min-bytes", type=parse_bytes, default=None,
                   help="smallest buffer (default 4K, 1M with --device cuda)")
    p.add_argument("--max-bytes", type=parse_bytes, default=None,
                   help="largest buffer per rank (default 256M, 1G with --device cuda)")
    p.add_argument("--half-bytes", type=parse_bytes, default=16 << 20,
                   help="buffer of the float16 native-vs-widened comparison (default 16M)")
    p.add_argument("--seconds-per-point", type=float, default=0.5,
                   help="time budget per case and point, which sets the repetitions")
    p.add_argument("--min-reps", type=int, default=10)
    p.add_argument("--max-reps", type=int, default=200)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.min_bytes = args.min_bytes or (1 << 20 if cuda else 4 << 10)
    args.max_bytes = args.max_bytes or (1 << 30 if cuda else 256 << 20)
    if args.min_bytes > args.max_bytes:
        p.error(f"--min-bytes ({human(args.min_bytes)}) is above --max-bytes")
    if min(args.min_reps, args.max_reps) < 1 or args.min_reps > args.max_reps:
        p.error("need 1 <= --min-reps <= --max-reps")

    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    timer = Timer(comm, args)
    contenders = Cuda(comm) if cuda else Host(comm)
    baseline = CUDA_BASELINE if cuda else BASELINE
    sweep, nbytes = [], args.min_bytes
    while nbytes <= args.max_bytes:
        x = np.ones(nbytes // 4, dtype=np.float32)
        sweep += timer.compare(human(nbytes), contenders.one_buffer(x, str(nbytes)), nbytes,
                               baseline)
        nbytes *= 2
    xs = [np.ones(SMALL_BYTES // 4, dtype=np.float32) for _ in range(SMALL_COUNT)]
    small = timer.compare("small", contenders.small(xs), SMALL_COUNT * SMALL_BYTES,
                          baseline + ", one call")
    sections = {
        "sweep": {"title": "One float32 buffer", "baseline": baseline, "rows": sweep},
        "small": {"title": f"{SMALL_COUNT} x {human(SMALL_BYTES)} float32, submitted "
                           "asynchronously then synchronized", "baseline": baseline + ", one call",
                  "rows": small}}
    if not cuda:
        sections["half"] = {
            "title": f"float16, {human(args.half_bytes)}: the native 16-bit sum against "
                     "widening to float32", "baseline": "hvd.allreduce float16",
            "rows": timer.compare("half", contenders.half(args.half_bytes), args.half_bytes,
                                  "hvd.allreduce float16")}
    contenders.close()
    hvd.shutdown()
    if comm.rank != 0:
        return
    name = "allreduce_cuda" if cuda else "allreduce"
    meta = describe(command_line(f"hpc-horovod run -np {comm.size} python"))
    meta.update(ranks=comm.size, skipped=contenders.skipped)
    if cuda:
        meta["gpu"] = contenders.torch.cuda.get_device_name(contenders.device)
    RESULTS.mkdir(parents=True, exist_ok=True)
    RAW.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "meta": meta, "sections": sections},
                               indent=1) + "\n")
    (RAW / f"{name}_repetitions.json").write_text(json.dumps(timer.raw) + "\n")
    for section in sections.values():
        print(f"\n{section['title']} (ratio: time / time of {section['baseline']})")
        for r in section["rows"]:
            ratio = f"x{r['ratio']:.2f}" if r["ratio"] is not None else ""
            print(f"  {human(r['bytes']):>9}  {r['case']:<40} {r['median_s'] * 1e3:10.3f} ms "
                  f"{ratio:>7}  busbw {r['busbw_GBps']:.3f} GB/s")
    for what, why in contenders.skipped.items():
        print(f"skipped {what}: {why}")
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
