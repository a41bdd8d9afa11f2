"""Cluster profiles: what a site's SLURM offers, as data.

A profile (``slurm_templates/profiles/<name>.toml``) lists the partitions and node constraints
with their GPUs per node and CPUs per task, the QoS names with their maximum wall time, the
account suffix each node type is billed to, the modules to load, the ``srun --mpi`` plugin and
whether the site wants ``--hint=nomultithread``. A profile without partitions (``generic``) lets
any partition through unchecked.

Users add or override clusters in ``$HPC_HOROVOD_CLUSTERS`` or
``~/.config/hpc_horovod/clusters.toml``: each top-level table is a cluster; a table named like a
built-in cluster is merged onto it, and ``based_on = "NAME"`` starts a new cluster from one::

    [mycluster]
    based_on = "generic"
    default = "gpu"
    [mycluster.partitions.gpu]
    gpus_per_node = 4
    cpus_per_task = 8
    cpus_per_node = 32
    max_time = "48:00:00"

A partition whose nodes have GPUs in numbers that vary says ``has_gpus = true`` instead of
``gpus_per_node``: a job there must say how many it wants (``--gpus-per-node N`` or ``-G N``).
"""

from __future__ import annotations

import copy
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..shipped import shipped_dir
from . import validate

PARTITION = "partition"
CONSTRAINT = "constraint"


@dataclass(frozen=True)
class NodeClass:
    """A partition or a node constraint: the nodes a job lands on.

    ``gpus_per_node`` is ``None`` when unknown (not checked) and 0 on CPU-only nodes.
    ``has_gpus`` marks nodes with GPUs whose number the profile does not know (Oscar's
    ``gpu`` partition mixes node models): a job there must say how many it wants.
    """

    name: str | None
    kind: str
    gpus_per_node: int | None
    cpus_per_task: int
    max_time: int | None = None
    qos: tuple[str, ...] = ()
    default_qos: str | None = None
    account_suffix: str | None = None
    modules: tuple[str, ...] = ()
    description: str = ""
    #: CPUs of one node, when the profile knows them (tasks x CPUs per task is checked)
    cpus_per_node: int | None = None
    has_gpus: bool = False


@dataclass(frozen=True)
class Qos:
    name: str
    max_time: int
    description: str = ""


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    description: str
    template: str
    srun_mpi: str
    hint_nomultithread: bool
    default_time: int
    default_modules: tuple[str, ...]
    module_depends_on: tuple[str, ...]
    default: str | None
    cpus_per_task: int
    partitions: dict[str, NodeClass] = field(default_factory=dict)
    constraints: dict[str, NodeClass] = field(default_factory=dict)
    qos: dict[str, Qos] = field(default_factory=dict)
    storage: dict[str, str] = field(default_factory=dict)
    source: str = ""
    #: CPUs of a node of a partition the profile does not list (None: unknown)
    cpus_per_node: int | None = None

    def select(self, partition: str | None, constraint: str | None
               ) -> tuple[NodeClass, str | None, str | None]:
        """The node type a job asks for, and its ``--partition`` and ``--constraint`` values.

        A constraint the profile lists selects its own nodes (Jean Zay's ``-C a100``); in a
        profile that lists none, a constraint is a node feature on top of the partition
        (Oscar's ``-p gpu --constraint=v100``) and is passed through.
        """
        if partition is not None:
            validate.token(partition, "--partition")
        if constraint is not None:
            validate.token(constraint, "--constraint")
        if constraint is not None and self.constraints:
            node = self._lookup(CONSTRAINT, constraint)
            if partition is not None:
                raise ValueError(f"constraint {constraint} of cluster {self.name} selects its "
                                 f"own nodes: give --partition or --constraint, not both")
            return node, None, constraint
        if partition is not None:
            node = self._lookup(PARTITION, partition)
        elif self.default is not None:
            kind = PARTITION if self.default in self.partitions else CONSTRAINT
            node = self._lookup(kind, self.default)
        else:
            node = NodeClass(None, PARTITION, None, self.cpus_per_task,
                             cpus_per_node=self.cpus_per_node)
        if node.kind == CONSTRAINT:
            return node, None, node.name
        return node, node.name, constraint

    def _lookup(self, kind: str, name: str) -> NodeClass:
        table = self.partitions if kind == PARTITION else self.constraints
        if name in table:
            return table[name]
        if not table:
            return NodeClass(name, kind, None, self.cpus_per_task,
                             cpus_per_node=self.cpus_per_node)
        other = self.constraints if kind == PARTITION else self.partitions
        hint = (f" ({name!r} is a {CONSTRAINT if kind == PARTITION else PARTITION} here: use "
                f"--{CONSTRAINT if kind == PARTITION else PARTITION} {name})"
                if name in other else "")
        raise ValueError(f"cluster {self.name} has no {kind} {name!r}{hint}; valid {kind}s: "
                         f"{', '.join(table)}")


def _seconds(value, where: str) -> int:
    try:
        return validate.parse_time(value)
    except ValueError:
        raise ValueError(f"{where}: {value!r} is not a SLURM time "
                         f"({validate.TIME_FORMATS})") from None


