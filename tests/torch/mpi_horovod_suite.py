"""What Horovod's own torch test suite expects of ``horovod.torch``, checked against
hpc_horovod.torch in our own words: error types of mismatched ranks, handles, sparse
allreduce handles, scaled grouped reducescatter, join, barriers, objects on process sets, and
``DistributedOptimizer`` with every torch optimizer. Run by every rank of
``mpirun -np N python -m pytest`` (test_torch_parallel.py).
"""

import inspect
import itertools
import json
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpc_horovod.torch as hvd
from hpc_horovod.common.topology import detect

torch.set_num_threads(1)
JOB = detect()  # the sets must exist before init
R, N = JOB.rank, max(JOB.size, 2)  # (a process alone only collects the checks)
EVEN = [r for r in range(N) if r % 2 == 0]
ODD = [r for r in range(N) if r % 2 == 1]
EVEN_SET, ODD_SET = hvd.ProcessSet(EVEN), hvd.ProcessSet(ODD)


@pytest.fixture(autouse=True)
def _job():
    hvd.init(process_sets=[EVEN_SET, ODD_SET])  # a new engine after a check that stopped it


def raises(kinds, fn, what, *args, **kwargs):
    """``fn(*args, **kwargs)`` must raise one of ``kinds`` (a type or a tuple of them)."""
    try:
        fn(*args, **kwargs)
    except kinds as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - the wrong type is the failure reported
        raise AssertionError(f"{what}: raised {type(exc).__name__}: {exc}, expected "
                             f"{kinds}") from exc
    raise AssertionError(f"{what}: did not raise")


# -- mismatches between ranks: RuntimeError; misuse on one rank: ValueError ------------------------

def mismatched():
    """Tensors of a different shape, rank of shape or dtype on some ranks."""
    odd_shape = torch.ones([17 + R] * 3)
    same_numel = torch.ones(17, 23 * 57) if R == 0 else torch.ones(17, 23, 57)
    odd_type = torch.ones(17, 17, dtype=torch.int32 if R % 2 == 0 else torch.float32)
    return odd_shape, same_numel, odd_type


def still_usable():
    """The engine is still usable after the errors."""
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [N, N]


@pytest.mark.parametrize("op_name", ["allreduce", "reducescatter"])
def test_reduction_mismatch_errors(op_name):
    odd_shape, same_numel, odd_type = mismatched()
    op = hvd.allreduce if op_name == "allreduce" else lambda t: hvd.reducescatter(t, op=hvd.Sum)
    raises(RuntimeError, op, f"{op_name} of different shapes", odd_shape)
    raises(RuntimeError, op, f"{op_name} of different ranks of shape", same_numel)
    raises(RuntimeError, op, f"{op_name} of different dtypes", odd_type)
    still_usable()


def test_other_mismatch_errors():
    odd_shape, _, odd_type = mismatched()
    raises(RuntimeError, lambda: hvd.grouped_allreduce([torch.ones(3), odd_shape]),
           "grouped allreduce with one tensor of different shapes")
    raises(RuntimeError, lambda: hvd.allgather(torch.ones(17, 17 + R, 17)),
           "allgather of different trailing dimensions")
    raises(RuntimeError, lambda: hvd.allgather(odd_type), "allgather of different dtypes")
    raises(RuntimeError, lambda: hvd.broadcast(odd_shape, 0), "broadcast of different shapes")
    raises(RuntimeError, lambda: hvd.broadcast(odd_type, 0), "broadcast of different dtypes")
    raises(RuntimeError, lambda: hvd.broadcast(torch.ones(3), R),
           "broadcast with different root ranks")
    raises(RuntimeError, lambda: hvd.alltoall(torch.ones(2 * N, 10 * (R + 1), 2)),
           "alltoall of different trailing dimensions")
    raises(RuntimeError, lambda: hvd.alltoall(odd_type[:N * 2]), "alltoall of different dtypes")
    still_usable()


