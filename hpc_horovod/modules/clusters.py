"""The modules a cluster's hpc_horovod module depends on (CUDA, NCCL, MPI, Python).

A module that ``depends_on`` these loads them with itself and unloads them with itself, so a
user types one ``module load horovod`` on every cluster. Names follow each site's module tree.
"""

from __future__ import annotations

#: cluster name -> modules loaded with hpc_horovod, in load order
CLUSTER_MODULES: dict[str, tuple[str, ...]] = {
    # No dependency: MPI, CUDA and Python come from the system or the Python environment.
    "generic": (),
    # IDRIS Jean Zay (V100/A100 partitions).
    "jean-zay": ("cuda/12.1.0", "nccl/2.18.5-1-cuda", "openmpi/4.1.5-cuda", "python/3.11.5"),
    # A GPU cluster with the common EasyBuild names of its toolchain.
    "easybuild-gpu": ("CUDA/12.1.1", "NCCL/2.18.3-GCCcore-12.3.0-CUDA-12.1.1",
                      "OpenMPI/4.1.5-GCC-12.3.0", "Python/3.11.3-GCCcore-12.3.0"),
}


def known_clusters() -> list[str]:
    """Cluster names ``--cluster`` accepts."""
    return sorted(CLUSTER_MODULES)


def cluster_modules(name: str) -> tuple[str, ...]:
    """The modules the hpc_horovod module of cluster ``name`` depends on."""
    try:
        return CLUSTER_MODULES[name]
    except KeyError:
        raise ValueError(
            f"unknown cluster {name!r}: choose one of {', '.join(known_clusters())}"
        ) from None
