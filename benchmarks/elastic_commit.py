"""What ``state.commit()`` costs in elastic training: the in-memory save alone (no
``HOROVOD_ELASTIC_DIR``) against the durable commit (rank 0 also writes the state atomically
to ``HOROVOD_ELASTIC_DIR``), for PyTorch models of a few sizes with Adam (whose state doubles
the bytes), next to the time of one training step of the same model.

    python benchmarks/elastic_commit.py [--reps 7] [--dir DIR]

One process (a job of size 1: the commit's collective part is then a no-op; on several ranks
it adds one small broadcast). ``--dir``: where durable commits go (default: a temporary
directory in the current one, on the disk a job would use rather than /tmp). The cases
alternate rep by rep. Results go to ``benchmarks/results/elastic_commit.json``;
``benchmarks/report.py`` adds them to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from machine import command_line, describe

import hpc_horovod.torch as hvd

HERE = Path(__file__).resolve().parent
#: width of the two-layer MLPs: 2, 32 and 128 MiB of float32 parameters
WIDTHS = (512, 2048, 4096)


def _model(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(width: int, reps: int, directory: Path) -> dict:
    torch.manual_seed(0)
    model = _model(width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(32, width)

    def step():
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    step()  # Adam's state exists from here on
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    times = {"step": [], "memory": [], "durable": []}
    for _ in range(reps):
        times["step"].append(_timed(step))
        os.environ.pop("HOROVOD_ELASTIC_DIR", None)
        times["memory"].append(_timed(state.commit))
        os.environ["HOROVOD_ELASTIC_DIR"] = str(directory)
        times["durable"].append(_timed(state.commit))
    os.environ.pop("HOROVOD_ELASTIC_DIR", None)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    row = {"width": width, "param_bytes": params, "state_bytes": 3 * params,
           "file_bytes": (directory / "commit.pkl").stat().st_size, "reps": reps}
    for case, values in times.items():
        values = sorted(values)
        row[f"{case}_median_s"] = statistics.median(values)
        row[f"{case}_min_s"], row[f"{case}_max_s"] = values[0], values[-1]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--output", type=Path, default=HERE / "results" / "elastic_commit.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    directory = args.dir or Path(tempfile.mkdtemp(prefix=".elastic-commit-", dir="."))
    try:
        rows = [measure(width, args.reps, directory) for width in WIDTHS]
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    result = {"meta": {**describe(command_line()), "ranks": 1,
                       "filesystem": _filesystem(directory)}, "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{r['param_bytes'] / 2**20:6.1f} MiB of parameters: step "
              f"{r['step_median_s'] * 1e3:8.2f} ms, commit in memory "
              f"{r['memory_median_s'] * 1e3:8.2f} ms, durable "
              f"{r['durable_median_s'] * 1e3:8.2f} ms")
    print(f"wrote {args.output}")


def _filesystem(path: Path) -> str:
    """The file system type under ``path`` (from /proc/mounts: the longest mount prefix)."""
    best, kind = "", "unknown"
    try:
        resolved = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if resolved.startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


if __name__ == "__main__":
    main()
