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
    sweep.append(row("bound: one pass in place", 16 * MIB, 1.5e-3, 4e-3))
    small = [row("hvd.allreduce_async_ (numpy)", 3 * MIB, 2e-3, 1e-3),
             row(mpi + ", one call", 3 * MIB, 1e-3, 1e-3)]
    half = [row("hvd.allreduce float16", 16 * MIB, 4e-3, 4e-3)]
    allreduce = {"benchmark": "allreduce", "meta": meta("hpc-horovod run -np 2 python a.py"),
                 "sections": {"sweep": section("One float32 buffer", mpi, sweep),
                              "small": section("200 x 16 KiB float32, async", mpi + ", one call",
                                               small),
                              "half": section("float16", "hvd.allreduce float16", half)}}
    ours, before = "hpc_horovod.torch (hierarchical)", "hpc_horovod.torch at abc1234"

    def config(name: str, rates: list, vs: float, efficiency: float, exposed=None,
               cpu=None) -> dict:
        c = {"name": name, "module": "m", "rounds_steps_per_sec": rates,
             "vs_reference": {"median": vs, "min": vs - 0.1, "max": vs + 0.1},
             "efficiency": {"median": efficiency, "min": efficiency - 0.05,
                            "max": efficiency + 0.05},
             "rounds_page_faults_per_step": [0.0, 2048.0, 1.0]}
        if exposed:
            c["rounds_last_bucket_exposed_ms"] = exposed
        if cpu:  # results from before the CPU columns have none
            c["rounds_thread_cpu_ms_per_step"], c["rounds_other_threads_cpu_ms_per_step"] = cpu
        return c

    def paired(plain: float, distributed: float, floor: float | None = None) -> dict:
        r = {"plain_s": plain, "distributed_s": distributed, "efficiency": plain / distributed}
        if floor is not None:
            r.update(floor_s=floor, floor_efficiency=plain / floor)
        return r

    training = {
        "benchmark": "training", "ours": ours, "flat": "hpc_horovod.torch (flat MPI)",
        "reference": before, "ddp": "torch DDP (gloo)", "limit": "plain optimizer",
        "meta": dict(meta("python training.py --rounds 2"), batch_size=32, warmup=1, steps=5,
                     step_pairs=10, rounds=2, processes=2,
                     malloc={"MALLOC_MMAP_THRESHOLD_": "33554432"}),
        "models": {
            "mlp": {"description": "an MLP", "configurations": [
                config(ours, [12.0, 10.0], 1.2, 0.9, [1.0, 3.0],
                       ([9.0, 10.0, 11.0], [1.0, 1.5, 2.0])),
                config(before, [10.0, 8.0], 1.0, 0.75, [4.0, 4.0]),
                config("plain optimizer", [13.0, 11.0], 1.3, 1.0)],
                "same_processes": {
                    ours: {"rounds": [paired(0.010, 0.0125, 0.012), paired(0.011, 0.0125, 0.012),
                                      paired(0.009, 0.0125, 0.012)],
                           "efficiency": {"median": 0.8, "min": 0.72, "max": 0.88},
                           "floor_efficiency": {"median": 0.833, "min": 0.75, "max": 0.917},
                           "vs_reference": {"median": 1.25, "min": 1.2, "max": 1.3}},
                    before: {"rounds": [paired(0.010, 0.0156), paired(0.011, 0.0172),
                                        paired(0.009, 0.0141)],
                             "efficiency": {"median": 0.64, "min": 0.64, "max": 0.64},
                             "vs_reference": {"median": 1.0, "min": 1.0, "max": 1.0}}}},
            "cnn": {"description": "a CNN", "configurations": [
                config(ours, [20.0, 18.0], 1.1, 0.8, [1.0, 1.0]),
                config(before, [18.0, 17.0], 1.0, 0.7, [2.0, 2.0]),
                config("plain optimizer", [22.0, 21.0], 1.2, 1.0)]}},
        "one_process_step": {ours: [
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

    assert target("mlp: hpc_horovod.torch (hierarchical) steps/s / hpc_horovod.torch at "
                  "abc1234").endswith("| x1.200 | >= 1.15 | yes |")
    assert target("cnn: hpc_horovod.torch (hierarchical) steps/s").endswith(
        "| x1.100 | >= 1.15 | **no** |")
    assert target("mlp: hpc_horovod.torch (hierarchical) scaling").endswith(
        "| x0.900 | >= 0.85 | yes |")
    # in the same processes: the speed-up is the ratio of the efficiencies; the floor has no
    # goal; a model measured without such a job has no rows
    assert target("mlp, in the same processes: hpc_horovod.torch (hierarchical) speed-up over "
                  "hpc_horovod.torch at abc1234").endswith("| x1.250 | >= 1.15 | yes |")
    assert target("mlp, in the same processes: hpc_horovod.torch (hierarchical) scaling").endswith(
        "| x0.800 | >= 0.85 | **no** |")
    assert target("mlp, in the same processes: floor").endswith("| x0.833 | - | - |")
    assert not any(line.startswith("| cnn, in the same processes") for line in lines)
    assert ("| hpc_horovod.torch (hierarchical) | 10.00 ms | 12.50 ms | 12.00 ms | 80% (72% - "
            "88%) | 83% (75% - 92%) | x1.250 (x1.200 - x1.300) |") in text
    assert "| hpc_horovod.torch at abc1234 | 10.00 ms | 15.60 ms | - | 64% (64% - 64%) | - |" \
        in text
    assert "| hpc_horovod.torch (hierarchical) | 11.00 | 10.00 - 12.00 | x1.200 (x1.100 - " \
        "x1.300) | 90% (85% - 95%) | 2.00 ms | 1 | 10.00 ms | 1.50 ms |" in text
    assert "malloc thresholds fixed (`MALLOC_MMAP_THRESHOLD_=33554432`)" in text
    assert "| plain optimizer | 12.00 | 11.00 - 13.00 |" in text
    assert target("plain optimizer | 12.00").endswith("| - | 1 | - | - |")  # measured without
    assert target("One process").endswith("| x1.010 | <= 1.02 | yes |")
    # 16 MiB: MPI 4 ms / ours 5 ms = 0.8, 32 MiB: 1.25; the worst size counts
    assert target("hvd.allreduce_, 16 MiB").endswith("| x0.800 | >= 0.95 | **no** |")
    assert target("hvd.allreduce_, 16 MiB: time").endswith("| x1.250 | <= 0.5 | **no** |")
    assert target("200 x 16 KiB").endswith("| x2.000 | <= 3 | yes |")
    # two passes of 1.5 ms against MPI's 4 ms: no goal, the floor under the one above
    assert target("Floor of hvd.allreduce_").endswith("| x0.750 | - | - |")
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


def test_scaling_constants_and_projections(tmp_path):
    """The scaling section: growth from the fewest ranks, the per-item constants taken from the
    measurements, and the projections at 1,024 and 4,096 ranks by the formulas."""
    def row(ranks: int, files: int, rss: int, first: float, steady: float) -> dict:
        return {"ranks": ranks, "backend": "hierarchical", "jobs": 3, "init_s": 0.1 * ranks,
                "init_s_jobs": [0.1 * ranks] * 3, "rank0_rss_bytes": rss,
                "rank0_open_files": files, "others_max_rss_bytes": rss,
                "others_max_open_files": 20, "first_step_s": first, "steady_step_s": steady,
                "exchange_s": first / 2, "band_allreduce_s": 1e-5, "match_s": 1e-4,
                "payload_bytes": 1000}

    def py(ranks: int, names: int) -> dict:
        entries = ranks * names
        return {"ranks": ranks, "names": names, "bytes_per_rank": 100 + 50 * names,
                "unpickled_bytes": 150 * entries, "unpickle_s": 100e-9 * entries,
                "match_s": 400e-9 * entries, "reps": 3}

    result = {"benchmark": "scaling",
              "meta": dict(meta("python benchmarks/scaling.py"), names=20, rounds=5, steps=20,
                           reps=20, jobs_per_point=3, shared_machine=True,
                           loadavg_end=[2.0, 2.0, 2.0]),
              "rows": [row(2, 22, 64 * MIB, 1e-3, 2.5e-4), row(64, 84, 64 * MIB + 62 * 1024,
                                                               8e-3, 1e-3)],
              "python": [py(r, n) for n in (20, 200) for r in (2, 4096)]}
    results, output = tmp_path / "results", tmp_path / "RESULTS.md"
    results.mkdir()
    (results / "scaling.json").write_text(json.dumps(result))
    report.main(["--results", str(results), "--output", str(output)])
    text = output.read_text()
    assert "## Costs as the ranks grow" in text
    # growth from 2 ranks: 8 ms / 1 ms; first / steady: 8 ms / 1 ms
    assert "| 64 | 3 | hierarchical | 6.40 s (x32.0) | 64 MiB (x1.0) | 84 (x3.8) | 20 | 8.00 ms " \
        "(x8.0) | 1.00 ms (x4.0) | x8.0 |" in text
    assert ("50.0 pickled bytes per name and 100 per list; 150 bytes held per unpickled entry; "
            "100 ns to unpickle and 400 ns of `match` per entry (at 4,096 ranks); rank 0: 1.00 "
            "open files and 1 KiB resident per rank") in text
    # 4,096 ranks x 200 names: 10,100 B per list, 4,096 lists received by rank 0 (41.4 MB),
    # twice that moved by the job (the decision, about one list, broadcast back: 82.7 MB);
    # 819,200 entries x 150 B held (123 MB), x 500 ns of Python; 2 + 200/64 rounded up = 6
    # words; rank 0's files: 84 + (4,096 - 64)
    assert "| 4,096 | 200 | 41.4 MB | 82.7 MB | 123 MB | 409.60 ms | 6 (48 B) | 4,116 |" in text
    # 1,024 ranks x 20 names: 1,100 B per list
    assert "| 1,024 | 20 | 1.13 MB | 2.25 MB | 3.07 MB | 10.24 ms | 3 (24 B) | 1,044 |" in text
