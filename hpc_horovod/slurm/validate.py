"""Checks for every user-supplied string that reaches a job script.

A job script is executed by bash, and its ``#SBATCH`` lines are parsed by ``sbatch``: a value
with a newline would start a new command, and a job name such as ``x; rm -rf ~`` must stay a
name. So values that go into ``#SBATCH`` lines are restricted to a safe alphabet (and refused
with a message that names it), and values that go into commands are shell-quoted by the
template. Every function raises ``ValueError`` naming the option and the fix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

#: SLURM's six time formats; a field after the first is bounded (minutes and seconds 0-59,
#: hours after a day count 0-23), which SLURM itself would silently carry over
_TIME = re.compile(
    r"(?P<days>[0-9]+)-(?P<day_hours>[01]?[0-9]|2[0-3])"
    r"(?::(?P<day_minutes>[0-5]?[0-9])(?::(?P<day_seconds>[0-5]?[0-9]))?)?"
    r"|(?P<hours>[0-9]+):(?P<hour_minutes>[0-5]?[0-9]):(?P<hour_seconds>[0-5]?[0-9])"
    r"|(?P<minutes>[0-9]+)(?::(?P<minute_seconds>[0-5]?[0-9]))?")
#: the formats, for error messages
TIME_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"
#: SLURM's words for no time limit
UNLIMITED = ("UNLIMITED", "INFINITE")
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_ACCOUNT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9][A-Za-z0-9._-]*)?")
#: an environment module's name: NAME or NAME/VERSION (also what a modulefile may depend on)
MODULE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*(/[A-Za-z0-9._+-]+)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OUTPUT = re.compile(r"[A-Za-z0-9._%/+@=,:-]+")

#: the characters a token (job name, partition, QoS, ...) may hold, for error messages
TOKEN_ALPHABET = "letters, digits and . _ + - (not starting with a symbol)"


def parse_time(text: str) -> float:
    """A SLURM time (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``;
    minutes and hours of the leading field unbounded) -> seconds; ``UNLIMITED`` (or SLURM's
    other spelling, ``INFINITE``) and ``0`` (sbatch's no time limit) -> ``math.inf``, which
    every finite limit refuses."""
    if str(text).strip().upper() in UNLIMITED:
        return math.inf
    match = _TIME.fullmatch(str(text).strip())
    if match is None:
        raise ValueError(f"--time {text!r} is not a SLURM time: write {TIME_FORMATS} (e.g. 30 "
                         "for 30 minutes, 20:00:00, 100:00:00, 1-12); minutes and seconds "
                         "after the first field are 0-59, hours after a day count 0-23")
    g = {key: int(value) for key, value in match.groupdict().items() if value is not None}
    days = g.get("days", 0)
    hours = g.get("day_hours", g.get("hours", 0))
    minutes = g.get("day_minutes", g.get("hour_minutes", g.get("minutes", 0)))
    seconds = g.get("day_seconds", g.get("hour_seconds", g.get("minute_seconds", 0)))
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    return math.inf if total == 0 else total  # sbatch: a time limit of 0 is no time limit


def format_time(seconds: float) -> str:
    """Seconds -> ``HH:MM:SS`` (hours unbounded), the form SLURM and site docs use; no limit
    -> ``UNLIMITED``."""
    if seconds == math.inf:
        return "UNLIMITED"
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"


def token(value: str, option: str) -> str:
    """A name written into an ``#SBATCH`` line: job name, partition, constraint, QoS."""
    value = str(value)
    if _TOKEN.fullmatch(value) is None or len(value) > 200:
        raise ValueError(f"{option} {value!r} may only contain {TOKEN_ALPHABET}: it is written "
                         "into an #SBATCH line of the job script")
    return value


def account(value: str) -> str:
    if _ACCOUNT.fullmatch(str(value)) is None:
        raise ValueError(f"--account {value!r} is not an account name: write PROJECT or "
                         "PROJECT@SUFFIX with letters, digits and . _ -")
    return str(value)


def modules(names: Iterable[str]) -> tuple[str, ...]:
    out = []
    for name in names:
        name = str(name).strip()
        if not name:
            continue
        if MODULE_NAME.fullmatch(name) is None:
            raise ValueError(f"--modules: {name!r} is not a module name (NAME or NAME/VERSION "
                             "with letters, digits and . _ + -)")
        out.append(name)
    return tuple(out)


def assignments(items: Iterable[str], option: str) -> dict[str, str]:
    """``["NAME=VALUE", ...]`` from a command line -> ``{"NAME": "VALUE"}``; the names are the
    caller's to check. ``option`` names the flag in the error (``--env``, ``--setenv``)."""
    result = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        if not sep:
            raise ValueError(f"{option} expects NAME=VALUE, got {item!r}")
        result[name] = value
    return result


def env_vars(items: Mapping[str, str] | Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``{"K": "V"}`` or ``["K=V", ...]`` -> ``(("K", "V"), ...)`` with names checked.

    Values may hold anything: the template shell-quotes them.
    """
    pairs = items if isinstance(items, Mapping) else assignments(items, "--env")
    out = []
    for name, value in pairs.items():
        if _ENV_NAME.fullmatch(str(name)) is None:
            raise ValueError(f"--env: {name!r} is not an environment variable name (letters, "
                             "digits and _, not starting with a digit)")
        out.append((str(name), str(value)))
    return tuple(out)


def output_pattern(value: str) -> str:
    if _OUTPUT.fullmatch(str(value)) is None:
        raise ValueError(f"--output {value!r} may only contain letters, digits, / and "
                         "._%+@=,:- (SLURM patterns such as %x-%j.out; no spaces)")
    return str(value)


def positive(value: int, option: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{option} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{option} must be at least {minimum}, got {value}")
    return value


_SIGNAL = re.compile(r"(?:(?P<batch>B):)?(?:SIG)?(?P<name>[A-Z0-9]+)(?:@(?P<seconds>[0-9]+))?")


def signal_seconds(value: str) -> int:
    """SLURM's ``--signal=[B:]SIG[@TIME]`` -> the seconds before the limit, for SIGUSR2 (the
    signal :func:`~hpc_horovod.slurm.requeue_on_signal` handles). With or without ``B:`` every
    task gets it: the job script's shell passes on a signal sent to it alone, so the script
    asks SLURM for the direct form."""
    match = _SIGNAL.fullmatch(str(value).strip().upper())
    if match is None or match.group("name") not in ("USR2", "12"):
        raise ValueError(f"--signal {value!r}: write USR2@SECONDS (e.g. USR2@300), the signal "
                         "hpc_horovod.slurm.requeue_on_signal handles")
    return int(match.group("seconds") or 60)  # SLURM's default: 60 s before the limit


def template_file(value: str | Path) -> Path:
    """A site's job script template given as a path: an existing, readable UTF-8 ``.j2`` file
    (its absolute path). What it must say is checked when it is rendered."""
    path = Path(value).expanduser()
    if not path.name.endswith(".j2"):
        raise ValueError(f"--template {str(value)!r} is not a jinja2 template: its name must end "
                         "in .j2 (e.g. mysite.sbatch.j2)")
    if not path.is_file():
        raise ValueError(f"--template {str(value)!r}: no such file")
    try:
        path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--template {str(value)!r} cannot be read: {exc}") from None
    return path.absolute()
