"""hvd.elastic for PyTorch in one process (a job of size 1): what a state commits, restores
and syncs, the reset callbacks' order, host updates, the durable commit the run wrapper resumes
from, and ElasticSampler's split of an epoch at several sizes and ranks."""

from __future__ import annotations

import atexit
import json
import pickle

import pytest

torch = pytest.importorskip("torch")

from support import single_process_job  # noqa: E402

import hpc_horovod.torch as hvd  # noqa: E402
from hpc_horovod.common import elastic as common_elastic  # noqa: E402
from hpc_horovod.torch.elastic import sampler as sampler_mod  # noqa: E402


@pytest.fixture
def single(monkeypatch):
    with single_process_job(hvd, monkeypatch) as job:
        yield job


def _training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def _step(model, optimizer):
    optimizer.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()


def test_restore_puts_back_the_last_commit(single):
    model, optimizer = _training()
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    _step(model, optimizer)
    state.epoch, state.batch = 1, 5
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    _step(model, optimizer)
    state.epoch, state.batch = 2, 7
    assert not torch.equal(model.weight, committed["weight"])
    state.restore()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in committed.items())
    assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], momentum)
    assert (state.epoch, state.batch) == (1, 5)


def test_sync_in_a_job_of_one_keeps_the_state(single):
    model, optimizer = _training()
    _step(model, optimizer)
    before = model.weight.detach().clone()
    state = hvd.elastic.TorchState(model, optimizer, epoch=3)
    state.sync()
    assert torch.equal(model.weight, before) and state.epoch == 3


def test_a_new_model_assigned_to_the_state_is_what_it_commits(single):
    model, optimizer = _training()
    state = hvd.elastic.TorchState(model, optimizer)
    other, _ = _training(seed=1)
    state.model = other
    with torch.no_grad():
        other.weight.add_(1.0)
    saved = other.weight.detach().clone()
    state.commit()
    with torch.no_grad():
        other.weight.zero_()
    state.restore()
    assert torch.equal(other.weight, saved)


def test_reset_runs_reset_then_the_callbacks_in_their_order(single):
    calls = []

    class Traced(hvd.elastic.ObjectState):
        def reset(self):
            calls.append("reset")

    state = Traced(epoch=0)
    state.register_reset_callbacks([lambda: calls.append("a"), lambda: calls.append("b")])
    state.register_reset_callbacks([lambda: calls.append("c")])
    state.on_reset()
    assert calls == ["reset", "a", "b", "c"]


def test_host_updates_interrupt_at_the_next_check_only(single):
    state = hvd.elastic.ObjectState(epoch=0)
    state.check_host_updates()  # nothing announced
    state.on_hosts_updated(1.0, True)
    with pytest.raises(hvd.HostsUpdatedInterrupt) as caught:
        state.commit()
    assert caught.value.skip_sync is True
    state.check_host_updates()  # already seen
    state.on_hosts_updated(0.5, False)  # older than the last one seen
    state.check_host_updates()


