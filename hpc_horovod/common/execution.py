"""Execution: how the tensors a cycle agreed on run, identically on every rank.

A :class:`Plan` orders the agreed requests and cuts them into steps; each step names its runner
from :data:`RUNNERS`, a table keyed by the kind of op, chosen once when the plan is built.
:class:`Execution` runs a plan's steps: on the device's stream for GPU tensors, inside the
timeline's activity when one is written, and, when a step fails, failing its requests with an
error that ends the engine (the communicator cannot be trusted after a backend failed).

Process-set creation and removal travel through the same negotiation, but are control steps of
the engine (its process-set registry changes), which it hands in as ``control``.
"""

from __future__ import annotations

from collections.abc import Callable

from .collectives import (
    adasum_one,
    allgather_group,
    alltoall_one,
    broadcast_one,
    reducescatter_one,
)
from .errors import HorovodInternalError
from .fusion import FusedAllreduce, group_allreduces
from .request import Request
from .types import Adasum, Signature

#: control steps: run by the engine itself (``Execution``'s ``control``)
CONTROL = ("process_set_add", "process_set_remove")


def _fused_allreduce(backend, sigs, group, fused) -> None:
    fused(backend, group)


def _allgather(backend, sigs, group, fused) -> None:
    allgather_group(backend, list(zip(sigs, group)))


def _one(collective):
    """A runner of one-request steps: ``collective(backend, sig, req)``."""
    def run(backend, sigs, group, fused) -> None:
        collective(backend, sigs[0], group[0])
    return run


def _barrier(backend, sigs, group, fused) -> None:
    backend.barrier()


#: the runner of each kind of step: ``runner(backend, sigs, requests, fused)``
RUNNERS: dict[str, Callable] = {
    "allreduce": _fused_allreduce,
    "adasum": _one(adasum_one),
    "allgather": _allgather,
    "broadcast": _one(broadcast_one),
    "alltoall": _one(alltoall_one),
    "reducescatter": _one(reducescatter_one),
    "barrier": _barrier,
}


class Plan:
    """How one set of agreed tensors executes, identically on every rank: their names and
    signatures in execution order, and the steps, each a slice of them:
    ``(kind, activity, start, stop, FusedAllreduce or None)``, ``kind`` a key of
    :data:`RUNNERS` or ``"control"``. Allreduces come first, fused per dtype/op/scales up to
    the fusion threshold, then allgathers (host, then device), then the other collectives one
    by one. ``order[i]`` is the position, in the lists the plan was built from, of its i-th
    tensor.

    A training step submits the same gradients every time, so plans of ready sets that came
    from the response cache are kept (``coordinator.ProcessSetState.cached_plan``): the
    grouping and the fusion layout are then computed once, not once per step.
    """

    __slots__ = ("names", "sigs", "steps", "order")

    def __init__(self, names: list[str], sigs: list[Signature], threshold: int):
        reductions, gathers, devices, others = [], [], [], []
        for i, sig in enumerate(sigs):
            if sig.kind == "allreduce" and sig.op != Adasum:
                reductions.append(i)
            elif sig.kind == "allgather":
                (devices if sig.device else gathers).append(i)
            else:
                others.append(i)
        groups = [("allreduce", g, True) for g in group_allreduces(sigs, reductions, threshold)]
        groups += [("allgather", g, False) for g in (gathers, devices) if g]
        groups += [(_step_kind(sigs[i]), [i], False) for i in others]
        self.order, self.steps = [], []
        for kind, indices, fuse in groups:
            start = len(self.order)
            self.order += indices
            fused = FusedAllreduce([sigs[i] for i in indices]) if fuse else None
            activity = sigs[indices[0]].kind.upper()
            self.steps.append((kind, activity, start, len(self.order), fused))
        self.names = [names[i] for i in self.order]
        self.sigs = [sigs[i] for i in self.order]


def _step_kind(sig: Signature) -> str:
    if sig.kind in CONTROL:
        return "control"
    if sig.kind == "allreduce":
        return "adasum"
    if sig.kind not in RUNNERS:  # pragma: no cover - guarded at submission
        raise ValueError(f"unknown collective {sig.kind}")
    return sig.kind


class Execution:
    """Runs plans. ``control(ps, sig, req)``: the engine's control steps;
    ``complete(req, error)``: complete a request that failed; ``done(group)``: mark a group's
    requests done and free their names."""

    def __init__(self, control: Callable, complete: Callable, done: Callable):
        self._control = control
        self._complete = complete
        self._done = done

    def run(self, ps, plan: Plan, reqs: list[Request | None], timeline) -> None:
        """Run the plan's steps on ``ps`` (a ``coordinator.ProcessSetState``), in the same
        order on every rank."""
        backend = ps.backend
        for kind, activity, start, stop, fused in plan.steps:
            sigs, group = plan.sigs[start:stop], reqs[start:stop]
            if kind == "control":
                def fn(sig=sigs[0], req=group[0]):
                    self._control(ps, sig, req)
            else:
                def fn(runner=RUNNERS[kind], sigs=sigs, group=group, fused=fused):
                    runner(backend, sigs, group, fused)
            self._run_group(backend, sigs[0].device, group, timeline, activity, fn)

    def _run_group(self, backend, device: bool, group: list[Request | None], tl,
                   activity: str, fn) -> None:
        if device:
            fn = _on_device_stream(backend, group, fn)
        if tl is not None:
            for req in group:
                if req is not None:
                    tl.negotiate_end(req.name)
                    tl.op_start(req.name, activity)
        try:
            if tl is not None:
                with tl.activity([r.name for r in group if r is not None], activity):
                    fn()
            else:
                fn()
        except Exception as exc:
            # Validated inputs make local failures impossible; what is left is the backend
            # failing, after which the communicator cannot be trusted: stop everywhere.
            error = exc if isinstance(exc, HorovodInternalError) else HorovodInternalError(
                f"{activity.lower()} failed: {type(exc).__name__}: {exc}")
            for req in group:
                if req is not None:
                    self._complete(req, error)
            raise error from exc
        if tl is not None:
            for req in group:
                if req is not None:
                    tl.op_end(req.name)
        self._done(group)


def _on_device_stream(backend, group, fn):
    """GPU groups run on the device's stream (``gpu_stream.DeviceStream``), after the
    producers' ready events, and leave a done event for the consumers: no host or device-wide
    synchronization. The thread works on the group's device meanwhile and gets its own current
    device back after (a caller blocked in ``wait`` runs cycles too). NCCL's asynchronous
    errors (a lost peer or link) surface here, before more work is queued behind a collective
    that will never end, and while the engine waits for peers (``RoutedBackend.negotiate``)."""

    def run() -> None:
        from .gpu_stream import device_stream, group_device, on_device

        backend.check_async_error()
        device = group_device(backend, [r.tensor for r in group if r is not None])
        stream = device_stream(device)
        with on_device(device), stream.activate():
            for req in group:
                if req is not None and req.ready_event is not None:
                    stream.wait_for(req.ready_event)
            fn()
            done = stream.done_event()
        for req in group:
            if req is not None:
                req.done_event = done

    return run
