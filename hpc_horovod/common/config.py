"""Settings read from ``HOROVOD_*`` variables, with Horovod's names, units and defaults."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .log import LEVELS

_TRUE = {"1", "true", "yes", "on"}


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    value = env.get(name)
    return default if value is None or value == "" else value.strip().lower() in _TRUE


def _number(env: Mapping[str, str], name: str, default: float, kind=float):
    value = env.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        parsed = kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a valid {kind.__name__}") from None
    if not math.isfinite(parsed):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if parsed < 0:
        raise ValueError(f"{name}={value!r} must not be negative")
    return parsed


def _log_level(env: Mapping[str, str]) -> str:
    value = env.get("HOROVOD_LOG_LEVEL", "")
    level = value.strip().lower() or Settings.log_level
    if level not in LEVELS:
        raise ValueError(f"HOROVOD_LOG_LEVEL={value!r} is not a log level: use one of "
                         f"{', '.join(LEVELS)} (in any case)")
    return level


@dataclass(frozen=True)
class Settings:
    #: bytes fused into one buffer; with the hierarchical allreduce, each rank's segment of the
    #: node's shared window (half staging, half gradient buckets)
    fusion_threshold: int = 128 * 1024 * 1024
    #: bytes of gradients the bindings' DistributedOptimizer / tape reduce as one flat tensor
    #: (torch DDP's bucket_cap_mb); 0: every gradient on its own.
    bucket_bytes: int = 25 * 1024 * 1024
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    timeline: str = ""
    timeline_mark_cycles: bool = False
    stall_check: bool = True
    stall_check_time_s: float = 60.0
    stall_shutdown_time_s: float = 0.0
    peer_timeout_s: float = 60.0
    dynamic_process_sets: bool = False
    #: host allreduce in stages (the node's shared window, then MPI across nodes); 0 gives the
    #: flat MPI path
    hierarchical_allreduce: bool = True
    #: Horovod's level of the ``hpc_horovod`` logger (``common/log.py``): what each adds is
    #: said there
    log_level: str = "warning"
    #: log lines without Horovod's timestamp
    log_hide_time: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read the variables users know from Horovod (and ours, prefixed the same way)."""
        env = os.environ if env is None else env
        return cls(
            fusion_threshold=_number(env, "HOROVOD_FUSION_THRESHOLD", cls.fusion_threshold, int),
            bucket_bytes=_number(env, "HOROVOD_BUCKET_BYTES", cls.bucket_bytes, int),
            cycle_time_ms=_number(env, "HOROVOD_CYCLE_TIME", cls.cycle_time_ms),
            cache_capacity=_number(env, "HOROVOD_CACHE_CAPACITY", cls.cache_capacity, int),
            timeline=env.get("HOROVOD_TIMELINE", ""),
            timeline_mark_cycles=_flag(env, "HOROVOD_TIMELINE_MARK_CYCLES"),
            stall_check=not _flag(env, "HOROVOD_STALL_CHECK_DISABLE"),
            stall_check_time_s=_number(
                env, "HOROVOD_STALL_CHECK_TIME_SECONDS", cls.stall_check_time_s
            ),
            stall_shutdown_time_s=_number(
                env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", cls.stall_shutdown_time_s
            ),
            peer_timeout_s=_number(env, "HOROVOD_PEER_TIMEOUT_SECONDS", cls.peer_timeout_s),
            dynamic_process_sets=_flag(env, "HOROVOD_DYNAMIC_PROCESS_SETS"),
            hierarchical_allreduce=_flag(env, "HOROVOD_HIERARCHICAL_ALLREDUCE",
                                         cls.hierarchical_allreduce),
            log_level=_log_level(env),
            log_hide_time=_flag(env, "HOROVOD_LOG_HIDE_TIME"),
        )
