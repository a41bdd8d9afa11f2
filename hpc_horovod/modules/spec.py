"""What goes into a modulefile, checked before it goes anywhere near Lua.

Every value ends up inside a Lua string that Lmod evaluates, and from there in the user's shell.
Instead of escaping, values that could leave the string or change its meaning (quotes, ``]]``,
newlines, ``$``, backticks, ``;``, backslashes, and ``:`` which splits PATH entries) are
rejected with an error that names the value and the fix.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..common.config import Settings
from ..slurm import validate
from ..version import __version__
from .clusters import cluster_modules

#: characters and sequences that never reach a modulefile, with the reason shown to the user
_UNSAFE = {
    '"': "a double quote",
    "'": "a single quote",
    "\\": "a backslash",
    "`": "a backtick",
    "$": "a dollar sign",
    ";": "a semicolon",
    ":": "a colon (it splits PATH entries)",
    "]]": "']]' (it ends a Lua long string)",
    "[[": "'[[' (it starts a Lua long string)",
}
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]*")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")

#: the name users type: ``module load horovod``
MODULE_NAME = "horovod"
#: names Horovod itself is installed under by Spack and EasyBuild
CONFLICTS = ("py-horovod", "Horovod")

#: HOROVOD_* variables the module sets by default; a value exported before loading wins
DEFAULT_SETENV: dict[str, str] = {
    "HOROVOD_CYCLE_TIME": f"{Settings.cycle_time_ms:g}",
    "HOROVOD_FUSION_THRESHOLD": str(Settings.fusion_threshold),
}


def check_safe(what: str, value: str) -> str:
    """``value`` unchanged, or ValueError when it could break out of a Lua string."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} is empty")
    for char in value:
        if char in "\n\r\t" or not char.isprintable():
            raise ValueError(f"{what} {value!r} contains the control character {char!r}: "
                             "use a value without newlines, tabs or control characters")
    for bad, name in _UNSAFE.items():
        if bad in value:
            raise ValueError(f"{what} {value!r} contains {name}, which is not allowed in a "
                             "modulefile: use a path or value without it (e.g. a symlink)")
    return value


def _check_path(what: str, path: Path) -> Path:
    if not path.is_absolute():
        raise ValueError(f"{what} {str(path)!r} must be an absolute path")
    check_safe(what, str(path))
    return path


def package_root() -> Path:
    """The directory that holds the ``hpc_horovod`` package being run."""
    return Path(__file__).resolve().parents[2]


def _inside(path: Path, prefix: Path) -> bool:
    return path.resolve().is_relative_to(prefix.resolve())


def parse_setenv(items: Iterable[str]) -> dict[str, str]:
    """``["NAME=VALUE", ...]`` from the command line as a dict, with a clear error on typos."""
    return validate.assignments(items, "--setenv")


@dataclass(frozen=True)
class ModuleSpec:
    """Everything one ``horovod/<version>.lua`` says, already validated."""

    python_env: Path
    version: str = __version__
    #: a directory put on PYTHONPATH: set when the package is not installed in ``python_env``
    pythonpath: Path | None = None
    cluster: str = "generic"
    depends_on: tuple[str, ...] = ()
    setenv: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_SETENV))

    def __post_init__(self) -> None:
        _check_path("python environment", self.python_env)
        if self.pythonpath is not None:
            _check_path("PYTHONPATH entry", self.pythonpath)
        if not _VERSION.fullmatch(check_safe("version", self.version)):
            raise ValueError(f"version {self.version!r} must look like 1.2.3 (letters, digits, "
                             "'.', '+', '_', '-'): it becomes the file name <version>.lua")
        check_safe("cluster", self.cluster)
        for module in self.depends_on:
            if not validate.MODULE_NAME.fullmatch(check_safe("module name", module)):
                raise ValueError(f"module name {module!r} must look like name/version")
            if module.split("/")[0] in (MODULE_NAME, *CONFLICTS):
                raise ValueError(f"{MODULE_NAME} cannot depend on {module!r}, another Horovod")
        for name, value in self.setenv.items():
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"--setenv name {name!r} must be an upper-case variable "
                                 "name such as HOROVOD_CYCLE_TIME")
            check_safe(f"value of {name}", value)
        Settings.from_env(dict(self.setenv))  # a bad HOROVOD_* value fails here, not at runtime

    @property
    def bin_dir(self) -> Path:
        return self.python_env / "bin"

    @classmethod
    def for_environment(cls, python_env: str | Path | None = None, *,
                        cluster: str = "generic", version: str | None = None,
                        depends_on: Iterable[str] | None = None,
                        setenv: Mapping[str, str] | None = None) -> ModuleSpec:
        """The module for ``python_env`` (default: the running interpreter's environment).

        The package being run goes on PYTHONPATH only when it lives outside that environment
        (a source checkout); ``depends_on`` replaces the cluster's modules; ``setenv``
        overrides or extends the HOROVOD_* defaults.
        """
        env = Path(python_env).expanduser().absolute() if python_env else Path(sys.prefix)
        root = package_root()
        return cls(
            python_env=env,
            version=version or __version__,
            pythonpath=None if _inside(root, env) else root,
            cluster=cluster,
            depends_on=cluster_modules(cluster) if depends_on is None else tuple(depends_on),
            setenv={**DEFAULT_SETENV, **(setenv or {})},
        )
