"""Writes ``benchmarks/RESULTS.md`` and ``benchmarks/results/allreduce.png`` from the JSON
files in ``benchmarks/results/`` (and nothing else): the machine, the versions, the command,
the targets computed from the measurements, one table per benchmark.

    python benchmarks/report.py [--results DIR] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 1 << 20


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def table(header: list[str], rows: list[list], align: str = "") -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    marks = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(marks) + " |",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows), ""]


def run_lines(meta: dict) -> list[str]:
    versions = ", ".join(f"{k} {v.split(',')[0] if k == 'mpi' else v}"
                         for k, v in meta["versions"].items()
                         if v is not None and k != "hpc_horovod from")
    lines = [f"- Run: {meta['date']} on `{meta['host']}`: {meta['cpu']}, {meta['cores']} cores, "
             f"{meta['platform']}" + (f", {meta['gpu']}" if "gpu" in meta else "")
             + f"; load average at the start {meta['loadavg'][0]}",
             f"- Versions: {versions}; code at commit `{meta['commit']}`",
             f"- Command: `{meta['command']}`"]
    lines += [f"- Not measured: {what} ({why})" for what, why in meta.get("skipped", {}).items()]
    return lines + [""]


# -- targets ---------------------------------------------------------------------------------

def verdict(value: float | None, goal: str) -> str:
    if value is None or goal == "-":
        return "-"
    bound = float(goal.split()[1])
    return "yes" if (value <= bound if goal.startswith("<=") else value >= bound) else "**no**"


def target_rows(allreduce: dict | None, training: dict | None) -> list[list]:
    rows = []  # [what, measured, goal]
    if training is not None:
        ours, reference = training["ours"], training.get("reference")
        for model, result in training["models"].items():
            mine = next(c for c in result["configurations"] if c["name"] == ours)
            if reference is not None:
                rows.append([f"{model}: {ours} steps/s / {reference}'s (median of per-round "
                             "ratios)", mine["vs_reference"]["median"], ">= 1.15"])
            rows.append([f"{model}: {ours} scaling efficiency (steps/s / {training['limit']}'s, "
                         "median of per-round ratios)", mine["efficiency"]["median"], ">= 0.85"])
            same = result.get("same_processes", {}).get(ours)
            if same is None:
                continue
            if "vs_reference" in same:
                rows.append([f"{model}, in the same processes: {ours} speed-up over {reference} "
                             "(scaling efficiency over the reference's, median of per-round "
                             "ratios)", same["vs_reference"]["median"], ">= 1.15"])
            rows.append([f"{model}, in the same processes: {ours} scaling efficiency (plain step "
                         "/ DistributedOptimizer step, median over rounds)",
                         same["efficiency"]["median"], ">= 0.85"])
            if "floor_efficiency" in same:
                rows.append([f"{model}, in the same processes: floor of the hierarchical path's "
                             "scaling efficiency (plain step / the floor's step)",
                             same["floor_efficiency"]["median"], "-"])
        rounds = training["one_process_step"].get(ours, [])
        ratio = statistics.median(r["ratio"] for r in rounds) if rounds else None
        rows.append(["One process: DistributedOptimizer step / plain optimizer step "
                     "(median over rounds)", ratio, "<= 1.02"])
    if allreduce is not None:
        sweep = allreduce["sections"]["sweep"]
        big = [r for r in sweep["rows"] if r["bytes"] >= 16 * MIB]
        for case in [c for c in dict.fromkeys(r["case"] for r in sweep["rows"])
                     if c.startswith("hvd")]:
            speeds = [1 / r["ratio"] for r in big if r["case"] == case and r["ratio"]]
            rows.append([f"{case}, 16 MiB and larger: speed vs {sweep['baseline']} "
                         "(worst size)", min(speeds) if speeds else None, ">= 0.95"])
        for case, goal in (("hvd.allreduce_", "<= 0.5"), ("hvd.allreduce", "<= 0.83")):
            at = [r for r in sweep["rows"] if r["bytes"] == 16 * MIB and r["case"] == case]
            if at:
                rows.append([f"{case}, 16 MiB: time / {sweep['baseline']}'s", at[0]["ratio"],
                             goal])
        # A private buffer reduced in place through shared memory is read twice and written
        # twice on every rank (the peers' slices staged out and their results copied back,
        # its own slice reduced): no such allreduce beats two passes over it in place.
        one_pass = [r for r in sweep["rows"]
                    if r["bytes"] == 16 * MIB and r["case"] == "bound: one pass in place"]
        if one_pass and one_pass[0]["ratio"]:
            rows.append(["Floor of hvd.allreduce_ through shared memory (two passes in place: "
                         f"the buffer read and written twice), 16 MiB: time / "
                         f"{sweep['baseline']}'s", 2 * one_pass[0]["ratio"], "-"])
        small = allreduce["sections"]["small"]
        for r in small["rows"]:
            if r["case"].startswith("hvd"):
                rows.append([f"{small['title']}: {r['case']} / {small['baseline']}",
                             r["ratio"], "<= 3"])
    return [[what, "not measured" if v is None else f"x{v:.3f}", goal, verdict(v, goal)]
            for what, v, goal in rows]


# -- allreduce ---------------------------------------------------------------------------------

def allreduce_lines(result: dict, plot: str | None) -> list[str]:
    cuda = result["benchmark"].endswith("cuda")
    title = "on the GPU (`--device cuda`)" if cuda else "on the host"
    lines = [f"## Allreduce {title}", "", *run_lines(result["meta"]),
             "Every reduction is a Sum; each cell is the median over repetitions of the slowest "
             "rank and, after x, its ratio to the baseline's time in the same run (below 1: "
             "faster). Quartiles and repetitions are in the JSON.", ""]
    sweep = result["sections"]["sweep"]
    cases = list(dict.fromkeys(r["case"] for r in sweep["rows"]))
    cell = {(r["bytes"], r["case"]): r for r in sweep["rows"]}
    sizes = sorted({r["bytes"] for r in sweep["rows"]})
    lines += [f"### {sweep['title']} (baseline: {sweep['baseline']})", ""]
    if any(c.startswith("bound:") for c in cases):
        lines += ["The `bound:` columns communicate nothing: every rank at once makes one pass "
                  "over its buffer in place, or copies it into a new array. No in-place "
                  "(out-of-place) allreduce of private buffers moves less memory.", ""]
    lines += table(["size", *cases], [
        [human(n), *(f"{fmt_time(cell[n, c]['median_s'])} x{cell[n, c]['ratio']:.2f}"
                     if (n, c) in cell and cell[n, c]["ratio"] else "-" for c in cases)]
        for n in sizes])
    for key, section in result["sections"].items():
        if key == "sweep":
            continue
        lines += [f"### {section['title']} (baseline: {section['baseline']})", ""]
        lines += table(["case", "median", "quartiles", "ratio", "bus bandwidth"], [
            [r["case"], fmt_time(r["median_s"]),
             f"{fmt_time(r['p25_s'])} - {fmt_time(r['p75_s'])}",
             f"x{r['ratio']:.2f}" if r["ratio"] else "-", f"{r['busbw_GBps']:.2f} GB/s"]
            for r in section["rows"]])
    if plot:
        lines += [f"![allreduce]({plot})", ""]
    return lines


def draw(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8),
                                      gridspec_kw={"width_ratios": [3, 2]})
    sweep = result["sections"]["sweep"]
    for case in dict.fromkeys(r["case"] for r in sweep["rows"]):
        points = sorted((r["bytes"], r["busbw_GBps"]) for r in sweep["rows"] if r["case"] == case)
        left.plot(*zip(*points), marker="o", ms=3, label=case)
    left.set_xscale("log", base=2)
    left.set_xlabel("bytes per rank")
    left.set_ylabel("bus bandwidth (GB/s)")
    left.set_title(f"{sweep['title']}, {result['meta']['ranks']} ranks")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    small = result["sections"]["small"]
    right.barh([r["case"] for r in small["rows"]], [r["median_s"] * 1e3 for r in small["rows"]])
    right.set_xscale("log")
    right.set_xlabel("ms (median, log scale)")
    right.set_title(small["title"].split(",")[0] + ", async then synchronized", fontsize=10)
    right.invert_yaxis()
    fig.suptitle(f"{result['meta']['host']}, {result['meta']['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- training ----------------------------------------------------------------------------------

def _spread(r: dict, percent: bool = False) -> str:
    if percent:
        return f"{r['median']:.0%} ({r['min']:.0%} - {r['max']:.0%})"
    return f"x{r['median']:.3f} (x{r['min']:.3f} - x{r['max']:.3f})"


def training_lines(result: dict) -> list[str]:
    meta, reference = result["meta"], result.get("reference")
    lines = ["## Training throughput", "", *run_lines(meta),
             f"{meta['processes']} processes, one compute thread each, {meta['steps']} timed "
             f"steps after {meta['warmup']}; {meta['rounds']} rounds, every configuration once "
             "per round (in an order rotating from round to round). A job's rate is its steps "
             "per second (timed steps over the time of its slowest process): the median over "
             "rounds, and its range. Ratios are taken round by round: median (range). Scaling "
             f"efficiency is the rate over the rate of the {result['limit']} (every process "
             "at once, no communication: the limit) in the same round. The last bucket's "
             "exposed time: from the arrival of backward's last gradient to the end of the "
             "reductions (median over rounds of each run's median step). Every process ran "
             "with glibc's malloc thresholds fixed ("
             + ", ".join(f"`{k}={v}`" for k, v in meta["malloc"].items())
             + "): adaptive ones make torch fault its gradient temporaries in again at every "
             "step in some processes and not in others. Page faults: minor page faults per "
             "timed step of the worst process (median over rounds). CPU per step: of the "
             "training thread, and of the process's other threads (engine, MPI, gloo, "
             "TensorFlow), each of the process that used most (median over rounds).", ""]
    for model, section in result["models"].items():
        lines += [f"### {model}: {section['description']}", ""]
        rows = []
        for c in section["configurations"]:
            rates = c["rounds_steps_per_sec"]
            exposed = c.get("rounds_last_bucket_exposed_ms")
            rows.append([c["name"], f"{statistics.median(rates):.2f}",
                         f"{min(rates):.2f} - {max(rates):.2f}",
                         _spread(c["vs_reference"]) if "vs_reference" in c else "-",
                         _spread(c["efficiency"], percent=True),
                         f"{statistics.median(exposed):.2f} ms" if exposed else "-",
                         f"{statistics.median(c['rounds_page_faults_per_step']):.0f}",
                         *(f"{statistics.median(c[key]):.2f} ms" if key in c else "-"
                           for key in ("rounds_thread_cpu_ms_per_step",
                                       "rounds_other_threads_cpu_ms_per_step"))])
        lines += table(["configuration", "steps/s", "range over rounds",
                        f"ratio to {reference}" if reference else "ratio to the reference",
                        "scaling efficiency", "last bucket exposed", "page faults",
                        "training thread CPU per step", "other threads' CPU per step"], rows)
        same = section.get("same_processes")
        if same:
            lines += [f"In the same processes, {meta['step_pairs']} steps of each copy of the "
                      "model in turn per round: the plain optimizer, DistributedOptimizer and, "
                      "for hpc_horovod, the floor of the hierarchical path (its passes by hand, "
                      "no engine). Steps: each case's median step of the slowest process, median "
                      "over rounds; ratios round by round, median (range). The speed-up is the "
                      "scaling efficiency over the reference's: a code whose threads take CPU "
                      "between steps slows its own job's plain steps too, which this ratio does "
                      "not count against it.", ""]
            lines += table(["code", "plain step", "DistributedOptimizer step", "floor step",
                            "scaling efficiency", "floor's scaling efficiency",
                            f"speed-up over {reference}" if reference else "speed-up"], [
                [name, *(fmt_time(statistics.median(r[key] for r in s["rounds"]))
                         if key in s["rounds"][0] else "-"
                         for key in ("plain_s", "distributed_s", "floor_s")),
                 *(_spread(s[key], percent=key != "vs_reference") if key in s else "-"
                   for key in ("efficiency", "floor_efficiency", "vs_reference"))]
                for name, s in same.items() if s["rounds"]])
    steps = {name: rounds for name, rounds in result["one_process_step"].items() if rounds}
    if steps:
        lines += [f"One process, {meta['step_pairs']} CNN steps of each alternated per round: "
                  "the training step with DistributedOptimizer against the plain optimizer it "
                  "wraps (two copies of one model).", ""]
        lines += table(["code", "plain step", "DistributedOptimizer step", "ratio (median)",
                        "ratio range"], [
            [name, fmt_time(statistics.median(r["plain_median_s"] for r in rounds)),
             fmt_time(statistics.median(r["distributed_median_s"] for r in rounds)),
             f"x{statistics.median(r['ratio'] for r in rounds):.3f}",
             f"x{min(r['ratio'] for r in rounds):.3f} - x{max(r['ratio'] for r in rounds):.3f}"]
            for name, rounds in steps.items()])
    return lines


def elastic_commit_lines(result: dict) -> list[str]:
    meta = result["meta"]
    lines = ["## Elastic commit", "", *run_lines(meta),
             f"`state.commit()` of a `TorchState` (a two-layer MLP and its Adam optimizer: the "
             f"state is three times the parameters), one process, {result['rows'][0]['reps']} "
             "reps of each case alternated: median (range). In memory: no "
             "`HOROVOD_ELASTIC_DIR`, the state is copied in host memory. Durable: rank 0 also "
             "writes it atomically (temporary file, fsync, rename) to a directory on "
             f"{meta['filesystem']}. One training step (batch 32) of the same model for scale.", ""]
    rows = []
    for r in result["rows"]:
        rows.append([f"{r['param_bytes'] / MIB:.0f} MiB", f"{r['file_bytes'] / MIB:.0f} MiB",
                     *(f"{fmt_time(r[f'{case}_median_s'])} ({fmt_time(r[f'{case}_min_s'])} - "
                       f"{fmt_time(r[f'{case}_max_s'])})" for case in ("step", "memory",
                                                                       "durable"))])
    return lines + table(["parameters", "commit file", "training step", "commit in memory",
                          "durable commit"], rows)


# -- scaling ---------------------------------------------------------------------------------

#: where the projections are made (docs/architecture.md, "Costs at scale")
PROJECTED_RANKS = (1024, 4096)


def _bytes(nbytes: float) -> str:
    """Three significant digits, in the largest unit under the value."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _growth(value: float, first: float, fmt=None) -> str:
    shown = fmt(value) if fmt else f"{value:g}"
    return f"{shown} (x{value / first:.1f})" if first else shown


