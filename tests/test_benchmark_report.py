"""``benchmarks/report.py``: RESULTS.md and the plot come from the JSON results alone, with the
targets computed from the measurements."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("matplotlib")
spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)

MIB = 1 << 20


def meta(command: str) -> dict:
    return {"date": "2030-01-02T03:04:05+00:00", "host": "node-a", "platform": "Linux",
            "cpu": "Test CPU 9000", "cores": 8, "loadavg": [0.1, 0.1, 0.1], "command": command,
            "commit": "abc1234", "ranks": 2, "skipped": {"gloo": "not built"},
            "versions": {"python": "3.11.7", "numpy": "2.4.6", "mpi": "Open MPI v4.1.4, x",
                         "hpc_horovod from": "/somewhere"}}


def row(case: str, nbytes: int, seconds: float, base: float) -> dict:
    return {"case": case, "bytes": nbytes, "median_s": seconds, "p25_s": seconds * 0.9,
            "p75_s": seconds * 1.1, "reps": 10, "busbw_GBps": nbytes / seconds / 1e9,
            "ratio": seconds / base}


def section(title: str, baseline: str, rows: list) -> dict:
    return {"title": title, "baseline": baseline, "rows": rows}


def write_results(folder: Path) -> None:
    mpi = "mpi4py Allreduce in place"
    sweep = [row(case, n, t, base) for n, times in ((4096, (2e-5, 1e-5)),
                                                    (16 * MIB, (5e-3, 4e-3)),
                                                    (32 * MIB, (8e-3, 1e-2)))
             for base in [times[1]] for case, t in zip(("hvd.allreduce_", mpi), times)]
    small = [row("hvd.allreduce_async_ (numpy)", 3 * MIB, 2e-3, 1e-3),
             row(mpi + ", one call", 3 * MIB, 1e-3, 1e-3)]
    half = [row("hvd.allreduce float16", 16 * MIB, 4e-3, 4e-3)]
    allreduce = {"benchmark": "allreduce", "meta": meta("hpc-horovod run -np 2 python a.py"),
                 "sections": {"sweep": section("One float32 buffer", mpi, sweep),
                              "small": section("200 x 16 KiB float32, async", mpi + ", one call",
                                               small),
                              "half": section("float16", "hvd.allreduce float16", half)}}
    training = {
        "benchmark": "training", "baseline": "torch DDP (gloo)", "ours": "hpc_horovod.torch",
        "meta": dict(meta("python training.py --rounds 2"), batch_size=32, warmup=1, steps=5,
                     step_pairs=10, rounds=2),
        "configurations": [
            {"name": "hpc_horovod.torch", "processes": 1, "module": "m",
             "rounds_img_per_sec_total": [100.0, 90.0]},
            {"name": "hpc_horovod.torch", "processes": 2, "module": "m",
             "rounds_img_per_sec_total": [180.0, 150.0]},
            {"name": "torch DDP (gloo)", "processes": 1, "module": "m",
             "rounds_img_per_sec_total": [50.0, 60.0]},
            {"name": "torch DDP (gloo)", "processes": 2, "module": "m",
             "rounds_img_per_sec_total": [100.0, 100.0]}],
        "one_process_step": {"hpc_horovod.torch": [
            {"plain_median_s": 0.01, "distributed_median_s": 0.0101, "ratio": 1.01},
            {"plain_median_s": 0.01, "distributed_median_s": 0.0103, "ratio": 1.03},
            {"plain_median_s": 0.01, "distributed_median_s": 0.0100, "ratio": 1.00}]}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "allreduce.json").write_text(json.dumps(allreduce))
    (folder / "training.json").write_text(json.dumps(training))


def test_report_computes_the_targets(tmp_path):
    results, output = tmp_path / "results", tmp_path / "RESULTS.md"
    write_results(results)
    report.main(["--results", str(results), "--output", str(output)])
    text = output.read_text()
    lines = text.splitlines()

    def target(start: str) -> str:
        return next(line for line in lines if line.startswith("| " + start))

    # per-round ratios to DDP: 2.0 and 1.5 with one process, 1.8 and 1.5 with two
    assert "x1.750 | - |" in target("hpc_horovod.torch training throughput / torch DDP (gloo), 1")
    assert "x1.650 | - |" in target("hpc_horovod.torch training throughput / torch DDP (gloo), 2")
    assert target("One process").endswith("| x1.010 | <= 1.02 | yes |")
    # 16 MiB: MPI 4 ms / ours 5 ms = 0.8, 32 MiB: 1.25; the worst size counts
    assert target("hvd.allreduce_, 16 MiB").endswith("| x0.800 | >= 0.95 | **no** |")
    assert target("200 x 16 KiB").endswith("| x2.000 | <= 3 | yes |")
    assert "node-a" in text and "Test CPU 9000" in text and "2030-01-02T03:04:05" in text
    assert "`hpc-horovod run -np 2 python a.py`" in text
    assert "`python training.py --rounds 2`" in text
    assert "Not measured: gloo (not built)" in text
    assert "| 16 MiB | 5.00 ms x1.25 | 4.00 ms x1.00 |" in text
    assert "![allreduce](results/allreduce.png)" in text
    assert (results / "allreduce.png").read_bytes().startswith(b"\x89PNG")


def test_committed_results_render(tmp_path):
    """The JSON the benchmarks wrote last (committed) is in the format the report reads."""
    committed = ROOT / "benchmarks" / "results"
    shutil.copytree(committed, tmp_path / "results", ignore=shutil.ignore_patterns("*.png"))
    report.main(["--results", str(tmp_path / "results"), "--output", str(tmp_path / "R.md")])
    text = (tmp_path / "R.md").read_text()
    for path in committed.glob("*.json"):
        assert json.loads(path.read_text())["meta"]["command"] in text


def test_no_results_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        report.main(["--results", str(tmp_path), "--output", str(tmp_path / "R.md")])
    assert "run the benchmarks first" in capsys.readouterr().err
