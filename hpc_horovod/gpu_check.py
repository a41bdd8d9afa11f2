"""``hpc-horovod check-build --gpu``: the device self-check of this installation.

Every collective of the torch binding runs on CUDA tensors (the engine, fusion, DLPack,
streams), each compared with the result computed on the CPU from every rank's inputs; half
precision averages are compared bit for bit with the float32 reference. Then allreduce bus
bandwidth is measured against raw NCCL on the same buffers. The table names every op with PASS
or FAIL (and the ranks where it failed); the exit status is 1 if anything failed. Run it as the
job would run: alone, or one rank per GPU under ``hpc-horovod run -np <GPUs>`` or ``srun``.
"""

from __future__ import annotations

from .check_build import mpi_library

#: allreduce cases the device check runs (dtype name, op name): every wire dtype and op kind
GPU_REDUCTIONS = (
    ("float32", "Average"), ("float64", "Sum"), ("float16", "Sum"), ("float16", "Max"),
    ("bfloat16", "Sum"), ("int32", "Sum"), ("int64", "Min"), ("int16", "Sum"), ("int8", "Sum"),
    ("uint8", "Max"), ("bool", "Min"), ("bool", "Max"),
)
#: message sizes of the bandwidth rows, in MiB
GPU_SIZES_MIB = (1, 16, 64, 256)