def scaling_constants(result: dict) -> dict:
    """The per-item constants of "Costs at scale", from the measurements: pickled bytes per
    name (the marginal bytes between the two list lengths measured) and per list, memory held
    per unpickled entry and Python seconds per entry (unpickling and ``match``) at the largest
    size measured, rank 0's extra open files and resident bytes per rank (the slope from the
    fewest to the most ranks)."""
    py = result["python"]
    counts = sorted({r["names"] for r in py})
    top = max(r["ranks"] for r in py)
    at = {(r["ranks"], r["names"]): r for r in py}
    lo, hi = at[top, counts[0]], at[top, counts[-1]]
    per_name = (hi["bytes_per_rank"] - lo["bytes_per_rank"]) / (counts[-1] - counts[0])
    entries = top * counts[-1]
    rows = sorted(result["rows"], key=lambda r: r["ranks"])
    first, last = rows[0], rows[-1]
    span = last["ranks"] - first["ranks"] or 1
    return {"bytes_per_name": per_name,
            "bytes_per_list": lo["bytes_per_rank"] - per_name * counts[0],
            "held_bytes_per_entry": hi["unpickled_bytes"] / entries,
            "unpickle_s_per_entry": hi["unpickle_s"] / entries,
            "match_s_per_entry": hi["match_s"] / entries,
            "rank0_files_per_rank": (last["rank0_open_files"] - first["rank0_open_files"]) / span,
            "rank0_rss_bytes_per_rank": (last["rank0_rss_bytes"] - first["rank0_rss_bytes"])
            / span, "top": top, "first": first, "last": last}


