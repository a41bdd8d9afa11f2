"""DistributedOptimizer, broadcasts of parameters/optimizer state/objects and SyncBatchNorm,
checked against one process training on the concatenated batch: run by every rank of
``mpirun -np N python -m pytest`` (test_torch_parallel.py)."""

import os
import warnings

import pytest
import torch
from torch import nn

import hpc_horovod.torch as hvd

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()


@pytest.fixture(autouse=True)
def _job():
    hvd.init()  # a new engine after a check that stopped it
BATCH = 4  # per rank
STEPS = 4


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def data(step):
    """The global batch of a step; rank r trains on rows [r*BATCH, (r+1)*BATCH)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(N * BATCH, 6, generator=g), torch.randn(N * BATCH, 3, generator=g)


def mine(tensor):
    return tensor[R * BATCH:(R + 1) * BATCH]


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference(make_opt, steps=STEPS):
    model = make_model()
    opt = make_opt(model.parameters())
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return model


def distributed(make_opt, steps=STEPS, passes=1, **kwargs):
    model = make_model(seed=R)  # different on every rank until the broadcast
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(steps):
        x, y = data(step)
        x, y = mine(x), mine(y)
        opt.zero_grad()
        for part in range(passes):  # micro-batches accumulated locally
            rows = slice(part * BATCH // passes, (part + 1) * BATCH // passes)
            (loss_fn(model, x[rows], y[rows]) / passes).backward()
        opt.step()
    return model, opt


def assert_identical_on_all_ranks(model, what):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    for r in range(N):
        assert torch.equal(gathered[r], flat), f"{what}: rank {r} differs from rank {R}"


def assert_close(model, ref, atol, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p - q).abs().max().item()
        assert err <= atol, f"{what}: {name} differs from one process by {err:g} > {atol:g}"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


EQUIVALENCE = [
    ("SGD+momentum", sgd, {}, 1e-5),
    ("Adam", adam, {}, 1e-5),
    ("SGD, backward_passes_per_step=2", sgd, {"passes": 2}, 1e-5),
    ("Adam, backward_passes_per_step=2", adam, {"passes": 2}, 1e-5),
    ("SGD, fp16 compression", sgd, {"compression": hvd.Compression.fp16}, 2e-3),
    ("Adam, fp16 compression", adam, {"compression": hvd.Compression.fp16}, 5e-3),
    ("SGD, gradient_predivide_factor=2", sgd, {"gradient_predivide_factor": 2.0}, 1e-5),
    ("SGD, groups=2", sgd, {"groups": 2}, 1e-5),
    ("SGD, op=Sum with lr/N", lambda p: torch.optim.SGD(p, lr=0.1 / N), {"op": hvd.Sum}, 1e-5),
]


@pytest.mark.parametrize("what, make_opt, kwargs, atol", EQUIVALENCE,
                         ids=[case[0] for case in EQUIVALENCE])
def test_equivalence(what, make_opt, kwargs, atol):
    if "op" in kwargs:
        ref = reference(lambda p: torch.optim.SGD(p, lr=0.1))
    else:
        ref = reference(make_opt)
    model, _ = distributed(make_opt, **kwargs)
    assert_close(model, ref, atol, what)
    assert_identical_on_all_ranks(model, what)


def bucketed_run(cap, set_to_none_steps=(0,), compression=hvd.Compression.none):
    """Train a model of two dtypes and a channels_last convolution with buckets of ``cap``
    bytes (``HOROVOD_BUCKET_BYTES``, read at ``init``); return the model, the optimizer and
    what the checks found on the way."""
    hvd.shutdown()
    os.environ["HOROVOD_BUCKET_BYTES"] = str(cap)
    try:
        hvd.init()
        torch.manual_seed(0)
        conv = nn.Conv2d(2, 3, 3).to(memory_format=torch.channels_last)
        head, wide = nn.Linear(12, 4), nn.Linear(4, 2).double()
        params = list(conv.parameters()) + list(head.parameters()) + list(wide.parameters())
        names = [(f"p{i}", p) for i, p in enumerate(params)]
        before, accumulated_in_views = {}, []
        for p in params:  # runs before the optimizer's hook: is p.grad the last step's view?
            p.register_post_accumulate_grad_hook(
                lambda p: accumulated_in_views.append(p.grad is before[p]))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                       named_parameters=names, compression=compression)
    finally:
        del os.environ["HOROVOD_BUCKET_BYTES"]
    found = {"grads kept": []}
    for step in range(4):
        g = torch.Generator().manual_seed(50 + step)
        x = torch.randn(N * 2, 2, 4, 4, generator=g).to(memory_format=torch.channels_last)
        x = x[2 * R:2 * R + 2]
        before.update((p, p.grad) for p in params)
        accumulated_in_views.clear()
        opt.zero_grad(set_to_none=step in set_to_none_steps)
        out = wide(torch.tanh(head(conv(x).flatten(1))).double())
        out.pow(2).mean().backward()
        found.setdefault("submitted in backward", set(opt._handles) == set(opt._buckets))
        found["grads kept"].append(all(accumulated_in_views))
        assert len(accumulated_in_views) == len(params)
        opt.step()
    return params, opt, found


@pytest.fixture
def default_knobs_after():
    """bucketed_run's init read its own HOROVOD_BUCKET_BYTES: the next check starts afresh."""
    yield
    hvd.shutdown()