def test_own_argument_errors():
    """Checks on one rank's own arguments."""
    raises(ValueError, lambda: hvd.alltoall(torch.empty(N + 1)),
           "alltoall without splits of a length the ranks do not divide")
    raises(ValueError, lambda: hvd.alltoall(torch.empty(N - 1), torch.ones(N, dtype=torch.int32)),
           "alltoall with splits summing past the first dimension")
    raises(ValueError, lambda: hvd.alltoall(torch.empty(N), torch.ones(N)),
           "alltoall with float splits (that would add up)")
    for scalar_op in (lambda: hvd.reducescatter(torch.tensor(float(R))),
                      lambda: hvd.grouped_reducescatter([torch.tensor(float(R))])):
        raises((RuntimeError, ValueError), scalar_op, "reducescatter of a scalar")
    still_usable()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float64,
                                   torch.float16], ids=str)
def test_reducescatter_adasum_is_refused(dtype):
    raises(RuntimeError, hvd.reducescatter, "reducescatter Adasum",
           torch.ones(N * 4, 3, dtype=dtype), op=hvd.Adasum)
    still_usable()


SUBMITS = {
    "allreduce_async": lambda t: hvd.allreduce_async(t, name="dup.allreduce"),
    "allgather_async": lambda t: hvd.allgather_async(t, name="dup.allgather"),
    "broadcast_async": lambda t: hvd.broadcast_async(t, 0, name="dup.broadcast"),
    "reducescatter_async": lambda t: hvd.reducescatter_async(t, name="dup.rs"),
}


@pytest.mark.parametrize("what", SUBMITS)
def test_duplicate_names(what):
    """A second op under a pending op's name raises ValueError on that rank, at once."""
    tensor = torch.ones(4, 4)
    submit = SUBMITS[what]
    handles = []
    if R == 0:
        handles.append(submit(tensor))
        raises(ValueError, submit, f"{what} under a pending name", tensor)
    hvd.barrier()
    if R > 0:
        handles.append(submit(tensor))
        raises(ValueError, submit, f"{what} under a pending name", tensor)
    for handle in handles:
        hvd.synchronize(handle)
    hvd.barrier()


# -- handles --------------------------------------------------------------------------------------

