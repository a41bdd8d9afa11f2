"""``DistributedOptimizer``: average gradients over ranks while ``backward()`` still runs.

The wrapper is a subclass of the wrapped optimizer's own class (as in Horovod), so
``isinstance`` checks, LR schedulers and ``state_dict`` keep working.

Gradients are reduced in buckets, as torch's DistributedDataParallel does: the parameters, in
reverse order (the order backward produces their gradients), fill buckets of one dtype on one
device, each closed once it holds ``HOROVOD_BUCKET_BYTES`` bytes (default 25 MiB; 1 MiB for the
first bucket of each dtype and device, so that the first reduction starts early). Each bucket
owns one flat tensor (in the node's shared window with the hierarchical host backend, see
``common.buckets``), and from its first reduction on every ``p.grad`` of the bucket is a view
into it when the step runs. A hook on each parameter counts the gradients as they are
accumulated; when the last one of a bucket arrives, the bucket's flat
tensor goes to the engine as one in-place allreduce, while autograd computes the gradients of
earlier layers. ``step()`` waits for the buckets and then runs the wrapped optimizer's update.
As with DDP's ``gradient_as_bucket_view``, ``zero_grad(set_to_none=False)`` zeroes each bucket
in one pass and keeps the views, so that backward accumulates into the bucket; with
``set_to_none=True`` (torch's default) the gradients become None, autograd hands each new
gradient over without adding it to zeros, and the bucket copies it in when it is submitted
(``p.grad`` becomes the view again): one copy costs less than zeroing the bucket and then
reading the zeros back in each accumulation. A gradient that is not a view of its bucket (the
first step, or one the user replaced) is copied in the same way. Sparse gradients are reduced
one tensor at a time.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from ..common import buckets
from ..common.basics import ProcessSet, global_process_set, size
from ..common.types import Adasum, Average
from .compression import Compression
from .functions import broadcast_object
from .mpi_ops import allreduce_async_, sparse_allreduce_async, synchronize

_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
_ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before "
                   "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                   "cause a race condition.")


def _parameter_names(optimizer: torch.optim.Optimizer, named_parameters) -> dict:
    """Parameter -> name, with Horovod's checks and default names."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                            for i, group in enumerate(optimizer.param_groups)
                            for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named_parameters:
        if name in seen:
            dups.add(name)
        seen.add(name)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found "
                         f"duplicates: {', '.join(sorted(dups))}")
    all_ids = {id(v) for group in optimizer.param_groups for v in group["params"]}
    unnamed = all_ids - {id(v) for _, v in named_parameters}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         f"not named. Python object ids: {', '.join(str(i) for i in unnamed)}")
    return {v: k for k, v in sorted(named_parameters, key=lambda item: item[0])}


