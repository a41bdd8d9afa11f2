"""The modules a cluster's hpc_horovod module depends on (CUDA, NCCL, MPI, Python).

A module that ``depends_on`` these loads them with itself and unloads them with itself, so a
user types one ``module load horovod`` on every cluster, and the job scripts of
``hpc-horovod sbatch`` (whose cluster profiles load ``horovod``) need nothing else. The lists
live in the cluster profiles (``module_depends_on`` in ``slurm_templates/profiles/*.toml``,
overridable in a user's clusters.toml). Module names and versions change with each site's
software stack: check ``module avail`` and pass ``--depends-on`` to override them.
"""

from __future__ import annotations

from ..slurm.profiles import get_profile, load_profiles


def known_clusters() -> list[str]:
    """Cluster names ``--cluster`` accepts."""
    return sorted(load_profiles())


def cluster_modules(name: str) -> tuple[str, ...]:
    """The modules the hpc_horovod module of cluster ``name`` depends on."""
    return get_profile(name).module_depends_on
