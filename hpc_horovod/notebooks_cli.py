"""``hpc-horovod notebooks copy [DEST]``: the example notebooks, into the user's workspace.

The notebooks (the top-level ``notebooks/`` folder, shipped inside the package) come with the
installed version, so a user who did ``module load horovod`` gets the ones that match it. They
go to ``$WORK`` (the usual work space on HPC centres) or, without it, to the current directory;
a notebook already there holds the user's own edits and is replaced only with ``--force``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .shipped import shipped_dir


def shipped_notebooks() -> list[Path]:
    """The shipped notebooks, by name."""
    return sorted(shipped_dir("notebooks").glob("*.ipynb"), key=lambda path: path.name)


def default_destination(env: Mapping[str, str] | None = None) -> Path:
    """``$WORK`` when set (it must exist), else the current directory."""
    env = os.environ if env is None else env
    work = env.get("WORK")
    if not work:
        return Path.cwd()
    if not Path(work).is_dir():
        raise FileNotFoundError(f"WORK={work} is not a directory: create it, or pass the "
                                "destination: hpc-horovod notebooks copy DEST")
    return Path(work)


def copy_notebooks(destination: str | Path | None = None, *, force: bool = False) -> list[Path]:
    """Copy every shipped notebook into ``destination``; return the paths written.

    Nothing is written when a notebook of the same name is there already, unless ``force``.
    """
    target = Path(destination).expanduser() if destination else default_destination()
    notebooks = shipped_notebooks()
    existing = [target / nb.name for nb in notebooks if (target / nb.name).exists()]
    if existing and not force:
        listing = "\n  ".join(str(path) for path in existing)
        raise FileExistsError(f"not overwriting\n  {listing}\npass --force to replace them, "
                              "or choose another destination")
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for nb in notebooks:
        path = target / nb.name
        path.write_bytes(nb.read_bytes())
        written.append(path)
    return written


def _copy(args) -> int:
    for path in copy_notebooks(args.dest, force=args.force):
        print(path)
    return 0


def register(sub) -> None:
    p = sub.add_parser("notebooks", help="copy the example notebooks (TF/Keras, PyTorch)",
                       description=__doc__)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    copy = actions.add_parser("copy", help="copy the notebooks to DEST ($WORK, else .)")
    copy.add_argument("dest", nargs="?", help="destination directory (default: $WORK, else .)")
    copy.add_argument("--force", action="store_true", help="replace notebooks already there")
    copy.set_defaults(func=_copy)
