"""``hpc-horovod timeline``: a real 2-rank job writes the timeline, the command reads and draws
it."""

import json
import subprocess
import sys
import textwrap

from hpc_horovod.timeline_plot import load_events, summarize

WORKER = textwrap.dedent("""
    import numpy as np
    import hpc_horovod as hvd
    hvd.init()
    for step in range(5):
        handles = [hvd.allreduce_async(np.ones(1000, np.float32) * i, name=f"grad.{i}")
                   for i in range(4)]
        for h in handles:
            hvd.synchronize(h)
    hvd.broadcast(np.ones(3), 0, name="bcast")
    hvd.shutdown()
""")


def test_timeline_of_a_training_loop(tmp_path, mpirun):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    trace = tmp_path / "timeline.json"
    mpirun(2, script, env={"HOROVOD_TIMELINE": str(trace),
                           "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    events = json.loads(trace.read_text())
    names = {e.get("name") for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE", "CYCLE_START",
            "NEGOTIATE_BROADCAST", "BROADCAST", "MPI_BCAST"} <= names
    rows = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert rows == {"grad.0", "grad.1", "grad.2", "grad.3", "bcast"}
    times = {t.name: t for t in summarize(load_events(str(trace)))}
    assert times["grad.0"].count == 5 and times["bcast"].count == 1

    png = tmp_path / "timeline.png"
    out = subprocess.run([sys.executable, "-m", "hpc_horovod.cli", "timeline", str(trace),
                          "--png", str(png)], capture_output=True, text=True, check=True).stdout
    assert "grad.3" in out and png.read_bytes().startswith(b"\x89PNG")


def test_truncated_timeline_is_still_readable(tmp_path):
    trace = tmp_path / "cut.json"
    trace.write_text('[\n{"name":"process_name","ph":"M","pid":1,"args":{"name":"t"}},\n'
                     '{"name":"ALLREDUCE","ph":"B","ts":1,"pid":1,"tid":1},\n'
                     '{"ph":"E","ts":5,"pid":1,"tid":1}')
    (t,) = summarize(load_events(str(trace)))
    assert t.name == "t" and t.communicate_us == 4


def test_empty_timeline_is_an_error(tmp_path):
    trace = tmp_path / "empty.json"
    trace.write_text("[\n]\n")
    proc = subprocess.run([sys.executable, "-m", "hpc_horovod.cli", "timeline", str(trace)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no tensor events" in proc.stderr


def test_a_file_that_is_not_a_timeline_is_named(tmp_path):
    """Not JSON, or JSON but no list of events: the error names the file, what it holds and what
    a timeline is."""
    for name, text, says in (("log.txt", "step 1 loss 0.3\n", "is not JSON (Expecting value "
                              "at line 1 column 1; it starts 'step 1 loss 0.3')"),
                             ("dict.json", '{"ph": "B"}', "holds JSON but not a list of events "
                              "(a dict)")):
        trace = tmp_path / name
        trace.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "hpc_horovod.cli", "timeline", str(trace)],
                              capture_output=True, text=True)
        assert proc.returncode == 2, proc.stderr
        assert f"{trace} {says}: expected a HOROVOD_TIMELINE file: a JSON list" in proc.stderr, \
            proc.stderr
