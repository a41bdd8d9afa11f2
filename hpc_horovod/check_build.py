"""``hpc-horovod check-build``: what this installation can do, in Horovod's layout.

``--gpu`` runs the device self-check instead (:mod:`hpc_horovod.gpu_check`)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

from .version import __version__


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _framework(module: str, dists: tuple[str, ...]) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    for dist in dists:
        version = _version(dist)
        if version:
            return version
    return "unknown version"


def mpi_library() -> str | None:
    """The MPI library mpi4py loads, without initializing MPI."""
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except Exception:  # noqa: BLE001 - a missing libmpi raises various errors
        return None
    return MPI.Get_library_version().strip().splitlines()[0].strip()


def report() -> str:
    from .common.basics import nccl_built
    from .common.gpu_probe import nccl_version_tuple

    try:
        from . import _native  # noqa: F401

        native = True
    except ImportError:
        native = False
    torch = _framework("torch", ("torch",))
    tf = _framework("tensorflow", ("tensorflow", "tensorflow-cpu"))
    keras = _framework("keras", ("keras",))
    mpi = mpi_library()
    nccl = nccl_built()

    def box(ok) -> str:
        return "[X]" if ok else "[ ]"

    nccl_text = "NCCL ({}.{}.{})".format(*nccl_version_tuple(nccl)) if nccl else "NCCL"
    lines = [
        f"hpc_horovod v{__version__}:",
        "",
        "Available Frameworks:",
        f"    {box(tf)} TensorFlow" + (f" ({tf})" if tf else ""),
        f"    {box(keras)} Keras" + (f" ({keras})" if keras else ""),
        f"    {box(torch)} PyTorch" + (f" ({torch})" if torch else ""),
        "",
        "Available Controllers:",
        f"    {box(mpi)} MPI" + (f" ({mpi})" if mpi else ""),
        f"    {box(False)} Gloo",
        "",
        "Available Tensor Operations:",
        f"    {box(nccl)} {nccl_text}",
        f"    {box(mpi)} MPI",
        f"    {box(native)} native reductions (float16/bfloat16 sum)",
    ]
    return "\n".join(lines)


def _main(args) -> int:
    if not args.gpu:
        print(report())
        return 0
    from .gpu_check import main

    return main()


def register(sub) -> None:
    p = sub.add_parser(
        "check-build", help="show frameworks, MPI, NCCL and the native extension",
        description="Show which frameworks, controllers and tensor operations this "
                    "installation of hpc_horovod has (Horovod's layout). With --gpu, run the "
                    "device self-check: every device op on this job's GPUs, PASS or FAIL, "
                    "and allreduce bandwidth against raw NCCL.")
    p.add_argument("--gpu", action="store_true",
                   help="run every device op of the torch binding on this job's GPUs and time "
                        "allreduce against raw NCCL (run it as the job would run: alone, or "
                        "with `hpc-horovod run -np <GPUs>` / srun)")
    p.set_defaults(func=_main)
