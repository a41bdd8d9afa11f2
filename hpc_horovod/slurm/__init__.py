"""SLURM-native jobs: job scripts per cluster, preflight checks, requeue before the time limit.

- :func:`render_job` writes a job script from a cluster profile (``slurm_templates/profiles``;
  users add theirs in ``~/.config/hpc_horovod/clusters.toml``): one task per GPU, ``srun`` with
  the site's MPI plugin, modules, and every value checked or shell-quoted. ``hpc-horovod
  sbatch`` is its command line.
- :mod:`~hpc_horovod.slurm.preflight` explains launch mistakes (tasks vs GPUs, a batch script
  without ``srun``, the MPI plugin); ``srun hpc-horovod doctor`` shows them for every rank.
- :func:`submit` runs a Python function on every task of a job (from a notebook on a login
  node, say) and returns a :class:`Job` whose ``result()`` shows progress and gives the
  per-rank return values; :func:`submit_array` runs a job array (a sweep, an ensemble), a
  :class:`Job` per element; :func:`jobs` and :meth:`Job.attach` find jobs again from a new
  session, :meth:`Job.cleanup` removes a job's folder.
- :func:`requeue_on_signal` stops every rank at the same step on SIGUSR2, saves on rank 0 and
  requeues the job; :func:`restart_count` tells the resumed job how many times it restarted.
"""

from . import preflight
from .job import JobPlan, plan_job
from .profiles import ClusterProfile, get_profile, load_profiles
from .remote import Job, jobs, submit, submit_array
from .render import render_job, render_plan
from .requeue import RequeueOnSignal, requeue_job, requeue_on_signal, restart_count
from .submit import sbatch

__all__ = [
    "ClusterProfile",
    "Job",
    "JobPlan",
    "RequeueOnSignal",
    "get_profile",
    "jobs",
    "load_profiles",
    "plan_job",
    "preflight",
    "render_job",
    "render_plan",
    "requeue_job",
    "requeue_on_signal",
    "restart_count",
    "sbatch",
    "submit",
    "submit_array",
]
