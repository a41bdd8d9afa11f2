"""Rendering and installing the modulefile: contents, validation of every interpolated value,
and the install rules. The files are loaded by real Lmod in test_lmod_module.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hpc_horovod import cli
from hpc_horovod.modules import (
    ModuleSpec,
    cluster_modules,
    install_modulefile,
    known_clusters,
    render_modulefile,
)
from hpc_horovod.modules.reference import reference_spec
from hpc_horovod.version import __version__

ROOT = Path(__file__).resolve().parents[2]


def fake_env(tmp_path: Path, name: str = "env") -> Path:
    """A directory shaped like a Python environment: bin/python and bin/hpc-horovod."""
    env = tmp_path / name
    (env / "bin").mkdir(parents=True)
    for exe in ("python", "hpc-horovod"):
        (env / "bin" / exe).symlink_to(sys.executable)
    return env


def test_render_has_lmod_metadata_paths_and_defaults(tmp_path):
    env = fake_env(tmp_path)
    text = render_modulefile(ModuleSpec.for_environment(env, setenv={"NCCL_DEBUG": "WARN"}))
    assert 'whatis("Name: hpc_horovod")' in text
    assert f'whatis("Version: {__version__}")' in text
    assert 'whatis("Description: ' in text and 'whatis("URL: https://' in text
    assert 'family("horovod")' in text
    assert 'conflict("py-horovod", "Horovod")' in text
    assert f'prepend_path("PATH", "{env}/bin")' in text
    # this checkout is not inside the fake environment, so it goes on PYTHONPATH
    assert f'prepend_path("PYTHONPATH", "{ROOT}")' in text
    assert ('pushenv("HOROVOD_CYCLE_TIME", os.getenv("HOROVOD_CYCLE_TIME") or "1")') in text
    assert 'os.getenv("HOROVOD_FUSION_THRESHOLD") or "134217728")' in text
    assert 'pushenv("NCCL_DEBUG", os.getenv("NCCL_DEBUG") or "WARN")' in text
    assert "depends_on" not in text
    assert text.startswith("-- -*- lua -*-") and "help([[" in text


def test_package_inside_environment_needs_no_pythonpath():
    spec = ModuleSpec.for_environment(ROOT)
    assert spec.pythonpath is None
    assert "PYTHONPATH" not in render_modulefile(spec).split("]])", 1)[1]


@pytest.mark.parametrize("cluster", known_clusters())
def test_cluster_modules_become_depends_on_in_order(cluster):
    text = render_modulefile(ModuleSpec.for_environment("/opt/env", cluster=cluster))
    lines = [line for line in text.splitlines() if line.startswith("depends_on(")]
    assert lines == [f'depends_on("{m}")' for m in cluster_modules(cluster)]


def test_clusters_are_those_of_the_slurm_profiles():
    from hpc_horovod.slurm.profiles import load_profiles

    assert set(known_clusters()) <= set(load_profiles({"HPC_HOROVOD_CLUSTERS": "/nonexistent"}))


def test_depends_on_replaces_the_cluster_modules():
    spec = ModuleSpec.for_environment("/opt/env", cluster="jean-zay",
                                      depends_on=["cuda/12.4", "openmpi/5.0"])
    assert spec.depends_on == ("cuda/12.4", "openmpi/5.0")
    none = ModuleSpec.for_environment("/opt/env", cluster="jean-zay", depends_on=[])
    assert none.depends_on == ()
    for other in ("horovod", "horovod/0.1", "py-horovod/0.28.1"):
        with pytest.raises(ValueError, match="cannot depend on .*another Horovod"):
            ModuleSpec.for_environment("/opt/env", depends_on=[other])


def test_unknown_cluster_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown cluster 'nowhere': choose one of .*generic"):
        ModuleSpec.for_environment("/opt/env", cluster="nowhere")


UNSAFE_PATHS = ['/opt/a"b', "/opt/a'b", "/opt/a]]b", "/opt/a\nb", "/opt/$HOME", "/opt/a`id`",
                "/opt/a;rm", "/opt/a:b", "/opt/a\\b", "/opt/a[[b"]


@pytest.mark.parametrize("path", UNSAFE_PATHS)
def test_unsafe_environment_paths_are_rejected(path):
    with pytest.raises(ValueError, match="python environment .* (contains|control character)"):
        ModuleSpec.for_environment(path)


@pytest.mark.parametrize("bad", ['x"y', "1]]", "a$b", "v`x`", "a;b"])
def test_unsafe_values_anywhere_are_rejected(bad):
    with pytest.raises(ValueError):
        ModuleSpec(python_env=Path("/opt/env"), setenv={"NCCL_DEBUG": bad})
    with pytest.raises(ValueError):
        ModuleSpec(python_env=Path("/opt/env"), depends_on=(bad,))
    with pytest.raises(ValueError):
        ModuleSpec(python_env=Path("/opt/env"), version=bad)
    with pytest.raises(ValueError):
        ModuleSpec(python_env=Path("/opt/env"), pythonpath=Path("/opt") / bad)


def test_bad_setenv_is_rejected_before_writing():
    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME='fast' is not a valid float"):
        ModuleSpec.for_environment("/opt/env", setenv={"HOROVOD_CYCLE_TIME": "fast"})
    with pytest.raises(ValueError, match="upper-case variable name"):
        ModuleSpec.for_environment("/opt/env", setenv={"horovod-x": "1"})
    with pytest.raises(ValueError, match="absolute path"):
        ModuleSpec(python_env=Path("relative/env"))


def test_install_writes_version_file_and_is_idempotent(tmp_path):
    spec = ModuleSpec.for_environment(fake_env(tmp_path))
    target = install_modulefile(spec, tmp_path / "mf")
    assert target == tmp_path / "mf" / "horovod" / f"{__version__}.lua"
    assert target.read_text() == render_modulefile(spec)
    assert install_modulefile(spec, tmp_path / "mf") == target  # same content: fine
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp file left


def test_install_refuses_to_replace_other_content_without_force(tmp_path):
    env = fake_env(tmp_path)
    target = install_modulefile(ModuleSpec.for_environment(env), tmp_path / "mf")
    changed = ModuleSpec.for_environment(env, setenv={"HOROVOD_CYCLE_TIME": "5"})
    with pytest.raises(FileExistsError, match="--force"):
        install_modulefile(changed, tmp_path / "mf")
    assert '"1")' in target.read_text()
    install_modulefile(changed, tmp_path / "mf", force=True)
    assert 'or "5")' in target.read_text()


def test_install_refuses_an_environment_without_python_or_command(tmp_path):
    with pytest.raises(ValueError, match="is not a Python environment"):
        install_modulefile(ModuleSpec.for_environment(tmp_path), tmp_path / "mf")
    env = fake_env(tmp_path)
    (env / "bin" / "hpc-horovod").unlink()
    with pytest.raises(ValueError, match="hpc-horovod not found: install the package"):
        install_modulefile(ModuleSpec.for_environment(env), tmp_path / "mf")
    assert not (tmp_path / "mf").exists()


def test_cli_install_and_render(tmp_path, capsys):
    env = fake_env(tmp_path)
    prefix = tmp_path / "mf"
    assert cli.main(["module", "install", "--prefix", str(prefix), "--python-env", str(env),
                     "--version", "9.9", "--setenv", "HOROVOD_CYCLE_TIME=2"]) == 0
    out = capsys.readouterr().out
    assert f"module use {prefix}; module load horovod/9.9" in out
    installed = (prefix / "horovod" / "9.9.lua").read_text()
    assert cli.main(["module", "render", "--python-env", str(env), "--version", "9.9",
                     "--setenv", "HOROVOD_CYCLE_TIME=2"]) == 0
    assert capsys.readouterr().out == installed
    assert cli.main(["module", "render", "--cluster", "jean-zay", "--depends-on",
                     "cuda/12.4,openmpi/5.0"]) == 0
    rendered = capsys.readouterr().out
    assert 'depends_on("cuda/12.4")\ndepends_on("openmpi/5.0")\n' in rendered
    assert rendered.count("depends_on(") == 2


def test_cli_rejects_unsafe_path_with_clear_error(tmp_path, capsys):
    bad = tmp_path / 'we"ird'
    code = cli.main(["module", "install", "--prefix", str(tmp_path / "mf"), "--python-env",
                     str(bad)])
    assert code == 2
    err = capsys.readouterr().err
    assert "hpc-horovod module: error: python environment" in err and "double quote" in err
    assert not (tmp_path / "mf").exists()
    assert cli.main(["module", "render", "--setenv", "NOEQUALS"]) == 2
    assert "--setenv expects NAME=VALUE" in capsys.readouterr().err


def test_reference_modulefile_in_tree_is_up_to_date():
    tracked = ROOT / "modulefiles" / "horovod" / f"{__version__}.lua"
    assert tracked.read_text() == render_modulefile(reference_spec()), (
        "regenerate with: python -m hpc_horovod.modules.reference")