def test_handles():
    tensors = [torch.full([17] * dim, float(R), dtype=dtype)
               for dtype in (torch.int32, torch.int64, torch.float32, torch.float64)
               for dim in (1, 2, 3)]
    # rank 0 submits first and polls while the others wait in a barrier, so none of its ops
    # can have finished: poll() must say so, and the barrier must pass the pending ops by
    if R == 0:
        handles = [hvd.allreduce_async(t, op=hvd.Sum) for t in tensors]
        assert not any(hvd.poll(h) for h in handles), "poll() said an op had finished before " \
            "every rank submitted it"
        hvd.barrier()
    else:
        hvd.barrier()
        handles = [hvd.allreduce_async(t, op=hvd.Sum) for t in tensors]
    for t, h in zip(tensors, handles):
        assert torch.equal(hvd.synchronize(h), torch.full_like(t, N * (N - 1) // 2))
    # a barrier does not disturb pending collectives
    eye = torch.eye(5)
    handles = [hvd.broadcast_async(torch.eye(3), root_rank=0), hvd.allgather_async(eye),
               hvd.allgather_async(torch.zeros(5, 5)), hvd.allreduce_async(eye)]
    hvd.barrier()
    outputs = [hvd.synchronize(h) for h in handles]
    assert torch.equal(outputs[-1], eye) and outputs[1].shape == (5 * N, 5)


def random_sparse(rows, generator):
    dense = torch.rand(rows, 10, generator=generator)
    dense[dense < 0.8] = 0
    return dense.to_sparse()


@pytest.mark.parametrize("where", ["global", "process set"])
def test_sparse_allreduce(where):
    """``sparse_allreduce_async`` returns a callable giving the reduced sparse tensor."""
    g = torch.Generator().manual_seed(100 + R)
    process_set = hvd.global_process_set if where == "global" else \
        EVEN_SET if R % 2 == 0 else ODD_SET
    tensors = [random_sparse(rows, g) for rows in (17, 32, 81, 12, 15, 23, 22)]
    dense = [hvd.allreduce(t.to_dense(), process_set=process_set) for t in tensors]
    handles = [hvd.sparse_allreduce_async(t, op=hvd.Average, name=f"sparse.{i}",
                                          process_set=process_set)
               for i, t in enumerate(tensors)]
    assert all(callable(h) for h in handles)
    for want, handle in zip(dense, handles):
        got = handle()
        assert got.is_sparse and torch.allclose(want, got.to_dense(), atol=1e-6)


def test_sparse_allreduce_through_synchronize_with_sum():
    g = torch.Generator().manual_seed(200 + R)
    t = random_sparse(6, g)
    got = hvd.synchronize(hvd.sparse_allreduce_async(t, name="sparse.sum", op=hvd.Sum))
    assert torch.allclose(got.to_dense(), hvd.allreduce(t.to_dense(), op=hvd.Sum))


@pytest.mark.parametrize("mode", ["prescale_factor", "postscale_factor"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.float32,
                                   torch.float64], ids=str)
def test_grouped_reducescatter_scaling(dtype, mode):
    """Every tensor of a group is scaled like a single reducescatter, in Horovod's order: each
    rank's values prescaled (integers in float64 and truncated, float16 in float32 and
    rounded), summed, then postscaled."""
    ints = (torch.int32, torch.int64)
    for dim in (1, 2, 3):
        g = torch.Generator().manual_seed(1234)
        factor = 0.1 + 0.8 * torch.rand((), generator=g, dtype=torch.float64).item()
        tensors = [torch.randint(-100, 100, [N * 4] * dim, generator=g).to(dtype)
                   for _ in range(5)]
        got = hvd.grouped_reducescatter(tensors, op=hvd.Sum, **{mode: factor})
        single = [hvd.reducescatter(t, op=hvd.Sum, **{mode: factor}) for t in tensors]
        math = torch.float64 if dtype in ints else torch.float32 if dtype == torch.float16 \
            else dtype
        mine = slice(R * 4, (R + 1) * 4)
        # a sum of three float16 is rounded after each addition
        exact = N == 2 or dtype != torch.float16 or mode == "postscale_factor"
        for t, out, alone in zip(tensors, got, single):
            t = t.to(math)
            if mode == "prescale_factor":
                want = ((t * factor).to(dtype).to(math) * N)[mine]
            else:
                want = (t[mine] * N * factor).to(dtype).to(math)
            assert torch.equal(out, alone), (dtype, mode)
            assert torch.allclose(out.to(math), want, rtol=0 if exact else 2e-3), \
                (dtype, dim, mode, out, want)
        average = hvd.grouped_reducescatter(tensors, op=hvd.Average, postscale_factor=2.0)
        if dtype.is_floating_point:
            for t, out in zip(tensors, average):
                assert torch.allclose(out, 2.0 * t[mine]), (dtype, out)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float64],
                         ids=str)
def test_join_allreduce(dtype):
    """The ranks that did not join average with the joined rank's zeros; join() returns the
    same rank, the last to join, everywhere."""
    for dim, first, caching in itertools.product((1, 2, 3), range(N), (False, True)):
        g = torch.Generator().manual_seed(1234)
        a = torch.randint(-100, 100, [5] * dim, generator=g).to(dtype)
        b = torch.randint(-100, 100, [17] * dim, generator=g).to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # average=
            if caching:
                hvd.synchronize(hvd.allreduce_async(a, name="join.a", average=True))
                hvd.synchronize(hvd.allreduce_async(b, name="join.b", average=True))
            if R == first:
                last = hvd.join()
            else:
                ha = hvd.allreduce_async(a, name="join.a", average=True)
                hb = hvd.allreduce_async(b, name="join.b", average=True)
                got_a, got_b = hvd.synchronize(ha), hvd.synchronize(hb)
                last = hvd.join()
                for t, got in ((a, got_a), (b, got_b)):
                    if dtype.is_floating_point:
                        want = t * (N - 1) / N
                    else:
                        want = (t * (N - 1)).div(N, rounding_mode="trunc")
                    # Average scales before the sum: 1/3 is rounded first
                    exact = N == 2 or not dtype.is_floating_point
                    assert torch.allclose(got, want, rtol=0 if exact else 1e-6), (dtype, got)
        assert last != first, (last, first)
        assert hvd.allgather_object(last) == [last] * N


