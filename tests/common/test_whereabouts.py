"""The deadline of a data call and the census's line (common/whereabouts.py); the census itself
runs over real ranks in tests/parallel/test_stuck.py."""

from __future__ import annotations

import math
import time

from hpc_horovod.common import whereabouts
from hpc_horovod.common.whereabouts import IDLE, Whereabouts, census_text, deadline


def test_the_deadline_is_the_peer_timeout_plus_the_bytes_at_the_floor_bandwidth():
    assert deadline(100.0, 60.0, 0) == 160.0
    assert deadline(100.0, 60.0, 250_000_000) == 162.5  # 250 MB at 100 MB/s
    assert whereabouts.FLOOR_BYTES_PER_S == 100e6
    assert deadline(100.0, 0.0, 1 << 30) == math.inf  # a timeout of 0: wait for ever


def test_only_a_data_call_past_its_deadline_is_overdue():
    here = Whereabouts(timeout_s=5.0)
    assert here.now is IDLE and here.overdue(time.monotonic() + 1e6) is None
    here.negotiating(0)
    assert here.overdue(time.monotonic() + 1e6) is None  # its wait has a timeout of its own
    here.enter("allreduce", ["grad.fc1"], 0, 1, 16 << 20, 0)
    since = here.now[1]
    late = deadline(since, 5.0, 16 << 20)
    assert here.overdue(late - 0.01) is None
    assert here.overdue(late + 0.01) == since
    forever = Whereabouts(timeout_s=0.0)
    forever.enter("allreduce", ["grad.fc1"], 0, 1, 16 << 20, 0)
    assert forever.overdue(time.monotonic() + 1e9) is None


def test_a_census_answer_says_where_the_engine_is_and_since_when():
    here = Whereabouts(timeout_s=60.0)
    assert here.answer() == {"phase": "idle", "what": "idle (outside a collective)",
                             "for_s": 0.0}
    here.enter("allreduce", ["grad.fc1"], 0, 1, 16 << 20, 0)
    answer = here.answer(now=here.now[1] + 61.04)
    assert answer == {"phase": "data", "for_s": 61.0,
                      "what": "in allreduce 'grad.fc1' (16.0 MiB, process set 0)"}
    here.enter("allgather", ["x", "a", "b", "c", "d", "e"], 1, 6, 100, 2)
    assert here.answer()["what"] == ("in allgather 'a', 'b', 'c' and 2 more (100 B, "
                                     "process set 2)")
    here.negotiating(1)
    assert here.answer()["what"] == "in the negotiation of process set 1"
    here.setting_up("creating process set 1, 3")
    answer = here.answer(now=here.now[1] + 120.0)
    assert answer == {"phase": "setup", "what": "in hvd.init, creating process set 1, 3",
                      "for_s": 120.0}


def _data(what: str, for_s: float) -> dict:
    return {"phase": "data", "what": what, "for_s": for_s}


def test_the_census_names_the_silent_ranks_then_where_each_other_is():
    call = "in allreduce 'grad.fc1' (16.0 MiB, process set 0)"
    answers = {0: _data(call, 60.2), 1: _data(call, 59.9), 2: _data(call, 60.0)}
    assert census_text(4, answers, 2.0) == (
        "rank 3 did not answer within 2 s (stopped, or blocked outside Python); "
        f"ranks 0, 1, 2 {call} for 60 s")
    assert census_text(3, answers, 2.0) == f"ranks 0, 1, 2 {call} for 60 s"


def test_the_census_says_when_the_ranks_are_in_different_collectives():
    answers = {0: _data("in allreduce 'a' (4 B, process set 0)", 9.0),
               1: _data("in broadcast 'b' (4 B, process set 0)", 8.0),
               2: {"phase": "negotiation", "what": "in the negotiation of process set 0",
                   "for_s": 7.0},
               3: {"phase": "idle", "what": "idle (outside a collective)", "for_s": 0.0}}
    assert census_text(5, answers, 2.0) == (
        "the ranks diverged (they are in different collectives); rank 4 did not answer within "
        "2 s (stopped, or blocked outside Python); rank 0 in allreduce 'a' (4 B, process set "
        "0) for 9 s; rank 1 in broadcast 'b' (4 B, process set 0) for 8 s; rank 2 in the "
        "negotiation of process set 0 for 7 s; rank 3 idle (outside a collective)")

