"""The collectives on TensorFlow tensors, eager and inside ``tf.function`` or tf.compat.v1 graphs.

Eager: the op runs at once on host views of the tensors (``staging``). Graph: each call becomes one
``tf.numpy_function`` (a grouped call: one for the whole list) whose body submits to the engine
and waits; its outputs carry every static dimension that is known.

A graph op that waits holds one of TensorFlow's inter-op threads, so the ranks must run a graph's
collectives in one order: two ranks that each start a different one first wait for each other
forever once the threads run out. Inside ``tf.function`` TensorFlow chains stateful ops in
program order itself. In a tf.compat.v1 graph each collective gets a control dependency on the
collectives built before it in the same graph (and control-flow context) whose run needs nothing
this one does not: no other placeholder and no other stateful op (variables and random numbers
aside), and that has not run yet. Collectives fetched together therefore run in the order they
were built on every rank, while fetching one never runs a collective that needs another feed or
consumes other input, such as the broadcast of the variables built after the training step. A
collective that has already run when a later one is built was fetched without it, so it is left
out: a program that fetches each collective as it builds it (as Horovod's tests do, one graph for
a hundred broadcasts) runs one collective per fetch, not every one built before. The ranks build
the same graph as long as each builds and runs in program order (in one thread).

Errors: a collective the ranks disagree on (shapes, dtypes, ops) raises
``tf.errors.FailedPreconditionError`` (also a ``HorovodInternalError``) eagerly; a bad argument
found when the op runs (alltoall splits) ``tf.errors.InvalidArgumentError``. Inside a graph
TensorFlow turns the first into ``tf.errors.UnknownError`` (a ``tf.numpy_function`` cannot choose
its error code) and keeps the second.

Names: an explicit ``name`` is the engine's name for the op, verbatim. Without one, an eager op
takes the core's counter (``allreduce.noname.3``) and a graph op its rank among the collectives of
its kind built in the same graph (``HorovodGroupedAllreduce.0``): the same on every rank that
runs the same program. Unlike Horovod, graph names do not come from tensor names, which Keras
numbers per process (a model built on rank 0 only would rename every layer after it).

Gradients follow Horovod: allreduce -> allreduce of the gradient with the same op and scale
factors (Sum and Average only); allgather -> Average-allreduce of the gradient, then this rank's
rows; broadcast -> Average-allreduce of the gradient on the root, zeros elsewhere; alltoall ->
alltoall back with the received splits; reducescatter -> allgather of the gradient (times the set
size for Sum). The broadcast's gradient is one collective of its own on every rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.ops import control_flow_util

from ..common import basics
from ..common import ops as core
from ..common.basics import ProcessSet, global_process_set
from ..common.errors import HorovodInternalError
from ..common.request import broadcast_request, resolve_op
from ..common.types import OP_NAMES, Average, Sum, check_dtype
from . import staging
from .compression import Compression

Runner = Callable[[list, "str | None"], list]
# Called from tf.function code, the API must run as plain Python: AutoGraph would otherwise
# rewrite it (and the core it calls) on every trace.
_not_autograph = tf.autograph.experimental.do_not_convert


#: Ops that move bytes without arithmetic: they also take uint16, sent as int16 (same bits).
_MOVING = ("allgather", "broadcast", "alltoall")


def _check_dtype(dtype: tf.DType, kind: str, op: int | None = None) -> None:
    try:
        np_dtype = np.dtype(dtype.as_numpy_dtype)
    except TypeError:
        np_dtype = None
    if np_dtype is None or np_dtype.kind == "O":
        raise ValueError(f"{kind} does not support tensors of dtype {dtype.name}")
    if np_dtype == np.uint16 and kind in _MOVING:
        return
    check_dtype(np_dtype, kind, op)


def _to_engine(array: np.ndarray) -> np.ndarray:
    return array.view(np.int16) if array.dtype == np.uint16 else array


def _from_engine(array, dtype: tf.DType):
    return array.view(np.uint16) if dtype == tf.uint16 else array


class CollectiveError(tf.errors.FailedPreconditionError, HorovodInternalError):
    """A collective failed on every rank taking part: the ranks disagreed on it (shapes, dtypes,
    ops), a peer died or stalled. Caught as ``tf.errors.FailedPreconditionError``, as Horovod's
    TensorFlow ops raise it, or as ``hvd.HorovodInternalError``."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


