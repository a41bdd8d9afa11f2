"""From what a user asks (cluster, nodes, GPUs, time, ...) to a checked, resolved job plan.

All validation happens here, before anything is rendered or written: an unknown partition or
QoS, more GPUs per node than the nodes have, a time over the QoS or partition limit, an account
billed to the wrong node type. Each error lists the valid choices.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from . import live as live_cluster
from . import options as sbatch_options
from . import validate
from .profiles import ClusterProfile, NodeClass, get_profile

#: seconds before the time limit at which ``--requeue`` jobs get SIGUSR2 when none is given
DEFAULT_SIGNAL_SECONDS = 300
#: how much earlier than asked SLURM may send ``--signal`` (its event handling runs each minute)
SIGNAL_EARLY_S = 60
#: the least time a job has between its start and its signal: the tasks start, import their
#: framework and call hvd.init(), which catches the signal from then on
SIGNAL_START_S = 60


@dataclass(frozen=True)
class JobPlan:
    """Everything the job script says, validated; the templates only format it."""

    cluster: str
    template: str
    job_name: str
    nodes: int
    ntasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    time: str
    partition: str | None
    constraint: str | None
    account: str | None
    qos: str | None
    hint_nomultithread: bool
    output: str
    requeue: bool
    signal_seconds: int | None
    modules: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    srun_mpi: str
    command: tuple[str, ...]
    storage: tuple[tuple[str, str], ...]
    #: ``srun --label``: each output line starts with its task's rank, so that the tracebacks
    #: of two ranks stay apart
    label: bool = True
    #: ``--open-mode``: append for a requeue-able job (its runs share one output file), else
    #: SLURM's default
    open_mode: str | None = None
    #: sbatch options written as given: ``(("--mem", "64G"), ("--exclusive", None))``
    extra: tuple[tuple[str, str | None], ...] = ()
    #: elastic training (``--min-nodes``): the job survives a lost node (``--no-kill``) and
    #: ``hpc-horovod run --min-np`` restarts the ranks on the nodes left, while at least this
    #: many remain; ``python`` runs that launcher
    min_nodes: int | None = None
    python: str = ""

    @property
    def total_tasks(self) -> int:
        return self.nodes * self.ntasks_per_node


def _where(node: NodeClass) -> str:
    return f"{node.kind} {node.name}" if node.name else "the default partition"


def _gpus_asked(gpus: int | None, gpus_per_node: int | None) -> str | None:
    """The GPU option as the user gave it (``--gpus 8``), for the refusals to name."""
    if gpus is not None:
        return f"--gpus {gpus}"
    return None if gpus_per_node is None else f"--gpus-per-node {gpus_per_node}"


def _layout(node: NodeClass, nodes: int, gpus: int | None, gpus_per_node: int | None,
            tasks: int | None, profile: ClusterProfile) -> tuple[int, int]:
    """GPUs and tasks per node: one task per GPU, or ``tasks`` on a CPU job.

    ``gpus`` (for the whole job, sbatch's ``-G``) or ``gpus_per_node``; without either, a GPU
    node type gets all its GPUs (or one per asked task), a GPU partition whose count the
    profile does not know asks for one, any other node a CPU job. Each refusal names the
    option the user gave.
    """
    asked = _gpus_asked(gpus, gpus_per_node)
    if tasks is not None:
        validate.positive(tasks, "--ntasks-per-node")
    if gpus is not None:
        validate.positive(gpus, "--gpus")
        if gpus_per_node is not None:
            raise ValueError(f"--gpus {gpus} (for the whole job) and --gpus-per-node "
                             f"{gpus_per_node}: give one of the two")
    elif gpus_per_node is not None:
        validate.positive(gpus_per_node, "--gpus-per-node", minimum=0)
    if (gpus or gpus_per_node) and node.gpus_per_node == 0:
        raise ValueError(f"{_where(node)} of cluster {profile.name} has no GPUs: leave "
                         f"{asked} out (a CPU job: --ntasks-per-node N), or pick a GPU "
                         "partition")
    if gpus is not None:
        if gpus % nodes:
            raise ValueError(f"{asked} (GPUs for the whole job, as in sbatch) does not split "
                             f"evenly over --nodes {nodes}: every node runs one task per GPU "
                             f"(ask --gpus {max(gpus // nodes, 1) * nodes}, or --gpus-per-node "
                             "N)")
        per_node = gpus // nodes
        if node.gpus_per_node is not None and per_node > node.gpus_per_node:
            need = -(-gpus // node.gpus_per_node)
            hint = (f"ask --nodes {need}" if gpus % need == 0 else
                    f"ask a multiple of {node.gpus_per_node} GPUs over more --nodes")
            raise ValueError(f"{asked} on {nodes} node(s) is {per_node} GPUs per node, but "
                             f"{_where(node)} has {node.gpus_per_node}: {hint}")
    elif gpus_per_node is not None:
        per_node = gpus_per_node
    else:
        if node.gpus_per_node and tasks is not None and tasks > node.gpus_per_node:
            raise ValueError(f"--ntasks-per-node {tasks} on {_where(node)}, which has "
                             f"{node.gpus_per_node} GPUs per node: a GPU job runs one task per "
                             f"GPU; use --ntasks-per-node {node.gpus_per_node} (or leave it out) "
                             "and more --nodes")
        if node.gpus_per_node is None and node.has_gpus:
            raise ValueError(f"{_where(node)} of cluster {profile.name} has GPUs, a number per "
                             "node the profile does not know: ask --gpus-per-node N (GPUs and "
                             "tasks per node) or --gpus N (for the whole job)")
        per_node = (node.gpus_per_node or 0) if tasks is None else min(tasks,
                                                                       node.gpus_per_node or 0)
    if per_node == 0:
        if node.gpus_per_node:
            raise ValueError(f"{asked or 'no GPU'}: {_where(node)} of cluster {profile.name} "
                             f"is a GPU {node.kind} ({node.gpus_per_node} per node): ask "
                             f"--gpus-per-node 1 to {node.gpus_per_node}, or pick a CPU "
                             f"{node.kind}")
        return 0, 1 if tasks is None else tasks
    if node.gpus_per_node is not None and per_node > node.gpus_per_node:
        bigger = [n.name for n in (*profile.partitions.values(), *profile.constraints.values())
                  if n.gpus_per_node and n.gpus_per_node >= per_node]
        hint = f", or a {' / '.join(bigger)} node" if bigger else ""
        raise ValueError(f"{_where(node)} has {node.gpus_per_node} GPUs per node, "
                         f"{asked} asks for more: use --gpus-per-node "
                         f"{node.gpus_per_node} and more --nodes{hint}")
    if tasks is not None and tasks != per_node:
        raise ValueError(f"--ntasks-per-node {tasks} with {asked}"
                         + (f" ({per_node} per node)" if gpus is not None else "")
                         + ": a GPU job runs one task per GPU; give one of the two")
    return per_node, per_node


def _tasks_per_node(nodes: int, ntasks: int | None, ntasks_per_node: int | None) -> int | None:
    """``--ntasks-per-node`` from ``-n/--ntasks`` (spread evenly over the nodes)."""
    if ntasks is None:
        return ntasks_per_node
    validate.positive(ntasks, "--ntasks")
    if ntasks % nodes:
        raise ValueError(f"--ntasks {ntasks} does not split evenly over --nodes {nodes}: every "
                         f"node runs as many tasks (ask --ntasks {ntasks // nodes * nodes or nodes}"
                         " or give --ntasks-per-node)")
    if ntasks_per_node is not None and ntasks_per_node * nodes != ntasks:
        raise ValueError(f"--ntasks {ntasks} and --ntasks-per-node {ntasks_per_node} on "
                         f"{nodes} node(s) disagree: give one of the two")
    return ntasks // nodes


def _choose_qos(node: NodeClass, profile: ClusterProfile, qos: str | None, seconds: int
                ) -> str | None:
    """The explicit QoS, checked, or the node type's default (the next longer one if needed)."""
    if not node.qos:
        if qos is not None and profile.qos:
            raise ValueError(f"{_where(node)} of cluster {profile.name} takes no --qos")
        return None if qos is None else validate.token(qos, "--qos")
    if qos is not None:
        validate.token(qos, "--qos")
        if qos not in node.qos:
            elsewhere = [n.name for n in (*profile.partitions.values(),
                                          *profile.constraints.values()) if qos in n.qos]
            hint = f" ({qos} is for {', '.join(elsewhere)})" if elsewhere else ""
            valid = ", ".join(f"{q} (max {validate.format_time(profile.qos[q].max_time)})"
                              for q in node.qos)
            raise ValueError(f"unknown QoS {qos!r} for {_where(node)}{hint}; valid: {valid}")
        limit = profile.qos[qos].max_time
        if seconds > limit:
            longer = [q for q in node.qos if profile.qos[q].max_time >= seconds]
            hint = f"; use --qos {longer[0]}" if longer else ""
            raise ValueError(f"--time {validate.format_time(seconds)} is over the "
                             f"{validate.format_time(limit)} limit of QoS {qos}{hint}")
        return qos
    candidates = [node.default_qos] + sorted(node.qos, key=lambda q: profile.qos[q].max_time)
    for name in candidates:
        if profile.qos[name].max_time >= seconds:
            return name
    raise ValueError(f"--time {validate.format_time(seconds)} is over every QoS of "
                     f"{_where(node)}: " + ", ".join(
                         f"{q} {validate.format_time(profile.qos[q].max_time)}" for q in node.qos))


def _account(node: NodeClass, profile: ClusterProfile, account: str | None) -> str | None:
    if account is None:
        return None
    account = validate.account(account)
    suffix = node.account_suffix
    if suffix is None:
        return account
    project, sep, given = account.partition("@")
    if not sep:
        return f"{project}@{suffix}"
    if given != suffix:
        raise ValueError(f"account {account} is billed to {given} hours but {_where(node)} of "
                         f"cluster {profile.name} uses {suffix} hours: --account "
                         f"{project}@{suffix} (or just --account {project})")
    return account


def plan_job(
    command: Sequence[str],
    *,
    cluster: str | ClusterProfile = "generic",
    nodes: int = 1,
    ntasks: int | None = None,
    ntasks_per_node: int | None = None,
    gpus: int | None = None,
    gpus_per_node: int | None = None,
    cpus_per_task: int | None = None,
    time: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    partition: str | None = None,
    constraint: str | None = None,
    job_name: str = "hpc-horovod",
    modules: Iterable[str] | None = None,
    env: Mapping[str, str] | Iterable[str] = (),
    requeue: bool = False,
    signal_seconds: int | None = None,
    output: str = "%x-%j.out",
    open_mode: str | None = None,
    template: str | os.PathLike | None = None,
    label: bool = True,
    profile_env: Mapping[str, str] | None = None,
    sbatch: Mapping[str, object] | None = None,
    live: live_cluster.LiveCluster | None = None,
    min_nodes: int | None = None,
) -> JobPlan:
    """Check a job request against its cluster profile and resolve every default.

    The names are sbatch's (``nodes``, ``ntasks``, ``ntasks_per_node``, ``gpus`` (for the
    whole job), ``gpus_per_node``, ``cpus_per_task``, ``time``, ...). ``gpus_per_node`` defaults
    to every GPU of the node type (none on CPU or unknown nodes: a CPU job of
    ``ntasks_per_node`` tasks); ``template`` is a site's template file that extends the
    packaged ones (default: the profile's); ``sbatch`` holds the options written as given
    (:data:`hpc_horovod.slurm.options.PASSTHROUGH`: ``{"mem": "64G", "exclusive": True}``).
    ``live`` is what the cluster itself says (:func:`hpc_horovod.slurm.live.query`), checked
    on top of the profile.
    """
    profile = cluster if isinstance(cluster, ClusterProfile) else get_profile(cluster,
                                                                              profile_env)
    if isinstance(command, (str, bytes)):
        raise TypeError(f"command must be a list of arguments, e.g. {command.split()!r}, "
                        f"not the string {command!r}")
    command = tuple(str(c) for c in command)
    if not command:
        raise ValueError("no command to run: hpc-horovod sbatch ... -- python train.py ARGS")
    validate.positive(nodes, "--nodes")
    if min_nodes is not None and not 1 <= min_nodes <= nodes:
        raise ValueError(f"--min-nodes {min_nodes}: between 1 and --nodes {nodes}")
    node, partition, constraint = profile.select(partition, constraint)
    gpus_asked = _gpus_asked(gpus, gpus_per_node)
    gpus, tasks = _layout(node, nodes, gpus, gpus_per_node,
                          _tasks_per_node(nodes, ntasks, ntasks_per_node), profile)
    seconds = profile.default_time if time is None else validate.parse_time(time)
    if node.max_time is not None and seconds > node.max_time:
        raise ValueError(f"--time {validate.format_time(seconds)} is over the "
                         f"{validate.format_time(node.max_time)} limit of {_where(node)}")
    chosen_qos = _choose_qos(node, profile, qos, seconds)
    latest = seconds - SIGNAL_EARLY_S - SIGNAL_START_S  # the longest lead that is safe
    if signal_seconds is not None:
        validate.positive(signal_seconds, "--signal")
        if signal_seconds > latest or signal_seconds > 65535:
            raise ValueError(
                f"--signal USR2@{signal_seconds}: the signal must come before the job's "
                f"{validate.format_time(seconds)} limit, and SLURM may send it up to "
                f"{SIGNAL_EARLY_S} s early, while the tasks still start ({SIGNAL_START_S} s): "
                f"ask at most USR2@{max(min(latest, 65535), 0)}"
                + ("" if latest > 0 else " (none fits: a longer --time)")
                + " (and at most 65535 s before)")
    elif requeue:
        if latest < 1:
            raise ValueError(f"--requeue with --time {validate.format_time(seconds)}: SIGUSR2 "
                             f"may come {SIGNAL_EARLY_S} s early and the tasks need "
                             f"{SIGNAL_START_S} s to start; a requeue-able job needs more than "
                             f"{validate.format_time(SIGNAL_EARLY_S + SIGNAL_START_S)}")
        signal_seconds = min(DEFAULT_SIGNAL_SECONDS, latest)
    cpus = validate.positive(node.cpus_per_task if cpus_per_task is None else cpus_per_task,
                             "--cpus-per-task")
    if node.cpus_per_node is not None and tasks * cpus > node.cpus_per_node:
        raise ValueError(f"{tasks} task(s) per node x --cpus-per-task {cpus} = {tasks * cpus} "
                         f"CPUs per node, but {_where(node)} of cluster {profile.name} has "
                         f"{node.cpus_per_node}: fewer tasks or CPUs per node, and more --nodes")
    if live is not None:
        live_cluster.check(live, partition, constraint, gpus, tasks, cpus, seconds,
                           gpus_asked)
    if open_mode not in (None, "append", "truncate"):
        raise ValueError(f"--open-mode {open_mode!r}: append or truncate")
    job_modules = profile.default_modules if modules is None else validate.modules(modules)
    return JobPlan(
        cluster=profile.name,
        template=(profile.template if template is None
                  else str(validate.template_file(template))),
        job_name=validate.token(job_name, "--job-name"),
        nodes=nodes,
        ntasks_per_node=tasks,
        gpus_per_node=gpus,
        cpus_per_task=cpus,
        time=validate.format_time(seconds),
        partition=partition,
        constraint=constraint,
        account=_account(node, profile, account),
        qos=chosen_qos,
        hint_nomultithread=profile.hint_nomultithread,
        output=validate.output_pattern(output),
        requeue=bool(requeue),
        signal_seconds=signal_seconds,
        modules=node.modules + tuple(m for m in job_modules if m not in node.modules),
        env=validate.env_vars(env),
        srun_mpi=profile.srun_mpi,
        command=command,
        storage=tuple(profile.storage.items()),
        label=bool(label),
        open_mode=open_mode or ("append" if requeue else None),
        extra=sbatch_options.passthrough(sbatch or {}),
        min_nodes=min_nodes,
        python=sys.executable if min_nodes is not None else "",
    )
