"""Start every rank from the same model and optimizer state: broadcasts of parameters, of an
optimizer's state, and of any picklable object."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..common.basics import ProcessSet, global_process_set
from ..common.ops import allgather_object, broadcast_object, synchronous
from .mpi_ops import broadcast_async_, synchronize


@synchronous
def broadcast_parameters(params, root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite tensors in place with ``root_rank``'s values.

    ``params``: ``model.state_dict()`` (a dict, broadcast in key order),
    ``model.named_parameters()`` or ``model.parameters()``.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: entry {name!r} is a "
                            f"{type(tensor).__name__}, not a tensor; broadcast it with "
                            "broadcast_object")
    handles = [broadcast_async_(tensor, root_rank, name, process_set)
               for name, tensor in items]
    for handle in handles:
        synchronize(handle)


def _zero_gradient(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    grad = torch.zeros_like(p)
    return grad.to_sparse() if isinstance(optimizer, torch.optim.SparseAdam) else grad


def _zero_missing_gradients(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = _zero_gradient(optimizer, p)


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has not stepped yet: one step on zero gradients,
    after which parameters and gradients are restored (so weight decay leaves no trace)."""
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                saved.append((p, p.detach().clone(), p.grad))
                p.grad = _zero_gradient(optimizer, p)
    # A DistributedOptimizer's own step would allreduce, which every rank would have to join.
    step = getattr(optimizer, "_local_step", optimizer.step)
    step()
    with torch.no_grad():
        for p, data, grad in saved:
            p.copy_(data)
            p.grad = grad


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters (e.g. after the root
    resumed from a checkpoint). Works for optimizers that have not stepped yet; on such a rank,
    every parameter that requires grad and has none gets a zero gradient afterwards (as in
    Horovod, whose state initialization leaves them), while the parameters and the state stay
    untouched."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state:
        _zero_missing_gradients(optimizer)
    root_has_state = broadcast_object(bool(optimizer.state), root_rank,
                                      name="optimizer_state.has_state", process_set=process_set)
    if root_has_state and not optimizer.state:
        _initialize_state(optimizer)
    elif not root_has_state:
        optimizer.state.clear()

    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, object] = {}
    setters = {}
    occurrences: dict[str, int] = {}
    for index, group in enumerate(optimizer.param_groups):
        for option, value in group.items():
            if option != "params":
                key = f"{option}.{index}"
                scalars[key] = value
                setters[key] = (group, option)
        for p in group["params"]:
            state = optimizer.state.get(p)
            for name, value in (state or {}).items():
                occurrences[name] = occurrences.get(name, 0) + 1
                key = f"{name}.{occurrences[name]}"
                if torch.is_tensor(value):
                    tensors.append((key, value))
                else:
                    scalars[key] = value
                    setters[key] = (state, name)

    layout = ([(key, tuple(t.shape), str(t.dtype)) for key, t in tensors], sorted(scalars))
    layouts = allgather_object(layout, name="optimizer_state.layout", process_set=process_set)
    root_layout = layouts[process_set.rank_of(root_rank)]
    if any(layout != root_layout for layout in layouts):
        ranks = process_set.ranks or list(range(len(layouts)))
        bad = [ranks[i] for i, layout in enumerate(layouts) if layout != root_layout]
        raise ValueError(f"broadcast_optimizer_state: the optimizer state of rank(s) {bad} does "
                         f"not have the layout of root rank {root_rank} (different parameters "
                         "or optimizer classes?)")
    broadcast_parameters(tensors, root_rank, process_set=process_set)
    for key, value in broadcast_object(scalars, root_rank, name="optimizer_state.scalars",
                                       process_set=process_set).items():
        container, name = setters[key]
        container[name] = value