def test_objects_on_process_sets():
    this_set, ranks = (EVEN_SET, EVEN) if R % 2 == 0 else (ODD_SET, ODD)
    expected = {"hello": 123, 0: [1, 2]}
    obj = hvd.broadcast_object(expected if R == ranks[0] else {}, root_rank=ranks[0],
                               process_set=this_set)
    assert obj == expected, obj
    record = {"metric_val_1": R}
    if R == 1:
        record["metric_val_2"] = 42
    gathered = hvd.allgather_object(record)
    assert gathered == [{"metric_val_1": r, **({"metric_val_2": 42} if r == 1 else {})}
                        for r in range(N)], gathered


def test_barriers():
    """Barriers wait for rank 0's sleep, a process set's only for its own ranks."""
    start = time.monotonic()
    if R == 0:
        time.sleep(1.5)
    hvd.barrier()
    assert time.monotonic() - start >= 1.2  # the ranks leave the last barrier at about once
    start = time.monotonic()
    if R in EVEN:
        if R == 0:
            time.sleep(1.5)
        hvd.barrier(EVEN_SET)
        assert time.monotonic() - start >= 1.2
    else:
        hvd.barrier(ODD_SET)
        assert time.monotonic() - start < 1.2, "the odd set waited for rank 0"
    hvd.barrier()


# -- DistributedOptimizer with every torch optimizer -----------------------------------------------

OPTIONS = [dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2)]


def optimizer_classes():
    """The torch optimizers that take every parameter of a small MLP with default options
    (L-BFGS and SparseAdam are for other uses)."""
    classes = []
    for cls in sorted(torch.optim.Optimizer.__subclasses__(), key=lambda c: c.__name__):
        if not cls.__module__.startswith("torch.optim") or \
                cls in (torch.optim.LBFGS, torch.optim.SparseAdam):
            continue
        try:
            cls([nn.Parameter(torch.ones(3))], lr=0.1)
        except (ValueError, TypeError):  # e.g. Muon: 2-D parameters only
            continue
        classes.append(cls)
    return classes


def new_optimizer(cls, options, params, distributed=True, **kwargs):
    accepted = inspect.signature(cls.__init__).parameters
    opt = cls(params, **{k: v for k, v in options.items() if k in accepted})
    return hvd.DistributedOptimizer(opt, **kwargs) if distributed else opt


def mlp():
    return nn.Sequential(nn.Linear(20, 10), nn.ReLU(), nn.Linear(10, 10))


CLASSES = optimizer_classes()
BY_NAME = {cls.__name__: cls for cls in CLASSES}