def same(p, q, rtol=1e-6):
    """Equal bits on 2 ranks (a sum of two does not depend on the order), close on more (the
    engine may add three ranks' values in any order)."""
    return torch.equal(p, q) if N == 2 else torch.allclose(p, q, rtol=rtol, atol=rtol)


CAPS = (0, 200, 25 * 1024 * 1024)


@pytest.mark.parametrize("cap", CAPS)
def test_bucket_layout(cap, default_knobs_after):
    """Buckets: reverse parameter order, one dtype each, one request each, gradients are views
    of the flat tensor (kept across steps when zero_grad keeps them)."""
    params, opt, found = bucketed_run(cap)
    assert found["submitted in backward"], cap
    # step 0 has no views yet, then zero_grad(set_to_none=False) zeroes them in place
    assert found["grads kept"] == [False, True, True, True], found
    for bucket in opt._buckets:
        assert len({(p.dtype, p.device) for p in bucket.params}) == 1
        for p in bucket.params:
            assert p.grad.untyped_storage().data_ptr() == \
                bucket.flat.untyped_storage().data_ptr(), (cap, opt._parameter_names[p])
    order = [p for b in opt._buckets for p in b.params]
    assert sorted(map(id, order)) == sorted(map(id, params))
    if cap == 0:  # one parameter per bucket, last parameter first
        assert [b.params for b in opt._buckets] == [[p] for p in params[::-1]]
    if cap == 25 * 1024 * 1024:  # one bucket per dtype
        assert len(opt._buckets) == 2, [len(b.params) for b in opt._buckets]
    conv_weight = params[0]
    assert conv_weight.grad.is_contiguous(memory_format=torch.channels_last)


def test_bucket_size_does_not_change_the_result(default_knobs_after):
    results = {cap: bucketed_run(cap)[0] for cap in CAPS}
    for cap in CAPS[1:]:
        for p, q in zip(results[cap], results[0]):
            assert same(p, q), f"bucket size {cap} changed the result"
    assert_identical_on_all_ranks(nn.ParameterList(results[200]), "buckets")


def test_buckets_with_set_to_none(default_knobs_after):
    """set_to_none every step (torch's default), as DDP's gradient_as_bucket_view: the
    gradients are None until autograd hands the new ones over, the bucket copies them in and
    they are its views again after the step; same result as accumulating into the views."""
    kept = bucketed_run(200)[0]
    params, opt, found = bucketed_run(200, set_to_none_steps=range(4))
    assert found["grads kept"] == [False] * 4, found  # never added to zeros
    for bucket in opt._buckets:
        assert all(p.grad is view for p, view in zip(bucket.params, bucket.views))
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    assert all(same(p, q) for p, q in zip(params, kept))