def _run_eagerly(run, arrays: list, name):
    """``run`` with the errors TensorFlow code expects of an op (see the module docstring)."""
    try:
        return run(arrays, name)
    except HorovodInternalError as exc:
        raise CollectiveError(str(exc)) from exc
    except ValueError as exc:
        raise tf.errors.InvalidArgumentError(None, None, str(exc)) from exc


def _check_not_xla(kind: str) -> None:
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            f"hpc_horovod's {kind} cannot run inside an XLA-compiled function: use "
            "tf.function(jit_compile=False), or model.compile(..., jit_compile=False) with Keras "
            "(Keras turns XLA on by default when a GPU is visible)")


_graph_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _graph_name(prefix: str) -> str:
    """The engine name of the next ``prefix`` collective built in the current graph."""
    counts = _graph_counts.setdefault(tf.compat.v1.get_default_graph(), {})
    n = counts[prefix] = counts.get(prefix, -1) + 1
    return f"{prefix}.{n}"


#: Stateful ops that a collective may run again for another one without changing what the program
#: computes: reading variables, and drawing random numbers.
_RERUNNABLE = frozenset({"VariableV2", "Variable", "VarHandleOp", "ReadVariableOp",
                         "VarIsInitializedOp", *auto_control_deps.LEGACY_RANDOM_OPS})


class _GraphCollective:
    """A collective built in a tf.compat.v1 graph, as the collectives built after it see it."""

    def __init__(self, context, needs: frozenset):
        self.op: tf.Operation | None = None
        self.context = context  # control-flow context
        self.needs = needs  # see _needs
        self.ran = False  # set when the op first runs

    def record(self, op: tf.Operation) -> None:
        self.op = op
        _graph_collectives.setdefault(op.graph, []).append(self)


#: Per tf.compat.v1 graph: every collective built in it, in build order.
_graph_collectives: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _needs(tensors: Iterable[tf.Tensor], built: dict) -> frozenset:
    """The placeholders and stateful ops (but those of ``_RERUNNABLE``) that running an op with
    these inputs runs; ``built`` maps the graph's collectives to their own needs."""
    needs, seen = set(), set()
    stack = [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op in built:
            needs |= built[op]
            continue
        if op.type in ("Placeholder", "PlaceholderV2") or \
                (op._is_stateful and op.type not in _RERUNNABLE):
            needs.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return frozenset(needs)


def _predecessors(inputs: list[tf.Tensor]):
    """In a tf.compat.v1 graph: the collectives this one must wait for (see the module docstring),
    and the record of the new one (``record`` it with its op). Inside ``tf.function``: none and
    None."""
    graph = tf.compat.v1.get_default_graph()
    if graph.building_function:
        return [], None
    context = graph._get_control_flow_context()
    earlier = _graph_collectives.get(graph, [])
    needs = _needs(inputs, {c.op: c.needs for c in earlier})
    deps = [c.op for c in earlier if not c.ran and c.context is context and c.needs <= needs]
    return deps, _GraphCollective(context, needs)


def _collective(run: Runner, inputs: list[tf.Tensor], out_dtypes: list[tf.DType],
                out_shapes: list, prefix: str, name: str | None):
    """Run ``run(host_arrays, name) -> host_arrays``: now (eager) or as one graph op."""
    run = core.synchronous(run)  # it waits for what it submits
    staging.note_gpu_staging(inputs, basics.rank)

    def run_on_host(arrays, name):
        results = run([_to_engine(np.asarray(a)) for a in arrays], name)
        return [_from_engine(r, dtype) for r, dtype in zip(results, out_dtypes)]

    if tf.executing_eagerly():
        device = inputs[0].device if inputs else ""
        results = _run_eagerly(run_on_host, [staging.to_host(t) for t in inputs], name)
        return [staging.to_device(r, dtype, device) for r, dtype in zip(results, out_dtypes)]
    _check_not_xla(prefix)
    if name is None:
        name = _graph_name(prefix)
    deps, built = _predecessors(inputs)

    def body(*arrays):
        if built is not None:
            built.ran = True
        return run_on_host(arrays, name)
    with tf.control_dependencies(deps):
        outputs = tf.numpy_function(body, inputs, out_dtypes, stateful=True, name=prefix)
    if built is not None:
        built.record(outputs if not out_dtypes else outputs[0].op)
    if not out_dtypes:
        return outputs
    for out, shape in zip(outputs, out_shapes):
        out.set_shape(shape)
    return outputs


def _check_process_set(process_set: ProcessSet) -> int:
    """Fail when the graph is built, not when it runs: hvd.init() must have been called and the
    set registered. Returns the set's size."""
    return process_set.size()


def _differentiable(op: int, kind: str) -> int:
    if op not in (Sum, Average):
        raise ValueError(f"{kind} with op={OP_NAMES[op]} has no gradient; only Sum and Average "
                         "are differentiable")
    return op


def _gathered_shape(shape: tf.TensorShape) -> tf.TensorShape:
    """Shape after concatenation along dim 0 of per-rank tensors whose dim 0 may differ."""
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None]).concatenate(shape[1:])


