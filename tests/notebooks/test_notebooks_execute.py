"""Both shipped notebooks, executed end to end with nbclient in a fresh kernel.

The kernel is this interpreter (a kernelspec written to a temporary directory), so it imports
the same hpc_horovod, torch and TensorFlow, but its PATH lacks this environment's ``bin/`` (as
for a kernel registered with ``ipykernel install`` on a JupyterHub): the notebooks must launch
with the kernel's own interpreter. Each notebook trains in the kernel's single process, then
writes its script and runs it with ``sys.executable -m hpc_horovod run -np 2``; both print
``FINAL test_accuracy=...``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from hpc_horovod.notebooks_cli import copy_notebooks

ACCURACY = re.compile(r"^(\[\d+,(\d+)\]<stdout>:)?FINAL test_accuracy=([0-9.]+)(.*)$", re.M)
MIN_ACCURACY = 0.9
ROOT = Path(__file__).resolve().parents[2]
#: a PATH of system directories only: MPI's launcher is there, this environment is not
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.fixture
def kernel_manager(tmp_path, monkeypatch) -> KernelManager:
    spec_dir = tmp_path / "kernels" / "hpc-horovod-tests"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hpc_horovod tests", "language": "python"}))
    # What the kernel inherits: a PATH without this environment (no hpc-horovod, no python of
    # it), this checkout's package, MPI as root, no SLURM or MPI rank variables from an outer
    # job, one thread per process.
    monkeypatch.setenv("PATH", SYSTEM_PATH)
    assert shutil.which("hpc-horovod") is None and shutil.which("horovodrun") is None
    assert shutil.which("python") != sys.executable
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH", "")])))
    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_COMM_WORLD", "PMI_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    monkeypatch.setenv("OMPI_MCA_mpi_yield_when_idle", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    return KernelManager(kernel_name="hpc-horovod-tests",
                         kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_dir.parent)]))


def execute(notebook: Path, kernel_manager: KernelManager) -> tuple[nbformat.NotebookNode, str]:
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, km=kernel_manager, timeout=240,
                            resources={"metadata": {"path": str(notebook.parent)}})
    client.execute()
    text = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                text.append(output.text)
    return nb, "".join(text)


@pytest.mark.mpi
@pytest.mark.parametrize("framework", ["pytorch", "keras"])
def test_notebook_trains_in_kernel_and_on_two_processes(framework, tmp_path, kernel_manager):
    name, plot = f"data_parallel_{framework}.ipynb", f"learning_curve_{framework}.png"
    copy_notebooks(tmp_path)
    nb, text = execute(tmp_path / name, kernel_manager)

    found = ACCURACY.findall(text)
    in_kernel = [float(acc) for tag, _, acc, _ in found if not tag]
    distributed = [(int(rank), float(acc), rest) for tag, rank, acc, rest in found if tag]
    assert len(in_kernel) == 1 and in_kernel[0] >= MIN_ACCURACY, text
    assert len(distributed) == 1, text
    rank, accuracy, rest = distributed[0]
    assert rank == 0 and accuracy >= MIN_ACCURACY and "processes=2" in rest, text

    images = [o for cell in nb.cells for o in cell.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, "the learning-curve cell drew nothing"
    assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.mpi
def test_run_from_a_notebook_cell(tmp_path, kernel_manager):
    """A function defined in a cell runs on two ranks (it travels by value), its results and
    a rank's exception come back to the cell."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import hpc_horovod\n"
            "def square_sum(x):\n"
            "    import numpy as np\n"
            "    import hpc_horovod as hvd\n"
            "    hvd.init()\n"
            "    if x < 0 and hvd.rank() == 1:\n"
            "        raise ArithmeticError('negative on rank 1')\n"
            "    return float(hvd.allreduce(np.array([x * (hvd.rank() + 1.0)]), op=hvd.Sum)[0])"),
        nbformat.v4.new_code_cell("print('RESULTS', hpc_horovod.run(square_sum, args=(3,), "
                                  "np=2))"),
        nbformat.v4.new_code_cell(
            "try:\n"
            "    hpc_horovod.run(square_sum, args=(-1,), np=2)\n"
            "except ArithmeticError as exc:\n"
            "    print('RAISED', exc, exc.__notes__[0].splitlines()[0])"),
    ]
    path = tmp_path / "run.ipynb"
    nbformat.write(nb, path)
    _, text = execute(path, kernel_manager)
    assert "RESULTS [9.0, 9.0]" in text, text
    assert "RAISED negative on rank 1 raised on rank 1 of 2" in text, text