class GpuCheck:
    """The device checks of ``check-build --gpu`` on this rank: every collective of the torch
    binding on CUDA tensors (the engine, fusion, DLPack, streams), each compared with the
    result computed on the CPU from every rank's inputs, then allreduce bandwidth against raw
    NCCL on the same buffers. Every rank runs the same checks in the same order."""

    def __init__(self, hvd, torch, device=None):
        """``device``: where the tensors live; None: this rank's GPU (local rank modulo the
        GPUs), made torch's current device. The CPU checks the checks themselves."""
        self.hvd, self.torch = hvd, torch
        self.rank, self.size = hvd.rank(), hvd.size()
        if device is None:
            index = hvd.local_rank() % torch.cuda.device_count()
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        self.dev = torch.device(device)
        self.rows: list[tuple[str, bool, str]] = []

    # -- inputs and expectations ---------------------------------------------------------------
    def values(self, r: int, shape, dtype):
        """Rank ``r``'s input: the same on every rank that computes it, on the CPU."""
        torch = self.torch
        gen = torch.Generator().manual_seed(1000 * r + int(torch.Size(shape).numel()))
        if dtype == torch.bool:
            return torch.rand(shape, generator=gen) < 0.7
        if dtype.is_floating_point:
            return (torch.randn(shape, generator=gen, dtype=torch.float64) + 1.5).to(dtype)
        low = 0 if dtype == torch.uint8 else -5
        return torch.randint(low, 6, shape, generator=gen).to(dtype)

    def reduced(self, shape, dtype, op: str):
        torch = self.torch
        every = torch.stack([self.values(r, shape, dtype) for r in range(self.size)])
        if dtype == torch.bool:
            return every.all(0) if op == "Min" else every.any(0)
        if op == "Min":
            return every.amin(0)
        if op == "Max":
            return every.amax(0)
        wide = every.to(torch.float64 if dtype.is_floating_point else torch.int64).sum(0)
        if op == "Average":
            wide = wide / self.size
        return wide.to(dtype)  # integer sums wrap as the narrow sum does

    def same(self, got, expected) -> None:
        torch = self.torch
        assert got.device == self.dev, f"result on {got.device}, not {self.dev}"
        got = got.cpu()
        assert got.dtype == expected.dtype and got.shape == expected.shape, \
            f"{got.dtype}{tuple(got.shape)} != {expected.dtype}{tuple(expected.shape)}"
        if expected.dtype.is_floating_point:
            tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2}.get(expected.dtype, 1e-5)
            torch.testing.assert_close(got.double(), expected.double(), rtol=tol, atol=tol)
        else:
            assert torch.equal(got, expected), f"{got.reshape(-1)[:6]} != " \
                                               f"{expected.reshape(-1)[:6]}"

    def dtype(self, name: str):
        return getattr(self.torch, name)

    # -- running -------------------------------------------------------------------------------
    def run(self, name: str, check) -> None:
        try:
            detail = check() or ""
            self.rows.append((name, True, detail))
        except Exception as exc:  # noqa: BLE001 - every failure is a row of the table
            text = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self.rows.append((name, False, text[:160]))

    def all_checks(self) -> None:
        for dtype, op in GPU_REDUCTIONS:
            self.run(f"allreduce {dtype} {op}", lambda d=dtype, o=op: self.allreduce(d, o, False))
        for dtype, op in (("float32", "Sum"), ("bfloat16", "Average"), ("int8", "Sum")):
            self.run(f"allreduce_ (in place) {dtype} {op}",
                     lambda d=dtype, o=op: self.allreduce(d, o, True))
        for dtype in ("bfloat16", "float16"):
            for how in ("alone", "in place", "fused"):
                self.run(f"allreduce {dtype} Average, postscale 1/3, {how}: exact",
                         lambda d=dtype, h=how: self.exact_average(d, h))
        self.run("allreduce prescale/postscale", self.scaled)
        self.run("allreduce non-contiguous input", self.non_contiguous)
        self.run("grouped_allreduce (7 tensors, fused)", self.grouped)
        self.run("grouped_allreduce_ scattered (fusion buffer)",
                 lambda: self.grouped_inplace(False))
        self.run("grouped_allreduce_ one flat bucket (zero copy)",
                 lambda: self.grouped_inplace(True))
        self.run("producer on a side stream after a long kernel", self.side_stream)
        self.run("allgather uneven rows float32/bfloat16", self.allgather)
        self.run("broadcast_ (in place) and broadcast", self.broadcast)
        self.run("alltoall with splits", self.alltoall)
        self.run("reducescatter Sum", self.reducescatter)
        self.run("Adasum", self.adasum)
        self.run("DistributedOptimizer step (torch.nn.Linear)", self.optimizer_step)

    # -- the checks ----------------------------------------------------------------------------
    def allreduce(self, dtype_name: str, op: str, inplace: bool) -> str:
        hvd, dtype = self.hvd, self.dtype(dtype_name)
        shape = (33, 17)
        tensor = self.values(self.rank, shape, dtype).to(self.dev)
        if inplace:
            ptr = tensor.data_ptr()
            out = hvd.allreduce_(tensor, op=getattr(hvd, op))
            assert out is tensor and tensor.data_ptr() == ptr
        else:
            out = hvd.allreduce(tensor, op=getattr(hvd, op))
            self.same(tensor, self.values(self.rank, shape, dtype))  # input untouched
        self.same(out, self.reduced(shape, dtype, op))

    def exact_average(self, dtype_name: str, how: str) -> str:
        """Average, then postscale 1/3 (so that one GPU scales by a factor that is not a
        power of two too), on integers whose sums are exact in half precision: the result is
        (float32 sum * float32 factor) rounded once to the half type, as on the host, bit for
        bit. A factor rounded to the half type first would be off for most elements."""
        hvd, torch = self.hvd, self.torch
        dtype = self.dtype(dtype_name)
        shapes = [(257,), (3, 5)] if how == "fused" else [(1000,)]

        def mine(r, shape):
            gen = torch.Generator().manual_seed(7 * r + int(torch.Size(shape).numel()))
            return torch.randint(-40, 41, shape, generator=gen).to(dtype)

        tensors = [mine(self.rank, s).to(self.dev) for s in shapes]
        factor = 1.0 / 3.0
        if how == "alone":
            outs = [hvd.allreduce(tensors[0], op=hvd.Average, postscale_factor=factor)]
        elif how == "in place":
            outs = [hvd.allreduce_(tensors[0], op=hvd.Average, postscale_factor=factor)]
        else:
            outs = hvd.grouped_allreduce(tensors, op=hvd.Average, postscale_factor=factor)
        scale = torch.tensor(factor / self.size, dtype=torch.float32)
        for shape, out in zip(shapes, outs):
            total = torch.stack([mine(r, shape) for r in range(self.size)]).float().sum(0)
            expected = (total * scale).to(dtype)
            got = out.cpu()
            wrong = int((got != expected).sum())
            assert wrong == 0, (f"{wrong} of {got.numel()} elements differ from the float32 "
                                f"reference, e.g. {got.reshape(-1)[:4].tolist()} vs "
                                f"{expected.reshape(-1)[:4].tolist()}")
        return f"{self.size} rank(s)"

    def scaled(self) -> None:
        hvd, torch = self.hvd, self.torch
        tensor = self.values(self.rank, (100,), torch.float32).to(self.dev)
        out = hvd.allreduce(tensor, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
        self.same(out, self.reduced((100,), torch.float32, "Sum") * 0.5)

    def non_contiguous(self) -> None:
        hvd, torch = self.hvd, self.torch
        base = self.values(self.rank, (6, 8), torch.float32).to(self.dev)
        out = hvd.allreduce(base.t(), op=hvd.Sum)
        self.same(out, self.reduced((6, 8), torch.float32, "Sum").t().contiguous())
        try:
            hvd.allreduce_(base.t(), op=hvd.Sum)
        except ValueError:
            return
        raise AssertionError("an in-place allreduce of a non-contiguous tensor did not raise")

    def _shapes(self):
        return [(5,), (3, 4), (1,), (64, 3), (2, 2, 2), (1000,), (7,)]

    def grouped(self) -> None:
        hvd, torch = self.hvd, self.torch
        tensors = [self.values(self.rank, s, torch.float32).to(self.dev) for s in self._shapes()]
        outs = hvd.grouped_allreduce(tensors, op=hvd.Sum)
        for shape, out in zip(self._shapes(), outs):
            self.same(out, self.reduced(shape, torch.float32, "Sum"))

    def grouped_inplace(self, flat: bool) -> str:
        hvd, torch = self.hvd, self.torch
        shapes = self._shapes()
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        if flat:  # the tensors are views laid end to end in one buffer
            bucket = torch.empty(sum(sizes), device=self.dev)
            tensors, start = [], 0
            for shape, n in zip(shapes, sizes):
                tensors.append(bucket[start:start + n].view(shape))
                start += n
            for shape, t in zip(shapes, tensors):
                t.copy_(self.values(self.rank, shape, torch.float32))
        else:
            tensors = [self.values(self.rank, s, torch.float32).to(self.dev) for s in shapes]
        ptrs = [t.data_ptr() for t in tensors]
        outs = hvd.grouped_allreduce_(tensors, op=hvd.Sum)
        assert [o.data_ptr() for o in outs] == ptrs
        for shape, out in zip(shapes, outs):
            self.same(out, self.reduced(shape, torch.float32, "Sum"))

    def side_stream(self) -> str:
        hvd, torch = self.hvd, self.torch
        if self.dev.type != "cuda":
            return "skipped: CUDA streams only"
        side = torch.cuda.Stream(device=self.dev)
        expected = self.size * (self.size + 1) / 2
        with torch.cuda.stream(side):
            tensor = torch.zeros(1 << 20, device=self.dev)
            torch.cuda._sleep(200_000_000)  # the producer is still running at submission
            tensor.fill_(self.rank + 1)
            handle = hvd.allreduce_async(tensor, op=hvd.Sum)
            out = hvd.synchronize(handle)
            total = out.sum()  # queued on the side stream, after the engine's done event
        side.synchronize()
        assert float(total) == expected * tensor.numel(), f"{float(total)}"

    def allgather(self) -> None:
        hvd, torch = self.hvd, self.torch
        for dtype in (torch.float32, torch.bfloat16):
            mine = self.values(self.rank, (self.rank + 1, 3), dtype).to(self.dev)
            out = hvd.allgather(mine)
            expected = torch.cat([self.values(r, (r + 1, 3), dtype) for r in range(self.size)])
            self.same(out, expected)

    def broadcast(self) -> None:
        hvd, torch = self.hvd, self.torch
        root = self.size - 1
        tensor = self.values(self.rank, (9, 2), torch.int32).to(self.dev)
        out = hvd.broadcast_(tensor, root_rank=root)
        assert out is tensor
        self.same(tensor, self.values(root, (9, 2), torch.int32))
        half = self.values(self.rank, (5,), torch.float16).to(self.dev)
        self.same(hvd.broadcast(half, root_rank=root), self.values(root, (5,), torch.float16))

    def alltoall(self) -> None:
        hvd, torch = self.hvd, self.torch
        splits = [(self.rank + j) % 3 for j in range(self.size)]
        rows = [torch.full((c, 2), float(self.rank * 100 + j)) for j, c in enumerate(splits)]
        out, received = hvd.alltoall(torch.cat(rows).to(self.dev),
                                     splits=torch.tensor(splits, dtype=torch.int32))
        counts = [(j + self.rank) % 3 for j in range(self.size)]
        expected = torch.cat([torch.full((c, 2), float(j * 100 + self.rank))
                              for j, c in enumerate(counts)])
        self.same(out, expected)
        assert received.tolist() == counts

    def reducescatter(self) -> None:
        hvd, torch = self.hvd, self.torch
        shape = (2 * self.size + 1, 4)
        tensor = self.values(self.rank, shape, torch.float32).to(self.dev)
        out = hvd.reducescatter(tensor, op=hvd.Sum)
        full = self.reduced(shape, torch.float32, "Sum")
        base, extra = divmod(shape[0], self.size)
        start = self.rank * base + min(self.rank, extra)
        self.same(out, full[start:start + base + (1 if self.rank < extra else 0)])

    def adasum(self) -> str:
        hvd, torch = self.hvd, self.torch
        from .common import basics

        if basics.device_transport() == "single":
            return "skipped: one process (no MPI) has no Adasum"
        from .common.collectives import _adasum_pair

        tensor = self.values(self.rank, (50,), torch.float32).to(self.dev)
        out = hvd.allreduce(tensor, op=hvd.Adasum)
        vectors = [self.values(r, (50,), torch.float32).double().numpy()
                   for r in range(self.size)]
        while len(vectors) > 1:
            paired = [_adasum_pair(vectors[i], vectors[i + 1])
                      for i in range(0, len(vectors) - 1, 2)]
            vectors = paired + ([vectors[-1]] if len(vectors) % 2 else [])
        self.same(out, torch.from_numpy(vectors[0]).float())

    def optimizer_step(self) -> None:
        hvd, torch = self.hvd, self.torch
        torch.manual_seed(self.rank)  # different initial weights: broadcast must fix them
        model = torch.nn.Linear(8, 4).to(self.dev)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters())
        before = [p.detach().clone() for p in model.parameters()]
        data = self.values(self.rank, (16, 8), torch.float32).to(self.dev)
        for _ in range(2):
            optimizer.zero_grad()
            model(data).square().mean().backward()
            optimizer.step()
        mine = [p.detach().cpu() for p in model.parameters()]
        assert any(not torch.equal(a.cpu(), b) for a, b in zip(before, mine))
        for other in hvd.allgather_object(mine):
            for a, b in zip(other, mine):
                assert torch.equal(a, b), "parameters differ between ranks"

    # -- bandwidth -----------------------------------------------------------------------------
    def bandwidth(self, sizes_mib=GPU_SIZES_MIB, iterations: int = 20):
        """(MiB, hvd seconds, raw NCCL seconds or None) per size: in-place float32 sums of the
        same buffer, back to back, ended by a device synchronization. The op has a name, as a
        training step's buckets do: an unnamed op is new to the response cache every time."""
        hvd, torch = self.hvd, self.torch
        try:
            raw = self._raw_nccl()
        except Exception:  # noqa: BLE001 - e.g. two ranks on one GPU: no raw NCCL to compare
            raw = None
        comm, nccl = raw if raw is not None else (None, None)
        rows = []
        for mib in sizes_mib:
            buf = torch.ones((mib << 20) // 4, device=self.dev)
            hvd_s = self._time(lambda b=buf, n=f"gpu_check.bandwidth.{mib}":
                               hvd.allreduce_(b, op=hvd.Sum, name=n), iterations)
            raw_s = None
            if comm is not None:
                buf.fill_(1.0)

                def call(b=buf):
                    comm.allReduce(b.data_ptr(), b.data_ptr(), b.numel(), nccl.NCCL_FLOAT32,
                                   nccl.NCCL_SUM, torch.cuda.current_stream().cuda_stream)
                raw_s = self._time(call, iterations)
            rows.append((mib, hvd_s, raw_s))
            del buf
        if comm is not None:
            comm.destroy()
        return rows

    def _time(self, call, iterations: int) -> float:
        import time

        sync = self.torch.cuda.synchronize if self.dev.type == "cuda" else (lambda: None)
        for _ in range(3):
            call()
        sync()
        self.hvd.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            call()
        sync()
        return (time.perf_counter() - start) / iterations

    def _raw_nccl(self):
        """A plain NCCL communicator over the same ranks (None without CuPy's NCCL)."""
        try:
            from cupy.cuda import nccl
        except Exception:  # noqa: BLE001 - no CuPy: no raw NCCL to compare with
            return None
        if not getattr(nccl, "available", False):
            return None
        from .backends.nccl import deserialize_unique_id, serialize_unique_id, unique_id_form

        uid = serialize_unique_id(nccl.get_unique_id()) if self.rank == 0 else None
        uid = self.hvd.broadcast_object(uid, root_rank=0)
        import platform

        import cupy

        form = unique_id_form(cupy.__version__, platform.machine())
        return nccl.NcclCommunicator(self.size, deserialize_unique_id(uid, form), self.rank), nccl


def gpu_versions(torch) -> list[tuple[str, str]]:
    """(component, version) of what the GPU path runs on; "missing" where absent."""
    from .common import gpu_probe
    from .common.basics import nccl_built
    from .common.gpu_probe import nccl_version_tuple

    rows = [("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")]
    cupy = gpu_probe.cupy_or_none()
    if cupy is None:
        rows.append(("cupy", "missing: one process only; " + gpu_probe.install_hint(None)))
    else:
        runtime = gpu_probe.cuda_runtime_version()
        try:
            driver = cupy.cuda.runtime.driverGetVersion()
        except Exception:  # noqa: BLE001
            driver = 0
        rows.append(("cupy", f"{cupy.__version__} (CUDA runtime {runtime}, driver {driver}, "
                             f"bfloat16 on the device: {gpu_probe.bfloat16_on_device()})"))
    code = nccl_built()
    package = gpu_probe.nccl_package(gpu_probe.cuda_runtime_version())
    rows.append(("NCCL", ".".join(map(str, nccl_version_tuple(code))) if code else
                 f"missing: `pip install {package}`"))
    rows.append(("MPI", mpi_library() or "missing"))
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    rows.append(("GPUs", f"{count}: {', '.join(names)}"))
    return rows


def multi_rank_note(nccl_code: int, gpus: int) -> str:
    """What a machine with ``gpus`` GPUs can test of the multi-rank paths with this NCCL."""
    from .common.gpu_probe import nccl_version_tuple

    if gpus == 0:
        return "no GPU visible: nothing on the device can be tested here."
    if gpus >= 2:
        return f"{gpus} GPUs: run it with one rank per GPU to test the multi-rank paths."
    version = ".".join(map(str, nccl_version_tuple(nccl_code))) if nccl_code else "none"
    if nccl_code and nccl_version_tuple(nccl_code) >= (2, 30, 0):
        return (f"one GPU, NCCL {version}: two ranks (at most) may share it with "
                "NCCL_MULTI_RANK_GPU_ENABLE=1 (bandwidth then means little).")
    return (f"one GPU, NCCL {version}: NCCL refuses two ranks on one GPU (before 2.30), so "
            "only one rank runs here; the multi-rank paths need two GPUs or more.")


def gpu_report(sizes_mib=GPU_SIZES_MIB, iterations: int = 20) -> tuple[str, bool, int]:
    """Run every device check and the bandwidth rows on this rank; returns the table (with
    every rank's failures), whether everything passed on every rank, and this rank."""
    import torch

    import hpc_horovod.torch as hvd

    if not torch.cuda.is_available():
        return "check-build --gpu: torch sees no CUDA device here.", False, 0
    hvd.init()
    from .common import basics

    check = GpuCheck(hvd, torch)
    check.all_checks()
    failed_here = [(name, detail) for name, ok, detail in check.rows if not ok]
    try:
        failures = hvd.allgather_object(failed_here)
    except Exception:  # noqa: BLE001 - the engine stopped: report this rank's own view
        failures = [failed_here]
    bandwidth = check.bandwidth(sizes_mib, iterations) if not any(failures) else []
    text = gpu_table(gpu_versions(torch), check.size, basics.device_transport(),
                     multi_rank_note(basics.nccl_built(), torch.cuda.device_count()),
                     check.rows, failures, bandwidth)
    hvd.shutdown()
    return text, not any(failures), check.rank


def gpu_table(versions, size: int, transport: str, note: str, rows, failures,
              bandwidth) -> str:
    """The table of ``check-build --gpu``: ``rows`` (name, passed, detail) of this rank,
    ``failures[rank]`` (name, detail) of every rank, ``bandwidth`` (MiB, hvd seconds, raw NCCL
    seconds or None)."""
    lines = ["hpc_horovod GPU check", ""]
    for name, version in versions:
        lines.append(f"  {name:<8} {version}")
    lines.append(f"  ranks    {size}, transport {transport}")
    lines.append(f"  note     {note}")
    lines += ["", f"  {'device op':<50} result"]
    for name, _, detail in rows:
        bad = [r for r, fails in enumerate(failures) if any(n == name for n, _ in fails)]
        if bad:
            status = f"FAIL on rank(s) {', '.join(map(str, bad))}"
            detail = next(d for n, d in failures[bad[0]] if n == name)
        else:
            status = "PASS"
        lines.append(f"  {name:<50} {status}" + (f"  ({detail})" if detail else ""))
    if bandwidth:
        factor = 2 * (size - 1) / size if size > 1 else 1.0
        unit = "busbw" if size > 1 else "algbw"
        lines += ["", f"  {'allreduce float32':<18} {'hvd ' + unit:>12} {'NCCL ' + unit:>12} "
                      f"{'hvd/NCCL':>9}   (GB/s)"]
        if transport == "single":
            lines.append("  (one process: nothing crosses between GPUs; the rows show the cost "
                         "per call)")
        for mib, hvd_s, raw_s in bandwidth:
            nbytes = mib << 20
            hvd_bw = nbytes / hvd_s / 1e9 * factor
            raw_text = f"{nbytes / raw_s / 1e9 * factor:12.1f}" if raw_s else f"{'n/a':>12}"
            ratio = f"{raw_s / hvd_s:9.2f}" if raw_s else f"{'':>9}"
            lines.append(f"  {f'{mib} MiB':<18} {hvd_bw:12.1f} {raw_text} {ratio}")
    ok = not any(failures)
    lines += ["", "  all device ops passed" if ok else "  SOME DEVICE OPS FAILED"]
    return "\n".join(lines)


def main() -> int:
    """``check-build --gpu``: rank 0 prints the table; 1 if anything failed on any rank."""
    text, ok, rank = gpu_report()
    if rank == 0:
        print(text, flush=True)
    return 0 if ok else 1