def test_buckets_with_fp16_compression(default_knobs_after):
    """fp16 compression per bucket: as per tensor (float16 sums are rounded where the engine's
    path for the group's size scales them, so not to the bit)."""
    compressed = [bucketed_run(cap, compression=hvd.Compression.fp16)[0] for cap in (0, 200)]
    assert all(torch.allclose(p, q, rtol=1e-3, atol=1e-3) for p, q in zip(*compressed))


def test_bad_bucket_size_is_named(monkeypatch):
    hvd.shutdown()
    monkeypatch.setenv("HOROVOD_BUCKET_BYTES", "25MB")
    with pytest.raises(ValueError, match=r"HOROVOD_BUCKET_BYTES='25MB' is not a valid int"):
        hvd.init()


def test_channels_last():
    """Gradients in a channels_last layout are not contiguous: reduced through a copy."""
    def make():
        torch.manual_seed(0)
        return nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(N * 2, 2, 5, 5, generator=g).to(memory_format=torch.channels_last)
    ref, model = make(), make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref(x).pow(2).mean().backward()
    ref_opt.step()
    model(x[2 * R:2 * R + 2]).pow(2).mean().backward()
    assert not model.weight.grad.is_contiguous()
    opt.step()
    assert_close(model, ref, 1e-6, "channels_last")
    assert model.weight.grad.is_contiguous(memory_format=torch.channels_last)


def test_missing_gradients():
    """A branch only rank 0 uses: its gradient is None elsewhere, yet nobody deadlocks and
    every rank applies rank 0's gradient divided by N."""
    torch.manual_seed(0)
    shared, branch = nn.Linear(2, 1), nn.Linear(2, 1)
    model = nn.ModuleDict({"shared": shared, "branch": branch})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = branch.weight.detach().clone()
    x = torch.ones(1, 2)
    out = shared(x)
    if R == 0:
        out = out + branch(x)
    opt.zero_grad()
    out.sum().backward()
    opt.step()
    assert torch.allclose(branch.weight, before - 1.0 / N), (branch.weight, before)
    assert_identical_on_all_ranks(model, "missing gradients")


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients(sparse_as_dense):
    torch.manual_seed(0)
    ref = nn.Embedding(10, 3, sparse=True)
    model = nn.Embedding(10, 3, sparse=True)
    model.load_state_dict(ref.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ids = torch.tensor([[r, r + 1] for r in range(N)])
    ref_opt.zero_grad()
    ref(ids).sum().div(N).backward()
    ref_opt.step()
    opt.zero_grad()
    model(ids[R:R + 1]).sum().backward()
    opt.step()
    assert torch.allclose(model.weight, ref.weight, atol=1e-6), sparse_as_dense


def fresh_optimizer():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = data(0)
    return model, opt, mine(x), mine(y)


def test_synchronize_clip_and_skip_synchronize():
    model, opt, x, y = fresh_optimizer()
    loss_fn(model, x, y).backward()
    with pytest.raises(AssertionError,
                       match=r"before optimizer.step\(\) or optimizer.synchronize\(\)"):
        opt.zero_grad()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    norm = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert norm <= 0.0100001, norm
    with opt.skip_synchronize():
        opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.synchronize()
        opt.step()  # synchronize() then step() without skip_synchronize: Horovod warns
    assert any("skip_synchronize" in str(w.message) for w in caught), caught


def test_second_backward_before_step():
    """backward_passes_per_step=1 allows one backward pass per step."""
    model, opt, x, y = fresh_optimizer()
    loss_fn(model, x, y).backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        loss_fn(model, x, y).backward()
    opt.synchronize()  # drain the first pass's handles


BAD_NAMES = {
    "duplicates": (lambda ps: [("w", ps[0][1]), ("w", ps[1][1])] + ps[2:],
                   "Parameter names in named_parameters must be unique. Found duplicates: w"),
    "unnamed": (lambda ps: ps[:1], "named_parameters was specified, but one or more model "
                                   "parameters were not named"),
    "not tuples": (lambda ps: [p for _, p in ps],
                   "named_parameters should be a sequence of tuples"),
}


@pytest.mark.parametrize("case", BAD_NAMES)
def test_bad_named_parameters(case):
    make_bad, text = BAD_NAMES[case]
    model = make_model()
    bad = make_bad(list(model.named_parameters()))
    with pytest.raises(ValueError) as caught:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=bad)
    assert text in str(caught.value), caught.value