def _node_class(name: str, kind: str, data: Mapping, defaults: Mapping, where: str) -> NodeClass:
    unknown = set(data) - {"gpus_per_node", "has_gpus", "cpus_per_task", "cpus_per_node",
                           "max_time", "qos", "default_qos", "account_suffix", "modules",
                           "description"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    gpus = data.get("gpus_per_node")
    qos = tuple(data.get("qos", ()))
    default_qos = data.get("default_qos", qos[0] if qos else None)
    if default_qos is not None and default_qos not in qos:
        raise ValueError(f"{where}: default_qos {default_qos!r} is not in its qos list")
    return NodeClass(
        name=name,
        kind=kind,
        gpus_per_node=None if gpus is None else int(gpus),
        cpus_per_task=int(data.get("cpus_per_task", defaults.get("cpus_per_task", 1))),
        max_time=_seconds(data["max_time"], where) if "max_time" in data else None,
        qos=qos,
        default_qos=default_qos,
        account_suffix=data.get("account_suffix"),
        modules=validate.modules(data.get("modules", ())),
        description=data.get("description", ""),
        cpus_per_node=(int(data["cpus_per_node"]) if "cpus_per_node" in data
                       else defaults.get("cpus_per_node")),
        has_gpus=bool(data.get("has_gpus", bool(gpus))),
    )


_TOP_KEYS = {"description", "template", "srun_mpi", "hint_nomultithread", "default_time",
             "default_modules", "module_depends_on", "default", "cpus_per_task", "cpus_per_node",
             "partitions",
             "constraints", "qos", "storage", "based_on"}


def profile_from_dict(name: str, data: Mapping, source: str = "") -> ClusterProfile:
    """Build and check a profile from its TOML table."""
    where = f"cluster {name} ({source})" if source else f"cluster {name}"
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(_TOP_KEYS)}")
    qos = {q: Qos(q, _seconds(v["max_time"], f"{where} qos {q}"), v.get("description", ""))
           for q, v in data.get("qos", {}).items()}
    partitions = {p: _node_class(p, PARTITION, v, data, f"{where} partition {p}")
                  for p, v in data.get("partitions", {}).items()}
    constraints = {c: _node_class(c, CONSTRAINT, v, data, f"{where} constraint {c}")
                   for c, v in data.get("constraints", {}).items()}
    for node in (*partitions.values(), *constraints.values()):
        missing = [q for q in node.qos if q not in qos]
        if missing:
            raise ValueError(f"{where}: {node.kind} {node.name} names QoS {missing} that the "
                             "profile's [qos] table does not define")
    default = data.get("default")
    if default is not None and default not in partitions and default not in constraints:
        raise ValueError(f"{where}: default {default!r} is neither a partition nor a constraint")
    return ClusterProfile(
        name=name,
        description=data.get("description", ""),
        template=data.get("template", "generic"),
        srun_mpi=validate.token(data.get("srun_mpi", "pmix"), f"{where} srun_mpi"),
        hint_nomultithread=bool(data.get("hint_nomultithread", False)),
        default_time=_seconds(data.get("default_time", "01:00:00"), f"{where} default_time"),
        default_modules=validate.modules(data.get("default_modules", ())),
        module_depends_on=validate.modules(data.get("module_depends_on", ())),
        default=default,
        cpus_per_task=int(data.get("cpus_per_task", 1)),
        partitions=partitions,
        constraints=constraints,
        qos=qos,
        storage=dict(data.get("storage", {})),
        source=source,
        cpus_per_node=int(data["cpus_per_node"]) if "cpus_per_node" in data else None,
    )


def _merge(base: dict, override: Mapping) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _builtin_tables() -> dict[str, tuple[dict, str]]:
    tables = {}
    for entry in sorted((shipped_dir("slurm_templates") / "profiles").glob("*.toml")):
        tables[entry.stem] = (tomllib.loads(entry.read_text(encoding="utf-8")),
                              f"built-in {entry.name}")
    return tables


def user_profiles_path(env: Mapping[str, str] | None = None) -> Path:
    """``$HPC_HOROVOD_CLUSTERS``, else ``$XDG_CONFIG_HOME/hpc_horovod/clusters.toml``."""
    env = os.environ if env is None else env
    if env.get("HPC_HOROVOD_CLUSTERS"):
        return Path(env["HPC_HOROVOD_CLUSTERS"]).expanduser()
    config = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME", "~"), ".config")
    return Path(config).expanduser() / "hpc_horovod" / "clusters.toml"


def load_profiles(env: Mapping[str, str] | None = None) -> dict[str, ClusterProfile]:
    """The built-in profiles, with the user's clusters file applied on top."""
    tables = _builtin_tables()
    path = user_profiles_path(env)
    if path.is_file():
        try:
            user = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: {exc}") from None
        for name, table in user.items():
            if not isinstance(table, Mapping):
                raise ValueError(f"{path}: {name!r} must be a table ([{name}]) describing a "
                                 "cluster")
            table = dict(table)
            base_name = table.pop("based_on", name if name in tables else None)
            if base_name is not None and base_name not in tables:
                raise ValueError(f"{path}: cluster {name} is based_on unknown cluster "
                                 f"{base_name!r}; known: {', '.join(sorted(tables))}")
            base = tables[base_name][0] if base_name else {}
            tables[name] = (_merge(base, table), str(path))
    return {name: profile_from_dict(name, data, source)
            for name, (data, source) in sorted(tables.items())}


def get_profile(name: str, env: Mapping[str, str] | None = None) -> ClusterProfile:
    profiles = load_profiles(env)
    if name not in profiles:
        raise ValueError(f"unknown cluster {name!r}: choose one of {', '.join(profiles)} (or "
                         f"describe it in {user_profiles_path(env)})")
    return profiles[name]