def projection_rows(result: dict, cache_capacity: int = 1024) -> list[list]:
    """What one full negotiation, the cheap phase and rank 0's side channel cost at
    ``PROJECTED_RANKS`` by the formulas of "Costs at scale", with the measured constants."""
    c = scaling_constants(result)
    last = c["last"]
    rows = []
    for size in PROJECTED_RANKS:
        for names in sorted({r["names"] for r in result["python"]}):
            payload = c["bytes_per_list"] + c["bytes_per_name"] * names
            entries = size * names
            words = 2 + -(-min(names, cache_capacity) // 64)
            files = last["rank0_open_files"] + c["rank0_files_per_rank"] * (size - last["ranks"])
            rows.append([f"{size:,}", names, _bytes(int(size * payload)),
                         _bytes(int(2 * size * payload)),
                         _bytes(int(entries * c["held_bytes_per_entry"])),
                         fmt_time(entries * (c["unpickle_s_per_entry"] + c["match_s_per_entry"])),
                         f"{words} ({8 * words} B)", f"{files:,.0f}"])
    return rows


def scaling_lines(result: dict) -> list[str]:
    meta, rows = result["meta"], sorted(result["rows"], key=lambda r: r["ranks"])
    base = rows[0]
    lines = ["## Costs as the ranks grow", "", *run_lines(meta),
             f"All ranks on one host of {meta['cores']} cores (oversubscribed from "
             f"{meta['cores'] * 2} ranks: every time below also measures how {meta['cores']} "
             "cores share out among the ranks), a machine shared with other people's jobs "
             f"(load average {meta['loadavg'][0]} at the start, {meta['loadavg_end'][0]} at the "
             "end). Separate jobs per number of ranks (the `jobs` column), every number of "
             "ranks once per pass; each time is that of "
             "the slowest rank. `init`, memory and open files: the median over jobs; steps "
             f"and exchanges: the median over every repetition of every job ({meta['rounds']} "
             f"first steps and {meta['rounds'] * meta['steps']} steady steps per job). After "
             "each value, in brackets, its growth from the fewest ranks. A first step submits "
             f"{meta['names']} allreduces (one float32 each) under names never seen: the full "
             "negotiation (every rank's pending names and signatures gathered at rank 0, "
             "`negotiation.match` there, its decision broadcast) and one fused allreduce; a "
             "steady step submits the same names again: the cheap phase (a bitwise AND of "
             "the cache bits) and the same allreduce. Measured alone, before `init`: the full "
             "negotiation's exchange (`MpiBackend.agree`: the lists gathered at rank 0, "
             "unpickled and matched there, the decision broadcast) and the cheap phase's "
             "MPI form, one bitwise-AND `Allreduce` of 3 words (on one host the engine ANDs "
             "through the node's shared window instead); `match` over the gathered lists on "
             "rank 0.", ""]
    if max(meta["loadavg"][0], meta["loadavg_end"][0]) > 2 * meta["cores"]:
        lines += [f"**The load average exceeded twice the {meta['cores']} cores**: the wall "
                  "times of this run (`init`, steps, exchanges) measure other people's load "
                  "more than the engine, and their growth need not be monotone. The counts "
                  "(memory, open files), the bytes and the CPU times (`match`, and the table "
                  "below) do not depend on it.", ""]
    ms = fmt_time
    lines += table(
        ["ranks", "jobs", "backend", "`init`", "rank 0 RSS", "rank 0 open files",
         "other ranks' open files (most)", "first step", "steady step", "first / steady",
         "exchange of the names alone", "3-word AND allreduce alone", "`match` (rank 0)"],
        [[r["ranks"], r["jobs"], r["backend"], _growth(r["init_s"], base["init_s"], ms),
          _growth(r["rank0_rss_bytes"], base["rank0_rss_bytes"],
                  lambda v: f"{v / MIB:.0f} MiB"),
          _growth(r["rank0_open_files"], base["rank0_open_files"], lambda v: f"{v:.0f}"),
          f"{r['others_max_open_files']:.0f}" if r["others_max_open_files"] else "-",
          _growth(r["first_step_s"], base["first_step_s"], ms),
          _growth(r["steady_step_s"], base["steady_step_s"], ms),
          f"x{r['first_step_s'] / r['steady_step_s']:.1f}",
          _growth(r["exchange_s"], base["exchange_s"], ms),
          _growth(r["band_allreduce_s"], base["band_allreduce_s"], ms),
          _growth(r["match_s"], base["match_s"], ms)] for r in rows])
    if not result["python"]:
        return lines + ["The Python work in one process was not measured in this run: no "
                        "constants, no projections.", ""]
    c = scaling_constants(result)
    py = sorted(result["python"], key=lambda r: (r["names"], r["ranks"]))
    lines += ["What rank 0 does with the gathered lists in a full negotiation, measured in one "
              "process at sizes one host cannot run: the bytes it receives (every rank's "
              "pickled list), the bytes the whole job moves (those, and the decision, about "
              "one list's bytes, broadcast to every rank), the memory the unpickled lists hold "
              "(traced), the time to unpickle them and `negotiation.match`'s (median of "
              "repetitions), and both per (rank, name) entry. The other ranks send one list "
              "and receive one decision whatever the number of ranks.", ""]
    lines += table(["ranks", "names", "received by rank 0", "moved by the job",
                    "held unpickled", "unpickle", "`match`", "per entry"], [
        [f"{r['ranks']:,}", r["names"], _bytes(r["ranks"] * r["bytes_per_rank"]),
         _bytes(2 * r["ranks"] * r["bytes_per_rank"]), _bytes(r["unpickled_bytes"]),
         fmt_time(r["unpickle_s"]), fmt_time(r["match_s"]),
         f"{(r['unpickle_s'] + r['match_s']) / (r['ranks'] * r['names']) * 1e9:.0f} ns"]
        for r in py])
    lines += [f"Constants (`docs/architecture.md`, \"Costs at scale\", gives the formulas): "
              f"{c['bytes_per_name']:.1f} pickled bytes per name and {c['bytes_per_list']:.0f} "
              f"per list; {c['held_bytes_per_entry']:.0f} bytes held per unpickled entry; "
              f"{c['unpickle_s_per_entry'] * 1e9:.0f} ns to unpickle and "
              f"{c['match_s_per_entry'] * 1e9:.0f} ns of `match` per entry (at "
              f"{c['top']:,} ranks); rank 0: {c['rank0_files_per_rank']:.2f} open files and "
              f"{c['rank0_rss_bytes_per_rank'] / 1024:.0f} KiB resident per rank (slope from "
              f"{c['first']['ranks']} to {c['last']['ranks']} ranks, on one host).", "",
              "Projected by those formulas (one full negotiation; the cheap phase with the "
              "names cached; rank 0's open files after `init`):", ""]
    lines += table(["ranks", "names", "received by rank 0", "moved by the job",
                    "held unpickled, rank 0", "Python work, rank 0", "cheap phase words",
                    "rank 0 open files"], projection_rows(result))
    return lines


# -- the page ----------------------------------------------------------------------------------

def render(results: dict[str, dict], plot: str | None) -> str:
    allreduce, training = results.get("allreduce"), results.get("training")
    latest = [f"{name} on {r['meta']['date']} on `{r['meta']['host']}` ({r['meta']['cpu']}, "
              f"{r['meta']['cores']} cores)" for name, r in sorted(results.items())]
    lines = ["# Benchmark results", "",
             "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; "
             "`make bench` reruns the benchmarks and this report. These are the latest "
             "numbers: " + "; ".join(latest) + ". Earlier results are in git history. The cases "
             "compared in a ratio ran in the same run, interleaved; each run gives the load "
             "average of its machine at its start.", "",
             "## Targets", ""]
    lines += table(["what", "measured", "goal", "met"], target_rows(allreduce, training), "lrrl")
    for name in sorted(results):
        if name.startswith("allreduce"):
            lines += allreduce_lines(results[name], plot if name == "allreduce" else None)
    if training is not None:
        lines += training_lines(training)
    if "elastic_commit" in results:
        lines += elastic_commit_lines(results["elastic_commit"])
    if "scaling" in results:
        lines += scaling_lines(results["scaling"])
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    args = p.parse_args(argv)
    results = {path.stem: json.loads(path.read_text())
               for path in sorted(args.results.glob("*.json"))}
    if not results:
        p.error(f"no results in {args.results}: run the benchmarks first (make bench)")
    plot = None
    if "allreduce" in results:
        png = args.results / "allreduce.png"
        draw(results["allreduce"], png)
        plot = Path(os.path.relpath(png.resolve(), args.output.resolve().parent)).as_posix()
    args.output.write_text(render(results, plot))
    print(f"wrote {args.output}" + (f" and {png}" if plot else ""))


if __name__ == "__main__":
    main()
