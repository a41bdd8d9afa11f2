"""Run by every rank of ``mpirun -np N python -m pytest`` (test_reinit.py): after a fatal error
(a stall past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, which stops the engine on every rank) that the
check catches, ``init`` gives a fresh, working engine: with and without ``shutdown`` first,
through the numpy API and the torch API, with process sets created again from scratch."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = "1"
os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = "2"
os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"

import torch  # noqa: E402

import hpc_horovod as hvd  # noqa: E402
import hpc_horovod.torch as thvd  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


@pytest.fixture(autouse=True)
def _job():
    hvd.init()  # a new engine after a check that stopped it


def fatal_stall(allreduce, tensor) -> str:
    """Rank 0 waits for a tensor rank 1 never submits: the engine stops on both; rank 1 then
    finds every op refused with the same error. Returns the error's text."""
    if hvd.rank() == 0:
        try:
            allreduce(tensor, name="never.on.rank1")
        except hvd.HorovodInternalError as exc:
            return str(exc)
        raise AssertionError("the stall did not stop the engine")
    time.sleep(4)  # past the 2 s limit: the engine has stopped meanwhile
    try:
        allreduce(tensor, name="after.the.stop")
    except hvd.HorovodInternalError as exc:
        return str(exc)
    raise AssertionError("an op after the engine stopped succeeded")


def works(allreduce, tensor, tag: str) -> None:
    got = allreduce(tensor, op=hvd.Sum, name=f"works.{tag}")
    assert np.asarray(got).tolist() == [float(hvd.size())] * 3, got


def test_init_without_shutdown_after_a_fatal_error():
    """numpy API, with a process set registered before the failure; bare init() afterwards."""
    first = hvd.add_process_set([0])
    works(hvd.allreduce, np.ones(3), "numpy.before")
    text = fatal_stall(hvd.allreduce, np.ones(3))
    assert "All ranks stop now" in text, text
    assert first.process_set_id is not None  # still registered to the stopped engine
    hvd.init()  # no shutdown: the stopped engine is replaced
    assert first.process_set_id is None, "a set of the old engine still has an id"
    works(hvd.allreduce, np.ones(3), "numpy.bare")
    again = hvd.add_process_set([0])  # the same ranks as before the failure: no "already exists"
    assert again.process_set_id is not None and again.ranks == [0]
    if RANK == 0:
        assert hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=again).tolist() == [1.0, 1.0]
    assert hvd.broadcast_object({"rank": RANK}, root_rank=SIZE - 1) == {"rank": SIZE - 1}
    hvd.remove_process_set(again)


def test_shutdown_then_init_after_a_fatal_error():
    fatal_stall(hvd.allreduce, np.ones(3))
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()
    works(hvd.allreduce, np.ones(3), "numpy.shutdown")


def test_torch_api_after_a_fatal_error():
    fatal_stall(thvd.allreduce, torch.ones(3))
    thvd.init()
    works(thvd.allreduce, torch.ones(3), "torch.bare")
    handle = thvd.allreduce_async(torch.ones(3), op=thvd.Sum, name="torch.async")
    assert thvd.synchronize(handle).tolist() == [float(SIZE)] * 3
    thvd.shutdown()
    thvd.init()
    works(thvd.allreduce, torch.ones(3), "torch.shutdown")
    assert thvd.join() in range(SIZE)
