"""The folders a site administrator customizes and a user browses: ``slurm_templates/`` (job
script templates and cluster profiles) and ``notebooks/`` (example notebooks).

They live at the top of the source tree, their single source. A built wheel carries copies
inside the package (``hpc_horovod/slurm_templates``, ``hpc_horovod/notebooks``: setup.py's
``build_py`` puts them there), so an installed package finds them next to its modules and a
source checkout (``pip install -e``, or ``PYTHONPATH``) finds them next to the package.
"""

from __future__ import annotations

from pathlib import Path

#: the shipped folders, by name
FOLDERS = ("slurm_templates", "notebooks")


def shipped_dir(name: str) -> Path:
    """The directory of the shipped folder ``name`` (one of :data:`FOLDERS`)."""
    if name not in FOLDERS:
        raise ValueError(f"no shipped folder {name!r}: one of {', '.join(FOLDERS)}")
    package = Path(__file__).resolve().parent
    for candidate in (package / name, package.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"hpc_horovod's {name}/ folder is missing: neither {package / name} "
                            f"(an installed package) nor {package.parent / name} (a source "
                            "checkout) exists; reinstall hpc-horovod")
