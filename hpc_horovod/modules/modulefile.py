"""Render a :class:`ModuleSpec` to Lua with jinja2, and install it into a module tree."""

from __future__ import annotations

import os
from pathlib import Path

import jinja2

from ..checkpoint import atomic_write
from .spec import CONFLICTS, MODULE_NAME, ModuleSpec, check_safe

DESCRIPTION = "Horovod-style data-parallel training for PyTorch and TensorFlow on SLURM clusters"
URL = "https://github.com/hpc-horovod/hpc_horovod"


def _lua_string(value) -> str:
    """A double-quoted Lua string; the value was checked, this only refuses what slipped by."""
    return '"' + check_safe("value", str(value)) + '"'


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("hpc_horovod.modules", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["lua"] = _lua_string
    return env


def render_modulefile(spec: ModuleSpec) -> str:
    """The Lua text of the module described by ``spec``."""
    template = _environment().get_template(f"{MODULE_NAME}.lua.j2")
    return template.render(
        version=spec.version,
        cluster=spec.cluster,
        python_env=spec.python_env,
        bin_dir=spec.bin_dir,
        pythonpath=spec.pythonpath,
        depends_on=spec.depends_on,
        setenv=spec.setenv,
        description=DESCRIPTION,
        url=URL,
        conflicts=CONFLICTS,
    )


def _check_environment(spec: ModuleSpec) -> None:
    """A module pointing at a missing interpreter or command would only fail for users."""
    python = spec.bin_dir / "python"
    if not os.access(python, os.X_OK):
        raise ValueError(f"{spec.python_env} is not a Python environment ({python} not found): "
                         "pass --python-env with the prefix of the venv or conda env that has "
                         "hpc_horovod installed")
    command = spec.bin_dir / "hpc-horovod"
    if not os.access(command, os.X_OK):
        raise ValueError(f"{command} not found: install the package into that environment "
                         f"first ({python} -m pip install hpc-horovod)")


def install_modulefile(spec: ModuleSpec, prefix: str | Path, *, force: bool = False) -> Path:
    """Write ``prefix/horovod/<version>.lua`` and return its path.

    The environment must exist and hold the ``hpc-horovod`` command. An existing file with other
    content is replaced only with ``force``; the write is atomic, so a user running
    ``module load`` meanwhile sees the old file or the new one, never half of one.
    """
    _check_environment(spec)
    text = render_modulefile(spec)
    directory = Path(prefix).expanduser().absolute() / MODULE_NAME
    target = directory / f"{spec.version}.lua"
    if target.exists() and not force and target.read_text(encoding="utf-8") != text:
        raise FileExistsError(f"{target} exists with other content: pass --force to replace it")
    return atomic_write(target, lambda fh: fh.write(text.encode("utf-8")), mode=0o644)
