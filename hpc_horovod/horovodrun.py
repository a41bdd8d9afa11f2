"""``horovodrun``: the launcher command of every Horovod tutorial, mapped onto ``hpc-horovod run``.

``horovodrun -np 4 -H a:2,b:2 python train.py`` starts the same processes as
``hpc-horovod run -np 4 -H a:2,b:2 python train.py`` (``mpirun`` with the hosts, or ``srun``
inside a SLURM allocation). The tuning flags become the ``HOROVOD_*`` variables they stand for,
set in the launcher's environment and forwarded to every rank. Flags of Horovod's launcher that
this package cannot honour (Gloo, host discovery, the autotuner, ssh options, ...) stop the
command with an error that says why, instead of being ignored. The elastic flags
(``--min-np``, ``--max-np``, ``--reset-limit``, ``--elastic-timeout``) start
``hpc-horovod run``'s elastic launcher (:mod:`hpc_horovod.elastic_launch`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import check_build
from .common.log import LEVELS
from .elastic_launch import Elastic, run_elastic
from .launch import Launch, exit_status, run_launch
from .version import __version__

#: Horovod launcher flags with no equivalent here -> why (each takes a value unless listed in
#: FLAGS_WITHOUT_VALUE)
UNSUPPORTED = {
    "--gloo": "hpc_horovod has no Gloo controller: it runs over MPI (drop --gloo)",
    "--jsrun": "hpc_horovod launches with mpirun or srun, not jsrun (drop --jsrun)",
    "--start-timeout": "the ranks start under mpirun or srun, which wait for them themselves",
    "--host-discovery-script": "elastic training runs on the hosts of -H, --hostfile or the "
                               "SLURM allocation, without lost ones; there is no discovery "
                               "script and no scale-up (see docs/horovod-differences.md)",
    "--blacklist-cooldown-range": "a lost host is left out for the rest of the job: there is "
                                  "no cooldown",
    "--slots-per-host": "slots come with the hosts here: -H host:slots or --hostfile",
    "--slots": "slots come with the hosts here: -H host:slots or --hostfile",
    "--autotune": "there is no autotuner: set --fusion-threshold-mb and --cycle-time-ms",
    "--autotune-log-file": "there is no autotuner",
    "--autotune-warmup-samples": "there is no autotuner",
    "--autotune-steps-per-sample": "there is no autotuner",
    "--autotune-bayes-opt-max-samples": "there is no autotuner",
    "--autotune-gaussian-process-noise": "there is no autotuner",
    "-p": "ssh options are not used: mpirun reaches the hosts its own way",
    "--ssh-port": "ssh options are not used: mpirun reaches the hosts its own way",
    "-i": "ssh options are not used: mpirun reaches the hosts its own way",
    "--ssh-identity-file": "ssh options are not used: mpirun reaches the hosts its own way",
    "--network-interface": "pass the MPI library's own option: --mpi-args '--mca "
                           "btl_tcp_if_include IFACE'",
    "--network-interfaces": "pass the MPI library's own option: --mpi-args '--mca "
                            "btl_tcp_if_include IFACE'",
    "--tcp": "the transport is the MPI library's choice: --mpi-args '--mca btl self,tcp'",
    "--output-filename": "pass the launcher's own option: --mpi-args '--output-filename DIR'",
    "--binding-args": "pass the launcher's own binding flags in --mpi-args",
    "--config-file": "a YAML configuration file is not read: give the flags on the command line",
    "--hierarchical-allgather": "hierarchical allgather is not implemented",
    "--no-hierarchical-allgather": "hierarchical allgather is not implemented",
    "--num-nccl-streams": "one NCCL stream is used",
    "--thread-affinity": "pin the background thread with the launcher's binding instead",
    "--gloo-timeout-seconds": "hpc_horovod has no Gloo controller",
    "--mpi-threads-disable": "MPI threading is chosen by hpc_horovod itself",
}
FLAGS_WITHOUT_VALUE = {"--gloo", "--jsrun", "--autotune", "--tcp", "--hierarchical-allgather",
                       "--no-hierarchical-allgather", "--mpi-threads-disable"}

LOG_LEVELS = tuple(name.upper() for name in LEVELS)


class _Refuse(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported: {UNSUPPORTED[self.dest_flag]}")

    def __init__(self, *args, dest_flag: str, **kwargs):
        self.dest_flag = dest_flag
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="horovodrun", description=__doc__, allow_abbrev=False,
        usage="horovodrun -np N [-H HOST:SLOTS,... | --hostfile FILE] [options] COMMAND ...",
        epilog="Horovod flags refused here, each with its reason when given: "
               + ", ".join(UNSUPPORTED) + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--version", action="version", version=f"hpc_horovod {__version__}")
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="number of processes")
    p.add_argument("-H", "--hosts", help="host:slots[,host:slots...]")
    p.add_argument("-hostfile", "--hostfile", dest="hostfile",
                   help="file of 'host slots=N' lines")
    p.add_argument("--mpi-args", help="extra launcher arguments, quoted")
    p.add_argument("--mpi", action="store_true",
                   help="run over MPI (always the case here)")
    p.add_argument("--verbose", action="store_true", help="print the launcher command")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="list the frameworks, controllers and operations of this build")
    p.add_argument("--disable-cache", action="store_true",
                   help="no response cache (HOROVOD_CACHE_CAPACITY=0)")
    tuning = p.add_argument_group("tuning (HOROVOD_* variables)")
    tuning.add_argument("--fusion-threshold-mb", type=float,
                        help="fusion buffer size in MiB (HOROVOD_FUSION_THRESHOLD)")
    tuning.add_argument("--cycle-time-ms", type=float,
                        help="engine cycle in ms (HOROVOD_CYCLE_TIME)")
    tuning.add_argument("--cache-capacity", type=int,
                        help="response cache entries (HOROVOD_CACHE_CAPACITY)")
    hier = tuning.add_mutually_exclusive_group()
    hier.add_argument("--hierarchical-allreduce", dest="hierarchical", action="store_true",
                      default=None, help="HOROVOD_HIERARCHICAL_ALLREDUCE=1")
    hier.add_argument("--no-hierarchical-allreduce", dest="hierarchical",
                      action="store_false", help="HOROVOD_HIERARCHICAL_ALLREDUCE=0")
    timeline = p.add_argument_group("timeline")
    timeline.add_argument("--timeline-filename", help="write a timeline (HOROVOD_TIMELINE)")
    timeline.add_argument("--timeline-mark-cycles", action="store_true",
                          help="mark engine cycles in it (HOROVOD_TIMELINE_MARK_CYCLES)")
    stall = p.add_argument_group("stall check")
    stall.add_argument("--no-stall-check", action="store_true",
                       help="HOROVOD_STALL_CHECK_DISABLE=1")
    stall.add_argument("--stall-check-warning-time-seconds", type=int,
                       help="HOROVOD_STALL_CHECK_TIME_SECONDS")
    stall.add_argument("--stall-check-shutdown-time-seconds", type=int,
                       help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    log_flags = p.add_argument_group("logging")
    log_flags.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                           help="what the ranks log (HOROVOD_LOG_LEVEL; default WARNING)")
    stamp = log_flags.add_mutually_exclusive_group()
    stamp.add_argument("--log-with-timestamp", dest="log_with_timestamp", action="store_true",
                       default=None, help=argparse.SUPPRESS)
    stamp.add_argument("--log-without-timestamp", "--log-hide-timestamp",
                       dest="log_with_timestamp", action="store_false",
                       help="log lines without their timestamp (HOROVOD_LOG_HIDE_TIME=1)")
    elastic = p.add_argument_group("elastic training (hpc-horovod run's)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                         help="restart on what is left after a lost rank while at least this "
                              "many processes can run")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                         help="at most this many processes")
    elastic.add_argument("--reset-limit", type=int, help="at most this many restarts")
    elastic.add_argument("--elastic-timeout", type=float,
                         help="seconds the ranks may take to end after one asked for a restart")
    for flag in UNSUPPORTED:
        p.add_argument(flag, action=_Refuse, dest_flag=flag, help=argparse.SUPPRESS,
                             nargs=0 if flag in FLAGS_WITHOUT_VALUE else None,
                             dest=f"refused_{flag.lstrip('-').replace('-', '_')}")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    return p


def horovod_env(args: argparse.Namespace) -> dict[str, str]:
    """The ``HOROVOD_*`` variables the flags stand for."""
    env: dict[str, str] = {}
    if args.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{args.cycle_time_ms:g}"
    if args.cache_capacity is not None:
        env["HOROVOD_CACHE_CAPACITY"] = str(args.cache_capacity)
    if args.disable_cache:
        env["HOROVOD_CACHE_CAPACITY"] = "0"
    if args.hierarchical is not None:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1" if args.hierarchical else "0"
    if args.timeline_filename:
        env["HOROVOD_TIMELINE"] = args.timeline_filename
    if args.timeline_mark_cycles:
        env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    if args.no_stall_check:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    if args.stall_check_warning_time_seconds is not None:
        env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(args.stall_check_warning_time_seconds)
    if args.stall_check_shutdown_time_seconds is not None:
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(args.stall_check_shutdown_time_seconds)
    if args.log_level:
        env["HOROVOD_LOG_LEVEL"] = args.log_level
    if args.log_with_timestamp is not None:
        env["HOROVOD_LOG_HIDE_TIME"] = "0" if args.log_with_timestamp else "1"
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.check_build:
        print(check_build.report())
        return 0
    elastic = args.min_np is not None or args.max_np is not None
    if args.np is None and elastic:
        args.np = args.max_np if args.max_np is not None else args.min_np
    if args.np is None:
        parser.error("-np/--num-proc is required")
    if not elastic and (args.reset_limit is not None or args.elastic_timeout is not None):
        parser.error("--reset-limit and --elastic-timeout need --min-np or --max-np")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    launch = Launch(np=args.np, command=tuple(command), hosts=args.hosts,
                    hostfile=args.hostfile, mpi_args=args.mpi_args)
    if elastic:
        bounds = Elastic.from_args(args)
        return exit_status("horovodrun", lambda: run_elastic(
            launch, bounds, horovod_env(args), verbose=args.verbose))
    return exit_status("horovodrun",
                       lambda: run_launch(launch, horovod_env(args), verbose=args.verbose))


if __name__ == "__main__":
    sys.exit(main())