# -- allreduce ------------------------------------------------------------------------------------

def _allreduce_runner(op, prescale, postscale, process_set, grouped: bool) -> Runner:
    def run(arrays, name):
        if grouped:
            handles = core.grouped_allreduce_async(arrays, None, name, op, prescale, postscale,
                                                   process_set)
        else:
            handles = [core.allreduce_async(arrays[0], None, name, op, prescale, postscale,
                                            process_set)]
        return [core.synchronize(h) for h in handles]
    return run


@_not_autograph
def _allreduce(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
               process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Differentiable allreduce of one dense tensor, without compression."""
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor.dtype, "allreduce", op)
    _check_process_set(process_set)
    run = _allreduce_runner(op, prescale_factor, postscale_factor, process_set, grouped=False)

    @tf.custom_gradient
    def forward(x):
        (y,) = _collective(run, [x], [x.dtype], [x.shape], "HorovodAllreduce", name)

        def grad(dy):
            return _allreduce(dy, op=_differentiable(op, "allreduce"),
                              prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                              process_set=process_set)
        return y, grad
    return forward(tensor)


@_not_autograph
def _grouped_allreduce(tensors: list, name=None, op=Sum, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> list[tf.Tensor]:
    """Differentiable allreduce of dense tensors in one graph op and one engine submission."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        _check_dtype(t.dtype, "allreduce", op)
    _check_process_set(process_set)
    run = _allreduce_runner(op, prescale_factor, postscale_factor, process_set, grouped=True)

    @tf.custom_gradient
    def forward(*xs):
        ys = _collective(run, list(xs), [x.dtype for x in xs], [x.shape for x in xs],
                         "HorovodGroupedAllreduce", name)

        def grad(*dys):
            dys = [tf.zeros_like(x) if dy is None else dy for dy, x in zip(dys, xs)]
            return _grouped_allreduce(dys, op=_differentiable(op, "allreduce"),
                                      prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor, process_set=process_set)
        return ys, grad
    return list(forward(*tensors))


def _check_sparse(op, prescale_factor, postscale_factor) -> None:
    """NotImplementedError for what an allreduce of tf.IndexedSlices cannot do (checked before
    any other check of a group that holds some, as Horovod does)."""
    if op not in (Sum, Average):
        raise NotImplementedError(
            f"allreduce of tf.IndexedSlices supports op=Sum and op=Average (it is an allgather "
            f"of values and indices), not {OP_NAMES[op]}; densify the gradients "
            "(sparse_as_dense=True)")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("allreduce of tf.IndexedSlices does not take "
                                  "prescale_factor/postscale_factor; scale the values yourself")


def _allreduce_sparse(slices: list[tf.IndexedSlices], op, prescale_factor, postscale_factor,
                      name, process_set) -> list[tf.IndexedSlices]:
    """tf.IndexedSlices are summed by gathering every rank's values and indices (one grouped
    allgather for all of them); duplicate indices add up when the slices are applied. Average
    divides the gathered values by the set size with TensorFlow's division (integer values
    become floats)."""
    _check_sparse(op, prescale_factor, postscale_factor)
    gathered = grouped_allgather([s.values for s in slices] + [s.indices for s in slices],
                                 name=name, process_set=process_set)
    out = []
    for s, values, indices in zip(slices, gathered[:len(slices)], gathered[len(slices):]):
        if op == Average:
            values = values / tf.cast(process_set.size(), values.dtype)
        out.append(tf.IndexedSlices(values, indices, dense_shape=s.dense_shape))
    return out


@_not_autograph
def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set: ProcessSet = global_process_set):
    """Reduce ``tensor`` (tf.Tensor, tf.Variable or tf.IndexedSlices) over the ranks of
    ``process_set``; default op: Average. Shapes and dtypes must match on every rank.

    A tf.IndexedSlices is reduced as an allgather of its values and indices (Sum or Average,
    without scale factors; NotImplementedError otherwise). ``prescale_factor``/
    ``postscale_factor`` multiply before/after the reduction. GPU tensors go
    through host memory for now; pin one GPU per process with
    ``tf.config.set_visible_devices(gpus[hvd.local_rank()], 'GPU')``.
    """
    op = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        with tf.device(device_sparse):
            return _allreduce_sparse([tensor], op, prescale_factor, postscale_factor, name,
                                     process_set)[0]
    with tf.device(device_dense):
        compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
        reduced = _allreduce(compressed, name, op, prescale_factor, postscale_factor, process_set)
        return compression.decompress(reduced, ctx)