@pytest.mark.parametrize("options", range(len(OPTIONS)), ids=["options", "lr"])
@pytest.mark.parametrize("name", BY_NAME)
def test_broadcast_state_every_optimizer(name, options):
    """After a step on rank 0, a checkpoint restored on rank 0 alone reaches every rank."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(16, 20, generator=g), torch.randn(16, 10, generator=g)
    cls, options = BY_NAME[name], OPTIONS[options]
    torch.manual_seed(R)
    model = mlp()
    opt = new_optimizer(cls, options, model.parameters(),
                        named_parameters=model.named_parameters())
    opt.zero_grad()
    F.mse_loss(model(x), y, reduction="sum").backward()
    opt.step()
    root_model = [hvd.broadcast(v, 0) for _, v in sorted(model.state_dict().items())]
    root_state = hvd.broadcast_object(opt.state_dict(), root_rank=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt.pt"
        if R == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        torch.manual_seed(100 + R)
        model = mlp()
        opt = new_optimizer(cls, options, model.parameters(),
                            named_parameters=model.named_parameters())
        if R == 0:
            checkpoint = torch.load(path)
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for want, (_, got) in zip(root_model, sorted(model.state_dict().items())):
        assert torch.equal(want, got), cls.__name__
    state = opt.state_dict()
    assert len(state["state"]) == len(root_state["state"]), cls.__name__
    for key, values in root_state["state"].items():
        for name, want in values.items():
            got = state["state"][key][name]
            assert type(got) is type(want), (cls.__name__, name, type(got), type(want))
            assert torch.equal(got, want) if torch.is_tensor(want) else got == want, \
                (cls.__name__, name)
    # training goes on from there on every rank alike
    opt.zero_grad()
    F.mse_loss(model(x), y, reduction="sum").backward()
    opt.step()


@pytest.mark.parametrize("name", BY_NAME)
def test_broadcast_state_options(name):
    """Hyper-parameters differ per rank; afterwards every rank has rank 0's, of the same types,
    and they still work in a step."""
    mine = [dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999),
                 etas=(0.8, 2.4), step_sizes=(1e-5, 100)),
            dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9),
                 etas=(0.25, 1.75), step_sizes=(1e-7, 5))]
    x, y = torch.randn(8, 20), torch.randn(8, 10)
    cls = BY_NAME[name]
    accepted = inspect.signature(cls.__init__).parameters
    model = mlp()
    opt = new_optimizer(cls, mine[min(R, 1)], model.parameters(),
                        named_parameters=model.named_parameters())
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(x), y, reduction="sum").backward()
        opt.step()
        if _ == 0:
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            for key, want in mine[0].items():
                if key not in accepted:
                    continue
                got = opt.param_groups[0][key]
                assert type(got) is type(want), (cls.__name__, key, got)
                assert got == want, (cls.__name__, key, got, want)


def test_broadcast_state_gradients():
    """A fresh optimizer: afterwards a parameter that requires grad has a zero gradient (which
    can be broadcast), one that does not keeps None; the state and the parameters are
    untouched."""
    class Indexed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
            self.b = nn.Parameter(torch.rand(4))

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x

    model = Indexed()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                        nesterov=True), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = model.b.detach().clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert model.a.grad is None
    grad = opt.param_groups[0]["params"][1].grad
    assert grad is not None and not grad.any()
    assert torch.equal(hvd.broadcast(grad, root_rank=0), grad)
    assert torch.equal(model.b, before) and not opt.state
    opt.zero_grad()
    model(torch.ones(2)).sum().backward()
    opt.step()


@pytest.mark.parametrize("options", range(len(OPTIONS)), ids=["options", "lr"])
@pytest.mark.parametrize("name", BY_NAME)
def test_missing_gradients_every_optimizer(name, options):
    """Rank 0 never uses fc3: its allreduce is still forced at step() and nobody waits."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(20, 10), nn.Linear(10, 10), nn.Linear(10, 10)

        def forward(self, x):
            x = F.relu(self.fc1(x))
            x1 = self.fc2(x)
            return x1, self.fc3(F.relu(x1))

    x, y = torch.randn(16, 20), torch.randn(16, 10)
    cls, options = BY_NAME[name], OPTIONS[options]
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = new_optimizer(cls, options, model.parameters(),
                        named_parameters=model.named_parameters())
    for _ in range(2):
        out1, out2 = model(x)
        loss = F.mse_loss(out1 if R == 0 else out2, y, reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert all(torch.equal(g, flat) for g in hvd.allgather(flat.unsqueeze(0))), cls.__name__


def test_dynamic_requires_grad():
    """Two optimizers, parameters switched on and off between steps (a GAN's loop)."""
    gen, disc = nn.Conv2d(1, 10, 1), nn.Conv2d(10, 1, 1)
    inp = torch.rand(1, 1, 16, 16)
    gen_opt = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1),
                                       named_parameters=gen.named_parameters())
    disc_opt = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                        named_parameters=disc.named_parameters())
    for _ in range(4):
        for train_gen in (True, False):
            for p in gen.parameters():
                p.requires_grad_(train_gen)
            for p in disc.parameters():
                p.requires_grad_(not train_gen)
            gen_opt.zero_grad()
            disc_opt.zero_grad()
            disc(gen(inp)).sum().backward()
            for module, trained in ((gen, train_gen), (disc, not train_gen)):
                for p in module.parameters():
                    assert trained == (p.grad is not None and bool(p.grad.max() != 0))
            (gen_opt if train_gen else disc_opt).step()