def _dense_layout(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides cover its elements once without gaps (a permuted contiguous
    tensor, e.g. channels_last): a bucket view can then have the parameter's own strides."""
    expected = 1
    for stride, n in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= n
    return True


class _Bucket:
    """Gradients reduced together: one flat tensor, one engine request per reduction.

    The flat tensor is laid out at the bucket's first reduction, when every member's gradient
    is known: a member whose gradient is sparse leaves the bucket then (reduced on its own).
    """

    __slots__ = ("params", "name", "flat", "views", "ready", "densified", "process_set_id")

    def __init__(self, params: list, name: str, process_set_id: int):
        self.params = params
        self.name = name
        self.process_set_id = process_set_id
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.ready = 0  # members whose gradient is final for this step
        self.densified: list = []  # (param, view) of sparse gradients reduced as dense

    def lay_out(self) -> None:
        """One flat tensor for the members: in the node's shared window when the host backend
        has one and room is left (its allreduce then reads it where it lies), else of its own."""
        first = self.params[0]
        count = sum(p.numel() for p in self.params)
        memory = None
        if count and first.device.type == "cpu":
            memory = buckets.shared_memory(self.process_set_id, count * first.element_size())
        if memory is not None:
            self.flat = torch.frombuffer(memory, dtype=first.dtype, count=count)
            self.flat.zero_()
        else:
            self.flat = torch.zeros(count, dtype=first.dtype, device=first.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            if n and _dense_layout(p):
                view = self.flat.as_strided(p.shape, p.stride(), offset)
            else:
                view = self.flat[offset:offset + n].view(p.shape)
            self.views.append(view)
            offset += n

    def fill(self) -> None:
        """Make every member's gradient its view of the flat tensor (copying it in where it is
        elsewhere; zeros for a gradient this rank did not compute, as Horovod submits)."""
        self.densified.clear()
        for p, view in zip(self.params, self.views):
            grad = p.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
                p.grad = view
            elif grad.is_sparse:  # sparse_as_dense: reduced dense, handed back sparse
                view.copy_(grad.to_dense())
                self.densified.append((p, view))
            else:
                view.copy_(grad)
                p.grad = view


def _by_kind(params: list, cap: float, first_cap: float) -> list[list]:
    """``params`` in order, in buckets of one dtype and device (``common.buckets.assign``)."""
    items = [((p.dtype, p.device), p.numel() * p.element_size()) for p in params]
    return [[params[i] for i in bucket] for bucket in buckets.assign(items, cap, first_cap)]


class _DistributedOptimizer(torch.optim.Optimizer):
    _base_class: type  # the wrapped optimizer's class, set by DistributedOptimizer

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set):
        self._base_class.__init__(self, params)
        self._compression = compression
        self._parameter_names = _parameter_names(self, named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        # The engine applies 1/size for Average: prescale 1/f and postscale f split it.
        self._scales = ((1.0 / gradient_predivide_factor, gradient_predivide_factor)
                        if op == Average else (1.0, 1.0))
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        #: bucket or parameter reduced on its own -> (handle, compression context)
        self._handles: dict = {}
        self._hook_handles = []
        self._requires_update: list[torch.Tensor] = []
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict = {}  # parameter -> its bucket (None: reduced on its own)
        self._accumulating = False  # a hook fired since the last synchronize()
        self._synchronized = False
        self._should_synchronize = True
        if groups is not None:
            if isinstance(groups, list):
                grouped_ids = set()
                for group in groups:
                    for p in group:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in grouped_ids:
                            raise ValueError("A parameter can only appear once in groups.")
                        grouped_ids.add(id(p))
            elif not isinstance(groups, int) or groups <= 0:
                raise ValueError("groups should be a non-negative integer or a list of list of "
                                 "torch.Tensor.")
        self._groups = groups
        if self.process_set.included() and size() > 1:
            self._register_hooks()

    def _register_hooks(self) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self._groups is None:
            cap = buckets.bucket_bytes()
            groups = _by_kind(params[::-1], cap, min(cap, buckets.FIRST_BUCKET_BYTES))
        else:
            # Every rank must form the same groups: order the parameters as rank 0 does.
            order = broadcast_object([self._parameter_names[p] for p in params], root_rank=0,
                                     name="DistributedOptimizer.order",
                                     process_set=self.process_set)
            params.sort(key=lambda p: order.index(self._parameter_names[p]))
            if isinstance(self._groups, list):
                listed = {id(p) for group in self._groups for p in group}
                p_groups = [[p for p in group if any(p is q for q in params)]
                            for group in self._groups]
                p_groups += [[p] for p in params if id(p) not in listed]
            else:
                p_groups = buckets.split(params, self._groups)
            # a group is reduced as one bucket of each dtype and device it holds
            groups = [b for group in p_groups
                      for b in _by_kind(group, float("inf"), float("inf"))]
        ps_id = self.process_set.process_set_id
        for members in groups:
            bucket = _Bucket(members, f"bucket.{self._parameter_names[members[0]]}", ps_id)
            self._buckets.append(bucket)
            for p in members:
                self._bucket_of[p] = bucket
        for p in params:
            self._requires_update.append(p)
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    # -- hooks and reductions -------------------------------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._accumulating = True
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p]:
            return
        bucket = self._bucket_of[p]
        if bucket is None:
            self._handles[p] = self._allreduce_grad_async(p)
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._submit(bucket)

    def _submit(self, bucket: _Bucket) -> None:
        """Start the bucket's allreduce (laying it out first if it is new)."""
        if bucket.flat is None:
            on_own = [p for p in bucket.params if p.grad is not None and p.grad.is_sparse
                      and not self.sparse_as_dense]
            for p in on_own:
                bucket.params.remove(p)
                self._bucket_of[p] = None
                if self._allreduce_delay[p] == 0:  # its hook fired: its gradient is final
                    self._handles[p] = self._allreduce_grad_async(p)
            if not bucket.params:
                self._buckets.remove(bucket)
                return
            bucket.lay_out()
        bucket.fill()
        compressed, ctx = self._compression.compress(bucket.flat)
        prescale, postscale = self._scales
        handle = allreduce_async_(compressed, name=bucket.name, op=self.op,
                                  prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=self.process_set)
        self._handles[bucket] = (handle, ctx)

    def _allreduce_grad_async(self, p: torch.Tensor):
        """One parameter's reduction on its own (sparse gradients)."""
        name = self._parameter_names.get(p)
        if p.grad is None:  # not computed here but maybe elsewhere: contribute nothing
            p.grad = torch.sparse_coo_tensor(
                torch.empty((p.dim(), 0), dtype=torch.int64, device=p.device),
                torch.empty(0, dtype=p.dtype, device=p.device), p.shape)
        grad = p.grad
        if grad.is_sparse:
            if not self.sparse_as_dense:
                return sparse_allreduce_async(grad, name=name, op=self.op,
                                              process_set=self.process_set), None
            grad = grad.to_dense()
        elif not grad.is_contiguous():
            grad = grad.contiguous()
        compressed, ctx = self._compression.compress(grad)
        prescale, postscale = self._scales
        handle = allreduce_async_(compressed, name=name, op=self.op, prescale_factor=prescale,
                                  postscale_factor=postscale, process_set=self.process_set)
        return handle, ctx

    def _apply(self, p: torch.Tensor, output, ctx) -> None:
        grad = self._compression.decompress(output, ctx)
        if p.grad.is_sparse:
            # Sparse gradients do not support set_; zero and add is equivalent.
            p.grad.zero_().add_(grad if grad.is_sparse else grad.to_sparse())
        elif grad is not p.grad:
            p.grad.copy_(grad)

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (starting those whose hook did not fire)."""
        if not self.process_set.included():
            self._synchronized = True
            return
        for bucket in list(self._buckets):
            if bucket not in self._handles:
                self._submit(bucket)
        for p, bucket in self._bucket_of.items():
            if bucket is None and p not in self._handles:
                self._handles[p] = self._allreduce_grad_async(p)
        handles, self._handles = self._handles, {}
        error = None
        for key, (handle, ctx) in handles.items():
            try:
                if isinstance(key, _Bucket):
                    reduced = synchronize(handle)
                    if reduced is not key.flat:
                        key.flat.copy_(self._compression.decompress(reduced, ctx))
                    for p, view in key.densified:
                        p.grad.zero_().add_(view.to_sparse())
                else:
                    self._apply(key, synchronize(handle), ctx)
            except BaseException as exc:  # wait for every handle before raising
                error = error or exc
        for bucket in self._buckets:
            bucket.ready = 0
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._accumulating = False
        self._synchronized = True
        if error is not None:
            raise error

    @contextmanager
    def skip_synchronize(self):
        """Make ``step()`` skip synchronization, after an explicit ``synchronize()``::

            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._local_step(closure)

    def _local_step(self, closure=None):
        """The wrapped optimizer's update alone, with no communication."""
        return self._base_class.step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; with ``set_to_none=False`` the gradients of
        laid-out buckets stay their views, each bucket zeroed in one pass (see the module's
        docstring)."""
        if self._handles or self._accumulating:
            raise AssertionError(_ZERO_GRAD_RACE)
        if set_to_none:
            return self._base_class.zero_grad(self, True)
        viewed = set()
        for bucket in self._buckets:
            if bucket.flat is None:
                continue
            bucket.flat.zero_()
            sparse = {id(p) for p, _ in bucket.densified}  # handed back sparse: not a view
            for p, view in zip(bucket.params, bucket.views):
                if id(p) not in sparse:
                    p.grad = view
                    viewed.add(p)
        if not viewed:
            return self._base_class.zero_grad(self, False)
        others = [(group, group["params"]) for group in self.param_groups]
        try:
            for group, params in others:
                group["params"] = [p for p in params if p not in viewed]
            return self._base_class.zero_grad(self, False)
        finally:
            for group, params in others:
                group["params"] = params

    def load_state_dict(self, state_dict) -> None:
        self._handles = {}
        self._accumulating = False
        for bucket in self._buckets:
            bucket.ready = 0
        self._synchronized = False
        self._should_synchronize = True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        return self._base_class.load_state_dict(self, state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    """Adasum (Horovod's delta optimizer): each rank applies its own update to a copy of the
    parameters, and the updates (deltas) are combined with the Adasum operation."""

    _base_class: type

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1):
        self._base_class.__init__(self, params)
        self._compression = compression
        self._parameter_names = _parameter_names(self, named_parameters)
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self._handles: dict = {}
        self._hook_handles = []
        self._requires_update: list[torch.Tensor] = []
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False)
                                 for p in self._parameter_names}
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
                    self._requires_update.append(p)
                    self._hook_handles.append(
                        p.register_post_accumulate_grad_hook(self._grad_ready))

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _grad_ready(self, p: torch.Tensor) -> None:
        entry = self._handles.get(p)
        if entry is not None and entry[0] is not None and self._allreduce_delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._allreduce_delay[p] -= 1
        self._handles[p] = (self._allreduce_grad_async(p) if self._allreduce_delay[p] == 0
                            else (None, None))

    def _allreduce_grad_async(self, p: torch.Tensor):
        # The local update of p alone, as a delta from where p started: p <- step(p) - start.
        start = self._starting_models[p]
        stashed = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p] if any(p is v for v in group["params"]) else []
        try:
            with torch.no_grad():
                start.copy_(p)
                self._base_class.step(self)
                p.sub_(start)
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=self._parameter_names.get(p), op=Adasum)
        return handle, ctx

    def synchronize(self) -> None:
        """Nothing to do: Adasum combines parameter updates inside ``step()``."""

    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for p in self._requires_update:
            entry = self._handles.get(p)
            if entry is None or entry[0] is None:
                self._handles[p] = self._allreduce_grad_async(p)
        with torch.no_grad():
            for p, (handle, ctx) in self._handles.items():
                delta = self._compression.decompress(synchronize(handle), ctx)
                start = self._starting_models[p]
                start.add_(delta)
                p.copy_(start)
                self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError(_ZERO_GRAD_RACE)
        return self._base_class.zero_grad(self, set_to_none)


def _wrap_class(template: type, base: type) -> type:
    """A subclass of ``base`` with ``template``'s methods (the optimizer keeps its class name)."""
    namespace = {k: v for k, v in template.__dict__.items() if k not in ("__dict__",
                                                                          "__weakref__")}
    namespace["_base_class"] = base
    cls = type(base.__name__, (base,), namespace)
    # torch wraps an optimizer class's step() with its profiling and step hooks; the wrapped
    # optimizer's own step() already has them, so they must not run twice.
    cls.step.hooked = True
    return cls


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Allreduces start during ``loss.backward()``, one per parameter as soon as its gradient is
    ready (fused by the engine); ``step()`` waits for them. Call ``synchronize()`` yourself to
    modify the reduced gradients (e.g. clipping), then ``step()`` inside
    ``skip_synchronize()``.

    Arguments:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``: names the allreduces (recommended).
        compression: ``Compression.none`` or ``Compression.fp16`` (gradients sent as float16).
        backward_passes_per_step: backward passes accumulated locally before each reduction.
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        gradient_predivide_factor: with Average, scale by ``1/f`` before the sum and by
            ``f/size`` after it.
        num_groups: deprecated alias of an integer ``groups``.
        groups: an int (split the parameters into that many groups) or a list of lists of
            parameters: each group is reduced in one grouped allreduce.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        process_set: reduce over this process set only.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    base = optimizer.__class__
    if op != Adasum or size() == 1:
        wrapped = _wrap_class(_DistributedOptimizer, base)(
            optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
            op, gradient_predivide_factor, groups, sparse_as_dense, process_set)
    else:
        if process_set is not global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        wrapped = _wrap_class(_DistributedAdasumOptimizer, base)(
            optimizer.param_groups, named_parameters, compression, backward_passes_per_step)
    wrapped.defaults = optimizer.defaults
    wrapped.state = optimizer.state  # keep what the optimizer already learned
    return wrapped
