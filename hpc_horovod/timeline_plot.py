"""``hpc-horovod timeline FILE --png OUT``: where the time of each tensor went.

Reads a timeline written with ``HOROVOD_TIMELINE`` and draws, per tensor, the time spent
negotiating (waiting for the other ranks to submit it) next to the time spent communicating.
A tensor with a long negotiation bar is one some rank submits late: the place to look first.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class TensorTimes:
    name: str
    negotiate_us: float = 0.0
    communicate_us: float = 0.0
    count: int = 0


#: what :func:`load_events` reads, as its errors say it
EXPECTED = ("a HOROVOD_TIMELINE file: a JSON list of trace events such as "
            '[{"name": "process_name", "ph": "M", "pid": 1, ...}, ...]')


def load_events(path: str) -> list[dict]:
    """The trace events of a timeline file; a ValueError naming the file and what it holds
    instead when it is not one."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read().strip()
    if text.startswith("[") and not text.endswith("]"):
        text = text.rstrip(",\n") + "]"  # a file cut short by a killed job is still readable
    try:
        events = json.loads(text)
    except json.JSONDecodeError as exc:
        start = text[:40] + ("..." if len(text) > 40 else "")
        raise ValueError(f"{path} is not JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno}; it starts {start!r}): expected {EXPECTED}") from None
    if not isinstance(events, list) or not all(isinstance(ev, dict) for ev in events):
        raise ValueError(f"{path} holds JSON but not a list of events (a "
                         f"{type(events).__name__}): expected {EXPECTED}")
    return events


def summarize(events: list[dict]) -> list[TensorTimes]:
    """Per tensor: total negotiation and communication time (microseconds)."""
    names: dict[int, str] = {}
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            names[ev["pid"]] = ev["args"]["name"]
    stacks: dict[int, list[tuple[str, float]]] = defaultdict(list)
    times: dict[int, TensorTimes] = {}
    for ev in events:
        pid = ev.get("pid")
        if pid not in names:
            continue
        entry = times.setdefault(pid, TensorTimes(names[pid]))
        if ev.get("ph") == "B":
            stacks[pid].append((ev["name"], ev["ts"]))
        elif ev.get("ph") == "E" and stacks[pid]:
            label, start = stacks[pid].pop()
            if label.startswith("NEGOTIATE_"):
                entry.negotiate_us += ev["ts"] - start
            else:
                entry.communicate_us += ev["ts"] - start
                entry.count += 1
    return sorted(times.values(), key=lambda t: t.negotiate_us + t.communicate_us, reverse=True)


def draw(times: list[TensorTimes], png: str, top: int = 40) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = times[:top][::-1]
    height = max(3.0, 0.3 * len(shown) + 1.5)
    fig, ax = plt.subplots(figsize=(10, height))
    ys = range(len(shown))
    neg = [t.negotiate_us / 1e3 for t in shown]
    com = [t.communicate_us / 1e3 for t in shown]
    ax.barh(ys, neg, color="#d62728", label="negotiation (waiting for ranks)")
    ax.barh(ys, com, left=neg, color="#1f77b4", label="communication")
    ax.set_yticks(list(ys), [t.name for t in shown], fontsize=8)
    ax.set_xlabel("total time (ms)")
    ax.set_title(f"hpc_horovod timeline: {len(times)} tensors"
                 + (f", slowest {top} shown" if len(times) > top else ""))
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def run(args) -> int:
    times = summarize(load_events(args.file))
    if not times:
        raise ValueError(f"{args.file} holds no tensor events: was HOROVOD_TIMELINE set on "
                         "rank 0 and did the job run a collective?")
    print(f"{'tensor':40s} {'ops':>5s} {'negotiate ms':>13s} {'communicate ms':>15s}")
    for t in times[: args.top]:
        print(f"{t.name[:40]:40s} {t.count:5d} {t.negotiate_us / 1e3:13.3f} "
              f"{t.communicate_us / 1e3:15.3f}")
    if args.png:
        draw(times, args.png, args.top)
        print(f"wrote {args.png}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("timeline", help="summarize a HOROVOD_TIMELINE file, draw it as PNG",
                       description=__doc__)
    p.add_argument("file", help="the timeline JSON written by rank 0")
    p.add_argument("--png", help="write a picture of negotiation vs communication per tensor")
    p.add_argument("--top", type=int, default=40, help="tensors shown (slowest first)")
    p.set_defaults(func=run)