@_not_autograph
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set: ProcessSet = global_process_set,
                      name=None) -> list:
    """Allreduce a list of tensors as one operation (one graph op, one engine submission, fused
    into as few MPI calls as the fusion threshold allows). tf.IndexedSlices in the list go
    through one grouped allgather."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    op = resolve_op(op, average)
    out: list = [None] * len(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
    if dense:
        with tf.device(device_dense):
            packed = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
            reduced = _grouped_allreduce([t for t, _ in packed], name, op, prescale_factor,
                                         postscale_factor, process_set)
            for i, r, (_, ctx) in zip(dense, reduced, packed):
                out[i] = compression.decompress(r, ctx)
    if sparse:
        with tf.device(device_sparse):
            reduced = _allreduce_sparse([tensors[i] for i in sparse], op, prescale_factor,
                                        postscale_factor, None if name is None else
                                        f"{name}.sparse", process_set)
            for i, r in zip(sparse, reduced):
                out[i] = r
    return out


# -- allgather ------------------------------------------------------------------------------------

def _row_offsets(tensors: list[tf.Tensor], process_set: ProcessSet):
    """(start, length) of this rank's rows in each gathered tensor: one allgather of dim 0s."""
    dims = tf.stack([tf.shape(t, out_type=tf.int64)[0] for t in tensors])
    counts = tf.reshape(allgather(dims, process_set=process_set), [process_set.size(), -1])
    me = process_set.rank()
    starts = tf.reduce_sum(counts[:me], axis=0)
    return [(starts[j], counts[me, j]) for j in range(len(tensors))]


def _allgather_runner(process_set, grouped: bool) -> Runner:
    def run(arrays, name):
        if grouped:
            handles = core.grouped_allgather_async(arrays, name, process_set)
        else:
            handles = [core.allgather_async(arrays[0], name, process_set)]
        return [core.synchronize(h) for h in handles]
    return run


