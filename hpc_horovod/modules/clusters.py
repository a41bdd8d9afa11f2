"""The modules a cluster's hpc_horovod module depends on (CUDA, NCCL, MPI, Python).

A module that ``depends_on`` these loads them with itself and unloads them with itself, so a
user types one ``module load horovod`` on every cluster, and the job scripts of
``hpc-horovod sbatch`` (whose cluster profiles load ``horovod``) need nothing else. Cluster names
are those of ``hpc_horovod/slurm/profiles``. Module names and versions change with each site's
software stack: check ``module avail`` and pass ``--depends-on`` to override them.
"""

from __future__ import annotations

#: cluster name -> modules loaded with hpc_horovod, in load order
CLUSTER_MODULES: dict[str, tuple[str, ...]] = {
    # MPI, CUDA and Python come from the system or the Python environment itself.
    "generic": (),
    # IDRIS Jean Zay: CUDA-aware builds carry a -cuda suffix.
    "jean-zay": ("cuda/12.1.0", "nccl/2.18.5-1-cuda", "openmpi/4.1.5-cuda", "python/3.11.5"),
    # Brown CCV Oscar: the site's default versions.
    "oscar": ("cuda", "nccl", "openmpi", "python"),
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