def test_the_wrapper_resumes_from_the_durable_commit_and_runs_the_callbacks(
        single, tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC_DIR", str(tmp_path))
    model, optimizer = _training()
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    _step(model, optimizer)
    state.epoch = 4
    state.commit()
    committed = model.weight.detach().clone()
    saved = pickle.loads((tmp_path / common_elastic.COMMIT_FILE).read_bytes())
    assert saved["objects"] == {"epoch": 4}
    assert torch.equal(saved["handlers"]["model"]["weight"], committed)

    # a restarted process: fresh objects, the commit on disk
    fresh_model, fresh_optimizer = _training(seed=7)
    fresh = hvd.elastic.TorchState(fresh_model, fresh_optimizer, epoch=0)
    resets = []
    fresh.register_reset_callbacks([lambda: resets.append(fresh.epoch)])

    @hvd.elastic.run
    def train(state, extra):
        return state.epoch, state.model.weight.detach().clone(), extra

    try:
        epoch, weight, extra = train(fresh, "x")
    finally:
        atexit.unregister(common_elastic.write_record)
    assert (epoch, extra) == (4, "x") and torch.equal(weight, committed)
    assert resets == [4], "the callbacks run once, after the commit was loaded"
    assert "momentum_buffer" in str(fresh_optimizer.state_dict()["state"][0].keys())
    world = json.loads((tmp_path / "ranks" / "world.json").read_text())
    assert len(world["hosts"]) == 1


def test_a_fresh_start_runs_no_reset_callback(single, tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC_DIR", str(tmp_path))
    state = hvd.elastic.ObjectState(epoch=0)
    state.register_reset_callbacks([lambda: pytest.fail("no reset happened")])
    try:
        assert hvd.elastic.run(lambda s: s.epoch)(state) == 0
    finally:
        atexit.unregister(common_elastic.write_record)


def test_an_error_of_the_script_is_recorded_as_a_failure_and_raised(single, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC_DIR", str(tmp_path))

    @hvd.elastic.run
    def train(state):
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        train(hvd.elastic.ObjectState(epoch=0))
    record = json.loads((tmp_path / "ranks" / "0.json").read_text())
    assert record["status"] == "failed" and "ValueError: bad batch" in record["reason"]


def test_without_an_elastic_launcher_commits_stay_in_memory_and_errors_propagate(
        single, tmp_path, monkeypatch):
    monkeypatch.delenv("HOROVOD_ELASTIC_DIR", raising=False)
    monkeypatch.chdir(tmp_path)

    @hvd.elastic.run
    def train(state):
        state.commit()
        raise hvd.HostsUpdatedInterrupt(False)

    with pytest.raises(hvd.HostsUpdatedInterrupt):
        train(hvd.elastic.ObjectState(epoch=0))
    assert list(tmp_path.iterdir()) == []


# -- ElasticSampler ------------------------------------------------------------------------------

def _as_rank(monkeypatch, rank, size):
    monkeypatch.setattr(sampler_mod, "size", lambda: size)
    monkeypatch.setattr(sampler_mod, "rank", lambda: rank)


def _samplers(monkeypatch, dataset, size, state=None, **kwargs):
    """One sampler per rank of a job of ``size`` (given ``state`` loaded, as a sync does)."""
    samplers = []
    for r in range(size):
        _as_rank(monkeypatch, r, size)
        samplers.append(hvd.elastic.ElasticSampler(dataset, **kwargs))
        if state is not None:
            samplers[-1].load_state_dict(state)
    return samplers


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_sampler_splits_an_epoch_evenly_over_the_ranks(monkeypatch, size, shuffle):
    dataset = list(range(10))
    samplers = _samplers(monkeypatch, dataset, size, shuffle=shuffle, seed=3)
    parts = [list(s) for s in samplers]
    assert all(len(p) == len(samplers[0]) == -(-10 // size) for p in parts)
    seen = [i for p in parts for i in p]
    assert set(seen) == set(range(10)) and len(seen) == len(samplers[0]) * size


@pytest.mark.parametrize("before, after", [(3, 2), (2, 3), (4, 1), (2, 2)])
def test_sampler_after_a_reset_shares_only_what_is_left_of_the_epoch(monkeypatch, before,
                                                                     after):
    dataset = list(range(23))
    first = _samplers(monkeypatch, dataset, before, seed=5)
    order = [i for batch in zip(*[list(s) for s in first]) for i in batch]
    for s in first:
        s.record_batch(0, 2)
        s.record_batch(1, 2)  # two batches of 2 on every rank
    done = 4 * before
    state = first[0].state_dict()
    assert state == {"epoch": 0, "processed_num": done}
    second = _samplers(monkeypatch, dataset, after, state=state, seed=5)
    rest = [i for s in second for i in s]
    assert set(rest) == set(range(23)) - set(order[:done])
    assert len(rest) == -(-(23 - done) // after) * after


def test_sampler_set_epoch_starts_a_new_order_with_nothing_processed(monkeypatch):
    (sampler,) = _samplers(monkeypatch, list(range(8)), 1, seed=1)
    sampler.record_batch(0, 4)
    assert list(sampler) == list(_samplers(monkeypatch, list(range(8)), 1, seed=1)[0])
    assert len(sampler) == 8  # record_batch changes what a reset leaves, not this iteration
    sampler.set_epoch(1)
    assert sampler.processed_num == 0 and sorted(sampler) == list(range(8))
    again = _samplers(monkeypatch, list(range(8)), 1, seed=1)[0]
    again.set_epoch(1)
    assert list(sampler) == list(again)
    unshuffled = _samplers(monkeypatch, list(range(8)), 1, shuffle=False)[0]
    assert list(unshuffled) == list(range(8))


def test_torch_state_tracks_the_sampler(single):
    sampler = hvd.elastic.ElasticSampler(list(range(6)), shuffle=False)
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0)
    sampler.record_batch(0, 2)
    state.commit()
    sampler.record_batch(1, 2)
    state.restore()
    assert sampler.processed_num == 2 and list(sampler) == [2, 3, 4, 5]
