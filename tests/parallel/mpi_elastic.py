"""Run by every rank of ``mpirun -np N python -m pytest`` (test_elastic.py): what
``hvd.elastic`` states do across ranks, in Horovod's terms: ``sync`` gives every rank rank 0's
model, optimizer, sampler and objects; ``restore`` after ``commit`` brings back each rank's own
commit; ``check_host_updates`` raises on every rank when rank 0 was told; ElasticSampler
shares an epoch among the ranks with nothing twice."""

from __future__ import annotations

import pytest
import torch

import hpc_horovod.torch as hvd

hvd.init()
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()


def _training():
    torch.manual_seed(RANK)  # different on every rank until synced
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (RANK + 1), momentum=0.9)
    optimizer.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_sync_gives_every_rank_rank_0s_state():
    model, optimizer = _training()
    sampler = hvd.elastic.ElasticSampler(list(range(10)), seed=RANK)
    sampler.processed_num = 2 * RANK
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, batch=20 + RANK,
                                   epoch=10 + RANK)
    state.sync()
    weights = hvd.allgather_object([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for w in weights for a, b in zip(w, weights[0]))
    assert (state.batch, state.epoch) == (20, 10)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    buffers = hvd.allgather_object(optimizer.state_dict()["state"][0]["momentum_buffer"])
    assert all(torch.equal(b, buffers[0]) for b in buffers)
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 0}


def test_restore_brings_back_this_ranks_commit():
    model, optimizer = _training()
    state = hvd.elastic.TorchState(model, optimizer, batch=0)
    state.sync()
    state.batch = RANK
    state.commit()
    committed = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    state.batch = 99
    state.restore()
    assert torch.equal(model.weight, committed) and state.batch == RANK


def test_host_updates_interrupt_every_rank_when_rank_0_was_told():
    state = hvd.elastic.ObjectState(epoch=0)
    if RANK == 0:
        state.on_hosts_updated(5.0, False)
    with pytest.raises(hvd.HostsUpdatedInterrupt) as caught:
        state.check_host_updates()
    assert caught.value.skip_sync is False
    if RANK != 0:
        state.on_hosts_updated(9.0, True)  # only rank 0's notices count
    state.check_host_updates()


def test_the_sampler_shares_an_epoch_with_nothing_twice():
    sampler = hvd.elastic.ElasticSampler(list(range(25)), shuffle=True, seed=4)
    mine = list(sampler)
    every = hvd.allgather_object(mine)
    assert all(len(part) == len(mine) for part in every)
    seen = [i for part in every for i in part]
    assert set(seen) == set(range(25)) and len(seen) - 25 < SIZE  # padding only
    sampler.record_batch(0, 2)
    assert sampler.processed_num == 2 * SIZE
    sampler.reset()
    rest = [i for part in hvd.allgather_object(list(sampler)) for i in part]
    first = [every[r][b] for b in range(2) for r in range(SIZE)]
    assert set(rest) == set(range(25)) - set(first)
