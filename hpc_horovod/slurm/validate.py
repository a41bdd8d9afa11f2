"""Checks for every user-supplied string that reaches a job script.

A job script is executed by bash, and its ``#SBATCH`` lines are parsed by ``sbatch``: a value
with a newline would start a new command, and a job name such as ``x; rm -rf ~`` must stay a
name. So values that go into ``#SBATCH`` lines are restricted to a safe alphabet (and refused
with a message that names it), and values that go into commands are shell-quoted by the
template. Every function raises ``ValueError`` naming the option and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

_TIME = re.compile(r"(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)")
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_ACCOUNT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9][A-Za-z0-9._-]*)?")
_MODULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*(/[A-Za-z0-9._+-]+)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OUTPUT = re.compile(r"[A-Za-z0-9._%/+@=,:-]+")

#: the characters a token (job name, partition, QoS, ...) may hold, for error messages
TOKEN_ALPHABET = "letters, digits and . _ + - (not starting with a symbol)"


def parse_time(text: str) -> int:
    """``HH:MM:SS`` or ``D-HH:MM:SS`` (SLURM's formats; hours may exceed 24) -> seconds."""
    match = _TIME.fullmatch(str(text).strip())
    if match is None:
        raise ValueError(f"--time {text!r} is not a SLURM time: write HH:MM:SS (e.g. 20:00:00, "
                         "100:00:00) or D-HH:MM:SS (e.g. 1-12:00:00)")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total == 0:
        raise ValueError("--time 00:00:00 is empty: write a positive HH:MM:SS")
    return total


def format_time(seconds: int) -> str:
    """Seconds -> ``HH:MM:SS`` (hours unbounded), the form SLURM and site docs use."""
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
        if _MODULE.fullmatch(name) is None:
            raise ValueError(f"--modules: {name!r} is not a module name (NAME or NAME/VERSION "
                             "with letters, digits and . _ + -)")
        out.append(name)
    return tuple(out)


def env_vars(items: Mapping[str, str] | Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``{"K": "V"}`` or ``["K=V", ...]`` -> ``(("K", "V"), ...)`` with names checked.

    Values may hold anything: the template shell-quotes them.
    """
    pairs = items.items() if isinstance(items, Mapping) else (_split_env(i) for i in items)
    out = []
    for name, value in pairs:
        if _ENV_NAME.fullmatch(str(name)) is None:
            raise ValueError(f"--env: {name!r} is not an environment variable name (letters, "
                             "digits and _, not starting with a digit)")
        out.append((str(name), str(value)))
    return tuple(out)


def _split_env(item: str) -> tuple[str, str]:
    name, sep, value = str(item).partition("=")
    if not sep:
        raise ValueError(f"--env expects NAME=VALUE, got {item!r}")
    return name, value


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