def test_clipping_and_warning():
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.zero_()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    opt.zero_grad()
    F.mse_loss(model(torch.ones(1, 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    prior = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert abs(model.weight.grad.item()) < abs(prior)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    F.mse_loss(model(torch.zeros(1, 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "optimizer.step() called without optimizer.skip_synchronize()" in \
        str(caught[0].message)


def test_unnamed_parameters():
    model = nn.Sequential(nn.Conv2d(1, 8, 1), nn.Conv2d(8, 1, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1))
    names = opt._parameter_names
    assert len(set(names.values())) == len(names) == 4
    assert hvd.allgather_object(set(names.values())) == [set(names.values())] * N
    opt.zero_grad()
    model(torch.rand(1, 1, 20, 20)).sum().backward()
    opt.step()


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embeddings(sparse_as_dense):
    model = nn.Embedding(10, 3, sparse=True)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(model.parameters()), lr=0.1),
                                   sparse_as_dense=sparse_as_dense)
    ids = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if R == 0 else \
        torch.tensor([[1, 3, 4], [4, 7, 9]])
    for _ in range(2):
        opt.zero_grad()
        model(ids).sum().backward()
        opt.step()
        assert model.weight.grad.is_sparse
    gathered = hvd.allgather(model.weight.detach().unsqueeze(0))
    assert all(torch.equal(g, model.weight) for g in gathered), sparse_as_dense


def test_optimizer_on_a_process_set():
    """Only the even ranks average; the odd ranks train alone."""
    this_set = EVEN_SET if R % 2 == 0 else ODD_SET
    torch.manual_seed(R)
    x, y = torch.randn(16, 20), torch.randn(16, 10)
    model = mlp()
    opt = new_optimizer(torch.optim.SGD, OPTIONS[0], model.parameters(),
                        named_parameters=model.named_parameters(), process_set=EVEN_SET)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt.zero_grad()
    F.mse_loss(model(x), y, reduction="sum").backward()
    opt.step()
    v = model.state_dict()["2.weight"]
    gathered = hvd.allgather(v.unsqueeze(0), process_set=this_set)
    for i, other in enumerate(gathered):
        if this_set is EVEN_SET:
            assert torch.equal(other, v)
        elif i != this_set.rank():
            assert not torch.allclose(other, v)


def test_timeline():
    """A timeline started and stopped at run time shows the op under its Horovod name
    (``allreduce.<name>``), its negotiation and, when asked, the engine's cycles."""
    with tempfile.TemporaryDirectory() as tmp:
        for i, mark_cycles in enumerate((True, False, True)):
            path = Path(tmp) / f"timeline{i}.json"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # best with HOROVOD_TIMELINE
                hvd.start_timeline(str(path), mark_cycles=mark_cycles)
            time.sleep(0.1)
            hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name="test_allreduce")
            time.sleep(0.1)
            hvd.stop_timeline()
            if R == 0:
                text = path.read_text()
                json.loads(text)
                for expected in ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", "ALLREDUCE"):
                    assert expected in text, (expected, text)
                assert ("CYCLE_START" in text) == mark_cycles, text


def test_reinit():
    rank, size = hvd.rank(), hvd.size()
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init(process_sets=[EVEN_SET, ODD_SET])
    assert hvd.is_initialized() and (hvd.rank(), hvd.size()) == (rank, size)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == N