def _allgather(tensors: list, name, process_set, grouped: bool) -> list[tf.Tensor]:
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        _check_dtype(t.dtype, "allgather")
    _check_process_set(process_set)
    run = _allgather_runner(process_set, grouped)
    prefix = "HorovodGroupedAllgather" if grouped else "HorovodAllgather"

    @tf.custom_gradient
    def forward(*xs):
        ys = _collective(run, list(xs), [x.dtype for x in xs],
                         [_gathered_shape(x.shape) for x in xs], prefix, name)

        def grad(*dys):
            dys = [tf.zeros_like(y) if dy is None else dy for dy, y in zip(dys, ys)]
            summed = _grouped_allreduce(dys, op=Average, process_set=process_set)
            rows = [x if x.shape.rank else tf.reshape(x, [1]) for x in xs]
            grads = []
            for x, s, (start, length) in zip(xs, summed, _row_offsets(rows, process_set)):
                mine = s[start:start + length]
                grads.append(tf.reshape(mine, tf.shape(x)) if x.shape.rank == 0 else mine)
            return grads
        return ys, grad
    return list(forward(*tensors))


@_not_autograph
def allgather(tensor, name=None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along dim 0 (dim 0 may differ between ranks)."""
    return _allgather([tensor], name, process_set, grouped=False)[0]


@_not_autograph
def grouped_allgather(tensors, name=None,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather a list of tensors as one operation."""
    tensors = list(tensors)
    return _allgather(tensors, name, process_set, grouped=True) if tensors else tensors


# -- broadcast ------------------------------------------------------------------------------------

def _broadcast_runner(root_rank, process_set) -> Runner:
    def run(arrays, name):
        base = name if name is not None else basics.next_name(process_set.process_set_id,
                                                              "broadcast")
        names = [base] if len(arrays) == 1 else [f"{base}.{i}" for i in range(len(arrays))]
        handles = core.submit([broadcast_request(np.asarray(a), root_rank, name=n,
                                                      process_set=process_set)
                               for a, n in zip(arrays, names)])
        return [core.synchronize(h) for h in handles]
    return run


@_not_autograph
def _grouped_broadcast(tensors: list, root_rank: int, name=None,
                       process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Broadcast several tensors as one operation (not differentiable): what broadcasting a
    model's variables needs."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        _check_dtype(t.dtype, "broadcast")
    process_set.rank_of(root_rank)  # ValueError unless a global rank of the set
    return _collective(_broadcast_runner(root_rank, process_set), tensors,
                       [t.dtype for t in tensors], [t.shape for t in tensors],
                       "HorovodGroupedBroadcast", name)


def _broadcast_grad(dy, root_rank: int, process_set: ProcessSet) -> tf.Tensor:
    """The average of ``dy`` over the set on the root, zeros elsewhere, as one collective whose
    output every rank uses: zeros made by TensorFlow would let a graph drop the allreduce on the
    other ranks, and the root would wait for them forever."""
    dy = tf.convert_to_tensor(dy)
    is_root = basics.rank() == root_rank

    def run(arrays, name):
        reduced = core.allreduce(arrays[0], name=name, op=Average, process_set=process_set)
        return [reduced if is_root else np.zeros_like(reduced)]
    return _collective(run, [dy], [dy.dtype], [dy.shape], "HorovodBroadcastGrad", None)[0]


@_not_autograph
def broadcast(tensor, root_rank: int, name=None,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s value of ``tensor`` on every rank (``root_rank`` is a global rank)."""
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor.dtype, "broadcast")
    process_set.rank_of(root_rank)  # ValueError unless a global rank of the set
    run = _broadcast_runner(root_rank, process_set)

    @tf.custom_gradient
    def forward(x):
        (y,) = _collective(run, [x], [x.dtype], [x.shape], "HorovodBroadcast", name)

        def grad(dy):
            return _broadcast_grad(dy, root_rank, process_set)
        return y, grad
    return forward(tensor)


@_not_autograph
def broadcast_(variables, root_rank: int, name=None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Assign every variable in ``variables`` its value on ``root_rank`` (one grouped broadcast)
    and return the new values. Eager: done on return; graph: the values depend on the
    assignments."""
    variables = list(variables)
    if not variables:
        return []
    if not all(hasattr(v, "assign") for v in variables):
        raise ValueError("broadcast_ assigns in place: pass variables (tf.Variable or Keras "
                         "variables), not tensors")
    values = _grouped_broadcast(variables, root_rank, name=name, process_set=process_set)
    assigns = [var.assign(value) for var, value in zip(variables, values)]
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(var) for var in variables]
    with tf.control_dependencies(assigns):  # reads made here come after the assignments
        # A Keras variable holds its tf.Variable in ``value``; read_value() makes a new read
        # (converting a tf.compat.v1 reference variable would reuse its cached snapshot).
        return [(var if isinstance(var, tf.Variable) else var.value).read_value()
                for var in variables]


# -- alltoall, reducescatter ----------------------------------------------------------------------

@_not_autograph
def alltoall(tensor, splits=None, name=None, process_set: ProcessSet = global_process_set):
    """Send ``splits[j]`` rows of ``tensor`` to rank j (equal blocks when ``splits`` is None) and
    receive the rows every rank sends here, in rank order.

    Returns the received tensor, and with ``splits`` given, ``(received, received_splits)`` (as in
    Horovod).
    """
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor.dtype, "alltoall")
    n = _check_process_set(process_set)
    split_inputs = [] if splits is None else [tf.cast(tf.convert_to_tensor(splits), tf.int64)]

    def run(arrays, name):
        received, received_splits = core.alltoall(arrays[0], arrays[1] if len(arrays) > 1
                                                  else None, name=name, process_set=process_set)
        return [received, np.asarray(received_splits, dtype=np.int32)]

    @tf.custom_gradient
    def forward(x):
        received, received_splits = _collective(
            run, [x] + split_inputs, [x.dtype, tf.int32], [_gathered_shape(x.shape), [n]],
            "HorovodAlltoall", name)

        def grad(dy, _):
            return alltoall(dy, splits=received_splits, process_set=process_set)[0]
        return (received, received_splits), grad
    received, received_splits = forward(tensor)
    return received if splits is None else (received, received_splits)


def _scattered_shape(shape: tf.TensorShape, n: int, me: int) -> tf.TensorShape:
    """This rank's block of rows: the first ranks get one more when dim 0 does not divide."""
    if shape.rank is not None and shape[0] is not None:
        base, extra = divmod(shape[0], n)
        return tf.TensorShape([base + (1 if me < extra else 0)]).concatenate(shape[1:])
    return _gathered_shape(shape)


def _reducescatter(tensors: list, op, name, process_set, prescale_factor, postscale_factor,
                   grouped: bool) -> list[tf.Tensor]:
    """Differentiable reducescatter of tensors (one graph op, one engine submission)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        _check_dtype(t.dtype, "reducescatter", op)
        if t.shape.rank == 0:
            raise ValueError("reducescatter needs a tensor with at least one dimension")
    n, me = process_set.size(), process_set.rank()

    def run(arrays, name):
        if grouped:
            return core.grouped_reducescatter(arrays, name, op, process_set, prescale_factor,
                                              postscale_factor)
        return [core.reducescatter(arrays[0], name, op, process_set, prescale_factor,
                                   postscale_factor)]

    @tf.custom_gradient
    def forward(*xs):
        ys = _collective(run, list(xs), [x.dtype for x in xs],
                         [_scattered_shape(x.shape, n, me) for x in xs],
                         "HorovodGroupedReducescatter" if grouped else "HorovodReducescatter",
                         name)

        def grad(*dys):
            _differentiable(op, "reducescatter")
            dys = [tf.zeros_like(y) if dy is None else dy for dy, y in zip(dys, ys)]
            factor = prescale_factor * postscale_factor * (n if op == Sum else 1)
            if factor != 1.0:
                dys = [dy * tf.cast(factor, dy.dtype) for dy in dys]
            return grouped_allgather(dys, process_set=process_set)
        return ys, grad
    return list(forward(*tensors))


@_not_autograph
def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set: ProcessSet = global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0) -> tf.Tensor:
    """Reduce over the ranks, then give rank i the i-th block of rows (the first ranks get one
    more row when dim 0 does not divide evenly)."""
    with tf.device(device_dense):
        compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
        (reduced,) = _reducescatter([compressed], op, name, process_set, prescale_factor,
                                    postscale_factor, grouped=False)
        return compression.decompress(reduced, ctx)


@_not_autograph
def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set: ProcessSet = global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0, name=None) -> list[tf.Tensor]:
    """Reducescatter a list of tensors as one operation (one graph op, one engine submission)."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    with tf.device(device_dense):
        packed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
        reduced = _reducescatter([t for t, _ in packed], op, name, process_set, prescale_factor,
                                 postscale_factor, grouped=True)
        return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed)]


