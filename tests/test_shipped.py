"""The top-level ``slurm_templates/`` and ``notebooks/`` are the single source of those files:
a source checkout reads them where they are, a built package carries copies inside
``hpc_horovod/`` (setup.py's ``build_py``) and finds those."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_horovod.notebooks_cli import shipped_notebooks
from hpc_horovod.shipped import FOLDERS, shipped_dir
from hpc_horovod.slurm.profiles import load_profiles
from hpc_horovod.slurm.render import packaged_templates

ROOT = Path(__file__).resolve().parents[1]


def test_a_checkout_reads_the_top_level_folders():
    for name in FOLDERS:
        assert shipped_dir(name) == ROOT / name
        assert not (ROOT / "hpc_horovod" / name).exists(), "a second copy in the package"
    assert packaged_templates() == ["base", "generic", "jean-zay", "oscar"]
    assert {"generic", "jean-zay", "oscar"} <= set(load_profiles(
        {"HPC_HOROVOD_CLUSTERS": "/nonexistent/clusters.toml"}))
    assert [p.parent for p in shipped_notebooks()] == [ROOT / "notebooks"] * 2
    with pytest.raises(ValueError, match="no shipped folder 'templates'"):
        shipped_dir("templates")


def test_a_built_package_carries_and_finds_them(tmp_path):
    build = tmp_path / "lib"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib",
                           str(build)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    package = build / "hpc_horovod"
    sources = sorted(p.relative_to(ROOT) for name in FOLDERS for p in (ROOT / name).rglob("*")
                     if p.is_file())
    assert Path("slurm_templates/base.sbatch.j2") in sources
    assert Path("slurm_templates/profiles/jean-zay.toml") in sources
    assert Path("notebooks/data_parallel_pytorch.ipynb") in sources
    for relative in sources:
        assert (package / relative).read_bytes() == (ROOT / relative).read_bytes(), relative
    # the built package's lookup finds its own copies (shipped.py imports nothing of the
    # package, so it is loaded alone here)
    spec = importlib.util.spec_from_file_location("built_shipped", package / "shipped.py")
    built = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(built)
    for name in FOLDERS:
        assert built.shipped_dir(name) == package / name


def test_sdist_manifest_carries_the_folders():
    manifest = (ROOT / "MANIFEST.in").read_text().split("\n")
    assert "graft slurm_templates" in manifest and "graft notebooks" in manifest
