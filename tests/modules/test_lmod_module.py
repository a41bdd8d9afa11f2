"""The installed modulefile under real Lmod (Debian's lmod), in a clean non-interactive bash.

The Python environment the module points at is a fresh venv made here. It reaches the
project's dependencies through a one-line .pth file naming the test runner's site-packages
(a plain path line: the editable install of hpc_horovod there is *not* activated), and it gets
the ``hpc-horovod`` console script pip would write. So ``import hpc_horovod`` in that venv works
only through the PYTHONPATH the module sets, which is what these tests prove.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import hpc_horovod
from hpc_horovod.modules import ModuleSpec, cluster_modules, install_modulefile, known_clusters
from hpc_horovod.version import __version__

LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")
LMOD_LIBEXEC = Path("/usr/share/lmod/lmod/libexec")
ROOT = Path(__file__).resolve().parents[2]
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"

if not LMOD_INIT.exists():
    pytest.fail("Lmod is not installed: apt-get install lmod (scripts/install-system-deps.sh)",
                pytrace=False)


@pytest.fixture(scope="module")
def python_env(tmp_path_factory) -> Path:
    env = tmp_path_factory.mktemp("pyenv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    purelib = Path(subprocess.run(
        [env / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    script = env / "bin" / "hpc-horovod"
    script.write_text(f"#!{env}/bin/python\nimport sys\nfrom hpc_horovod.cli import main\n"
                      "sys.exit(main())\n")
    script.chmod(0o755)
    return env


def lmod_bash(script: str, modulepath: Path | str, **env: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a clean bash with Lmod initialised and ``module use`` done."""
    clean = {"HOME": os.environ.get("HOME", "/root"), "PATH": BASE_PATH, "LANG": "C.UTF-8",
             "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **env}
    text = f"source {LMOD_INIT}\nmodule use {modulepath}\n{script}"
    return subprocess.run(["bash", "-c", text], capture_output=True, text=True, env=clean,
                          timeout=120)


def values(output: str) -> dict[str, str]:
    """``KEY=value`` lines printed by a test script."""
    return dict(line.split("=", 1) for line in output.splitlines() if re.match(r"[A-Z_0-9]+=",
                                                                                 line))


LOAD_AND_UNLOAD = """
echo "PATH_BEFORE=$PATH"
echo "PYTHONPATH_BEFORE=${PYTHONPATH-<unset>}"
python3 -c "import hpc_horovod" 2>/dev/null && echo "IMPORT_BEFORE=ok" || echo "IMPORT_BEFORE=no"
module load horovod || exit 10
echo "CMD=$(command -v hpc-horovod)"
echo "CYCLE=$HOROVOD_CYCLE_TIME"
echo "FUSION=$HOROVOD_FUSION_THRESHOLD"
python -c "import sys, hpc_horovod; print('VERSION=' + hpc_horovod.__version__); \
print('PREFIX=' + sys.prefix); print('FILE=' + hpc_horovod.__file__)" || exit 11
hpc-horovod check-build || exit 12
module unload horovod || exit 13
echo "PATH_AFTER=$PATH"
echo "PYTHONPATH_AFTER=${PYTHONPATH-<unset>}"
echo "CYCLE_AFTER=${HOROVOD_CYCLE_TIME-<unset>}"
"""


@pytest.mark.parametrize("before", [{}, {"PYTHONPATH": "/srv/site-python",
                                         "HOROVOD_CYCLE_TIME": "7"}],
                         ids=["clean", "preset"])
def test_load_puts_package_and_command_on_paths_and_unload_restores(python_env, tmp_path,
                                                                    before):
    prefix = tmp_path / "modulefiles"
    install_modulefile(ModuleSpec.for_environment(python_env), prefix)
    proc = lmod_bash(LOAD_AND_UNLOAD, prefix, **before)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = values(proc.stdout)
    assert got["IMPORT_BEFORE"] == "no"
    assert got["CMD"] == f"{python_env}/bin/hpc-horovod"
    assert got["VERSION"] == __version__ == hpc_horovod.__version__
    assert got["PREFIX"] == str(python_env)
    assert got["FILE"] == str(ROOT / "hpc_horovod" / "__init__.py")
    assert f"hpc_horovod v{__version__}:" in proc.stdout
    assert "Available Frameworks:" in proc.stdout
    # a value exported before loading wins over the module's default
    assert got["CYCLE"] == before.get("HOROVOD_CYCLE_TIME", "1")
    assert got["FUSION"] == "134217728"
    assert got["PATH_AFTER"] == got["PATH_BEFORE"] == BASE_PATH
    assert got["PYTHONPATH_AFTER"] == got["PYTHONPATH_BEFORE"] == before.get("PYTHONPATH",
                                                                             "<unset>")
    assert got["CYCLE_AFTER"] == before.get("HOROVOD_CYCLE_TIME", "<unset>")


def test_every_generated_file_passes_lmod_syntax_checks(python_env, tmp_path):
    prefix = tmp_path / "modulefiles"
    names = []
    for i, cluster in enumerate(known_clusters()):
        version = f"{__version__}-{cluster}"
        spec = ModuleSpec.for_environment(python_env, cluster=cluster, version=version,
                                          setenv={"NCCL_DEBUG": "WARN"} if i else None)
        install_modulefile(spec, prefix)
        names.append(f"horovod/{version}")
    for tree in (prefix, ROOT / "modulefiles"):
        proc = subprocess.run([LMOD_LIBEXEC / "check_module_tree_syntax", str(tree)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "No errors found" in proc.stdout + proc.stderr
    names.append(f"horovod/{__version__}")
    modulepath = f"{prefix}:{ROOT / 'modulefiles'}"
    for name in names:
        proc = subprocess.run([LMOD_LIBEXEC / "lmod", "bash", "--checkSyntax", "load", name],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "MODULEPATH": modulepath})
        assert proc.returncode == 0, name + proc.stdout + proc.stderr


def test_syntax_check_catches_a_broken_file(tmp_path):
    """The check above can fail: a modulefile with an unknown function does not pass."""
    broken = tmp_path / "horovod" / "0.0.lua"
    broken.parent.mkdir()
    broken.write_text('family("horovod")\nprepend_path("PATH", "/x"\n')
    proc = subprocess.run([LMOD_LIBEXEC / "check_module_tree_syntax", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0


def write_module(tree: Path, name: str, body: str) -> None:
    path = tree / f"{name}.lua"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)


def test_cluster_modules_are_loaded_and_unloaded_with_horovod(python_env, tmp_path):
    site = tmp_path / "site"
    for module in cluster_modules("jean-zay"):
        marker = module.split("/")[0].upper()
        write_module(site, module, f'setenv("SITE_{marker}", "{module}")\n')
    prefix = tmp_path / "modulefiles"
    install_modulefile(ModuleSpec.for_environment(python_env, cluster="jean-zay"), prefix)
    script = f"""module use {site}
module load horovod || exit 10
echo "LOADED=$LOADEDMODULES"
echo "SITE_CUDA=$SITE_CUDA"
module unload horovod
echo "LOADED_AFTER=${{LOADEDMODULES-}}"
"""
    proc = lmod_bash(script, prefix)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = values(proc.stdout)
    assert got["LOADED"].split(":") == [*cluster_modules("jean-zay"), f"horovod/{__version__}"]
    assert got["SITE_CUDA"] == cluster_modules("jean-zay")[0]
    assert got["LOADED_AFTER"] == ""


def test_missing_cluster_module_fails_the_load(python_env, tmp_path):
    prefix = tmp_path / "modulefiles"
    install_modulefile(ModuleSpec.for_environment(python_env, cluster="jean-zay"), prefix)
    proc = lmod_bash("module load horovod", prefix)
    assert proc.returncode != 0
    assert cluster_modules("jean-zay")[0] in proc.stderr


def test_a_second_horovod_conflicts_or_replaces(python_env, tmp_path):
    prefix = tmp_path / "modulefiles"
    install_modulefile(ModuleSpec.for_environment(python_env), prefix)
    install_modulefile(ModuleSpec.for_environment(python_env, version="0.0.9"), prefix)
    other = tmp_path / "other"
    write_module(other, "py-horovod/0.28.1", 'prepend_path("PATH", "/opt/horovod/bin")\n')
    # Horovod itself loaded first: ours refuses to load next to it
    proc = lmod_bash(f"module use {other}\nmodule load py-horovod\nmodule load horovod\n"
                     'echo "LOADED=$LOADEDMODULES"', prefix)
    assert "Cannot load module" in proc.stderr and "py-horovod" in proc.stderr
    assert values(proc.stdout)["LOADED"] == "py-horovod/0.28.1"
    # two versions of ours: one horovod at a time, never both on PATH
    proc = lmod_bash(f"module load horovod/0.0.9\nmodule load horovod/{__version__}\n"
                     'echo "LOADED=$LOADEDMODULES"\necho "FAMILY=$LMOD_FAMILY_HOROVOD_VERSION"',
                     prefix)
    got = values(proc.stdout)
    assert got["LOADED"] == f"horovod/{__version__}", proc.stderr
    assert got["FAMILY"] == __version__