def test_predivide_with_sum_is_refused():
    model = make_model()
    with pytest.raises(ValueError,
                       match="gradient_predivide_factor not supported with op != Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)


def test_the_wrapper_is_the_wrapped_class():
    _, opt, _, _ = fresh_optimizer()
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"


def test_broadcast_state_of_fresh_optimizers():
    """Every rank fresh: the state stays empty (no hidden step), parameters do not move."""
    model = make_model(seed=R)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1 * (R + 1), weight_decay=0.5)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert not opt.state
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.param_groups[0]["lr"] == 0.1, opt.param_groups[0]["lr"]


def test_broadcast_state_of_a_resumed_root():
    """The root resumed (has state), the others are fresh: they receive the root's state."""
    model = make_model()
    base = torch.optim.Adam(model.parameters(), lr=0.01)
    if R == 0:
        for step in range(3):
            x, y = data(step)
            loss_fn(model, x, y).backward()
            base.step()
            base.zero_grad()
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for p in model.parameters():
        state = opt.state[p]
        assert float(state["step"]) == 3.0, state["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            gathered = hvd.allgather(state[key].unsqueeze(0))
            assert all(torch.equal(g, state[key]) for g in gathered), key
        assert p.grad is None or not p.grad.abs().sum()


def test_broadcast_and_allgather_objects():
    obj = hvd.broadcast_object({"epoch": 7, "rank": R} if R == 0 else None, root_rank=0)
    assert obj == {"epoch": 7, "rank": 0}, obj
    assert hvd.allgather_object(("r", R)) == [("r", r) for r in range(N)]


def test_sync_batch_norm():
    g = torch.Generator().manual_seed(5)
    x_all = torch.randn(N * 3, 4, 5, 5, generator=g, dtype=torch.float64) * 2 + 1
    w_out = torch.randn(N * 3, 4, 5, 5, generator=g, dtype=torch.float64)
    ref = nn.BatchNorm2d(4).double()
    sync = hvd.SyncBatchNorm(4).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-1, 1)
    sync.load_state_dict(ref.state_dict())
    xr = x_all.clone().requires_grad_(True)
    ref_out = ref(xr)
    (ref_out * w_out).sum().backward()
    xs = x_all[R * 3:(R + 1) * 3].clone().requires_grad_(True)
    out = sync(xs)
    (out * w_out[R * 3:(R + 1) * 3]).sum().backward()
    rows = slice(R * 3, (R + 1) * 3)
    assert torch.allclose(out, ref_out[rows], atol=1e-10)
    assert torch.allclose(xs.grad, xr.grad[rows], atol=1e-10), (xs.grad - xr.grad[rows]).abs().max()
    for mine_grad, ref_param in ((sync.weight.grad, ref.weight), (sync.bias.grad, ref.bias)):
        total = hvd.allreduce(mine_grad, op=hvd.Sum)
        assert torch.allclose(total, ref_param.grad, atol=1e-10)
    assert torch.allclose(sync.running_mean, ref.running_mean, atol=1e-10)
    assert torch.allclose(sync.running_var, ref.running_var, atol=1e-10)
    assert int(sync.num_batches_tracked) == 1
    sync.eval()
    ref.eval()
    assert torch.allclose(sync(xs.detach()), ref(x_all)[rows], atol=1e-10)


@pytest.mark.skipif(N != 2, reason="the pairwise formula of two ranks")
def test_adasum():
    """Adasum combines each rank's parameter update: check the pairwise formula for 2 ranks."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    start = model.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    x = torch.tensor([[1.0, 2.0, 3.0]]) * (R + 1) + torch.tensor([[R, 0.0, -R]])
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    deltas = hvd.allgather(-0.1 * x)  # each rank's SGD update of the weight
    a, b = deltas[0].double(), deltas[1].double()
    dot = a @ b
    combined = (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b
    assert torch.allclose(model.weight.detach().double(), start.double() + combined,
                          atol=1e-6), (model.weight, start + combined)