# -- synchronization ------------------------------------------------------------------------------

@_not_autograph
def barrier(process_set: ProcessSet = global_process_set):
    """Wait until every rank of ``process_set`` reaches the barrier. Graph mode: returns the op."""
    _check_process_set(process_set)

    def run(arrays, name):
        core.barrier(process_set)
        return []
    result = _collective(run, [], [], [], "HorovodBarrier", "barrier")
    return None if tf.executing_eagerly() else result


@_not_autograph
def join() -> tf.Tensor:
    """Declare that this rank has no more batches; until every rank has joined it contributes
    zeros to the other ranks' allreduces. Returns the rank that joined last (int32 scalar)."""
    _check_process_set(global_process_set)

    def run(arrays, name):
        return [np.asarray(core.join(), dtype=np.int32)]
    return _collective(run, [], [tf.int32], [[]], "HorovodJoin", "join")[0]


# -- graph-safe queries ---------------------------------------------------------------------------

def _query(value: Callable[[], int], name: str | None, default: str) -> tf.Tensor:
    """An int32 scalar read when the graph runs, not when it is built (Horovod's *_op)."""
    if tf.executing_eagerly():
        return tf.constant(value(), dtype=tf.int32)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True,
                            name=name or default)
    out.set_shape([])
    return out


def _set_ranks(process_set_id: int) -> list[int]:
    return basics.engine().process_set_ranks(process_set_id)


@_not_autograph
def size_op(process_set_id: int = 0, name=None) -> tf.Tensor:
    """The number of processes in the process set (the whole job by default)."""
    return _query(lambda: len(_set_ranks(process_set_id)), name, "HorovodSize")


@_not_autograph
def process_set_included_op(process_set_id: int = 0, name=None) -> tf.Tensor:
    """1 when this process belongs to the process set, else 0."""
    return _query(lambda: int(basics.rank() in _set_ranks(process_set_id)), name,
                  "HorovodProcessSetIncluded")


@_not_autograph
def rank_op(name=None) -> tf.Tensor:
    return _query(basics.rank, name, "HorovodRank")


@_not_autograph
def local_rank_op(name=None) -> tf.Tensor:
    return _query(basics.local_rank, name, "HorovodLocalRank")


@_not_autograph
def local_size_op(name=None) -> tf.Tensor:
    return _query(basics.local_size, name, "HorovodLocalSize")


@_not_autograph
def cross_rank_op(name=None) -> tf.Tensor:
    return _query(basics.cross_rank, name, "HorovodCrossRank")


@_not_autograph
def cross_size_op(name=None) -> tf.Tensor:
    return _query(basics.cross_size, name, "HorovodCrossSize")
